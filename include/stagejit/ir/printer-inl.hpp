#pragma once
/// \file
/// Bodies of ir/printer.hpp (core/config.hpp): compiled once in src/compiled_bodies.cpp,
/// or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/printer.hpp>

#include <cctype>
#include <ostream>
#include <string>
#include <vector>

#include <stagejit/core/overloaded.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/detail/names.hpp>
#include <stagejit/ir/detail/op_words.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>

namespace stagejit::ir {

namespace detail {

// An op or host op name as text: bare when the lexer reads it back as one identifier
// (`mul`, `aten::mul`, `MulConstant`), else quoted (`"struct torch::autograd::Neg"`, a
// C++ type name of the seed era's Windows printouts).
inline std::string op_name_text(std::string_view name) {
  auto start = [](char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; };
  auto part = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  bool plain = !name.empty() && start(name[0]);
  for (size_t i = 0; plain && i < name.size(); ++i) {
    if (part(name[i])) continue;
    plain = name[i] == ':' && i + 2 < name.size() && name[i + 1] == ':' && start(name[i + 2]);
    ++i;
  }
  return plain ? std::string(name) : quote(std::string(name));
}

/// An `Op`'s name as printed: quoted also when the parser would read the bare word as
/// something else (an alias such as `Add`, a kind, a 2018 namespace: detail/op_words.hpp).
inline std::string op_kind_text(std::string_view name) {
  return detail::is_reserved_op_word(name) ? quote(std::string(name)) : op_name_text(name);
}

inline std::string kind_text(const Node& n, size_t& fusion_index,
                             std::vector<const Graph*>& subgraphs) {
  auto bare = [](const auto& k) -> std::string { return std::string(kind_name<std::decay_t<decltype(k)>>()); };
  return std::visit(
      Overloaded{
          [&](const Op& k) -> std::string {
            std::string out = op_kind_text(k.name());
            if (!k.attributes.empty()) {
              out += '[';
              for (size_t i = 0; i < k.attributes.size(); ++i)
                out += (i ? ", " : "") + k.attributes[i].first + "=" + format_attribute(k.attributes[i].second);
              out += ']';
            }
            return out;
          },
          [&](const HostOp& k) -> std::string {
            std::string out = "^" + op_name_text(k.name) + "[" + k.calling_convention + "](";
            for (size_t i = 0; i < k.scalars.size(); ++i) out += (i ? ", " : "") + format_scalar(k.scalars[i]);
            return out + ")";
          },
          [&](const FusionGroup& k) -> std::string {
            subgraphs.push_back(k.subgraph.get());
            return std::string(kind_name<FusionGroup>()) + "_" + std::to_string(fusion_index++);
          },
          // No perm: reverse the axes, printed as in the seed era.
          [&](const Transpose& k) -> std::string {
            if (k.perm.empty()) return std::string(kind_name<Transpose>());
            return "Transpose[perm=" + format_attribute(AttributeValue(k.perm)) + "]";
          },
          // Constant, Reshape, Gemm: `Name[field=value, ...]`.
          [&]<class K>(const K& k) -> std::string requires is_attribute_kind<K> {
            std::string out = std::string(kind_name<K>()) + "[";
            bool first = true;
            boost::hana::for_each(boost::hana::accessors<K>(), [&](auto acc) {
              out += (first ? "" : ", ") + std::string(boost::hana::to<const char*>(boost::hana::first(acc))) +
                     "=" + format_attribute(AttributeValue(boost::hana::second(acc)(k)));
              first = false;
            });
            return out + "]";
          },
          [&](const Undefined& k) { return bare(k); },
          [&](const Eval& k) { return bare(k); },
          [&](const Param& k) { return bare(k); },
          [&](const Return& k) { return bare(k); },
      },
      n.kind());
}

inline void print_graph(std::string& out, const Graph& g) {
  NameTable names(g);
  out += "graph(";
  size_t stage = 0;
  const auto& ins = g.inputs();
  for (size_t i = 0; i < ins.size(); ++i) {
    if (i) out += ",\n      ";
    if (ins[i]->stage() != stage) {
      stage = ins[i]->stage();
      out += "-------- stage " + std::to_string(stage) + " --------\n      ";
    }
    out += names(ins[i]) + " : " + to_string(ins[i]->type());
  }
  out += ") {\n";
  stage = 0;
  size_t fusion_index = 0;
  std::vector<const Graph*> subgraphs;
  for (Node* n : g.nodes()) {
    if (n->stage() != stage) {
      stage = n->stage();
      out += "  ---------------- stage " + std::to_string(stage) + " ----------------\n";
    }
    out += "  ";
    for (size_t i = 0; i < n->outputs().size(); ++i)
      out += (i ? ", " : "") + names(n->output(i)) + " : " + to_string(n->output(i)->type());
    if (!n->outputs().empty()) out += " = ";
    out += kind_text(*n, fusion_index, subgraphs) + "(";
    for (size_t i = 0; i < n->inputs().size(); ++i) out += (i ? ", " : "") + names(n->input(i));
    out += ");\n";
  }
  out += "  return (";
  const auto& outs = g.outputs();
  size_t k = 0;
  for (size_t s = 0; s < g.num_stages(); ++s) {
    if (s) out += " | ";
    for (size_t j = 0; j < g.stage_output_counts()[s]; ++j, ++k)
      out += (j ? ", " : "") + names(outs[k]);
  }
  out += ");\n}\n";
  for (size_t i = 0; i < subgraphs.size(); ++i) {
    out += "with fusion_group_" + std::to_string(i) + " = ";
    if (subgraphs[i]) print_graph(out, *subgraphs[i]);
    else out += "<missing subgraph>\n";
  }
}

}  // namespace detail

STAGEJIT_FUNC std::string to_string(const Graph& graph) {
  std::string out;
  detail::print_graph(out, graph);
  return out;
}

STAGEJIT_FUNC std::ostream& operator<<(std::ostream& os, const Graph& graph) { return os << to_string(graph); }

STAGEJIT_FUNC std::string value_label(const Value* v) {
  if (v->has_name()) return "%" + v->name();
  const Graph* g = v->node()->owning_graph();
  return g ? detail::NameTable(*g)(v) : "%#" + std::to_string(v->id());
}

STAGEJIT_FUNC int64_t fusion_group_index(const Node* n) {
  if (!n->is<FusionGroup>() || !n->owning_graph()) return -1;
  int64_t index = 0;
  for (const Node* m : n->owning_graph()->nodes()) {
    if (m == n) return index;
    index += m->is<FusionGroup>();
  }
  return -1;
}

STAGEJIT_FUNC std::string node_label(const Node* n, const detail::NameTable& names, int64_t fusion_index) {
  std::string out;
  if (n->is<Return>()) {
    out = "return";
  } else {
    for (size_t i = 0; i < n->outputs().size(); ++i) out += (i ? ", " : "") + names(n->output(i));
    if (!n->outputs().empty()) out += " = ";
    out += fusion_index >= 0 ? "fusion_group_" + std::to_string(fusion_index) : n->describe();
  }
  if (n->location().known())
    out += " (line " + std::to_string(n->location().line) + ", column " + std::to_string(n->location().column) + ")";
  return out;
}

STAGEJIT_FUNC std::string node_label(const Node* n) {
  if (!n->owning_graph()) return n->describe();
  return node_label(n, detail::NameTable(*n->owning_graph()), fusion_group_index(n));
}

}  // namespace stagejit::ir
