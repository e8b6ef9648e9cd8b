#pragma once
/// \file
/// Typed attribute values of IR nodes (docs/seed-system.md §1.5): `f` double, `fs` double list,
/// `i` int64, `is` int64 list, `s` string, `ss` string list, `t` tensor, `ts` tensor
/// list, `g` graph, `gs` graph list; and their conversion from core `Scalar`s and back
/// (`detail::to_core_attributes`). The one reader of op-table `Attributes` by name is
/// here too (`find_attribute`).
///
/// Text form: `f` always has a `.` or exponent (`1.0`), `i` never does; strings are
/// quoted; non-empty lists are `[a, b]`, empty ones carry their kind (`is[]`, `fs[]`,
/// `ss[]`, `ts[]`, `gs[]`); tensors are tensor literals (detail/literals.hpp). Graph
/// attributes print as `<Graph>` / `[<Graphs>]` and cannot be parsed back.
///
/// The longer functions' bodies are in ir/attributes-inl.hpp (core/config.hpp).

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/detail/literals.hpp>

namespace stagejit::ir {

class Graph;

/// One attribute value; the alternative's index gives its kind (see `attribute_kind`).
using AttributeValue =
    std::variant<double, std::vector<double>, int64_t, std::vector<int64_t>, std::string,
                 std::vector<std::string>, at::Tensor, std::vector<at::Tensor>,
                 std::shared_ptr<Graph>, std::vector<std::shared_ptr<Graph>>>;

/// Attributes of a node in their insertion (argument) order.
using AttributeList = std::vector<std::pair<std::string, AttributeValue>>;

/// Kind names in the order of `AttributeValue`'s alternatives.
inline constexpr std::array<std::string_view, 10> attribute_kind_names = {
    "f", "fs", "i", "is", "s", "ss", "t", "ts", "g", "gs"};

/// The docs/seed-system.md §1.5 kind of `v`: `"f"`, `"is"`, `"t"`, ...
inline std::string_view attribute_kind(const AttributeValue& v) {
  return attribute_kind_names[v.index()];
}

/// Converts a core `Scalar` (tracer/op arguments) into an attribute: `double` -> f,
/// `int64_t` -> i, `bool` -> i (0 or 1), string -> s, int list -> is, double list -> fs.
/// Throws IrError for `NoneScalar`, which no attribute kind holds.
STAGEJIT_FUNC AttributeValue to_attribute(const Scalar& s);

/// Converts core `Attributes` element-wise with `to_attribute`, keeping the order.
STAGEJIT_FUNC AttributeList to_attribute_list(const Attributes& attrs);

/// Tensors equal in dtype, device, sizes and values (NaN never equals NaN).
STAGEJIT_FUNC bool tensor_equal(const at::Tensor& a, const at::Tensor& b);

/// Structural equality: same kind and equal contents; tensors by `tensor_equal`,
/// graphs by identity.
STAGEJIT_FUNC bool attribute_equal(const AttributeValue& a, const AttributeValue& b);

/// The value of `v` as `T` where the text form allows it: exact alternative, or an
/// integer (list) where a double (list) is expected. nullopt otherwise.
template <class T>
std::optional<T> attribute_as(const AttributeValue& v) {
  if (auto p = std::get_if<T>(&v)) return *p;
  if constexpr (std::is_same_v<T, double>) {
    if (auto p = std::get_if<int64_t>(&v)) return static_cast<double>(*p);
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    if (auto p = std::get_if<std::vector<int64_t>>(&v)) return T(p->begin(), p->end());
  }
  return std::nullopt;
}

/// The text form of an attribute value (see the file comment).
STAGEJIT_FUNC std::string format_attribute(const AttributeValue& v);

/// The text form of a core `Scalar` (host op scalar arguments): like attributes, with
/// `bool` as `true`/`false`.
STAGEJIT_FUNC std::string format_scalar(const Scalar& s);

/// The value of attribute `name` in op-table `Attributes`, or null when it has none.
inline const Scalar* find_attribute(const Attributes& attrs, std::string_view name) {
  for (const auto& [k, v] : attrs)
    if (k == name) return &v;
  return nullptr;
}

}  // namespace stagejit::ir

namespace stagejit::detail {

/// Converts IR attributes back to the op table's `Attributes` (the inverse of
/// `ir::to_attribute`): f -> double, i -> int64_t, is -> vector<int64_t>,
/// fs -> vector<double>, s -> string. Tensor and graph attributes have no op-table form:
/// throws `CompileError` for a tensor, string-list or graph attribute.
STAGEJIT_FUNC Attributes to_core_attributes(const ir::AttributeList& attrs);

}  // namespace stagejit::detail

#ifdef STAGEJIT_HEADER_TEST_CASES
#include <stagejit/testing/doctest.hpp>
TEST_SUITE("ir") {
  TEST_CASE("Scalars convert to the attribute kinds and print by kind") {
    using namespace stagejit::ir;
    stagejit::Attributes a = {{"alpha", 1.0},
                              {"dim", int64_t(1)},
                              {"keepdim", true},
                              {"dims", std::vector<int64_t>{}},
                              {"w", std::vector<double>{0.5, 2.0}},
                              {"mode", std::string("a\"b")}};
    auto list = to_attribute_list(a);
    std::vector<std::string> kinds, texts;
    for (auto& [n, v] : list) {
      kinds.emplace_back(attribute_kind(v));
      texts.push_back(format_attribute(v));
    }
    CHECK(kinds == std::vector<std::string>{"f", "i", "i", "is", "fs", "s"});
    CHECK(texts == std::vector<std::string>{"1.0", "1", "1", "is[]", "[0.5, 2.0]", "\"a\\\"b\""});
    CHECK(attribute_as<double>(AttributeValue{int64_t(3)}) == 3.0);
    CHECK_FALSE(attribute_as<int64_t>(AttributeValue{3.0}).has_value());
  }
}
#endif
