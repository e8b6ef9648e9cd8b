#pragma once
/// \file
/// Node kinds: a closed set of plain structs held in the `NodeKind` variant and
/// dispatched with `std::visit` (docs/design.md, "Types dispatched through variants").
///
/// `kind_names` is the Boost.Hana compile-time table from each kind type to the name the
/// text form uses; the printer and the parser both read it, so they cannot drift apart.
/// Kinds whose fields are attributes (`Constant`, `Transpose`, `Reshape`, `Gemm`) are
/// Hana Structs: the printer writes their members as `[name=value, ...]` and the parser
/// fills them back by member name.
///
/// `kind_equal`'s body is in ir/kinds-inl.hpp (core/config.hpp).

#include <ATen/ATen.h>
#include <boost/hana.hpp>

#include <any>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include <stagejit/core/config.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ops/op_schema.hpp>

namespace stagejit::ir {

class Graph;

/// A graph input (one output, no inputs). Created only by `Graph::add_input`.
struct Param {};

/// A constant tensor (one output, no inputs). Printed `Constant[value=<tensor literal>]()`.
struct Constant {
  BOOST_HANA_DEFINE_STRUCT(Constant, (at::Tensor, value));
};

/// Stands for an undefined (null) tensor, e.g. a missing gradient (one output).
struct Undefined {};

/// A table op (`mul`, `add`, `tanh`, `mm`, `sum`, ...) with its non-tensor arguments as
/// typed attributes in argument order. The op is held by identity: its interned
/// `OpSchema` (ops/op_schema.hpp), resolved once when the node is made (by the tracer
/// from the op it ran, by the parser from the name it read), so passes test `id()`, never
/// the name. A name the table lacks gets `OpId::unknown` and its own schema: it prints
/// and parses back, and the closure compiler refuses to run it.
struct Op {
  /// The op named `name` (interned; `OpId::unknown` when the table lacks it).
  explicit Op(std::string_view name, AttributeList attrs = {})
      : attributes(std::move(attrs)), schema_(intern_op(name)) {}
  /// The table's op `id` (not `OpId::unknown`).
  explicit Op(OpId id, AttributeList attrs = {})
      : attributes(std::move(attrs)), schema_(&op_schema(id)) {}

  /// An op whose attributes come from core `Attributes` (see `to_attribute`).
  static Op with(std::string_view name, const Attributes& attrs = {}) {
    return Op(name, to_attribute_list(attrs));
  }
  static Op with(OpId id, const Attributes& attrs = {}) { return Op(id, to_attribute_list(attrs)); }

  AttributeList attributes;

  /// The op's identity (`OpId::unknown` for a name the table lacks).
  OpId id() const noexcept { return schema_->id; }
  /// What is known of the op (arity, elementwise, side effects, fusion template, ...).
  const OpSchema& schema() const noexcept { return *schema_; }
  /// ATen's name of the op, as printed.
  std::string_view name() const noexcept { return schema_->name; }
  /// The attribute called `key`, or nullptr.
  const AttributeValue* attribute(std::string_view key) const {
    for (const auto& [k, v] : attributes)
      if (k == key) return &v;
    return nullptr;
  }

 private:
  const OpSchema* schema_;  // never null; interned, so equal ops have equal pointers
};

/// A user C++ callable whose backward is opaque (the seed's PythonOp / CppOp).
/// `calling_convention` has one letter per argument in call order: `t` a tensor input,
/// `s` a scalar from `scalars`. Its last output may be a Handle (its backward), run at
/// the next stage by an `Eval`. Printed `^name[convention](scalars)(inputs)`.
struct HostOp {
  std::string name;
  std::string calling_convention;
  std::vector<Scalar> scalars;
  /// Type-erased slot for whoever records the node (the tracer keeps the callable here).
  /// Not printed, not compared.
  std::shared_ptr<void> payload;
};

/// Runs a Handle (an opaque backward) made at an earlier stage. Its last input is that
/// Handle; its outputs are the gradients, plus a Handle when it is itself opaque.
struct Eval {};

/// A group of elementwise nodes fused into one kernel; `subgraph`'s inputs and outputs
/// correspond one to one with the node's. Printed `fusion_group_N` plus a `with` block.
struct FusionGroup {
  std::shared_ptr<Graph> subgraph;
};

/// ONNX-style permutation of dimensions (1 input, 1 output).
struct Transpose {
  BOOST_HANA_DEFINE_STRUCT(Transpose, (std::vector<int64_t>, perm));
};

/// ONNX-style reshape to `shape` (1 input, 1 output).
struct Reshape {
  BOOST_HANA_DEFINE_STRUCT(Reshape, (std::vector<int64_t>, shape));
};

/// `beta * C + alpha * (A @ B)` for inputs (A, B, C) (1 output).
struct Gemm {
  BOOST_HANA_DEFINE_STRUCT(Gemm, (double, alpha), (double, beta));
};

/// The graph's return sentinel: its inputs are the graph outputs. Never in `nodes()`.
struct Return {};

/// Every node kind.
using NodeKind = std::variant<Param, Constant, Undefined, Op, HostOp, Eval, FusionGroup,
                              Transpose, Reshape, Gemm, Return>;

/// Compile-time table kind type -> printed name. `Op` prints its op name and `HostOp`
/// prints `^name`; their entries name the kind in messages. `FusionGroup` prints
/// `fusion_group_<index>`.
inline constexpr auto kind_names = boost::hana::make_map(
    boost::hana::make_pair(boost::hana::type_c<Param>, std::string_view("Param")),
    boost::hana::make_pair(boost::hana::type_c<Constant>, std::string_view("Constant")),
    boost::hana::make_pair(boost::hana::type_c<Undefined>, std::string_view("Undefined")),
    boost::hana::make_pair(boost::hana::type_c<Op>, std::string_view("Op")),
    boost::hana::make_pair(boost::hana::type_c<HostOp>, std::string_view("HostOp")),
    boost::hana::make_pair(boost::hana::type_c<Eval>, std::string_view("Eval")),
    boost::hana::make_pair(boost::hana::type_c<FusionGroup>, std::string_view("fusion_group")),
    boost::hana::make_pair(boost::hana::type_c<Transpose>, std::string_view("Transpose")),
    boost::hana::make_pair(boost::hana::type_c<Reshape>, std::string_view("Reshape")),
    boost::hana::make_pair(boost::hana::type_c<Gemm>, std::string_view("Gemm")),
    boost::hana::make_pair(boost::hana::type_c<Return>, std::string_view("Return")));

namespace detail {
template <class Variant>
struct every_kind_named;
template <class... Ks>
struct every_kind_named<std::variant<Ks...>> {
  static constexpr bool value =
      (decltype(boost::hana::contains(kind_names, boost::hana::type_c<Ks>))::value && ...) &&
      sizeof...(Ks) == decltype(boost::hana::length(kind_names))::value;
};
}  // namespace detail
static_assert(detail::every_kind_named<NodeKind>::value,
              "ir::kind_names must name every alternative of ir::NodeKind exactly once");

/// The table name of kind type `K`.
template <class K>
constexpr std::string_view kind_name() {
  return kind_names[boost::hana::type_c<K>];
}

/// The table name of the kind held by `kind`.
inline std::string_view kind_name(const NodeKind& kind) {
  return std::visit([](const auto& k) { return kind_name<std::decay_t<decltype(k)>>(); }, kind);
}

/// True for kinds whose fields are attributes (Hana Structs).
template <class K>
inline constexpr bool is_attribute_kind = boost::hana::Struct<K>::value;

/// True when running the node does more than compute its outputs from its inputs, so
/// passes must neither remove nor merge it: ATen in-place ops (name ending in `_`) and
/// random ops (`OpSchema::side_effects`). HostOp and Eval are opaque and never merged, but are removed by DCE
/// when none of their outputs is used.
inline bool has_side_effects(const NodeKind& kind) {
  if (auto op = std::get_if<Op>(&kind)) return op->schema().side_effects;
  return false;
}

/// Structural equality of two kinds, as CSE needs it: same alternative and equal fields
/// (tensors by dtype, sizes and values). HostOp, Eval, FusionGroup, Param and Return
/// are never equal to another node's kind (they are opaque or unique).
STAGEJIT_FUNC bool kind_equal(const NodeKind& a, const NodeKind& b);

}  // namespace stagejit::ir

#ifdef STAGEJIT_HEADER_TEST_CASES
#include <stagejit/testing/doctest.hpp>
TEST_SUITE("ir") {
  TEST_CASE("the Hana kind table names kinds, and kind_equal compares fields") {
    using namespace stagejit::ir;
    CHECK(kind_name<Gemm>() == "Gemm");
    CHECK(kind_name(NodeKind{FusionGroup{}}) == "fusion_group");
    CHECK(kind_equal(Gemm{1.0, 0.5}, Gemm{1.0, 0.5}));
    CHECK_FALSE(kind_equal(Gemm{1.0, 0.5}, Gemm{1.0, 1.0}));
    CHECK(kind_equal(Op::with("add", {{"alpha", int64_t(1)}}), Op::with("add", {{"alpha", true}})));
    CHECK_FALSE(kind_equal(Op::with("add", {{"alpha", 1.0}}), Op::with("add", {{"alpha", int64_t(1)}})));
    CHECK(kind_equal(Constant{at::ones({2})}, Constant{at::ones({2})}));
    CHECK_FALSE(kind_equal(Constant{at::ones({2})}, Constant{at::ones({2}, at::kDouble)}));
    CHECK_FALSE(kind_equal(Eval{}, Eval{}));
    CHECK(has_side_effects(Op::with("add_")));
    CHECK(has_side_effects(Op::with("dropout")));
    CHECK_FALSE(has_side_effects(Op::with("add")));
  }
}
#endif
