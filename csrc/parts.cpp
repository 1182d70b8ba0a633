// Decode attention over a cache's stored parts, fused into one op for MLX's CPU backend.
//
// ops/attention.py's decode path runs about a hundred MLX ops per layer over a compressed
// cache (unpack, multiply, scale, concatenate, softmax, ...): on a CPU each costs a few
// microseconds and a pass over memory, which made a compressed decode slower than a dense
// one. This op does the whole of it per KV head in one pass: scores of every key part,
// softmax, and the product with every value part, with the codes unpacked a few words at
// a time into registers (no float copy of a store, not even a transient one).
//
// Parts, laid one after the other along the tokens (keys and values may be cut at
// different places), as ops/parts.py describes them:
//   dense    [B, H, n, D] floats (float32, float16 or bfloat16)
//   token    codes [B, H, n, D * bits / 8 bytes] (any unsigned words), scales [B, H, n, G]
//            and optional biases: x = scale * level + bias per group of D / G dims
//   channel  codes [B, H, D, n * bits / 8 bytes], scales and biases [B, H, D, n / group]
//            (KIVI's keys: one scale per channel per group of tokens)
// Codes of 1, 2, 4 and 8 bits are packed from the low bits up (MLX's layout, read on a
// little-endian CPU). A level is the code itself, or table[code] for codebook parts.
// Vector lanes run over tokens, so no kernel reduces across a vector per token.
//
// Factor-space attention (low-rank caches: x = a B + m with a token factor a of width r)
// places parts in the rows: a key part reads dims [qoff, qoff + D) of each query row (the
// query projected by the cache, q B^T) and may add a per-row shift to its scores (q . m);
// a value part adds its product p @ a into output dims [ooff, ooff + D) and may write its
// probability mass after them (the cache applies B and m after the op). A projected part
// carries its own B and m (per head, dense or token rows [B, H, r, Dp], read by the op's own
// key and value kernels as they read any part): a key part projects dims [qoff, qoff + Dp)
// of the queries itself and adds q . m; a value part adds (p @ a) B + (sum p) m into output
// dims [ooff, ooff + Dp). The cache's small per-head products then run inside the op, not
// as a dozen MLX ops a layer.
//
// A key part may carry a rotation (RoPE): its inverse frequencies [1, 1, 1, dims / 2] and
// its first position (int32 [1, 1, 1, 1]), the angles made in the op (class Angles); extra
// kPairs pairs neighbouring dims (2i, 2i + 1), else dims i and i + dims / 2.
// A dense part's rows are rotated as they are read. A projected part with a rotation holds
// keys stored before RoPE as a factor (xKV's default, XQuant): the op rebuilds a few tokens'
// keys a P + m at a time, rotates and scores them while they are in cache, so no rebuilt
// key ever exists at full size.
//
// A value part shared by the KV heads (head stride 0) is read once for every head's rows:
// each head's softmax first, then the part's tokens split between the threads.
//
// floats_of: token-coded rows as float32 in one op, for caches that rebuild from codes
// with a matmul where this op does not (XQuant-CL's layer input, the MLX path of xKV and
// XQuant): MLX's ops took several passes over the rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace {

constexpr int L = 16;
typedef float vf __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

enum Kind : int { kDense = 0, kToken = 1, kChannel = 2 };
// kind, bits, group, has biases, has a table, query offset, output offset, extras, then a
// projection's kind, bits, group, has biases, has a table (zeros without one)
constexpr int kSpecInts = 13;
constexpr int kProjSpec = 8;  // where a projection's stored form starts in a part's spec
enum Extra : int { kShift = 1, kMass = 2, kRotate = 4, kProject = 8, kPairs = 16 };

// An input's base pointer with byte strides over its four axes.
struct View {
  const uint8_t* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  mx::Dtype dtype = mx::float32;
  const uint8_t* at(int64_t b, int64_t h) const { return data + b * stride[0] + h * stride[1]; }
};

View view_of(const mx::array& a) {
  View v;
  v.data = a.data<uint8_t>();
  v.dtype = a.dtype();
  const auto size = static_cast<int64_t>(mx::size_of(a.dtype()));
  for (int i = 0; i < 4; ++i) v.stride[i] = a.shape(i) == 1 ? 0 : a.strides()[i] * size;
  return v;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half to float with integer ops.
inline float half_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  if (e == 0) return (sign ? -1.f : 1.f) * static_cast<float>(m) * 5.9604645e-8f;
  return bits_float(sign | ((e == 31 ? 255u : e + 112u) << 23) | (m << 13));
}

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

struct Part {
  int kind, bits, group;
  bool has_bias, has_table;
  int qoff = 0, ooff = 0, extras = 0;
  int64_t n = 0, D = 0;
  View a, s, z, shift;  // dense values or codes; scales; biases; score shift [B, H, R, 1]
  // A rotated part: RoPE's inverse frequencies [1, 1, 1, dims / 2] (contiguous float32), the
  // position of the part's token 0, and of this slice's first token among the part's.
  // Pairs (2i, 2i + 1) with kPairs, else (i, i + dims / 2).
  const float* rot_inv = nullptr;
  int64_t rot_dims = 0, rot_start = 0, rot_first = 0;
  vf table = {};
  // A projected part (x = a P + m): its factor P [B, H, r, Dp] (dense or token rows) and
  // mean m [B, H, 1, Dp].
  std::shared_ptr<const Part> proj;
  View mean;
};

// Scales and biases (zeros without) of head (b, h) as contiguous floats [rows, cols].
std::pair<std::vector<float>, std::vector<float>> scales_of(const Part& pt, int64_t b, int64_t h,
                                                            int64_t rows, int64_t cols) {
  auto s = load_matrix(pt.s, b, h, rows, cols);
  auto z = pt.has_bias ? load_matrix(pt.z, b, h, rows, cols) : std::vector<float>(rows * cols, 0.f);
  s.resize(rows * cols + L, 0.f), z.resize(rows * cols + L, 0.f);  // whole-vector reads at the end
  return {std::move(s), std::move(z)};
}

// Code k of each lane's word as a level: the code, or its table entry.
template <int BITS, bool TABLE>
inline vf levels(vu word, int k, const vf& table) {
  const vu code = (word >> (k * BITS)) & ((1u << BITS) - 1);
  if constexpr (!TABLE) {
    return __builtin_convertvector(code, vf);
  } else {
#if defined(__GNUC__) && !defined(__clang__)
    if constexpr (BITS <= 4) return __builtin_shuffle(table, vi(code));
#endif
    vf out;
    for (int j = 0; j < L; ++j) out[j] = table[code[j]];
    return out;
  }
}

// f(first dim, its group, levels of the word's dims) for every word of the code rows of
// tokens t..t+L of a token part (a group holds whole words: checked when the op is built).
// The words are transposed through a tile read row by row: on this AMD EPYC a gather of
// rows 4 * D / per bytes apart took about a third of the whole op.
template <int BITS, bool TABLE, class F>
inline void for_each_word(const Part& pt, const uint8_t* base, int64_t t, int64_t count, F&& f) {
  constexpr int per = 32 / BITS;
  const int64_t words_per_group = pt.group / per, words = pt.D / per;
  thread_local std::vector<vu> tile;
  tile.resize(words);
  for (int j = 0; j < L; ++j) {
    const uint8_t* row = base + (t + std::min<int64_t>(j, count - 1)) * pt.a.stride[2];
    for (int64_t w = 0; w < words; ++w) {
      uint32_t u;
      std::memcpy(&u, row + 4 * w, 4);
      tile[w][j] = u;
    }
  }
  for (int64_t w = 0; w < words; ++w) {
    const vu word = tile[w];
    vf lv[per];
    for (int k = 0; k < per; ++k) lv[k] = levels<BITS, TABLE>(word, k, pt.table);
    f(w * per, w / words_per_group, lv);
  }
}

// sum_k q[k] * x[k] as a tree: an accumulator updated once per dim made each multiply
// wait for the previous one (a chain through memory, about ten cycles a dim).
template <int N>
inline vf dot(const float* q, const vf* x) {
  if constexpr (N == 1) {
    return q[0] * x[0];
  } else {
    return dot<N / 2>(q, x) + dot<N - N / 2>(q + N / 2, x + N / 2);
  }
}

// m[(t + j) * step] for the lanes j < count, zeros past it.
inline vf lanes(const float* m, int64_t step, int64_t t, int64_t count) {
  vf out = {};
  for (int j = 0; j < count; ++j) out[j] = m[(t + j) * step];
  return out;
}

inline float lane_sum(const vf& v) {
  float total = 0.f;
  for (int j = 0; j < L; ++j) total += v[j];
  return total;
}

// f(w) on `threads` threads (w = 0 on this one).
template <class F>
void on_threads(int threads, F&& f) {
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w) pool.emplace_back(f, w);
  f(0);
  for (auto& t : pool) t.join();
}

// Scores q @ K^T of a token part into out[r * ld + t].
template <int BITS, bool TABLE>
void token_keys(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
                int64_t ld) {
  const int64_t D = pt.D, gs = pt.group, G = D / gs, n = pt.n;
  auto [s, z] = scales_of(pt, b, h, n, G);
  std::vector<float> qsum(R * G, 0.f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < D; ++i) qsum[r * G + i / gs] += q[r * D + i];
  const uint8_t* base = pt.a.at(b, h);
  std::vector<vf> acc(R * G), sl(G), zl(G);
  for (int64_t t = 0; t < n; t += L) {
    const int64_t count = std::min<int64_t>(L, n - t);
    std::fill(acc.begin(), acc.end(), vf{});
    for_each_word<BITS, TABLE>(pt, base, t, count, [&](int64_t d, int64_t g, const vf* lv) {
      for (int64_t r = 0; r < R; ++r) acc[r * G + g] += dot<32 / BITS>(q + r * D + d, lv);
    });
    for (int64_t g = 0; g < G; ++g)  // the tokens' scales in lanes, once for every row
      sl[g] = lanes(s.data() + g, G, t, count), zl[g] = lanes(z.data() + g, G, t, count);
    for (int64_t r = 0; r < R; ++r) {
      vf score = {};
      for (int64_t g = 0; g < G; ++g) score += sl[g] * acc[r * G + g] + zl[g] * qsum[r * G + g];
      for (int j = 0; j < count; ++j) out[r * ld + t + j] = score[j];
    }
  }
}

// p @ V of a token part (p[r * ld + t]) added into acc [R, D].
template <int BITS, bool TABLE>
void token_values(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                  float* out) {
  const int64_t D = pt.D, gs = pt.group, G = D / gs, n = pt.n;
  auto [s, z] = scales_of(pt, b, h, n, G);
  const uint8_t* base = pt.a.at(b, h);
  std::vector<vf> acc(R * D), pz(R * G), ps(R * G), sl(G), zl(G);
  for (int64_t t = 0; t < n; t += L) {
    const int64_t count = std::min<int64_t>(L, n - t);
    for (int64_t g = 0; g < G; ++g)
      sl[g] = lanes(s.data() + g, G, t, count), zl[g] = lanes(z.data() + g, G, t, count);
    for (int64_t r = 0; r < R; ++r) {
      const vf pr = lanes(p + r * ld, 1, t, count);
      for (int64_t g = 0; g < G; ++g) ps[r * G + g] = pr * sl[g], pz[r * G + g] += pr * zl[g];
    }
    for_each_word<BITS, TABLE>(pt, base, t, count, [&](int64_t d, int64_t g, const vf* lv) {
      for (int k = 0; k < 32 / BITS; ++k)
        for (int64_t r = 0; r < R; ++r) acc[r * D + d + k] += ps[r * G + g] * lv[k];
    });
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d)
      out[r * D + d] += lane_sum(acc[r * D + d]) + lane_sum(pz[r * G + d / gs]);
}

typedef uint8_t vb __attribute__((vector_size(L)));

// One row of codes (D values, little-endian words) as floats: code * scale + bias, in
// blocks of L values of one group (lane i: byte i * BITS / 8, shifted by i * BITS % 8).
template <int BITS>
void decode_row(const uint8_t* codes, const float* s, const float* z, int64_t D, int64_t gs,
                const float* plus, float* out) {
  vb idx;
  vu shift;
  for (int i = 0; i < L; ++i) idx[i] = i * BITS / 8, shift[i] = i * BITS % 8;
  for (int64_t d = 0; d < D; d += L) {
    vb bytes = {};
    std::memcpy(&bytes, codes + d * BITS / 8, L * BITS / 8);
    const vu code = (__builtin_convertvector(__builtin_shuffle(bytes, idx), vu) >> shift) &
                    ((1u << BITS) - 1);
    vf v = __builtin_convertvector(code, vf) * s[d / gs] + z[d / gs];
    if (plus != nullptr) {
      vf p;
      std::memcpy(&p, plus + d, sizeof(vf));
      v += p;
    }
    std::memcpy(out + d, &v, sizeof(vf));
  }
}

// L bytes as L words (GCC's generic conversion extracted them one by one).
inline vu widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<const vu&>(w);
#else
  vb bytes;
  std::memcpy(&bytes, p, L);
  return __builtin_convertvector(bytes, vu);
#endif
}

// Rows r0..r0+RN of p @ V for the code blocks of tokens t0..t1, accumulated in acc
// [blocks][RN][per] (registers for one block at a time: RN * per vectors).
template <int BITS, bool TABLE, int RN>
void value_rows_block(const Part& pt, const uint8_t* base, const std::vector<float>& s,
                      const std::vector<vi>& group_of, const float* p, int64_t ld,
                      int64_t t0, int64_t t1, vf* acc) {
  constexpr int per = 8 / BITS;
  const int64_t gs = pt.group, G = pt.D / gs, blocks = pt.D / per / L;
  const bool whole = gs % (L * per) == 0;  // each block inside one group: scale the weights
  for (int64_t j = 0; j < blocks; ++j) {
    vf a[RN][per];
    for (int r = 0; r < RN; ++r)
      for (int k = 0; k < per; ++k) a[r][k] = acc[(j * RN + r) * per + k];
    for (int64_t t = t0; t < t1; ++t) {
      const vu wide = widen(base + t * pt.a.stride[2] + L * j);
      if (whole) {
        const float sc = s[t * G + L * per * j / gs];
        for (int k = 0; k < per; ++k) {  // scaled once, not once per row
          const vf lv = levels<BITS, TABLE>(wide, k, pt.table) * sc;
          for (int r = 0; r < RN; ++r) a[r][k] += p[r * ld + t] * lv;
        }
        continue;
      }
      vf srow;  // lanes past G hold the next tokens' scales, never selected
      std::memcpy(&srow, s.data() + t * G, sizeof(vf));
      for (int k = 0; k < per; ++k) {
#if defined(__GNUC__) && !defined(__clang__)
        const vf sv = __builtin_shuffle(srow, group_of[j * per + k]);
#else
        vf sv;
        for (int i = 0; i < L; ++i) sv[i] = srow[group_of[j * per + k][i]];
#endif
        const vf lv = sv * levels<BITS, TABLE>(wide, k, pt.table);
        for (int r = 0; r < RN; ++r) a[r][k] += p[r * ld + t] * lv;
      }
    }
    for (int r = 0; r < RN; ++r)
      for (int k = 0; k < per; ++k) acc[(j * RN + r) * per + k] = a[r][k];
  }
}

template <int BITS, bool TABLE, int RN>
void value_rows(const Part& pt, const uint8_t* base, const std::vector<float>& s,
                const std::vector<vi>& group_of, const float* p, int64_t ld, float* out) {
  constexpr int per = 8 / BITS;
  // Tokens in chunks whose code rows stay in the cache while every block reads them.
  constexpr int64_t kChunk = 256;
  const int64_t D = pt.D, blocks = D / per / L;
  std::vector<vf> acc(blocks * RN * per, vf{});
  for (int64_t t = 0; t < pt.n; t += kChunk)
    value_rows_block<BITS, TABLE, RN>(pt, base, s, group_of, p, ld, t,
                                      std::min(pt.n, t + kChunk), acc.data());
  for (int r = 0; r < RN; ++r)
    for (int64_t j = 0; j < blocks; ++j)
      for (int k = 0; k < per; ++k)
        for (int i = 0; i < L; ++i)
          out[r * D + (L * j + i) * per + k] += acc[(j * RN + r) * per + k][i];
}

// p @ V of a token part, lanes over the dims of one token's code row (no gathers):
// lane i of byte block j, phase k holds dim (L * j + i) * (8 / BITS) + k. Rows of whole
// blocks of L bytes and at most L groups; other token parts take token_values. The query
// rows go in blocks of at most kRowBlock, each block's sums held in registers.
constexpr int kRowBlock = 6;

// out[r, d] += sum_t p[r, t] z[t, d / gs] for G <= L groups: token t's biases are one
// vector (z holds L floats past its end), each row's sums a vector in registers (a sum per
// group updated token by token was half of a value part's time).
template <int RN>
void add_bias_rows(const float* z, int64_t G, int64_t gs, int64_t n, const float* p,
                   int64_t ld, float* out) {
  vf acc[RN] = {};
  vf zt;
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(&zt, z + t * G, sizeof(vf));
    for (int r = 0; r < RN; ++r) acc[r] += p[r * ld + t] * zt;
  }
  for (int r = 0; r < RN; ++r)
    for (int64_t d = 0; d < G * gs; ++d) out[r * G * gs + d] += acc[r][d / gs];
}

void add_bias_sums(const std::vector<float>& z, int64_t G, int64_t gs, int64_t n,
                   const float* p, int64_t ld, int64_t R, float* out) {
  constexpr int kRows = 8;
  int64_t r = 0;
  for (; r + kRows <= R; r += kRows)
    add_bias_rows<kRows>(z.data(), G, gs, n, p + r * ld, ld, out + r * G * gs);
  for (; r < R; ++r) add_bias_rows<1>(z.data(), G, gs, n, p + r * ld, ld, out + r * G * gs);
}

template <int BITS, bool TABLE>
void token_values_rows(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld,
                       int64_t R, float* out) {
  constexpr int per = 8 / BITS;
  const int64_t D = pt.D, gs = pt.group, G = D / gs, n = pt.n, blocks = D / per / L;
  auto [s, z] = scales_of(pt, b, h, n, G);
  std::vector<vi> group_of(blocks * per);
  for (int64_t j = 0; j < blocks; ++j)
    for (int k = 0; k < per; ++k)
      for (int i = 0; i < L; ++i) group_of[j * per + k][i] = ((L * j + i) * per + k) / gs;
  const uint8_t* base = pt.a.at(b, h);
  const int64_t row_blocks = (R + kRowBlock - 1) / kRowBlock;
  for (int64_t r0 = 0, i = 0; i < row_blocks; ++i) {
    const int64_t rn = (R - r0) / (row_blocks - i);  // even blocks: 9 rows as 5 and 4
    const float* pr = p + r0 * ld;
    float* o = out + r0 * D;
    switch (rn) {
      case 1: value_rows<BITS, TABLE, 1>(pt, base, s, group_of, pr, ld, o); break;
      case 2: value_rows<BITS, TABLE, 2>(pt, base, s, group_of, pr, ld, o); break;
      case 3: value_rows<BITS, TABLE, 3>(pt, base, s, group_of, pr, ld, o); break;
      case 4: value_rows<BITS, TABLE, 4>(pt, base, s, group_of, pr, ld, o); break;
      case 5: value_rows<BITS, TABLE, 5>(pt, base, s, group_of, pr, ld, o); break;
      default: value_rows<BITS, TABLE, kRowBlock>(pt, base, s, group_of, pr, ld, o); break;
    }
    r0 += rn;
  }
  if (pt.has_bias) add_bias_sums(z, G, gs, n, p, ld, R, out);
}

// Scores of a channel part: lane j of word block w holds tokens (w + j) * per + k.
template <int BITS>
void channel_keys(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
                  int64_t ld) {
  constexpr int per = 32 / BITS;
  const int64_t D = pt.D, g = pt.group, n = pt.n, groups = n / g, words = n / per;
  auto [s, z] = scales_of(pt, b, h, D, groups);  // [D, groups] (+ L floats of padding)
  const uint8_t* base = pt.a.at(b, h);
  std::vector<vf> acc(R * per), shift(R);
  vi lane;
  for (int j = 0; j < L; ++j) lane[j] = j;
  for (int64_t w = 0; w < words; w += L) {
    const int64_t count = std::min<int64_t>(L, words - w), g0 = w * per / g;
    const vi group_of = (lane + static_cast<int>(w)) * per / static_cast<int>(g) - static_cast<int>(g0);
    std::fill(acc.begin(), acc.end(), vf{});
    std::fill(shift.begin(), shift.end(), vf{});
    for (int64_t d = 0; d < D; ++d) {
      vu word = {};
      if (count == L) std::memcpy(&word, base + d * pt.a.stride[2] + 4 * w, sizeof(vu));
      else std::memcpy(&word, base + d * pt.a.stride[2] + 4 * w, 4 * count);
      vf srow, zrow;  // the next L groups' scales of channel d (the buffers are padded)
      std::memcpy(&srow, s.data() + d * groups + g0, sizeof(vf));
      std::memcpy(&zrow, z.data() + d * groups + g0, sizeof(vf));
      vf lv[per];
      for (int k = 0; k < per; ++k)
        lv[k] = __builtin_convertvector((word >> (k * BITS)) & ((1u << BITS) - 1), vf);
#if defined(__GNUC__) && !defined(__clang__)
      const vf sv = __builtin_shuffle(srow, group_of), zv = __builtin_shuffle(zrow, group_of);
#else
      vf sv, zv;
      for (int j = 0; j < L; ++j) sv[j] = srow[group_of[j]], zv[j] = zrow[group_of[j]];
#endif
      for (int64_t r = 0; r < R; ++r) {
        const vf qs = q[r * D + d] * sv;
        shift[r] += q[r * D + d] * zv;
        for (int k = 0; k < per; ++k) acc[r * per + k] += qs * lv[k];
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int j = 0; j < count; ++j)
        for (int k = 0; k < per; ++k) out[r * ld + (w + j) * per + k] = acc[r * per + k][j] + shift[r][j];
  }
}

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
    const bool pairs = pt_.extras & kPairs;
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

// Whether a key part's keys are rebuilt in the op: projected (x = a P + m) and rotated.
inline bool rebuilds(const Part& pt) { return pt.proj && (pt.extras & kRotate); }

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

// Scores of a dense part: each block of L tokens transposed into lanes.
void dense_keys(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
                int64_t ld) {
  const int64_t D = pt.D, n = pt.n;
  std::vector<float> row(D);
  std::vector<vf> tile(D), acc(R);
  std::optional<Angles> angles;
  if (pt.extras & kRotate) angles.emplace(pt);
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

template <bool TABLE>
void token_keys_of(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
                   int64_t ld) {
  switch (pt.bits) {
    case 1: return token_keys<1, TABLE>(pt, b, h, q, R, out, ld);
    case 2: return token_keys<2, TABLE>(pt, b, h, q, R, out, ld);
    case 4: return token_keys<4, TABLE>(pt, b, h, q, R, out, ld);
    default: return token_keys<8, TABLE>(pt, b, h, q, R, out, ld);
  }
}

template <bool TABLE>
void token_values_of(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                     float* out) {
  if (pt.bits > 1 && pt.D * pt.bits % (8 * L) == 0 && pt.D / pt.group <= L) {
    switch (pt.bits) {
      case 2: return token_values_rows<2, TABLE>(pt, b, h, p, ld, R, out);
      case 4: return token_values_rows<4, TABLE>(pt, b, h, p, ld, R, out);
      default: return token_values_rows<8, TABLE>(pt, b, h, p, ld, R, out);
    }
  }
  switch (pt.bits) {
    case 1: return token_values<1, TABLE>(pt, b, h, p, ld, R, out);
    case 2: return token_values<2, TABLE>(pt, b, h, p, ld, R, out);
    case 4: return token_values<4, TABLE>(pt, b, h, p, ld, R, out);
    default: return token_values<8, TABLE>(pt, b, h, p, ld, R, out);
  }
}

void keys_into(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
               int64_t ld) {
  if (pt.kind == kDense) return dense_keys(pt, b, h, q, R, out, ld);
  if (pt.kind == kToken)
    return pt.has_table ? token_keys_of<true>(pt, b, h, q, R, out, ld)
                        : token_keys_of<false>(pt, b, h, q, R, out, ld);
  switch (pt.bits) {
    case 1: return channel_keys<1>(pt, b, h, q, R, out, ld);
    case 2: return channel_keys<2>(pt, b, h, q, R, out, ld);
    case 4: return channel_keys<4>(pt, b, h, q, R, out, ld);
    default: return channel_keys<8>(pt, b, h, q, R, out, ld);
  }
}

void values_into(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                 float* out) {
  if (pt.kind == kDense) return dense_values(pt, b, h, p, ld, R, out);
  return pt.has_table ? token_values_of<true>(pt, b, h, p, ld, R, out)
                      : token_values_of<false>(pt, b, h, p, ld, R, out);
}

// exp(x) for x <= 0: 2^i * p(f) as in ops/attention.py (max relative error 1.9e-7);
// below 2^-127 it is exactly 0.
inline vf exp_nonpositive(vf x) {
  constexpr float c[6] = {1.8775767e-3f, 8.9893397e-3f, 5.5826318e-2f,
                          2.4015361e-1f, 6.9315308e-1f, 9.9999994e-1f};
  vf t = x * 1.4426950408889634f;
  t = t < -127.f ? vf{} - 127.f : t;
  vf i = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  i = i > t ? i - 1.f : i;
  const vf f = t - i;
  vf p = c[0] * f + c[1];
  for (int k = 2; k < 6; ++k) p = p * f + c[k];
  const vi e = (__builtin_convertvector(i, vi) + 127) << 23;
  return p * reinterpret_cast<const vf&>(e);
}

// Row softmax numerators in place; returns each row's sum.
std::vector<float> exp_rows(float* sc, int64_t R, int64_t S) {
  std::vector<float> den(R);
  for (int64_t r = 0; r < R; ++r) {
    float* row = sc + r * S;
    const float m = *std::max_element(row, row + S);
    vf sum = {};
    int64_t t = 0;
    for (; t + L <= S; t += L) {
      vf x;
      std::memcpy(&x, row + t, sizeof(vf));
      x = exp_nonpositive(x - m);
      std::memcpy(row + t, &x, sizeof(vf));
      sum += x;
    }
    vf x = vf{} - 1e30f;
    std::memcpy(&x, row + t, 4 * (S - t));
    x = exp_nonpositive(x - m);
    std::memcpy(row + t, &x, 4 * (S - t));
    den[r] = lane_sum(sum) + lane_sum(x);
  }
  return den;
}

std::vector<float> projection_mean(const Part& pt, int64_t b, int64_t h) {
  std::vector<float> m(pt.proj->D);
  load(pt.mean, pt.mean.at(b, h), pt.mean.stride[3], pt.proj->D, m.data());
  return m;
}

// Width of the query dims a key part reads (its projection's, when projected).
inline int64_t read_width(const Part& pt) { return pt.proj ? pt.proj->D : pt.D; }

// Width of the query rows a key part's kernel takes: the projected queries' (its rank), or
// the queries' own dims where the kernel rebuilds the keys.
inline int64_t query_width(const Part& pt) { return rebuilds(pt) ? pt.proj->D : pt.D; }

// Dims [qoff, qoff + D) of R query rows (stride Dq): R rows of D.
void query_dims(const float* q, int64_t R, int64_t Dq, int64_t qoff, int64_t D, float* out) {
  for (int64_t r = 0; r < R; ++r) std::copy_n(q + r * Dq + qoff, D, out + r * D);
}

// A key part's queries, R rows of query_width, from dims [qoff, qoff + read_width) of the
// query rows (stride Dq): copied, or projected onto its factor for head (b, h): q P^T is
// the scores of the query against P's rows, so the key kernels compute it from P's codes.
void part_queries(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, int64_t Dq,
                  float* out) {
  if (!pt.proj || rebuilds(pt)) return query_dims(q, R, Dq, pt.qoff, query_width(pt), out);
  const Part& P = *pt.proj;
  std::vector<float> own;
  if (pt.qoff != 0 || P.D != Dq) own.resize(R * P.D), query_dims(q, R, Dq, pt.qoff, P.D, own.data());
  keys_into(P, b, h, own.empty() ? q : own.data(), R, out, pt.D);
}

// A key part's per-row score shift: given (q . m, computed by the cache), or its
// projection's mean (q . m here); empty without.
std::vector<float> score_shift(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R,
                               int64_t Dq) {
  std::vector<float> shift;
  if (pt.extras & kShift) {
    shift.resize(R);
    load(pt.shift, pt.shift.at(b, h), pt.shift.stride[2], R, shift.data());
  } else if (pt.proj && !rebuilds(pt)) {
    const auto m = projection_mean(pt, b, h);
    for (int64_t r = 0; r < R; ++r)
      shift.push_back(std::inner_product(m.begin(), m.end(), q + r * Dq + pt.qoff, 0.f));
  }
  return shift;
}

// Scores of a key part's R query rows (of query_width) for each head h .. h + nh: a part
// shared by the heads is read once for all of them.
void scores_into(const Part& pt, int64_t b, int64_t h, int64_t nh, const float* q, int64_t R,
                 float* out, int64_t ld) {
  if (rebuilds(pt)) return rebuilt_keys(pt, b, h, nh, q, R, out, ld);
  keys_into(pt, b, h, q, nh * R, out, ld);
}

// Scores of a key part placed at dims [qoff, ...) of the query rows (stride Dq), plus its
// per-row shift; `pre`: the head's rows of scores computed for every head at once.
void placed_keys(const Part& pt, int64_t b, int64_t h, const std::vector<float>& q, int64_t Dq,
                 int64_t R, float* out, int64_t ld, const float* pre) {
  if (pre != nullptr) {
    for (int64_t r = 0; r < R; ++r) std::copy_n(pre + (h * R + r) * pt.n, pt.n, out + r * ld);
  } else if (pt.qoff == 0 && pt.D == Dq && !pt.proj) {
    keys_into(pt, b, h, q.data(), R, out, ld);
  } else {
    std::vector<float> own(R * query_width(pt));
    part_queries(pt, b, h, q.data(), R, Dq, own.data());
    scores_into(pt, b, h, 1, own.data(), R, out, ld);
  }
  const auto shift = score_shift(pt, b, h, q.data(), R, Dq);
  for (size_t r = 0; r < shift.size(); ++r)
    for (int64_t t = 0; t < pt.n; ++t) out[r * ld + t] += shift[r];
}

// Head (b, h)'s R rows of a value part's p @ V (own [R, D]) added into output dims
// [ooff, ooff + D) of acc (stride Dout), and the part's probability mass into dim ooff + D;
// projected into dims [ooff, ooff + Dp): own P + mass m, where own P weighs P's rows as
// probabilities weigh tokens, so the value kernels compute it from P's codes.
void place_values(const Part& pt, int64_t b, int64_t h, const float* own, const float* p,
                  int64_t ld, int64_t R, float* acc, int64_t Dout) {
  const int64_t D = read_width(pt);
  std::vector<float> sum;
  if (pt.proj) sum.assign(R * D, 0.f), values_into(*pt.proj, b, h, own, pt.D, R, sum.data());
  const std::vector<float> m = pt.proj ? projection_mean(pt, b, h) : std::vector<float>();
  for (int64_t r = 0; r < R; ++r) {
    float* o = acc + r * Dout + pt.ooff;
    const float* x = pt.proj ? sum.data() + r * D : own + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] += x[d];
    if (!pt.proj && !(pt.extras & kMass)) continue;
    const float mass = std::accumulate(p + r * ld, p + r * ld + pt.n, 0.f);
    if (pt.proj) {
      for (int64_t d = 0; d < D; ++d) o[d] += mass * m[d];
    } else {
      o[D] += mass;
    }
  }
}

void placed_values(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                   float* acc, int64_t Dout) {
  if (pt.ooff == 0 && pt.D == Dout && !(pt.extras & kMass) && !pt.proj)
    return values_into(pt, b, h, p, ld, R, acc);
  std::vector<float> own(R * pt.D, 0.f);
  values_into(pt, b, h, p, ld, R, own.data());
  place_values(pt, b, h, own.data(), p, ld, R, acc, Dout);
}

// One sequence's parts: every query row's own (a batch of conversations), or one set whose
// arrays have the queries' batch axis.
struct Parts {
  std::vector<Part> keys, values;
  int64_t S = 0;
};

struct Plan {
  std::vector<Parts> rows;  // one entry: shared by the batch
  View q;
  int64_t B, H, R, D, Dv;
  int64_t causal = 0;  // > 0: rows are (query head, token) of the last `causal` keys' tokens
};

// A causal chunk: row r is token r % C of the chunk's C tokens, the last C of S keys; it
// sees the keys up to its own. The rest of its scores get a floor whose exp is 0.
void mask_causal(float* sc, int64_t R, int64_t S, int64_t C) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t seen = S - C + 1 + r % C;
    std::fill(sc + r * S + seen, sc + (r + 1) * S, -1e30f);
  }
}

// Scores of batch row b's key parts shared by the KV heads, for every head's rows: [b][part]
// -> [H * R, n] (empty for parts of each head's own).
using Shared = std::vector<std::vector<std::vector<float>>>;

// Whether a key part is one view shared by the KV heads (a low-rank token factor): its
// codes are then unpacked once for every head's rows, not once per head.
bool shared_by_heads(const Plan& pl, const Part& pt) {
  return pl.H > 1 && pt.kind != kChannel && pt.a.stride[1] == 0 && pt.s.stride[1] == 0 &&
         pt.z.stride[1] == 0;
}

// Tokens t0..t1 of a token or dense part.
Part tokens(Part pt, int64_t t0, int64_t t1) {
  pt.a.data += t0 * pt.a.stride[2];
  if (pt.s.data != nullptr) pt.s.data += t0 * pt.s.stride[2];
  if (pt.z.data != nullptr) pt.z.data += t0 * pt.z.stride[2];
  pt.rot_first += t0;
  pt.n = t1 - t0;
  return pt;
}

// Scores of every key part shared by the KV heads, for every head's rows: each part's
// queries for all heads first, then one start of the threads for all parts, each thread
// scoring its share of every part's tokens (a thread start costs tens of microseconds).
Shared shared_scores(const Plan& pl, int threads) {
  const bool own = pl.rows.size() > 1;
  const int64_t R = pl.R, HR = pl.H * R;
  struct Job {
    const Part* pt;
    int64_t pb;
    std::vector<float> q;
    float* sc;
  };
  Shared out(pl.B);
  for (int64_t b = 0; b < pl.B; ++b)
    for (const auto& pt : pl.rows[own ? b : 0].keys)
      out[b].emplace_back(shared_by_heads(pl, pt) ? HR * pt.n : 0);
  std::vector<Job> jobs;
  for (int64_t b = 0; b < pl.B; ++b) {
    const auto& keys = pl.rows[own ? b : 0].keys;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (out[b][i].empty()) continue;
      const Part& pt = keys[i];
      const int64_t D = query_width(pt);
      Job job{&pt, own ? 0 : b, std::vector<float>(HR * D), out[b][i].data()};
      for (int64_t h = 0; h < pl.H; ++h)
        part_queries(pt, job.pb, h, load_matrix(pl.q, b, h, R, pl.D).data(), R, pl.D,
                     job.q.data() + h * R * D);
      jobs.push_back(std::move(job));
    }
  }
  if (jobs.empty()) return out;
  on_threads(threads, [&](int w) {
    for (const auto& job : jobs) {
      const int64_t n = job.pt->n, step = (n + threads * L - 1) / (threads * L) * L;
      const int64_t t0 = w * step, t1 = std::min(n, t0 + step);  // whole lane blocks
      if (t0 < t1)
        scores_into(tokens(*job.pt, t0, t1), job.pb, 0, pl.H, job.q.data(), R, job.sc + t0, n);
    }
  });
  return out;
}

// Head (b, h)'s rows: exponentiated scores over every key part into sc [R, S], their
// sums returned.
std::vector<float> head_probs(const Plan& pl, const Shared& shared, int64_t b, int64_t h,
                              float* sc) {
  const bool own = pl.rows.size() > 1;
  const Parts& ps = pl.rows[own ? b : 0];
  const int64_t R = pl.R, S = ps.S, pb = own ? 0 : b;
  const auto q = load_matrix(pl.q, b, h, R, pl.D);
  int64_t off = 0;
  for (size_t i = 0; i < ps.keys.size(); ++i) {
    const auto& pt = ps.keys[i];
    const auto& pre = shared[b][i];
    placed_keys(pt, pb, h, q, pl.D, R, sc + off, S, pre.empty() ? nullptr : pre.data());
    off += pt.n;
  }
  if (pl.causal > 0) mask_causal(sc, R, S, pl.causal);
  return exp_rows(sc, R, S);
}

// Head (b, h)'s value parts into acc [R, Dv], but those `skip` marks (read for every head
// at once).
void head_values(const Plan& pl, int64_t b, int64_t h, const float* sc, float* acc,
                 const std::vector<char>& skip) {
  const bool own = pl.rows.size() > 1;
  const Parts& ps = pl.rows[own ? b : 0];
  int64_t off = 0;
  for (size_t i = 0; i < ps.values.size(); ++i) {
    const auto& pt = ps.values[i];
    if (skip.empty() || !skip[i])
      placed_values(pt, own ? 0 : b, h, sc + off, ps.S, pl.R, acc, pl.Dv);
    off += pt.n;
  }
}

void normalize(const float* acc, const std::vector<float>& den, int64_t R, int64_t Dv, float* out) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < Dv; ++d) out[r * Dv + d] = acc[r * Dv + d] / den[r];
}

void attend_head(const Plan& pl, const Shared& shared, int64_t b, int64_t h, float* out) {
  const int64_t S = pl.rows[pl.rows.size() > 1 ? b : 0].S;
  std::vector<float> sc(pl.R * S), acc(pl.R * pl.Dv, 0.f);
  const auto den = head_probs(pl, shared, b, h, sc.data());
  head_values(pl, b, h, sc.data(), acc.data(), {});
  normalize(acc.data(), den, pl.R, pl.Dv, out);
}

// Value parts one view shared by the KV heads (a low-rank token factor), where every head's
// scores fit kSharedScores floats: their codes are then unpacked once for all heads' rows.
constexpr int64_t kSharedScores = int64_t{1} << 21;

std::vector<char> values_shared(const Plan& pl, const Parts& ps) {
  std::vector<char> out;
  if (pl.H * pl.R * ps.S > kSharedScores) return out;
  bool any = false;
  for (const auto& pt : ps.values) out.push_back(shared_by_heads(pl, pt)), any |= out.back();
  if (!any) out.clear();
  return out;
}

// Batch row b in two phases: every head's scores and own value parts (heads split between
// the threads), then each shared value part for all heads' rows at once (tokens split).
void attend_row_shared(const Plan& pl, const Shared& shared, int64_t b, float* out, int threads,
                       const std::vector<char>& skip) {
  const bool own = pl.rows.size() > 1;
  const Parts& ps = pl.rows[own ? b : 0];
  const int64_t H = pl.H, R = pl.R, S = ps.S, HR = H * R;
  std::vector<float> sc(HR * S), acc(HR * pl.Dv, 0.f);
  std::vector<std::vector<float>> den(H);
  const int nt = static_cast<int>(std::min<int64_t>(threads, H));
  on_threads(nt, [&](int w) {
    for (int64_t h = w; h < H; h += nt) {
      den[h] = head_probs(pl, shared, b, h, sc.data() + h * R * S);
      head_values(pl, b, h, sc.data() + h * R * S, acc.data() + h * R * pl.Dv, skip);
    }
  });
  // The shared parts (their first token at off), all in one start of the threads: each
  // thread sums its share of every part's tokens into its own buffer.
  std::vector<std::pair<const Part*, int64_t>> parts;
  for (size_t i = 0, off = 0; i < ps.values.size(); off += ps.values[i].n, ++i)
    if (skip[i]) parts.emplace_back(&ps.values[i], off);
  std::vector<std::vector<std::vector<float>>> sums(parts.size());
  for (size_t k = 0; k < parts.size(); ++k)
    sums[k].assign(threads, std::vector<float>(HR * parts[k].first->D, 0.f));
  on_threads(threads, [&](int w) {
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto [pt, off] = parts[k];
      const int64_t step = (pt->n + threads - 1) / threads;
      const int64_t t0 = w * step, t1 = std::min(pt->n, t0 + step);
      if (t0 < t1)
        values_into(tokens(*pt, t0, t1), own ? 0 : b, 0, sc.data() + off + t0, S, HR,
                    sums[k][w].data());
    }
  });
  for (size_t k = 0; k < parts.size(); ++k) {
    const auto [pt, off] = parts[k];
    auto& sum = sums[k][0];
    for (int w = 1; w < threads; ++w)
      for (int64_t i = 0; i < HR * pt->D; ++i) sum[i] += sums[k][w][i];
    for (int64_t h = 0; h < H; ++h)
      place_values(*pt, own ? 0 : b, h, sum.data() + h * R * pt->D, sc.data() + h * R * S + off,
                   S, R, acc.data() + h * R * pl.Dv, pl.Dv);
  }
  for (int64_t h = 0; h < H; ++h)
    normalize(acc.data() + h * R * pl.Dv, den[h], R, pl.Dv, out + (b * H + h) * R * pl.Dv);
}

void run(const Plan& pl, float* out, int threads) {
  const Shared shared = shared_scores(pl, threads);
  std::vector<int64_t> per_head;  // batch rows without shared value parts
  for (int64_t b = 0; b < pl.B; ++b) {
    const auto skip = values_shared(pl, pl.rows[pl.rows.size() > 1 ? b : 0]);
    if (skip.empty()) {
      for (int64_t h = 0; h < pl.H; ++h) per_head.push_back(b * pl.H + h);
    } else {
      attend_row_shared(pl, shared, b, out, threads, skip);
    }
  }
  const int64_t n = static_cast<int64_t>(per_head.size());
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  on_threads(nt, [&](int w) {
    for (int64_t i = w; i < n; i += nt) {
      const int64_t bh = per_head[i];
      attend_head(pl, shared, bh / pl.H, bh % pl.H, out + bh * pl.R * pl.Dv);
    }
  });
}

// ---- what the ops take: every argument is checked once per call, on shapes, dtypes and
// ints when the op is built and on strides when it runs (before any task is dispatched),
// so that no call from Python makes a kernel read or write out of bounds. Refusals are
// std::invalid_argument (ValueError in Python) naming the argument and what was expected.

constexpr const char* kRefusal = "veloxquant native: ";

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(kRefusal + what);
}

// A refusal whose message is built only when it is refused (a call's checks pass with no
// string made).
template <class F, class = decltype(std::declval<F>()())>
void check(bool ok, F&& what) {
  if (!ok) throw std::invalid_argument(kRefusal + std::string(what()));
}

// The same refusal placed: "where: what".
[[noreturn]] void refuse_in(const std::string& where, const std::invalid_argument& e) {
  std::string what = e.what();
  if (what.rfind(kRefusal, 0) == 0) what = what.substr(std::strlen(kRefusal));
  throw std::invalid_argument(kRefusal + where + ": " + what);
}

std::string shape_of(const mx::array& a) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << "] " << a.dtype();
  return s.str();
}

// arrays[i - 1]: inputs[0] is the queries.
std::string arg(size_t i) { return "arrays[" + std::to_string(i - 1) + "]"; }

bool is_float(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

// Threads a call may start (a large count would exhaust the process, not speed it up).
// Read once: hardware_concurrency() reads the system's CPU list, tens of microseconds.
int max_threads() {
  static const int most = static_cast<int>(std::max(64u, std::thread::hardware_concurrency()));
  return most;
}

void check_threads(int threads) {
  check(threads >= 1 && threads <= max_threads(), [&] {
    return std::string("threads must be 1 to " + std::to_string(max_threads()) + ", got " +
                       std::to_string(threads));
  });
}

// The op's buffers and outputs, in floats: broadcast views make large shapes of little memory,
// and a failed allocation inside a task would end the process.
constexpr int64_t kMaxFloats = int64_t{1} << 30;
// Query and output offsets (a head's dims).
constexpr int kMaxOffset = 1 << 16;

void check_floats(__int128 count, const char* what) {
  check(count <= kMaxFloats, [&] {
    return std::string(what) + " must be at most 2^30 floats, got " +
           std::to_string(static_cast<long double>(count));
  });
}

// Every element of a's view inside its buffer (the extent of its strides from its first
// element, either way): a view made with as_strided can point anywhere.
template <class N>
void check_extent(const mx::array& a, N&& name) {
  if (a.size() == 0) return;
  int64_t lo = 0, hi = 0, span = 0;
  bool ok = true;
  for (int i = 0; i < a.ndim(); ++i) {
    ok &= !__builtin_mul_overflow(int64_t{a.shape(i) - 1}, a.strides()[i], &span);
    ok &= !__builtin_add_overflow(span < 0 ? lo : hi, span, span < 0 ? &lo : &hi);
  }
  const auto item = static_cast<int64_t>(a.itemsize());
  const auto first = a.data<uint8_t>() - static_cast<const uint8_t*>(a.buffer().raw_ptr());
  const auto size = static_cast<int64_t>(a.buffer_size());
  ok = ok && !__builtin_mul_overflow(lo, item, &lo) && !__builtin_mul_overflow(hi + 1, item, &hi);
  check(ok && first + lo >= 0 && first + hi <= size, [&] {
    return std::string(name() + " " + shape_of(a) +
                       " is a view whose strides run past its buffer of " + std::to_string(size) +
                       " bytes");
  });
}

// Rows of an input contiguous along their last axis (the kernels read whole rows).
template <class N>
void check_last_axis(const mx::array& a, N&& name) {
  check(a.ndim() == 0 || a.shape(a.ndim() - 1) <= 1 || a.strides().back() == 1, [&] {
    return std::string(name() + " " + shape_of(a) +
                       " must be contiguous along its last axis (stride 1), got " +
                       std::to_string(a.ndim() ? a.strides().back() : 0));
  });
}

// What the decode op checks as it runs: every input inside its buffer; codes contiguous
// along their rows; a table and RoPE's inverse frequencies contiguous.
void check_at_run(const std::vector<mx::array>& in, const std::vector<int>& spec,
                  const std::vector<int>& counts) {
  for (size_t i = 0; i < in.size(); ++i)
    check_extent(in[i], [&] { return i == 0 ? std::string("q") : arg(i); });
  size_t next = 1;
  const auto stored = [&](const int* sp) {
    if (sp[0] != kDense) check_last_axis(in[next], [&] { return arg(next) + " (codes)"; });
    next += sp[0] == kDense ? 1 : 2 + sp[3];
    if (sp[0] != kDense && sp[4]) {
      check(in[next].flags().row_contiguous,
            [&] { return std::string(arg(next) + " (a table) must be contiguous"); });
      ++next;
    }
  };
  const int parts = std::accumulate(counts.begin(), counts.end(), 0);
  for (int i = 0; i < parts; ++i) {
    const int* sp = spec.data() + kSpecInts * i;
    stored(sp);
    next += (sp[7] & kShift) ? 1 : 0;
    if (sp[7] & kRotate) {
      check(in[next].flags().row_contiguous, [&] {
        return std::string(arg(next) + " (a rotation's inverse frequencies) must be contiguous");
      });
      next += 2;
    }
    if (sp[7] & kProject) stored(sp + kProjSpec), ++next;
  }
}

// A stored form's views and sizes from inputs[next] on (sp: kind, bits, group, has biases,
// has a table).
Part bind_stored(const int* sp, const std::vector<mx::array>& in, size_t& next) {
  Part pt{sp[0], sp[1], sp[2], sp[3] != 0, sp[4] != 0};
  const auto& a = in[next++];
  pt.a = view_of(a);
  if (pt.kind == kDense) {
    pt.n = a.shape(2), pt.D = a.shape(3);
    return pt;
  }
  pt.s = view_of(in[next++]);
  if (pt.has_bias) pt.z = view_of(in[next++]);
  if (pt.has_table) {
    const auto& t = in[next++];
    for (size_t j = 0; j < t.size() && j < L; ++j) pt.table[j] = t.data<float>()[j];
  }
  const int64_t width = a.shape(3) * static_cast<int64_t>(mx::size_of(a.dtype())) * 8 / pt.bits;
  pt.n = pt.kind == kToken ? a.shape(2) : width;
  pt.D = pt.kind == kToken ? width : a.shape(2);
  return pt;
}

// Fills the parts' views and sizes from the op's inputs (inputs[0] is the queries).
std::vector<Part> bind_parts(const std::vector<int>& spec, size_t first, size_t count,
                       const std::vector<mx::array>& in, size_t& next) {
  std::vector<Part> parts;
  for (size_t i = first; i < first + count; ++i) {
    const int* sp = spec.data() + kSpecInts * i;
    Part pt = bind_stored(sp, in, next);
    pt.qoff = sp[5], pt.ooff = sp[6], pt.extras = sp[7];
    // After the stored arrays, in check_part's order: shift, rotation, projection and mean.
    if (pt.extras & kShift) pt.shift = view_of(in[next++]);
    if (pt.extras & kRotate) {
      pt.rot_dims = 2 * in[next].shape(3);
      pt.rot_inv = in[next++].data<float>();
      pt.rot_start = in[next++].data<int32_t>()[0];
    }
    if (pt.extras & kProject) {
      pt.proj = std::make_shared<const Part>(bind_stored(sp + kProjSpec, in, next));
      pt.mean = view_of(in[next++]);
    }
    parts.push_back(pt);
  }
  return parts;
}

// A primitive of this extension: its output allocated and registered the same way for
// every op, and CPU only.
class CpuOp : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

 protected:
  mx::cpu::CommandEncoder& encoder(const std::vector<mx::array>& in, mx::array& out) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    return enc;
  }
};

class DecodeAttention : public CpuOp {
 public:
  DecodeAttention(mx::Stream s, std::vector<int> spec, std::vector<int> counts, int threads,
                  int causal)
      : CpuOp(s), spec_(std::move(spec)), counts_(std::move(counts)), threads_(threads),
        causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    check_at_run(in, spec_, counts_);  // the strides, known now, before any task
    auto& out = outs[0];
    Plan pl;
    size_t next = 1, first = 0;
    for (size_t i = 0; i < counts_.size(); i += 2) {
      Parts ps;
      ps.keys = bind_parts(spec_, first, counts_[i], in, next);
      ps.values = bind_parts(spec_, first + counts_[i], counts_[i + 1], in, next);
      first += counts_[i] + counts_[i + 1];
      for (const auto& pt : ps.keys) ps.S += pt.n;
      pl.rows.push_back(std::move(ps));
    }
    const auto& q = in[0];
    pl.q = view_of(q);
    pl.B = q.shape(0), pl.H = q.shape(1), pl.R = q.shape(2), pl.D = q.shape(3);
    pl.Dv = out.shape(3);
    pl.causal = causal_;
    auto& enc = encoder(in, out);
    // Raw views only, as MLX's own CPU ops (weak copies): MLX keeps the inputs alive until
    // the task has run.
    enc.dispatch([pl = std::move(pl), out_ptr = out.data<float>(), threads = threads_]() {
      run(pl, out_ptr, threads);
    });
  }

  const char* name() const override { return "VeloxquantDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttention&>(other);
    return spec_ == o.spec_ && counts_ == o.counts_ && threads_ == o.threads_ &&
           causal_ == o.causal_;
  }

 private:
  std::vector<int> spec_, counts_;
  int threads_, causal_;
};

// Checks one part's stored arrays (from inputs[next]); returns its token count and head dim.
std::pair<int64_t, int64_t> check_stored(const int* sp, const std::vector<mx::array>& in,
                                         size_t& next, int64_t B, int64_t H) {
  const int kind = sp[0], bits = sp[1], group = sp[2];
  check(kind >= kDense && kind <= kChannel, [&] {
    return std::string("kind must be 0 (dense), 1 (token) or 2 (channel), got " +
                       std::to_string(kind));
  });
  check((sp[3] == 0 || sp[3] == 1) && (sp[4] == 0 || sp[4] == 1),
        "the biases and table ints must be 0 or 1");
  check(next < in.size(), "fewer arrays than the parts need");
  const size_t ia = next++;
  const auto& a = in[ia];
  const auto heads = [&] { return "[" + std::to_string(B) + ", " + std::to_string(H) + ", ...]"; };
  check(a.ndim() == 4 && a.shape(0) == B && a.shape(1) == H, [&] {
    return std::string(arg(ia) + ": every part must be 4-D with the queries' batch and KV heads " +
                       heads() + ", got " + shape_of(a));
  });
  if (kind == kDense) {
    check(bits == 0 && group == 0 && !sp[3] && !sp[4],
          "a dense part's bits, group, biases and table ints must be 0");
    check(is_float(a.dtype()), [&] {
      return std::string(arg(ia) + ": dense parts must be float32, float16 or bfloat16");
    });
    return {a.shape(2), a.shape(3)};
  }
  check(bits == 1 || bits == 2 || bits == 4 || bits == 8,
        [&] { return std::string("bits must be 1, 2, 4 or 8, got " + std::to_string(bits)); });
  check(mx::issubdtype(a.dtype(), mx::unsignedinteger), [&] {
    return std::string(arg(ia) + ": codes must be unsigned integers, got " + shape_of(a));
  });
  const int64_t bytes = a.shape(3) * static_cast<int64_t>(mx::size_of(a.dtype()));
  const int64_t width = bytes * 8 / bits;
  check(bytes % 4 == 0,
        [&] { return std::string(arg(ia) + ": a code row must be whole 32-bit words"); });
  check(next < in.size(), "fewer arrays than the parts need");
  const size_t is = next++;
  const auto& s = in[is];
  check(is_float(s.dtype()) && s.ndim() == 4 && s.shape(0) == B && s.shape(1) == H, [&] {
    return std::string(arg(is) + ": scales must be 4-D floats with the codes' batch and KV heads " +
                       heads() + ", got " + shape_of(s));
  });
  if (sp[3]) {
    check(next < in.size(), "fewer arrays than the parts need");
    const auto& z = in[next++];
    check(z.shape() == s.shape() && is_float(z.dtype()), [&] {
      return std::string(arg(next - 1) + ": biases must be floats of the scales' shape " +
                         shape_of(s) + ", got " + shape_of(z));
    });
  }
  if (sp[4]) {
    check(next < in.size(), "fewer arrays than the parts need");
    const auto& t = in[next++];
    check(t.dtype() == mx::float32 && t.size() == (size_t{1} << bits) && bits <= 4, [&] {
      return std::string(arg(next - 1) + ": a table must be 2^bits float32 levels, bits at most 4");
    });
  }
  const auto form = [&] {
    return " (" + std::to_string(bits) + "-bit codes " + shape_of(a) + ", group " +
           std::to_string(group) + "), got " + shape_of(s);
  };
  if (kind == kToken) {
    check(
        group > 0 && width % group == 0 && s.shape(2) == a.shape(2) && s.shape(3) == width / group,
        [&] {
          return std::string(arg(is) + ": token scales must be [B, H, n, D / group]" + form());
        });
    check(group % (32 / bits) == 0, "a token group must hold whole 32-bit words of codes");
    return {a.shape(2), width};
  }
  check(sp[3] && !sp[4], "channel parts have biases and no table");
  check(group > 0 && s.shape(2) == a.shape(2) && s.shape(3) * int64_t{group} == width &&
            group % (32 / bits) == 0,
        [&] {
          return std::string(
              arg(is) + ": channel scales must be [B, H, D, n / group], groups of whole words" +
              form());
        });
  return {width, a.shape(2)};
}

// Checks a projected part's factor [B, H, r, Dp] (r: the part's width) and mean
// [B, H, 1, Dp]; returns Dp, the query dims it reads or the output dims it writes.
int64_t check_projection(const int* sp, int64_t r, const std::vector<mx::array>& in, size_t& next,
                         int64_t B, int64_t H) {
  const int* pp = sp + kProjSpec;
  check(!(sp[7] & (kShift | kMass)) && sp[0] != kChannel,
        "a projected part is dense or token rows, with no shift or mass of its own");
  check(pp[0] != kChannel && !pp[4], "a projection is dense or token rows, without a table");
  const auto [rows, Dp] = check_stored(pp, in, next, B, H);
  check(rows == r, [&] {
    return std::string("a projection needs one row per dim of its part (" + std::to_string(r) +
                       "), got " + std::to_string(rows));
  });
  if (sp[7] & kRotate)  // rebuilt a row at a time: whole vectors of whole groups, or floats
    for (const int* form : {sp, pp})
      check(form[0] == kDense || (!form[4] && form[2] % L == 0),
            "a rotated projected part and its projection are dense or token rows without a "
            "table, in groups of a multiple of 16 dims");
  check(next < in.size(), "fewer arrays than the parts need");
  const auto& m = in[next++];
  check(is_float(m.dtype()) && m.ndim() == 4 && m.shape(0) == B && m.shape(1) == H &&
            m.shape(2) == 1 && m.shape(3) == Dp,
        [&] {
          return std::string(arg(next - 1) +
                             ": a projection's mean must be floats [B, H, 1, Dp] with Dp " +
                             std::to_string(Dp) + ", got " + shape_of(m));
        });
  return Dp;
}

// A part's placement ints and its shift.
void check_placement(const int* sp, bool is_key, const std::vector<mx::array>& in, size_t& next,
                     int64_t B, int64_t H, int64_t R) {
  const int qoff = sp[5], ooff = sp[6], extras = sp[7];
  check(qoff >= 0 && ooff >= 0 && qoff <= kMaxOffset && ooff <= kMaxOffset && extras >= 0 &&
            extras <= (kShift | kMass | kRotate | kProject | kPairs) &&
            ((extras & kRotate) || !(extras & kPairs)),
        "offsets must be 0 to 65536 and extras 0-31 (1: score shift, 2: probability mass, "
        "4: RoPE, 8: projection, 16: RoPE pairs neighbouring dims)");
  check((extras & kProject) ||
            std::all_of(sp + kProjSpec, sp + kSpecInts, [](int x) { return x == 0; }),
        "a part without a projection has zeros in its projection's five ints");
  check(is_key || (qoff == 0 && !(extras & kShift)), "a value part has no query offset or shift");
  check(!is_key || (ooff == 0 && !(extras & kMass)), "a key part has no output offset or mass");
  if (extras & kShift) {
    check(next < in.size(), "fewer arrays than the parts need");
    const auto& s = in[next++];
    check(s.dtype() == mx::float32 && s.ndim() == 4 && s.shape(0) == B && s.shape(1) == H &&
              s.shape(2) == R && s.shape(3) == 1,
          [&] {
            return std::string(arg(next - 1) +
                               ": a score shift must be float32 [B, H, rows, 1], got " +
                               shape_of(s));
          });
  }
}

// Checks one part (its stored arrays, shift, rotation, projection) and its placement;
// returns its token count and head dim.
std::pair<int64_t, int64_t> check_part(const int* sp, bool is_key, const std::vector<mx::array>& in,
                                       size_t& next, int64_t B, int64_t H, int64_t R) {
  const auto got = check_stored(sp, in, next, B, H);
  const int extras = sp[7];
  check_placement(sp, is_key, in, next, B, H, R);
  int64_t half = 0;  // of the dims a rotation turns
  if (extras & kRotate) {
    check(is_key && (sp[0] == kDense || (extras & kProject)),
          "only dense or projected key parts are rotated");
    check(next + 1 < in.size(), "fewer arrays than the parts need");
    const auto &inv = in[next++], &start = in[next++];
    check(inv.dtype() == mx::float32 && inv.ndim() == 4 && inv.size() == inv.shape(3) &&
              inv.size() > 0 && inv.flags().row_contiguous,
          [&] {
            return std::string(arg(next - 2) +
                               ": a rotation's inverse frequencies must be contiguous float32 "
                               "[1, 1, 1, dims / 2], got " +
                               shape_of(inv));
          });
    check(start.dtype() == mx::int32 && start.ndim() == 4 && start.size() == 1, [&] {
      return std::string(arg(next - 1) +
                         ": a rotation's first position must be int32 [1, 1, 1, 1], got " +
                         shape_of(start));
    });
    half = inv.shape(3);
  }
  const int64_t width =
      (extras & kProject) ? check_projection(sp, got.second, in, next, B, H) : got.second;
  check(2 * half <= width, [&] {
    return std::string("a rotation turns at most the part's dims (" + std::to_string(width) +
                       "), got " + std::to_string(2 * half));
  });
  return {got.first, width};
}

// Token count and output width of one sequence's parts, summed as they are checked.
struct Extent {
  int64_t S_keys = 0, S_values = 0, Dk = -1, Dv = -1, Dout = 0;
  bool placed = false;
};

void add_part(Extent& e, const int* sp, bool is_key, int64_t n, int64_t d, int64_t D) {
  if (is_key) {
    check(sp[5] + d <= D, [&] {
      return std::string("key parts must fit in the query rows at their offset (" +
                         std::to_string(sp[5]) + " + " + std::to_string(d) + " dims, rows of " +
                         std::to_string(D) + ")");
    });
    check(sp[5] > 0 || e.Dk < 0 || e.Dk == d, "key parts at offset 0 must share one head dim");
    if (sp[5] == 0) e.Dk = d;
    e.placed |= sp[5] > 0, e.S_keys += n;
    return;
  }
  check(sp[0] != kChannel, "channel parts hold keys only");
  if (sp[6] == 0 && !(sp[7] & kMass)) {
    check(e.Dv < 0 || e.Dv == d, "value parts must share one head dim");
    e.Dv = d;
  }
  e.Dout = std::max<int64_t>(e.Dout, sp[6] + d + ((sp[7] & kMass) ? 1 : 0));
  e.S_values += n;
}

// One sequence's parts from inputs[next] on: checks them, returns their output width and
// token count. Value parts at output offset 0 without a mass share one head dim; others
// extend the output past it.
std::pair<int64_t, int64_t> check_parts(const std::vector<int>& spec, int64_t first, int64_t n_keys,
                                        int64_t n_values, const std::vector<mx::array>& in,
                                        size_t& next, int64_t B, int64_t H, int64_t D, int64_t R) {
  check(n_keys >= 1 && n_values >= 1, [&] {
    return std::string("need at least one key part and one value part, got " +
                       std::to_string(n_keys) + " and " + std::to_string(n_values));
  });
  check((first + n_keys + n_values) * kSpecInts <= static_cast<int64_t>(spec.size()),
        "spec must describe the counted parts");
  Extent e;
  for (int64_t i = first; i < first + n_keys + n_values; ++i) {
    const int* sp = spec.data() + kSpecInts * i;
    const bool is_key = i < first + n_keys;
    try {
      const auto [n, d] = check_part(sp, is_key, in, next, B, H, R);
      add_part(e, sp, is_key, n, d, D);
    } catch (const std::invalid_argument& err) {
      refuse_in("part " + std::to_string(i) + " (spec[" + std::to_string(kSpecInts * i) + ":" +
                    std::to_string(kSpecInts * (i + 1)) + "], " + (is_key ? "key" : "value") +
                    " part " + std::to_string(is_key ? i - first : i - first - n_keys) + ")",
                err);
    }
  }
  check(e.placed || e.Dk == D, "key parts must have the queries' head dim");
  check(e.S_keys == e.S_values && e.S_keys > 0, [&] {
    return std::string("key and value parts must cover the same tokens, got " +
                       std::to_string(e.S_keys) + " and " + std::to_string(e.S_values));
  });
  return {e.Dout, e.S_keys};
}

// counts: (key parts, value parts) of one set shared by the batch, or of each batch row's
// own (its arrays then have a batch axis of 1).
mx::array decode_attention(const mx::array& q, const std::vector<mx::array>& arrays,
                           const std::vector<int>& spec, const std::vector<int>& counts,
                           int threads, int causal) {
  check(q.ndim() == 4 && q.dtype() == mx::float32,
        [&] { return std::string("q must be [B, H, rows, D] float32, got " + shape_of(q)); });
  check(spec.size() % kSpecInts == 0, [&] {
    return std::string("spec must hold 13 ints per part, got " + std::to_string(spec.size()) +
                       " ints");
  });
  const int64_t B = q.shape(0), H = q.shape(1), R = q.shape(2), plans = counts.size() / 2;
  check(counts.size() % 2 == 0 && plans >= 1 && (plans == 1 || plans == B),
        "counts must be (key parts, value parts) once, or once per batch row");
  check_threads(threads);
  check(causal >= 0 && (causal == 0 || R % causal == 0),
        "causal must be 0 (no mask) or the chunk's token count, dividing the query rows");
  std::vector<mx::array> inputs = {q};
  inputs.insert(inputs.end(), arrays.begin(), arrays.end());
  size_t next = 1;
  int64_t first = 0, Dv = -1;
  __int128 scores = 0;
  for (int64_t i = 0; i < plans; ++i) {
    const auto [d, S] = check_parts(spec, first, counts[2 * i], counts[2 * i + 1], inputs, next,
                                    plans == 1 ? B : 1, H, q.shape(3), R);
    check(Dv < 0 || Dv == d, "every row's value parts must give one output width");
    check(causal <= S, "a causal chunk cannot hold more tokens than the keys");
    Dv = d, first += counts[2 * i] + counts[2 * i + 1];
    scores += static_cast<__int128>(plans == 1 ? B : 1) * H * R * S;
  }
  check(first * kSpecInts == static_cast<int64_t>(spec.size()),
        "spec must describe the counted parts");
  check(next == inputs.size(), [&] {
    return std::string("more arrays than the parts take (" + std::to_string(next - 1) + "), got " +
                       std::to_string(arrays.size()));
  });
  check_floats(scores, "the scores (batch x heads x rows x keys)");
  check_floats(static_cast<__int128>(B) * H * R * Dv, "the output (batch x heads x rows x width)");
  return mx::array({static_cast<int>(B), static_cast<int>(H), q.shape(2), static_cast<int>(Dv)},
                   mx::float32,
                   std::make_shared<DecodeAttention>(mx::to_stream(mx::Device::cpu), spec, counts,
                                                     threads, causal),
                   inputs);
}

// ---- token-coded rows as floats (the transient a cache reads where no op takes codes) ----

// An input's rows: its data, shape and strides copied out of the array, so that the task
// an op dispatches holds no array, as MLX's own CPU ops (weak copies): MLX keeps the
// inputs alive until the task has run, and a task's copy would outlive that.
struct Rows {
  const uint8_t* data = nullptr;
  int64_t itemsize = 4;
  mx::Dtype dtype = mx::float32;
  std::vector<int64_t> shape, strides;

  // Row i's first element over the leading axes (any strides).
  const uint8_t* row(int64_t i) const {
    int64_t off = 0;
    for (int k = static_cast<int>(shape.size()) - 2; k >= 0; --k)
      off += (i % shape[k]) * strides[k], i /= shape[k];
    return data + off * itemsize;
  }
  int64_t count() const {
    int64_t n = 1;
    for (size_t k = 0; k + 1 < shape.size(); ++k) n *= shape[k];
    return n;
  }
  View view() const {  // for load(): only the dtype is read
    View v;
    v.dtype = dtype;
    return v;
  }
};

Rows rows_of(const mx::array& a) {
  Rows r;
  r.data = a.data<uint8_t>();
  r.itemsize = static_cast<int64_t>(a.itemsize());
  r.dtype = a.dtype();
  r.shape.assign(a.shape().begin(), a.shape().end());
  r.strides.assign(a.strides().begin(), a.strides().end());
  return r;
}

// The inputs' rows, checked as the op runs (strides are known then): inside their buffers,
// contiguous along their last axis.
std::vector<Rows> rows_of(const std::vector<mx::array>& in, const std::vector<const char*>& names) {
  std::vector<Rows> out;
  for (size_t i = 0; i < in.size(); ++i) {
    check_extent(in[i], [&] { return std::string(names[i]); });
    check_last_axis(in[i], [&] { return std::string(names[i]); });
    out.push_back(rows_of(in[i]));
  }
  return out;
}

class DecodeRows : public CpuOp {
 public:
  DecodeRows(mx::Stream st, int bits, int group, int threads)
      : CpuOp(st), bits_(bits), group_(group), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto rows = rows_of(in, {"codes", "scales", "biases", "plus"});
    auto& out = outs[0];
    auto& enc = encoder(in, out);
    enc.dispatch([in = std::move(rows), out_ptr = out.data<float>(), D = out.shape().back(),
                  bits = bits_, gs = group_, threads = threads_]() {
      run_rows(in, out_ptr, D, bits, gs, threads);
    });
  }

  const char* name() const override { return "VeloxquantDecodeRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeRows&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && threads_ == o.threads_;
  }

 private:
  static void run_rows(const std::vector<Rows>& in, float* out, int64_t D, int bits,
                       int64_t gs, int threads) {
    const auto &codes = in[0], &s = in[1], &z = in[2];
    const int64_t rows = codes.count(), G = D / gs;
    on_threads(threads, [&](int w) {
      std::vector<float> sf(G), zf(G);
      for (int64_t i = w; i < rows; i += threads) {
        load(s.view(), s.row(i), s.itemsize, G, sf.data());
        load(z.view(), z.row(i), z.itemsize, G, zf.data());
        const uint8_t* c = codes.row(i);
        const float* p =
            in.size() > 3 ? reinterpret_cast<const float*>(in[3].row(i)) : nullptr;
        float* o = out + i * D;
        switch (bits) {
          case 1: decode_row<1>(c, sf.data(), zf.data(), D, gs, p, o); break;
          case 2: decode_row<2>(c, sf.data(), zf.data(), D, gs, p, o); break;
          case 4: decode_row<4>(c, sf.data(), zf.data(), D, gs, p, o); break;
          default: decode_row<8>(c, sf.data(), zf.data(), D, gs, p, o); break;
        }
      }
    });
  }

  int bits_, group_, threads_;
};

mx::array floats_of(const mx::array& codes, const mx::array& scales, const mx::array& biases,
                    int bits, int group, int threads, std::optional<mx::array> plus) {
  check(bits == 1 || bits == 2 || bits == 4 || bits == 8,
        [&] { return std::string("bits must be 1, 2, 4 or 8, got " + std::to_string(bits)); });
  check(codes.ndim() >= 1 && mx::issubdtype(codes.dtype(), mx::unsignedinteger), [&] {
    return std::string("codes must be unsigned integers of at least one axis, got " +
                       shape_of(codes));
  });
  check(is_float(scales.dtype()) && scales.shape() == biases.shape() &&
            biases.dtype() == scales.dtype(),
        [&] {
          return std::string("scales and biases must be floats of one shape, got " +
                             shape_of(scales) + " and " + shape_of(biases));
        });
  const int64_t D = static_cast<int64_t>(codes.shape().back()) * codes.itemsize() * 8 / bits;
  check_floats(D, "a decoded row");
  check(group > 0 && group % L == 0 && D % group == 0, [&] {
    return std::string("group must divide the row (" + std::to_string(D) +
                       " values), in blocks of 16, got " + std::to_string(group));
  });
  auto shape = codes.shape();
  auto want = shape;
  want.back() = static_cast<int>(D / group);
  check(scales.shape() == want, [&] {
    return std::string("scales must be [..., D / group] with D / group " +
                       std::to_string(D / group) + ", got " + shape_of(scales));
  });
  shape.back() = static_cast<int>(D);
  check_threads(threads);
  __int128 rows = 1;
  for (int i = 0; i + 1 < codes.ndim(); ++i) rows *= codes.shape(i);
  check_floats(rows * D, "the decoded rows");
  std::vector<mx::array> inputs = {codes, scales, biases};
  if (plus) {  // added as it is decoded (a sum of decoded rows takes no pass of its own)
    check(plus->dtype() == mx::float32 && plus->shape() == shape, [&] {
      return std::string("plus must be float32 of the decoded rows' shape, got " + shape_of(*plus));
    });
    inputs.push_back(*plus);
  }
  return mx::array(
      shape, mx::float32,
      std::make_shared<DecodeRows>(mx::to_stream(mx::Device::cpu), bits, group, threads), inputs);
}

// ---- RMS norm of float32 rows (MLX's CPU norm took a pass per op, its sum the slowest) ----

class RmsRows : public CpuOp {
 public:
  RmsRows(mx::Stream st, float eps, int threads) : CpuOp(st), eps_(eps), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto rows = rows_of(in, {"x", "weight"});
    auto& out = outs[0];
    auto& enc = encoder(in, out);
    enc.dispatch([in = std::move(rows), out_ptr = out.data<float>(), eps = eps_,
                  threads = threads_]() { run(in, out_ptr, eps, threads); });
  }

  const char* name() const override { return "VeloxquantRmsRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RmsRows&>(other);
    return eps_ == o.eps_ && threads_ == o.threads_;
  }

 private:
  static void run(const std::vector<Rows>& in, float* out, float eps, int threads) {
    const auto &x = in[0], &w = in[1];
    const int64_t D = x.shape.back(), rows = x.count();
    std::vector<float> weight(D);
    load(w.view(), w.data, w.itemsize, D, weight.data());
    const int64_t whole = D / L * L;
    on_threads(threads, [&](int w) {
      for (int64_t i = w; i < rows; i += threads) {
        const float* r = reinterpret_cast<const float*>(x.row(i));
        float* o = out + i * D;
        vf acc = {}, v;  // lanes of sums: one running sum made each add wait for the last
        for (int64_t d = 0; d < whole; d += L) std::memcpy(&v, r + d, sizeof(vf)), acc += v * v;
        float sum = lane_sum(acc);
        for (int64_t d = whole; d < D; ++d) sum += r[d] * r[d];
        const float scale = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
        for (int64_t d = 0; d < D; ++d) o[d] = r[d] * scale * weight[d];
      }
    });
  }

  float eps_;
  int threads_;
};

mx::array rms_rows(const mx::array& x, const mx::array& weight, float eps, int threads) {
  check(x.ndim() >= 1 && x.dtype() == mx::float32,
        [&] { return std::string("x must be float32 rows, got " + shape_of(x)); });
  check_threads(threads);
  check(weight.ndim() == 1 && is_float(weight.dtype()) && weight.shape(0) == x.shape().back(), [&] {
    return std::string("weight must be floats, one per dim of a row (" +
                       std::to_string(x.shape().back()) + "), got " + shape_of(weight));
  });
  check(std::isfinite(eps) && eps >= 0.f, "eps must be finite and at least 0");
  check_floats(x.size(), "x");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RmsRows>(mx::to_stream(mx::Device::cpu), eps, threads),
                   {x, weight});
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "veloxquant_mlx's fused CPU decode attention over stored parts.";
  m.def("decode_attention", &decode_attention, "q"_a, "arrays"_a, "spec"_a, "counts"_a,
        "threads"_a = 1, "causal"_a = 0);
  m.def("floats_of", &floats_of, "codes"_a, "scales"_a, "biases"_a, "bits"_a, "group"_a,
        "threads"_a = 1, "plus"_a = nb::none());
  m.def("rms_rows", &rms_rows, "x"_a, "weight"_a, "eps"_a, "threads"_a = 1);
}
