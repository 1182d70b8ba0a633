// Reading dense parts, rotated parts and keys rebuilt from a factor, and the one place a
// part's kind picks its kernel (coded parts: codes.cpp).
//
// A key part may carry a rotation (RoPE): its inverse frequencies [1, 1, 1, dims / 2] and
// its first position (int32 [1, 1, 1, 1]), the angles made here (class Angles); `pairs`
// pairs neighbouring dims (2i, 2i + 1), else dims i and i + dims / 2. A dense part's rows
// are rotated as they are read. A projected part with a rotation holds keys stored before
// RoPE as a factor (xKV's default, XQuant): the op rebuilds a few tokens' keys a P + m at a
// time, rotates and scores them while they are in cache, so no rebuilt key ever exists at
// full size.
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "parts.h"

namespace veloxquant {
namespace {

// IEEE half to float with integer ops.
inline float half_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  if (e == 0) return (sign ? -1.f : 1.f) * static_cast<float>(m) * 5.9604645e-8f;
  return bits_float(sign | ((e == 31 ? 255u : e + 112u) << 23) | (m << 13));
}

}  // namespace

// count values from p, step bytes apart, as floats.
void load(const View& v, const uint8_t* p, int64_t step, int64_t count, float* out) {
  uint16_t h;
  int64_t i0 = 0;
#if defined(__F16C__)
  if (v.dtype == mx::float16 && step == 2) {  // the common case: a run of float16 scales
    for (; i0 + 8 <= count; i0 += 8)
      _mm256_storeu_ps(out + i0, _mm256_cvtph_ps(_mm_loadu_si128(
                                     reinterpret_cast<const __m128i*>(p + 2 * i0))));
  }
#endif
  p += i0 * step, out += i0, count -= i0;
  if (v.dtype == mx::float32) {
    for (int64_t i = 0; i < count; ++i) std::memcpy(&out[i], p + i * step, 4);
  } else if (v.dtype == mx::float16) {
    for (int64_t i = 0; i < count; ++i) std::memcpy(&h, p + i * step, 2), out[i] = half_float(h);
  } else {  // bfloat16 (checked when the op is built)
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(&h, p + i * step, 2), out[i] = bits_float(uint32_t{h} << 16);
  }
}

// The [rows, cols] matrix of v at (b, h) as contiguous floats.
std::vector<float> load_matrix(const View& v, int64_t b, int64_t h, int64_t rows, int64_t cols) {
  std::vector<float> out(rows * cols);
  if (v.stride[2] == cols * v.stride[3] || rows == 1) {  // one run (small rows are common)
    load(v, v.at(b, h), v.stride[3], rows * cols, out.data());
    return out;
  }
  for (int64_t r = 0; r < rows; ++r)
    load(v, v.at(b, h) + r * v.stride[2], v.stride[3], cols, out.data() + r * cols);
  return out;
}

namespace {

constexpr int64_t kFine = 32;  // positions per coarse angle: ops/rope.py's FINE
constexpr int64_t kSeed = 8;   // angles turned on from an exact one at most this many times

// RoPE's cos and sin of a rotated part's tokens, made as ops/rope.py's angles() makes them:
// position start + F c + j turns by the coarse angle of start + F c plus the fine one of j
// (angle addition), so no table sized by the tokens is ever allocated. A coarse or fine
// angle is the one before it turned by one more step, every kSeed-th computed exactly:
// at 4096 tokens and 32 frequencies, about 700 calls of std::cos and std::sin instead of
// 5000; seven turns add about 1e-6 to the float32 angle's own rounding.
class Angles {
 public:
  explicit Angles(const Part& pt)
      : pt_(pt), half_(pt.rot_dims / 2), cf_(kFine * half_), sf_(kFine * half_), cc_(half_),
        sc_(half_), cstep_(half_), sstep_(half_) {
    std::vector<float> c1(half_), s1(half_);
    for (int64_t i = 0; i < half_; ++i) {
      c1[i] = std::cos(pt.rot_inv[i]), s1[i] = std::sin(pt.rot_inv[i]);
      const float coarse = static_cast<float>(kFine) * pt.rot_inv[i];
      cstep_[i] = std::cos(coarse), sstep_[i] = std::sin(coarse);
    }
    for (int64_t j = 0; j < kFine; ++j) {
      float *c = cf_.data() + j * half_, *s = sf_.data() + j * half_;
      if (j % kSeed == 0) {
        for (int64_t i = 0; i < half_; ++i) {
          const float a = static_cast<float>(j) * pt.rot_inv[i];
          c[i] = std::cos(a), s[i] = std::sin(a);
        }
      } else {
        turn(c - half_, s - half_, c1.data(), s1.data(), c, s);
      }
    }
  }

  // Token t of the slice, rotated in place (dims [0, rot_dims) of x).
  void rotate(int64_t t, float* x) {
    const int64_t u = pt_.rot_first + t, block = u / kFine, j = u % kFine;
    if (block != block_) {
      if (block == block_ + 1 && block % kSeed != 0) {
        turn(cc_.data(), sc_.data(), cstep_.data(), sstep_.data(), cc_.data(), sc_.data());
      } else {
        const float pos = static_cast<float>(pt_.rot_start + kFine * block);
        for (int64_t i = 0; i < half_; ++i)
          cc_[i] = std::cos(pos * pt_.rot_inv[i]), sc_[i] = std::sin(pos * pt_.rot_inv[i]);
      }
      block_ = block;
    }
    const float *cf = cf_.data() + j * half_, *sf = sf_.data() + j * half_;
    const bool pairs = pt_.pairs;
    const int64_t step = pairs ? 2 : 1, other = pairs ? 1 : half_;
    for (int64_t i = 0; i < half_; ++i) {
      const float c = cc_[i] * cf[i] - sc_[i] * sf[i], s = sc_[i] * cf[i] + cc_[i] * sf[i];
      float& a = x[i * step];
      float& b = x[i * step + other];
      const float u0 = a, v0 = b;
      a = u0 * c - v0 * s, b = u0 * s + v0 * c;
    }
  }

 private:
  const Part& pt_;
  int64_t half_, block_ = -2;
  std::vector<float> cf_, sf_, cc_, sc_, cstep_, sstep_;

  // (c, s) of angles a + b from those of a (c0, s0) and b (cb, sb), half_ of each.
  void turn(const float* c0, const float* s0, const float* cb, const float* sb, float* c,
            float* s) const {
    for (int64_t i = 0; i < half_; ++i) {
      const float ci = c0[i] * cb[i] - s0[i] * sb[i], si = s0[i] * cb[i] + c0[i] * sb[i];
      c[i] = ci, s[i] = si;
    }
  }
};

// Row t of a dense or token part (no table) of head (b, h) as pt.D floats.
void row_floats(const Part& pt, int64_t b, int64_t h, int64_t t, float* out) {
  const uint8_t* row = pt.a.at(b, h) + t * pt.a.stride[2];
  if (pt.kind == kDense) return load(pt.a, row, pt.a.stride[3], pt.D, out);
  const int64_t G = pt.D / pt.group;
  thread_local std::vector<float> s, z;
  s.resize(G), z.assign(G, 0.f);
  load(pt.s, pt.s.at(b, h) + t * pt.s.stride[2], pt.s.stride[3], G, s.data());
  if (pt.has_bias) load(pt.z, pt.z.at(b, h) + t * pt.z.stride[2], pt.z.stride[3], G, z.data());
  switch (pt.bits) {
    case 1: return decode_row<1>(row, s.data(), z.data(), pt.D, pt.group, nullptr, out);
    case 2: return decode_row<2>(row, s.data(), z.data(), pt.D, pt.group, nullptr, out);
    case 4: return decode_row<4>(row, s.data(), z.data(), pt.D, pt.group, nullptr, out);
    default: return decode_row<8>(row, s.data(), z.data(), pt.D, pt.group, nullptr, out);
  }
}

// C [RB, NV * L] = A [RB, r] @ P [r, NV * L] (row strides lda, ldp, ldc), the RB * NV
// accumulators held in registers over all of r: each P row is read once per RB rows.
template <int RB, int NV>
inline void tile_product(const float* A, int64_t lda, const float* P, int64_t ldp, int64_t r,
                         float* C, int64_t ldc) {
  vf acc[RB][NV] = {};
  for (int64_t k = 0; k < r; ++k) {
    vf p[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&p[j], P + k * ldp + j * L, sizeof(vf));
    for (int i = 0; i < RB; ++i) {
      const float a = A[i * lda + k];
      for (int j = 0; j < NV; ++j) acc[i][j] += a * p[j];
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j) std::memcpy(C + i * ldc + j * L, &acc[i][j], sizeof(vf));
}

constexpr int kRebuilt = 6;  // tokens rebuilt at once: 6 x 4 accumulators of L floats

// K [kRebuilt, D] = A [kRebuilt, r] @ P [r, D]: column blocks of 4, 3, 2 or 1 vectors, then
// single columns.
void rows_product(const float* A, int64_t r, const float* P, int64_t D, float* K) {
  constexpr int RB = kRebuilt;
  int64_t c = 0;
  for (; c + 4 * L <= D; c += 4 * L) tile_product<RB, 4>(A, r, P + c, D, r, K + c, D);
  switch ((D - c) / L) {
    case 3: tile_product<RB, 3>(A, r, P + c, D, r, K + c, D), c += 3 * L; break;
    case 2: tile_product<RB, 2>(A, r, P + c, D, r, K + c, D), c += 2 * L; break;
    case 1: tile_product<RB, 1>(A, r, P + c, D, r, K + c, D), c += L; break;
    default: break;
  }
  for (; c < D; ++c)
    for (int i = 0; i < RB; ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < r; ++k) sum += A[i * r + k] * P[k * D + c];
      K[i * D + c] = sum;
    }
}

// Scores of a dense part: each block of L tokens transposed into lanes.
void dense_keys(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
                int64_t ld) {
  const int64_t D = pt.D, n = pt.n;
  std::vector<float> row(D);
  std::vector<vf> tile(D), acc(R);
  std::optional<Angles> angles;
  if (pt.rotate) angles.emplace(pt);
  for (int64_t t = 0; t < n; t += L) {
    const int64_t count = std::min<int64_t>(L, n - t);
    std::fill(tile.begin(), tile.end(), vf{});
    for (int j = 0; j < count; ++j) {
      load(pt.a, pt.a.at(b, h) + (t + j) * pt.a.stride[2], pt.a.stride[3], D, row.data());
      if (angles) angles->rotate(t + j, row.data());
      for (int64_t d = 0; d < D; ++d) tile[d][j] = row[d];
    }
    std::fill(acc.begin(), acc.end(), vf{});
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
      for (int64_t r = 0; r < R; ++r) acc[r] += dot<8>(q + r * D + d, tile.data() + d);
    for (; d < D; ++d)
      for (int64_t r = 0; r < R; ++r) acc[r] += q[r * D + d] * tile[d];
    for (int64_t r = 0; r < R; ++r)
      for (int j = 0; j < count; ++j) out[r * ld + t + j] = acc[r][j];
  }
}

void dense_values(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                  float* out) {
  const int64_t D = pt.D;
  std::vector<float> row(D);
  for (int64_t t = 0; t < pt.n; ++t) {
    load(pt.a, pt.a.at(b, h) + t * pt.a.stride[2], pt.a.stride[3], D, row.data());
    for (int64_t r = 0; r < R; ++r) {
      const float w = p[r * ld + t];
      float* o = out + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * row[d];
    }
  }
}

}  // namespace

// Scores of a part whose keys are stored before RoPE as a factor (xKV, XQuant): for heads
// h0 .. h0 + nh (q: R rows of Dp each), keys x = a P_h + m_h rebuilt kRebuilt tokens at a
// time and rotated to their positions, each tile scored while it is in cache. Rebuilt with
// MLX's ops, the keys were a full-size float transient a layer and three more passes.
void rebuilt_keys(const Part& pt, int64_t b, int64_t h0, int64_t nh, const float* q, int64_t R,
                  float* out, int64_t ld) {
  const Part& P = *pt.proj;
  const int64_t r = pt.D, D = P.D;
  std::vector<float> Ph(nh * r * D), Mh(nh * D), A(kRebuilt * r), K(kRebuilt * D);
  Angles angles(pt);
  for (int64_t i = 0; i < nh; ++i) {
    for (int64_t k = 0; k < r; ++k) row_floats(P, b, h0 + i, k, Ph.data() + (i * r + k) * D);
    load(pt.mean, pt.mean.at(b, h0 + i), pt.mean.stride[3], D, Mh.data() + i * D);
  }
  for (int64_t t = 0; t < pt.n; t += kRebuilt) {
    const int64_t count = std::min<int64_t>(kRebuilt, pt.n - t);
    for (int64_t j = 0; j < kRebuilt; ++j)
      row_floats(pt, b, h0, t + std::min(j, count - 1), A.data() + j * r);
    for (int64_t i = 0; i < nh; ++i) {
      rows_product(A.data(), r, Ph.data() + i * r * D, D, K.data());
      for (int64_t j = 0; j < count; ++j) {
        float* k = K.data() + j * D;
        for (int64_t d = 0; d < D; ++d) k[d] += Mh[i * D + d];
        angles.rotate(t + j, k);
        for (int64_t row = 0; row < R; ++row) {
          const float* qr = q + (i * R + row) * D;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < D; ++d) sum += qr[d] * k[d];
          out[(i * R + row) * ld + t + j] = sum;
        }
      }
    }
  }
}

void keys_into(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
               int64_t ld) {
  if (pt.kind == kDense) return dense_keys(pt, b, h, q, R, out, ld);
  return coded_keys(pt, b, h, q, R, out, ld);
}

void values_into(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                 float* out) {
  if (pt.kind == kDense) return dense_values(pt, b, h, p, ld, R, out);
  return coded_values(pt, b, h, p, ld, R, out);
}

}  // namespace veloxquant
