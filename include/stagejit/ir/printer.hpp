#pragma once
/// \file
/// `ir::to_string`: the canonical text form of a graph (docs/seed-system.md §1.7, Value era).
///
/// ```text
/// graph(%x : Float(3, 4),
///       %w : Float(4, 5),
///       -------- stage 1 --------
///       %gy : Float(3, 5)) {
///   %0 : Float(3, 5) = mm(%x, %w);
///   %1 : Float(3, 5), %2 : Handle = ^Scale[ts](2.0)(%0);
///   ---------------- stage 1 ----------------
///   %3 : Float(3, 5) = Eval(%gy, %2);
///   return (%1 | %3);
/// }
/// ```
/// - Inputs: `%name : Type`, separated by `,` and a newline; `-------- stage K --------`
///   before the first input of each stage after 0.
/// - Nodes: `outputs = op(inputs);` with `---------------- stage K ----------------` when
///   the stage changes (from 0). Ops: `name[attr=value, ...]` for Op; `^name[conv](scalars)`
///   for HostOp; `Eval`; `Undefined`; `Constant[value=<tensor literal>]`;
///   `Transpose[perm=...]`, `Reshape[shape=...]`, `Gemm[alpha=..., beta=...]`;
///   `fusion_group_N` (N counts fusion groups in print order).
/// - `return (...)` lists the outputs with `|` between stage groups (one group per stage).
/// - After `}`, each fusion group's subgraph as `with fusion_group_N = graph(...) {...}`.
/// - Value names: see detail/names.hpp. Literals: see attributes.hpp and detail/literals.hpp.

#include <stagejit/core/detail/bodies_begin.hpp>
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

std::string to_string(const Graph& graph);

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

/// The canonical text of `graph` (see the file comment). Stable: equal graphs print
/// equally, and `to_string(*parse(to_string(g))) == to_string(g)`.
inline std::string to_string(const Graph& graph) {
  std::string out;
  detail::print_graph(out, graph);
  return out;
}

inline std::ostream& operator<<(std::ostream& os, const Graph& graph) { return os << to_string(graph); }

/// How `v` prints in its graph (`%x`, `%3`), for messages: the name the printer (and so
/// `stagejit-run --print`) gives it. Linear in the graph's size; meant for error paths.
inline std::string value_label(const Value* v) {
  if (v->has_name()) return "%" + v->name();
  const Graph* g = v->node()->owning_graph();
  return g ? detail::NameTable(*g)(v) : "%#" + std::to_string(v->id());
}

/// The printer's index of fusion group `n` among its graph's fusion groups
/// (`fusion_group_N`), or -1 when `n` is not a listed fusion group.
inline int64_t fusion_group_index(const Node* n) {
  if (!n->is<FusionGroup>() || !n->owning_graph()) return -1;
  int64_t index = 0;
  for (const Node* m : n->owning_graph()->nodes()) {
    if (m == n) return index;
    index += m->is<FusionGroup>();
  }
  return -1;
}

/// A node for messages, as `--print` shows it: `%3 = mul`, `%4, %5 = chunk`,
/// `fusion_group_0`, then ` (line 4, column 3)` when it was read from text. Linear in the
/// graph's size; meant for error paths.
/// The same with the graph's names and the node's fusion group index already known (a
/// caller labelling many nodes builds the NameTable once).
inline std::string node_label(const Node* n, const detail::NameTable& names, int64_t fusion_index) {
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
inline std::string node_label(const Node* n) {
  if (!n->owning_graph()) return n->describe();
  return node_label(n, detail::NameTable(*n->owning_graph()), fusion_group_index(n));
}

}  // namespace stagejit::ir
#include <stagejit/core/detail/bodies_end.hpp>
