// Reading coded parts: scores against token and channel codes and the product of
// probabilities with token codes, the codes unpacked a few words at a time into registers
// (no float copy of a store, not even a transient one).
#include <algorithm>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parts.h"

namespace veloxquant {
namespace {

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

// m[(t + j) * step] for the lanes j < count, zeros past it.
inline vf lanes(const float* m, int64_t step, int64_t t, int64_t count) {
  vf out = {};
  for (int j = 0; j < count; ++j) out[j] = m[(t + j) * step];
  return out;
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

}  // namespace

// Scales and biases (zeros without) of head (b, h) as contiguous floats [rows, cols].
std::pair<std::vector<float>, std::vector<float>> scales_of(const Part& pt, int64_t b, int64_t h,
                                                            int64_t rows, int64_t cols) {
  auto s = load_matrix(pt.s, b, h, rows, cols);
  auto z = pt.has_bias ? load_matrix(pt.z, b, h, rows, cols) : std::vector<float>(rows * cols, 0.f);
  s.resize(rows * cols + L, 0.f), z.resize(rows * cols + L, 0.f);  // whole-vector reads at the end
  return {std::move(s), std::move(z)};
}

// Code k of each lane's word as a level: the code, or its table entry.
void coded_keys(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
                int64_t ld) {
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

void coded_values(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                  float* out) {
  return pt.has_table ? token_values_of<true>(pt, b, h, p, ld, R, out)
                      : token_values_of<false>(pt, b, h, p, ld, R, out);
}

}  // namespace veloxquant
