#pragma once
/// \file
/// Bodies of ir/detail/op_words.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/detail/op_words.hpp>
#include <stagejit/ir/kinds.hpp>

#include <boost/hana.hpp>

#include <string_view>

namespace stagejit::ir::detail {

STAGEJIT_FUNC bool is_reserved_op_word(std::string_view name) {
  for (std::string_view ns : ir_namespaces)
    if (name.substr(0, ns.size()) == ns) return true;
  for (const OpAlias& a : op_aliases)
    if (a.from == name) return true;
  if (name == "CppOp" || name == "If" || name == "Loop") return true;
  if (is_fusion_ref(name, "fusion_group_") || is_fusion_ref(name, "FusionGroup_")) return true;
  bool kind = false;
  boost::hana::for_each(kind_names, [&](auto pair) { kind = kind || boost::hana::second(pair) == name; });
  return kind;
}

}  // namespace stagejit::ir::detail
