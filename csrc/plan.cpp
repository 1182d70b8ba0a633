// A checked call's parts bound to its inputs: views and sizes of every part, one part set
// whose arrays have the queries' batch axis, or each batch row's own (a batch of
// conversations, each row's arrays of batch 1).
#include <memory>
#include <vector>

#include "ops.h"
#include "parts.h"

namespace veloxquant {
namespace {

// A stored form's views and sizes from inputs[next] on.
Part bind_stored(const Form& f, const std::vector<mx::array>& in, size_t& next) {
  Part pt{f.kind, f.bits, f.group, f.biases, f.table};
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

// Parts first .. first + count from the op's inputs (inputs[0] is the queries).
std::vector<Part> bind_parts(const std::vector<PartSpec>& specs, size_t first, size_t count,
                             const std::vector<mx::array>& in, size_t& next) {
  std::vector<Part> parts;
  for (size_t i = first; i < first + count; ++i) {
    const PartSpec& sp = specs[i];
    Part pt = bind_stored(sp.form, in, next);
    pt.qoff = sp.qoff, pt.ooff = sp.ooff;
    pt.has_shift = sp.shift, pt.mass = sp.mass, pt.rotate = sp.rotate, pt.pairs = sp.pairs;
    // After the stored arrays, in check_part's order: shift, rotation, projection and mean.
    if (sp.shift) pt.shift = view_of(in[next++]);
    if (sp.rotate) {
      pt.rot_dims = 2 * in[next].shape(3);
      pt.rot_inv = in[next++].data<float>();
      pt.rot_start = in[next++].data<int32_t>()[0];
    }
    if (sp.projection) {
      pt.proj = std::make_shared<const Part>(bind_stored(*sp.projection, in, next));
      pt.mean = view_of(in[next++]);
    }
    parts.push_back(pt);
  }
  return parts;
}

}  // namespace

View view_of(const mx::array& a) {
  View v;
  v.data = a.data<uint8_t>();
  v.dtype = a.dtype();
  const auto size = static_cast<int64_t>(mx::size_of(a.dtype()));
  for (int i = 0; i < 4; ++i) v.stride[i] = a.shape(i) == 1 ? 0 : a.strides()[i] * size;
  return v;
}

Plan plan_of(const std::vector<mx::array>& in, const std::vector<PartSpec>& parts,
             const std::vector<int>& counts, int64_t Dv, int causal) {
  Plan pl;
  size_t next = 1, first = 0;
  for (size_t i = 0; i < counts.size(); i += 2) {
    Parts ps;
    ps.keys = bind_parts(parts, first, counts[i], in, next);
    ps.values = bind_parts(parts, first + counts[i], counts[i + 1], in, next);
    first += counts[i] + counts[i + 1];
    for (const auto& pt : ps.keys) ps.S += pt.n;
    pl.rows.push_back(std::move(ps));
  }
  const auto& q = in[0];
  pl.q = view_of(q);
  pl.B = q.shape(0), pl.H = q.shape(1), pl.R = q.shape(2), pl.D = q.shape(3);
  pl.Dv = Dv;
  pl.causal = causal;
  return pl;
}

}  // namespace veloxquant
