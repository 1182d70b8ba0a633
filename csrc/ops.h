// The array side of the extension: the ops Python calls (ops.cpp), the checks of their
// arguments (checks.cpp, chunks.cpp) and the binding of a call's arrays into a plan
// (plan.cpp).
//
// Every argument is checked once per call, on shapes, dtypes and ints when the op is built
// and on strides when it runs (before any task is dispatched), so that no call from Python
// makes a kernel read or write out of bounds. Refusals are std::invalid_argument
// (ValueError in Python) naming the argument or field and what was expected.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "parts.h"

namespace veloxquant {

constexpr const char* kRefusal = "veloxquant native: ";

inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(kRefusal + what);
}

// A refusal whose message is built only when it is refused (a call's checks pass with no
// string made).
template <class F, class = decltype(std::declval<F>()())>
void check(bool ok, F&& what) {
  if (!ok) throw std::invalid_argument(kRefusal + std::string(what()));
}

// The same refusal placed: "where: what".
[[noreturn]] void refuse_in(const std::string& where, const std::invalid_argument& e);

std::string shape_of(const mx::array& a);
bool is_float(mx::Dtype t);
// Threads a call may start (a large count would exhaust the process, not speed it up).
void check_threads(int threads);
// The op's buffers and outputs, in floats: broadcast views make large shapes of little
// memory, and a failed allocation inside a task would end the process.
void check_floats(__int128 count, const char* what);

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

// ---- checks.cpp: the decode op's arguments (inputs[0] is the queries, the arrays follow)

// Everything known when the op is built; returns the output's width.
int64_t check_decode(const std::vector<mx::array>& inputs, const std::vector<PartSpec>& parts,
                     const std::vector<int>& counts, int threads, int causal);
// What is known as it runs: every input inside its buffer, codes contiguous along their rows,
// a table and RoPE's inverse frequencies contiguous.
void check_at_run(const std::vector<mx::array>& in, const std::vector<PartSpec>& parts);

// ---- chunks.cpp: a prompt chunk's `causal` against the query rows, then the keys
void check_chunk(int causal, int64_t rows);
void check_chunk_keys(int causal, int64_t keys);

// ---- plan.cpp: a checked call's parts bound to its inputs, per batch row where counts
// hold each row's own
Plan plan_of(const std::vector<mx::array>& in, const std::vector<PartSpec>& parts,
             const std::vector<int>& counts, int64_t Dv, int causal);
View view_of(const mx::array& a);

// ---- ops.cpp: the ops module.cpp binds
mx::array decode_attention(const mx::array& q, const std::vector<mx::array>& arrays,
                           const std::vector<PartSpec>& parts, const std::vector<int>& counts,
                           int threads, int causal);
mx::array floats_of(const mx::array& codes, const mx::array& scales, const mx::array& biases,
                    int bits, int group, int threads, std::optional<mx::array> plus);
mx::array rms_rows(const mx::array& x, const mx::array& weight, float eps, int threads);

}  // namespace veloxquant
