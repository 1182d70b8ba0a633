// The extension's MLX primitives and the ops that make them: the fused decode attention
// over described parts, token-coded rows as floats, and the RMS norm of float32 rows. Each
// op checks its arguments before it builds its array, and its strides as it runs.
//
// floats_of: token-coded rows as float32 in one op, for caches that rebuild from codes
// with a matmul where the decode op does not (XQuant-CL's layer input, the MLX path of xKV
// and XQuant): MLX's ops took several passes over the rows.
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "ops.h"

namespace veloxquant {
namespace {

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
  DecodeAttention(mx::Stream s, std::vector<PartSpec> parts, std::vector<int> counts,
                  int threads, int causal)
      : CpuOp(s), parts_(std::move(parts)), counts_(std::move(counts)), threads_(threads),
        causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    check_at_run(in, parts_);  // the strides, known now, before any task
    auto& out = outs[0];
    Plan pl = plan_of(in, parts_, counts_, out.shape(3), causal_);
    auto& enc = encoder(in, out);
    // Raw views only, as MLX's own CPU ops (weak copies): MLX keeps the inputs alive until
    // the task has run.
    enc.dispatch([pl = std::move(pl), out_ptr = out.data<float>(), threads = threads_]() {
      attend(pl, out_ptr, threads);
    });
  }

  const char* name() const override { return "VeloxquantDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttention&>(other);
    return parts_ == o.parts_ && counts_ == o.counts_ && threads_ == o.threads_ &&
           causal_ == o.causal_;
  }

 private:
  std::vector<PartSpec> parts_;
  std::vector<int> counts_;
  int threads_, causal_;
};

}  // namespace

// counts: (key parts, value parts) of one set shared by the batch, or of each batch row's
// own (its arrays then have a batch axis of 1).
mx::array decode_attention(const mx::array& q, const std::vector<mx::array>& arrays,
                           const std::vector<PartSpec>& parts, const std::vector<int>& counts,
                           int threads, int causal) {
  std::vector<mx::array> inputs = {q};
  inputs.insert(inputs.end(), arrays.begin(), arrays.end());
  const int64_t Dv = check_decode(inputs, parts, counts, threads, causal);
  return mx::array({q.shape(0), q.shape(1), q.shape(2), static_cast<int>(Dv)}, mx::float32,
                   std::make_shared<DecodeAttention>(mx::to_stream(mx::Device::cpu), parts, counts,
                                                     threads, causal),
                   inputs);
}

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace veloxquant
