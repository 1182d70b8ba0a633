// The decode op's arguments: each part's description (PartSpec, its fields named in every
// refusal) against the arrays it says follow, the placements, the counts and the sizes.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mlx/utils.h"
#include "ops.h"

namespace veloxquant {

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

bool is_float(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

namespace {

// Read once: hardware_concurrency() reads the system's CPU list, tens of microseconds.
int max_threads() {
  static const int most = static_cast<int>(std::max(64u, std::thread::hardware_concurrency()));
  return most;
}

constexpr int64_t kMaxFloats = int64_t{1} << 30;
// Query and output offsets (a head's dims).
constexpr int kMaxOffset = 1 << 16;

// arrays[i - 1]: inputs[0] is the queries.
std::string arg(size_t i) { return "arrays[" + std::to_string(i - 1) + "]"; }

std::string kinds() {
  std::string out;
  for (const auto& k : kKinds)
    out += (out.empty() ? "" : ", ") + std::to_string(k.kind) + " (" + k.name + ")";
  return out;
}

void check_next(size_t next, const std::vector<mx::array>& in) {
  check(next < in.size(), "fewer arrays than the parts need");
}

// A dense form's other fields: "name must be 0 (false) for a dense part".
void check_dense_form(const Form& f, const char* name) {
  const std::pair<const char*, int> fields[] = {
      {"bits", f.bits}, {"group", f.group}, {"biases", f.biases}, {"table", f.table}};
  for (const auto& [field, value] : fields)
    check(value == 0, [&] {
      return std::string(name) + "." + field + " must be 0 (false) for a dense part, got " +
             std::to_string(value);
    });
}

// A coded form's scales, biases and table from inputs[next] on (codes at ia, `width` values
// a row); its refusals name the form's fields as `name`.
void check_scales(const Form& f, const char* name, const std::vector<mx::array>& in, size_t ia,
                  int64_t width, size_t& next, int64_t B, int64_t H) {
  const auto& a = in[ia];
  const auto field = [&](const char* x) { return std::string(name) + "." + x; };
  check_next(next, in);
  const size_t is = next++;
  const auto& s = in[is];
  check(is_float(s.dtype()) && s.ndim() == 4 && s.shape(0) == B && s.shape(1) == H, [&] {
    return std::string(arg(is) + ": scales must be 4-D floats with the codes' batch and KV heads [" +
                       std::to_string(B) + ", " + std::to_string(H) + ", ...], got " + shape_of(s));
  });
  if (f.biases) {
    check_next(next, in);
    const auto& z = in[next++];
    check(z.shape() == s.shape() && is_float(z.dtype()), [&] {
      return std::string(arg(next - 1) + ": biases must be floats of the scales' shape " +
                         shape_of(s) + ", got " + shape_of(z));
    });
  }
  if (f.table) {
    check_next(next, in);
    const auto& t = in[next++];
    check(t.dtype() == mx::float32 && t.size() == (size_t{1} << f.bits) && f.bits <= 4, [&] {
      return std::string(arg(next - 1) + ": a table must be 2^" + field("bits") +
                         " float32 levels, " + field("bits") + " at most 4");
    });
  }
  const auto form = [&] {
    return " (" + std::to_string(f.bits) + "-bit codes " + shape_of(a) + ", " + field("group") +
           " " + std::to_string(f.group) + "), got " + shape_of(s);
  };
  const int per = 32 / f.bits;  // codes a word
  if (f.kind == kToken) {
    check(f.group > 0 && width % f.group == 0 && s.shape(2) == a.shape(2) &&
              s.shape(3) == width / f.group,
          [&] {
            return std::string(arg(is) + ": token scales must be [B, H, n, D / group]" + form());
          });
    check(f.group % per == 0, [&] {
      return field("group") + " must hold whole 32-bit words of codes (a multiple of " +
             std::to_string(per) + "), got " + std::to_string(f.group);
    });
    return;
  }
  check(f.biases && !f.table, [&] {
    return field("biases") + " must be true and " + field("table") + " false for a channel part";
  });
  check(f.group > 0 && s.shape(2) == a.shape(2) && s.shape(3) * int64_t{f.group} == width &&
            f.group % per == 0,
        [&] {
          return std::string(arg(is) + ": channel scales must be [B, H, D, n / group], " +
                             field("group") + " of whole words" + form());
        });
}

// One stored form's arrays (from inputs[next]); returns its token count and head dim.
std::pair<int64_t, int64_t> check_stored(const Form& f, const char* name,
                                         const std::vector<mx::array>& in, size_t& next,
                                         int64_t B, int64_t H) {
  const auto field = [&](const char* x) { return std::string(name) + "." + x; };
  check(f.kind >= kDense && f.kind <= kChannel, [&] {
    return field("kind") + " must be " + kinds() + ", got " + std::to_string(f.kind);
  });
  check_next(next, in);
  const size_t ia = next++;
  const auto& a = in[ia];
  check(a.ndim() == 4 && a.shape(0) == B && a.shape(1) == H, [&] {
    return std::string(arg(ia) + ": every part must be 4-D with the queries' batch and KV heads [" +
                       std::to_string(B) + ", " + std::to_string(H) + ", ...], got " + shape_of(a));
  });
  if (f.kind == kDense) {
    check_dense_form(f, name);
    check(is_float(a.dtype()), [&] {
      return std::string(arg(ia) + ": dense parts must be float32, float16 or bfloat16");
    });
    return {a.shape(2), a.shape(3)};
  }
  check(f.bits == 1 || f.bits == 2 || f.bits == 4 || f.bits == 8, [&] {
    return field("bits") + " must be 1, 2, 4 or 8, got " + std::to_string(f.bits);
  });
  check(mx::issubdtype(a.dtype(), mx::unsignedinteger), [&] {
    return std::string(arg(ia) + ": codes must be unsigned integers, got " + shape_of(a));
  });
  const int64_t bytes = a.shape(3) * static_cast<int64_t>(mx::size_of(a.dtype()));
  const int64_t width = bytes * 8 / f.bits;
  check(bytes % 4 == 0,
        [&] { return std::string(arg(ia) + ": a code row must be whole 32-bit words"); });
  check_scales(f, name, in, ia, width, next, B, H);
  if (f.kind == kToken) return {a.shape(2), width};
  return {width, a.shape(2)};
}

// A projected part's factor [B, H, r, Dp] (r: the part's width) and mean [B, H, 1, Dp];
// returns Dp, the query dims it reads or the output dims it writes.
int64_t check_projection(const PartSpec& sp, int64_t r, const std::vector<mx::array>& in,
                         size_t& next, int64_t B, int64_t H) {
  const Form& pp = *sp.projection;
  check(!sp.shift && !sp.mass, "shift and mass must be false for a projected part");
  check(sp.form.kind != kChannel, "form.kind must be dense or token for a projected part");
  check(pp.kind != kChannel && !pp.table,
        "projection.kind must be dense or token, projection.table false");
  const auto [rows, Dp] = check_stored(pp, "projection", in, next, B, H);
  check(rows == r, [&] {
    return std::string("a projection needs one row per dim of its part (" + std::to_string(r) +
                       "), got " + std::to_string(rows));
  });
  if (sp.rotate) {  // rebuilt a row at a time: whole vectors of whole groups, or floats
    const std::pair<const Form*, const char*> forms[] = {{&sp.form, "form"}, {&pp, "projection"}};
    for (const auto& [form, name] : forms)
      check(form->kind == kDense || (!form->table && form->group % L == 0), [&] {
        return std::string(name) + ".table must be false and " + name +
               ".group a multiple of 16 for a rotated projected part (dense or token rows), got " +
               std::to_string(form->group);
      });
  }
  check_next(next, in);
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

// A part's placement fields and its shift.
void check_placement(const PartSpec& sp, bool is_key, const std::vector<mx::array>& in,
                     size_t& next, int64_t B, int64_t H, int64_t R) {
  const std::pair<const char*, int> offsets[] = {{"qoff", sp.qoff}, {"ooff", sp.ooff}};
  for (const auto& [field, value] : offsets)
    check(value >= 0 && value <= kMaxOffset, [&] {
      return std::string(field) + " must be 0 to 65536, got " + std::to_string(value);
    });
  check(sp.rotate || !sp.pairs, "pairs (how a rotation pairs dims) needs rotate");
  check(is_key || (sp.qoff == 0 && !sp.shift), "qoff must be 0 and shift false for a value part");
  check(!is_key || (sp.ooff == 0 && !sp.mass), "ooff must be 0 and mass false for a key part");
  if (sp.shift) {
    check_next(next, in);
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

// A rotation's inverse frequencies and first position; returns half the dims it turns.
int64_t check_rotation(const PartSpec& sp, bool is_key, const std::vector<mx::array>& in,
                       size_t& next) {
  check(is_key && (sp.form.kind == kDense || sp.projection),
        "rotate is for dense or projected key parts");
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
  return inv.shape(3);
}

// One part (its stored arrays, shift, rotation, projection) and its placement; returns its
// token count and head dim.
std::pair<int64_t, int64_t> check_part(const PartSpec& sp, bool is_key,
                                       const std::vector<mx::array>& in, size_t& next, int64_t B,
                                       int64_t H, int64_t R) {
  const auto got = check_stored(sp.form, "form", in, next, B, H);
  check_placement(sp, is_key, in, next, B, H, R);
  const int64_t half = sp.rotate ? check_rotation(sp, is_key, in, next) : 0;
  const int64_t width =
      sp.projection ? check_projection(sp, got.second, in, next, B, H) : got.second;
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

void add_part(Extent& e, const PartSpec& sp, bool is_key, int64_t n, int64_t d, int64_t D) {
  if (is_key) {
    check(sp.qoff + d <= D, [&] {
      return std::string("key parts must fit in the query rows at their offset (qoff " +
                         std::to_string(sp.qoff) + " + " + std::to_string(d) + " dims, rows of " +
                         std::to_string(D) + ")");
    });
    check(sp.qoff > 0 || e.Dk < 0 || e.Dk == d, "key parts at qoff 0 must share one head dim");
    if (sp.qoff == 0) e.Dk = d;
    e.placed |= sp.qoff > 0, e.S_keys += n;
    return;
  }
  check(sp.form.kind != kChannel, "channel parts hold keys only");
  if (sp.ooff == 0 && !sp.mass) {
    check(e.Dv < 0 || e.Dv == d, "value parts must share one head dim");
    e.Dv = d;
  }
  e.Dout = std::max<int64_t>(e.Dout, sp.ooff + d + (sp.mass ? 1 : 0));
  e.S_values += n;
}

// One sequence's parts from inputs[next] on: checks them, returns their output width and
// token count. Value parts at output offset 0 without a mass share one head dim; others
// extend the output past it.
std::pair<int64_t, int64_t> check_parts(const std::vector<PartSpec>& parts, int64_t first,
                                        int64_t n_keys, int64_t n_values,
                                        const std::vector<mx::array>& in, size_t& next, int64_t B,
                                        int64_t H, int64_t D, int64_t R) {
  check(n_keys >= 1 && n_values >= 1, [&] {
    return std::string("need at least one key part and one value part, got " +
                       std::to_string(n_keys) + " and " + std::to_string(n_values));
  });
  check(first + n_keys + n_values <= static_cast<int64_t>(parts.size()), [&] {
    return std::string("parts must describe the counted parts, got " +
                       std::to_string(parts.size()) + " for at least " +
                       std::to_string(first + n_keys + n_values));
  });
  Extent e;
  for (int64_t i = first; i < first + n_keys + n_values; ++i) {
    const bool is_key = i < first + n_keys;
    try {
      const auto [n, d] = check_part(parts[i], is_key, in, next, B, H, R);
      add_part(e, parts[i], is_key, n, d, D);
    } catch (const std::invalid_argument& err) {
      refuse_in("part " + std::to_string(i) + " (" + (is_key ? "key" : "value") + " part " +
                    std::to_string(is_key ? i - first : i - first - n_keys) + ")",
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

}  // namespace

void check_threads(int threads) {
  check(threads >= 1 && threads <= max_threads(), [&] {
    return std::string("threads must be 1 to " + std::to_string(max_threads()) + ", got " +
                       std::to_string(threads));
  });
}

void check_floats(__int128 count, const char* what) {
  check(count <= kMaxFloats, [&] {
    return std::string(what) + " must be at most 2^30 floats, got " +
           std::to_string(static_cast<long double>(count));
  });
}

int64_t check_decode(const std::vector<mx::array>& inputs, const std::vector<PartSpec>& parts,
                     const std::vector<int>& counts, int threads, int causal) {
  const auto& q = inputs[0];
  check(q.ndim() == 4 && q.dtype() == mx::float32,
        [&] { return std::string("q must be [B, H, rows, D] float32, got " + shape_of(q)); });
  const int64_t B = q.shape(0), H = q.shape(1), R = q.shape(2), plans = counts.size() / 2;
  check(counts.size() % 2 == 0 && plans >= 1 && (plans == 1 || plans == B),
        "counts must be (key parts, value parts) once, or once per batch row");
  check_threads(threads);
  check_chunk(causal, R);
  size_t next = 1;
  int64_t first = 0, Dv = -1;
  __int128 scores = 0;
  for (int64_t i = 0; i < plans; ++i) {
    const auto [d, S] = check_parts(parts, first, counts[2 * i], counts[2 * i + 1], inputs, next,
                                    plans == 1 ? B : 1, H, q.shape(3), R);
    check(Dv < 0 || Dv == d, "every row's value parts must give one output width");
    check_chunk_keys(causal, S);
    Dv = d, first += counts[2 * i] + counts[2 * i + 1];
    scores += static_cast<__int128>(plans == 1 ? B : 1) * H * R * S;
  }
  check(first == static_cast<int64_t>(parts.size()), [&] {
    return std::string("parts must describe the counted parts (" + std::to_string(first) +
                       "), got " + std::to_string(parts.size()));
  });
  check(next == inputs.size(), [&] {
    return std::string("more arrays than the parts take (" + std::to_string(next - 1) + "), got " +
                       std::to_string(inputs.size() - 1));
  });
  check_floats(scores, "the scores (batch x heads x rows x keys)");
  check_floats(static_cast<__int128>(B) * H * R * Dv, "the output (batch x heads x rows x width)");
  return Dv;
}

void check_at_run(const std::vector<mx::array>& in, const std::vector<PartSpec>& parts) {
  for (size_t i = 0; i < in.size(); ++i)
    check_extent(in[i], [&] { return i == 0 ? std::string("q") : arg(i); });
  size_t next = 1;
  const auto stored = [&](const Form& f) {
    if (f.kind != kDense) check_last_axis(in[next], [&] { return arg(next) + " (codes)"; });
    next += f.kind == kDense ? 1 : 2 + f.biases;
    if (f.kind != kDense && f.table) {
      check(in[next].flags().row_contiguous,
            [&] { return std::string(arg(next) + " (a table) must be contiguous"); });
      ++next;
    }
  };
  for (const PartSpec& sp : parts) {
    stored(sp.form);
    next += sp.shift ? 1 : 0;
    if (sp.rotate) {
      check(in[next].flags().row_contiguous, [&] {
        return std::string(arg(next) + " (a rotation's inverse frequencies) must be contiguous");
      });
      next += 2;
    }
    if (sp.projection) stored(*sp.projection), ++next;
  }
}

}  // namespace veloxquant
