#pragma once
/// \file
/// Bodies of ir/detail/names.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/detail/names.hpp>
#include <stagejit/ir/graph.hpp>

#include <string>

namespace stagejit::ir::detail {

STAGEJIT_FUNC NameTable::NameTable(const Graph& g) {
  for (Value* v : g.inputs()) assign(v);
  for (Node* n : g.nodes())
    for (Value* v : n->outputs()) assign(v);
}

STAGEJIT_FUNC std::string NameTable::node(const Node* n) const {
  if (n->is<Return>()) return "return";
  std::string out;
  for (size_t i = 0; i < n->outputs().size(); ++i) out += (i ? ", " : "") + (*this)(n->output(i));
  if (out.empty()) out = "#" + std::to_string(n->id());
  return out + " (" + n->describe() + ")";
}

}  // namespace stagejit::ir::detail
