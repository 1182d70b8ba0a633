// Decode attention over a cache's stored parts, fused into one op for MLX's CPU backend.
//
// ops/attention.py's decode path runs about a hundred MLX ops per layer over a compressed
// cache (unpack, multiply, scale, concatenate, softmax, ...): on a CPU each costs a few
// microseconds and a pass over memory, which made a compressed decode slower than a dense
// one. This op does the whole of it per KV head in one pass: scores of every key part,
// softmax, and the product with every value part, with the codes unpacked a few words at
// a time into registers (no float copy of a store, not even a transient one).
//
// This header is the kernel side: what a part is, how its arrays are viewed, the vector
// helpers the kernels share, and what each kernel file offers the others.
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
// Files, by concern: codes.cpp reads coded parts (token, channel), read.cpp dense and
// rotated parts and keys rebuilt from a factor, decode.cpp is the attention over a plan
// (placement, softmax, heads on threads), chunks.cpp the prompt chunk's causal mask,
// plan.cpp binds a call's arrays into a plan (one part set, or each batch row's own),
// checks.cpp checks a call's arguments, ops.cpp holds the MLX primitives and module.cpp
// the Python bindings (ops.h: the array side's shared declarations).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "mlx/dtype.h"

namespace veloxquant {

namespace mx = mlx::core;

constexpr int L = 16;
typedef float vf __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint8_t vb __attribute__((vector_size(L)));

// The part kinds, one table for the kernels, the checks and Python (module.cpp exports it
// as part_kinds; ops/native.py's PartKind must equal it, which tests/test_native.py checks).
enum Kind : int { kDense = 0, kToken = 1, kChannel = 2 };
struct KindName {
  const char* name;
  Kind kind;
};
inline constexpr KindName kKinds[] = {{"dense", kDense}, {"token", kToken}, {"channel", kChannel}};

// A stored form as Python describes it (ops/native.py's Form): its kind, the codes' bit
// width and group (0 for dense rows), whether biases and a table of levels follow.
struct Form {
  int kind = kDense, bits = 0, group = 0;
  bool biases = false, table = false;
  bool operator==(const Form&) const = default;
};

// One part of a call (ops/native.py's PartSpec): its stored form, where its queries and
// output sit in the rows, what follows its stored arrays (a score shift, a rotation's
// frequencies and first position, a projection's form and mean), whether it adds its
// probability mass and whether its rotation pairs neighbouring dims.
struct PartSpec {
  Form form;
  int qoff = 0, ooff = 0;
  bool shift = false, mass = false, rotate = false, pairs = false;
  std::optional<Form> projection;
  bool operator==(const PartSpec&) const = default;
};

// An input's base pointer with byte strides over its four axes.
struct View {
  const uint8_t* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  mx::Dtype dtype = mx::float32;
  const uint8_t* at(int64_t b, int64_t h) const { return data + b * stride[0] + h * stride[1]; }
};

struct Part {
  int kind, bits, group;
  bool has_bias, has_table;
  int qoff = 0, ooff = 0;
  bool has_shift = false, mass = false, rotate = false, pairs = false;
  int64_t n = 0, D = 0;
  View a, s, z, shift;  // dense values or codes; scales; biases; score shift [B, H, R, 1]
  // A rotated part: RoPE's inverse frequencies [1, 1, 1, dims / 2] (contiguous float32), the
  // position of the part's token 0, and of this slice's first token among the part's.
  // Pairs (2i, 2i + 1) with `pairs`, else (i, i + dims / 2).
  const float* rot_inv = nullptr;
  int64_t rot_dims = 0, rot_start = 0, rot_first = 0;
  vf table = {};
  // A projected part (x = a P + m): its factor P [B, H, r, Dp] (dense or token rows) and
  // mean m [B, H, 1, Dp].
  std::shared_ptr<const Part> proj;
  View mean;
};

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

// ---- vector helpers of several kernels

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
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

// Whether a key part's keys are rebuilt in the op: projected (x = a P + m) and rotated.
inline bool rebuilds(const Part& pt) { return pt.proj && pt.rotate; }

// ---- read.cpp: values of any part

// count values from p, step bytes apart, as floats.
void load(const View& v, const uint8_t* p, int64_t step, int64_t count, float* out);
// The [rows, cols] matrix of v at (b, h) as contiguous floats.
std::vector<float> load_matrix(const View& v, int64_t b, int64_t h, int64_t rows, int64_t cols);
// Scores q @ K^T of any part's R query rows into out[r * ld + t].
void keys_into(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
               int64_t ld);
// p @ V of any part (p[r * ld + t]) added into out [R, D].
void values_into(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                 float* out);
// Scores of a part whose keys are rebuilt from a factor and rotated (heads h0 .. h0 + nh).
void rebuilt_keys(const Part& pt, int64_t b, int64_t h0, int64_t nh, const float* q, int64_t R,
                  float* out, int64_t ld);

// ---- codes.cpp: coded parts

// Scales and biases (zeros without) of head (b, h) as contiguous floats [rows, cols].
std::pair<std::vector<float>, std::vector<float>> scales_of(const Part& pt, int64_t b, int64_t h,
                                                            int64_t rows, int64_t cols);
void coded_keys(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, float* out,
                int64_t ld);
void coded_values(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                  float* out);

// ---- chunks.cpp: prompt chunks

// Scores past each chunk row's own token floored (exp 0): rows are (head, token) of the
// chunk's C tokens, the last C of S keys.
void mask_causal(float* sc, int64_t R, int64_t S, int64_t C);

// ---- decode.cpp: the attention over a plan, into out [B, H, R, Dv].
void attend(const Plan& pl, float* out, int threads);

}  // namespace veloxquant
