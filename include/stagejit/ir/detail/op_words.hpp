#pragma once
/// \file
/// Words the IR parser gives a meaning of their own in a node's kind position, shared by
/// the parser (which reads them) and the printer (which quotes an op of that name so that
/// it reads back as the same op):
/// - the seed-era and ONNX op names that alias ops of the table (Note [Op aliases] in
///   ir/detail/parser_dialects.hpp: `Add`, `Concat`, ...);
/// - kind names (`Constant`, `Transpose`, ...), `CppOp`, control flow (`If`, `Loop`);
/// - fusion-group references (`fusion_group_N`, `FusionGroup_N`);
/// - names in the 2018 namespaces `aten::`, `prim::`, `onnx::`, which the parser strips.
///
/// `is_reserved_op_word`'s body is in ir/detail/op_words-inl.hpp (core/config.hpp).

#include <string_view>

#include <stagejit/core/config.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ops/op_schema.hpp>

namespace stagejit::ir::detail {

/// A seed-era or ONNX op name and the table op it stands for.
struct OpAlias {
  std::string_view from;
  OpId to;
};

inline constexpr OpAlias op_aliases[] = {
    {"Add", OpId::add},         {"Sub", OpId::sub},     {"Mul", OpId::mul},   {"Div", OpId::div},
    {"Neg", OpId::neg},         {"Tanh", OpId::tanh},   {"Sigmoid", OpId::sigmoid},
    {"Exp", OpId::exp},         {"Log", OpId::log},     {"Relu", OpId::relu}, {"Chunk", OpId::chunk},
    {"Split", OpId::split},     {"Concat", OpId::cat},  {"Sqrt", OpId::sqrt}, {"Abs", OpId::abs},
    {"Reciprocal", OpId::reciprocal}, {"MatMul", OpId::matmul}, {"Cat", OpId::cat},
};

/// The 2018 namespaces the parser strips from a kind (`aten::mul` is `mul`).
inline constexpr std::string_view ir_namespaces[] = {"aten::", "prim::", "onnx::"};

/// Whether `name` is a fusion-group reference: `prefix` followed by digits only.
inline bool is_fusion_ref(std::string_view name, std::string_view prefix) {
  return name.size() > prefix.size() && name.substr(0, prefix.size()) == prefix &&
         name.find_first_not_of("0123456789", prefix.size()) == std::string_view::npos;
}

/// Whether the identifier `name` in a node's kind position reads as something other than
/// an op of that very name (an alias, another kind, a namespace the parser strips...).
STAGEJIT_FUNC bool is_reserved_op_word(std::string_view name);

}  // namespace stagejit::ir::detail
