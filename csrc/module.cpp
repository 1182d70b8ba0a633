// The Python module: the ops, the part kinds (part_kinds, name -> code) and the fields of a
// part description (part_fields, form_fields), which ops/native.py's PartKind, PartSpec and
// Form must equal (tests/test_native.py checks; ops/native.py refuses a build that differs).
// A part description is any object with those fields (ops/native.py's dataclasses), read
// here into PartSpec: a missing field or one of the wrong type is refused by its name.
#include <climits>
#include <utility>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace veloxquant {
namespace {

constexpr const char* kFormFields[] = {"kind", "bits", "group", "biases", "table"};
constexpr const char* kPartFields[] = {"form",  "qoff",   "ooff",  "shift",
                                       "mass", "rotate", "pairs", "projection"};

// The interned Python string of a field name, made once (a string literal: its address is
// its key), so that reading a description makes no string per field and call.
PyObject* interned(const char* name) {
  static std::vector<std::pair<const char*, PyObject*>> names;
  for (const auto& [key, value] : names)
    if (key == name) return value;
  names.emplace_back(name, PyUnicode_InternFromString(name));
  return names.back().second;
}

const char* py_type(nb::handle value) { return Py_TYPE(value.ptr())->tp_name; }

// obj.name, refused when obj has none (prefix + name: the field in the message).
nb::object field_of(nb::handle obj, const char* name, const char* prefix) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), interned(name));
  if (value == nullptr) {
    PyErr_Clear();
    check(false, [&] {
      return std::string("no field ") + prefix + name + " in a " + py_type(obj) +
             " (a part is ops.native.PartSpec)";
    });
  }
  return nb::steal(value);
}

int int_field(nb::handle obj, const char* name, const char* prefix) {
  const nb::object value = field_of(obj, name, prefix);
  check(PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr()), [&] {
    return std::string(prefix) + name + " must be an int, got " + py_type(value);
  });
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  check(overflow == 0 && x >= INT_MIN && x <= INT_MAX, [&] {
    return std::string(prefix) + name + " must fit in 32 bits, got " + nb::str(value).c_str();
  });
  return static_cast<int>(x);
}

bool bool_field(nb::handle obj, const char* name, const char* prefix) {
  const nb::object value = field_of(obj, name, prefix);
  check(PyBool_Check(value.ptr()), [&] {
    return std::string(prefix) + name + " must be a bool, got " + py_type(value);
  });
  return value.ptr() == Py_True;
}

// prefix: "form." or "projection.", for the messages.
Form form_of(nb::handle obj, const char* prefix) {
  return {int_field(obj, "kind", prefix), int_field(obj, "bits", prefix),
          int_field(obj, "group", prefix), bool_field(obj, "biases", prefix),
          bool_field(obj, "table", prefix)};
}

PartSpec part_of(nb::handle obj) {
  PartSpec sp;
  sp.form = form_of(field_of(obj, "form", ""), "form.");
  sp.qoff = int_field(obj, "qoff", ""), sp.ooff = int_field(obj, "ooff", "");
  sp.shift = bool_field(obj, "shift", ""), sp.mass = bool_field(obj, "mass", "");
  sp.rotate = bool_field(obj, "rotate", ""), sp.pairs = bool_field(obj, "pairs", "");
  const nb::object projection = field_of(obj, "projection", "");
  if (!projection.is_none()) sp.projection = form_of(projection, "projection.");
  return sp;
}

std::vector<PartSpec> parts_of(const nb::list& parts) {
  std::vector<PartSpec> out;
  out.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    try {
      out.push_back(part_of(parts[i]));
    } catch (const std::invalid_argument& err) {
      refuse_in("part " + std::to_string(i), err);
    }
  }
  return out;
}

template <size_t N>
nb::tuple names(const char* const (&fields)[N]) {
  nb::list out;
  for (const char* f : fields) out.append(nb::str(f));
  return nb::tuple(out);
}

}  // namespace
}  // namespace veloxquant

NB_MODULE(_native, m) {
  namespace vq = veloxquant;
  m.doc() = "veloxquant_mlx's fused CPU decode attention over stored parts.";
  m.def(
      "decode_attention",
      [](const mx::array& q, const std::vector<mx::array>& arrays, const nb::list& parts,
         const std::vector<int>& counts, int threads, int causal) {
        return vq::decode_attention(q, arrays, vq::parts_of(parts), counts, threads, causal);
      },
      "q"_a, "arrays"_a, "parts"_a, "counts"_a, "threads"_a = 1, "causal"_a = 0);
  m.def("floats_of", &vq::floats_of, "codes"_a, "scales"_a, "biases"_a, "bits"_a, "group"_a,
        "threads"_a = 1, "plus"_a = nb::none());
  m.def("rms_rows", &vq::rms_rows, "x"_a, "weight"_a, "eps"_a, "threads"_a = 1);
  nb::dict kinds;
  for (const auto& k : vq::kKinds) kinds[k.name] = static_cast<int>(k.kind);
  m.attr("part_kinds") = kinds;
  m.attr("part_fields") = vq::names(vq::kPartFields);
  m.attr("form_fields") = vq::names(vq::kFormFields);
}
