#pragma once
/// \file
/// Bodies of ir/lint.hpp (core/config.hpp): the checks, `detail::Linter`, and `lint`;
/// compiled once in src/compiled_bodies.cpp, or inline in every translation unit of a
/// header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/lint.hpp>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <stagejit/core/error.hpp>
#include <stagejit/ir/detail/names.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/ops/op_schema.hpp>

namespace stagejit::ir {

namespace detail {

class Linter {
 public:
  explicit Linter(const Graph& g, LintOptions options = {}) : g_(g), options_(options), names_(g) {
    // A set, not Graph::owns: a corrupt use list may point at a freed node.
    for (const Node* n : g.all_nodes()) owned_.insert(n);
  }

  void run() {
    check_inputs();
    std::unordered_set<const Value*> defined(g_.inputs().begin(), g_.inputs().end());
    size_t last_stage = 0;
    for (Node* n : g_.nodes()) {
      if (n->is<Param>() || n->is<Return>()) fail(n, "structure", "Param and Return nodes may not be in the node list");
      if (n->stage() < last_stage)
        fail(n, "stage-order", "stage " + std::to_string(n->stage()) + " comes after a node of stage " +
                                   std::to_string(last_stage) + "; node stages must not decrease");
      last_stage = n->stage();
      if (n->stage() >= g_.num_stages())
        fail(n, "output-groups", "stage " + std::to_string(n->stage()) + " has no output group (graph has " +
                                     std::to_string(g_.num_stages()) + ")");
      check_node(n, defined);
      for (Value* o : n->outputs()) defined.insert(o);
    }
    check_node(g_.return_node(), defined);
    check_outputs();
    check_names();
  }

 private:
  [[noreturn]] void fail(const Node* n, const std::string& rule, const std::string& what) const {
    throw LintError(rule, n->location(),
                    "lint: " + std::string(n->is<Return>() ? "return" : "node " + names_.node(n)) +
                        (n->is<Return>() ? "" : " at stage " + std::to_string(n->stage())) + ": rule '" +
                        rule + "': " + what);
  }

  void check_inputs() {
    size_t last = 0;
    for (Value* v : g_.inputs()) {
      if (v->owning_graph() != &g_ || !v->node()->is<Param>() || v->node()->outputs().size() != 1)
        fail(v->node(), "structure", "graph input " + names_(v) + " is not the output of a Param of this graph");
      if (v->stage() < last) fail(v->node(), "structure", "graph inputs are not in stage order");
      last = v->stage();
      if (v->stage() >= g_.num_stages())
        fail(v->node(), "output-groups", "input stage " + std::to_string(v->stage()) + " has no output group");
      if (v->is_handle()) fail(v->node(), "handle", "graph input " + names_(v) + " is a Handle");
      if (!v->node()->inputs().empty()) fail(v->node(), "arity", "a Param has no inputs");
      check_uses_of(v);
    }
  }

  void check_uses_of(const Value* v) const {
    for (const Use& u : v->uses()) {
      if (!u.user || !owned_.count(u.user) || u.offset >= u.user->inputs().size() || u.user->inputs()[u.offset] != v)
        fail(v->node(), "use-list", "value " + names_(v) + " lists a use that is not an input edge");
      if ((!u.user->in_list() && !u.user->is<Return>()))
        fail(v->node(), "use-list", "value " + names_(v) + " is used by a node that is not in the graph's list");
    }
  }

  void check_node(const Node* n, const std::unordered_set<const Value*>& defined) const {
    const auto& ins = n->inputs();
    for (size_t i = 0; i < ins.size(); ++i) {
      const Value* v = ins[i];
      if (!v || v->owning_graph() != &g_)
        fail(n, "use-list", "input " + std::to_string(i) + " belongs to another graph");
      size_t count = 0;
      for (const Use& u : v->uses()) count += (u.user == n && u.offset == i);
      if (count != 1)
        fail(n, "use-list", "input " + std::to_string(i) + " (" + names_(v) + ") has " + std::to_string(count) +
                                " matching uses, expected exactly 1");
      if (!defined.count(v))
        fail(n, "def-before-use", "input " + names_(v) + " is not defined before this node");
      if (!n->is<Return>() && v->stage() > n->stage())
        fail(n, "stage", "input " + names_(v) + " has stage " + std::to_string(v->stage()) +
                             ", later than the node's");
      if (v->is_handle() && !(n->is<Eval>() && i + 1 == ins.size()))
        fail(n, "handle", "Handle " + names_(v) + " may only be the last input of an Eval");
    }
    for (const Value* o : n->outputs()) {
      check_uses_of(o);
      if (o->is_handle() && !((n->is<HostOp>() || n->is<Eval>()) && o->offset() + 1 == n->outputs().size()))
        fail(n, "handle", "Handle output " + names_(o) + " may only be the last output of a HostOp or Eval");
    }
    std::visit([&](const auto& k) { check_kind(n, k); }, n->kind());
  }

  // One overload per node kind (no catch-all: a new kind does not compile until linted).
  void arity(const Node* n, size_t ins, const char* what) const {
    if (n->inputs().size() != ins || n->outputs().size() != 1)
      fail(n, "arity", std::string(what) + " takes " + std::to_string(ins) + " inputs and has 1 output, found " +
                           std::to_string(n->inputs().size()) + " inputs and " +
                           std::to_string(n->outputs().size()) + " outputs");
  }
  void check_kind(const Node* n, const Param&) const { fail(n, "structure", "a Param is not a graph input"); }
  void check_kind(const Node*, const Return&) const {}  // its inputs are the graph outputs: any number
  void check_kind(const Node* n, const Constant& k) const {
    arity(n, 0, "Constant");
    if (!k.value.defined()) fail(n, "arity", "a Constant holds an undefined tensor");
  }
  void check_kind(const Node* n, const Undefined&) const { arity(n, 0, "Undefined"); }
  void check_kind(const Node* n, const Op& k) const {
    const OpSchema& s = k.schema();
    const std::string name(k.name());
    if (k.id() == OpId::unknown) {
      if (options_.allow_unknown_ops) return;
      fail(n, "unknown-op", "op '" + name +
                                "' is not in the op table (ops/op_schema.hpp), so the graph cannot run; "
                                "keep it with LintOptions::allow_unknown_ops (stagejit-run --allow-unknown-ops)");
    }
    const size_t ins = n->inputs().size(), outs = n->outputs().size();
    if (int64_t(ins) < s.min_inputs || (s.max_inputs >= 0 && int64_t(ins) > s.max_inputs))
      fail(n, "op-arity", name + " takes " + inputs_text(s) + ", found " + std::to_string(ins));
    // A binary op's scalar form (`mul[other=2](%x)`): its scalar is an attribute.
    if (std::string_view scalar = scalar_form_attribute(s); !scalar.empty() && int64_t(ins) < s.max_inputs &&
                                                             !k.attribute(scalar))
      fail(n, "op-arity", name + " with " + std::to_string(ins) + " input needs the attribute '" +
                              std::string(scalar) + "' (its scalar form), or " + std::to_string(s.max_inputs) +
                              " inputs");
    auto int_attribute = [&](std::string_view key) -> std::optional<int64_t> {
      const AttributeValue* v = k.attribute(key);
      if (!v) fail(n, "op-attribute", name + " needs the attribute '" + std::string(key) + "'");
      if (auto i = std::get_if<int64_t>(v)) return *i;
      return std::nullopt;
    };
    size_t min_outs = 1, max_outs = 1;
    switch (k.id()) {
      case OpId::chunk: {
        auto chunks = int_attribute("chunks");
        if (!chunks) fail(n, "op-attribute", "chunk's attribute 'chunks' must be an integer");
        if (*chunks < 1)
          fail(n, "op-attribute", "chunk's attribute 'chunks' is " + std::to_string(*chunks) + "; it must be >= 1");
        max_outs = size_t(*chunks);
        break;
      }
      case OpId::split: {
        const AttributeValue* v = k.attribute("split_size");
        if (!v) fail(n, "op-attribute", "split needs the attribute 'split_size'");
        if (auto list = std::get_if<std::vector<int64_t>>(v)) {
          for (int64_t size : *list)
            if (size < 0) fail(n, "op-attribute", "split's size " + std::to_string(size) + " is negative");
          min_outs = max_outs = list->size();
        } else if (auto size = std::get_if<int64_t>(v)) {
          if (*size < 0) fail(n, "op-attribute", "split's split_size " + std::to_string(*size) + " is negative");
          max_outs = size_t(-1);
        } else {
          fail(n, "op-attribute", "split's attribute 'split_size' must be an integer or an integer list");
        }
        break;
      }
      case OpId::dropout: max_outs = 2; break;  // result, and the mask when a backward needs it
      case OpId::max_pool2d_with_indices: min_outs = max_outs = 2; break;
      case OpId::native_batch_norm:
      case OpId::native_layer_norm:
      case OpId::native_group_norm: min_outs = max_outs = 3; break;
      default: break;
    }
    if (outs < min_outs || outs > max_outs) {
      std::string want = min_outs == max_outs ? std::to_string(min_outs)
                         : max_outs == size_t(-1) ? "at least " + std::to_string(min_outs)
                                                  : std::to_string(min_outs) + " to " + std::to_string(max_outs);
      fail(n, "op-arity", name + " has " + want + " output" + (max_outs == 1 ? "" : "s") + ", found " +
                              std::to_string(outs));
    }
    if (s.elementwise) check_elementwise_types(n, k);
  }

  static std::string inputs_text(const OpSchema& s) {
    if (s.max_inputs < 0) return "at least " + std::to_string(s.min_inputs) + " inputs";
    if (s.min_inputs == s.max_inputs)
      return std::to_string(s.min_inputs) + " input" + (s.min_inputs == 1 ? "" : "s");
    return std::to_string(s.min_inputs) + " to " + std::to_string(s.max_inputs) + " inputs";
  }

  // The attribute a binary op's one-input form takes its scalar from ("other" of
  // "other (scalar form), alpha (default 1)"), or empty.
  static std::string_view scalar_form_attribute(const OpSchema& s) {
    constexpr std::string_view mark = " (scalar form)";
    size_t at = s.attributes.find(mark);
    if (at == std::string_view::npos) return {};
    size_t begin = s.attributes.rfind(' ', at == 0 ? 0 : at - 1);
    begin = begin == std::string_view::npos ? 0 : begin + 1;
    return s.attributes.substr(begin, at - begin);
  }

  // Rule `declared-type` for an elementwise op: its inputs' declared sizes broadcast to
  // each declared output's sizes; a differentiable op (not `to`) on inputs of one
  // floating dtype keeps it.
  void check_elementwise_types(const Node* n, const Op& k) const {
    std::vector<const TensorType*> in;
    for (const Value* v : n->inputs()) {
      const TensorType* t = v->tensor_type();
      if (!t) return;  // a type not declared: nothing to check against
      in.push_back(t);
    }
    if (in.empty()) return;
    std::vector<int64_t> sizes;
    for (size_t i = 0; i < in.size(); ++i) {
      const auto& b = in[i]->sizes;
      std::vector<int64_t> out(std::max(sizes.size(), size_t(b.size())), 1);
      for (size_t d = 0; d < out.size(); ++d) {
        int64_t x = d < sizes.size() ? sizes[sizes.size() - 1 - d] : 1;
        int64_t y = d < b.size() ? b[b.size() - 1 - d] : 1;
        if (x != y && x != 1 && y != 1)
          fail(n, "declared-type", "the inputs' declared sizes " + inputs_types(n) + " do not broadcast");
        out[out.size() - 1 - d] = x == 1 ? y : x;
      }
      sizes = std::move(out);
    }
    // The dtype is checked when the op keeps its inputs' one floating dtype.
    const at::ScalarType dtype = in[0]->dtype;
    bool check_dtype = k.schema().differentiable && k.id() != OpId::to && at::isFloatingType(dtype);
    for (const TensorType* t : in) check_dtype = check_dtype && t->dtype == dtype;
    for (const Value* o : n->outputs()) {
      const TensorType* t = o->tensor_type();
      if (!t) continue;
      const bool sizes_ok = std::equal(t->sizes.begin(), t->sizes.end(), sizes.begin(), sizes.end());
      if (sizes_ok && (!check_dtype || t->dtype == dtype)) continue;
      std::string expect =
          check_dtype ? to_string(Type(TensorType::contiguous(dtype, sizes))) : "sizes " + sizes_text(sizes);
      fail(n, "declared-type", "output " + names_(o) + " is declared " + to_string(o->type()) + ", but " +
                                   std::string(k.name()) + " of " + inputs_types(n) + " gives " + expect);
    }
  }

  std::string inputs_types(const Node* n) const {
    std::string out = "(";
    for (size_t i = 0; i < n->inputs().size(); ++i)
      out += (i ? ", " : "") + names_(n->inputs()[i]) + " : " + to_string(n->inputs()[i]->type());
    return out + ")";
  }
  static std::string sizes_text(const std::vector<int64_t>& sizes) {
    std::string out = "[";
    for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
    return out + "]";
  }
  void check_kind(const Node* n, const Transpose&) const { arity(n, 1, "Transpose"); }
  void check_kind(const Node* n, const Reshape&) const { arity(n, 1, "Reshape"); }
  void check_kind(const Node* n, const Gemm&) const { arity(n, 3, "Gemm"); }
  void check_kind(const Node* n, const Eval&) const {
    if (n->inputs().empty() || !n->inputs().back()->is_handle())
      fail(n, "handle", "an Eval's last input must be the Handle it runs");
  }
  void check_kind(const Node* n, const HostOp& k) const {
    size_t t = 0, s = 0;
    for (char c : k.calling_convention) {
      if (c == 't') ++t;
      else if (c == 's') ++s;
      else fail(n, "calling-convention", "convention '" + k.calling_convention + "' may only contain 't' and 's'");
    }
    if (t != n->inputs().size() || s != k.scalars.size())
      fail(n, "calling-convention", "convention '" + k.calling_convention + "' expects " + std::to_string(t) +
                                        " inputs and " + std::to_string(s) + " scalars, found " +
                                        std::to_string(n->inputs().size()) + " and " +
                                        std::to_string(k.scalars.size()));
  }
  void check_kind(const Node* n, const FusionGroup& k) const {
    if (!k.subgraph) fail(n, "fusion-group", "the FusionGroup has no subgraph");
    const Graph& sub = *k.subgraph;
    if (sub.inputs().size() != n->inputs().size() || sub.outputs().size() != n->outputs().size())
      fail(n, "fusion-group", "subgraph has " + std::to_string(sub.inputs().size()) + " inputs and " +
                                  std::to_string(sub.outputs().size()) + " outputs, node has " +
                                  std::to_string(n->inputs().size()) + " and " +
                                  std::to_string(n->outputs().size()));
    if (sub.num_stages() != 1) fail(n, "fusion-group", "the subgraph must have a single stage");
    try {
      Linter(sub, options_).run();
    } catch (const LintError& e) {
      fail(n, "fusion-group", std::string("subgraph: ") + e.what());
    }
  }

  void check_outputs() const {
    const auto& counts = g_.stage_output_counts();
    size_t total = 0;
    for (size_t c : counts) total += c;
    if (total != g_.outputs().size())
      fail(g_.return_node(), "output-groups", "stage output counts sum to " + std::to_string(total) + " but there are " +
                                                  std::to_string(g_.outputs().size()) + " outputs");
    for (size_t i = 0; i < g_.outputs().size(); ++i) {
      const Value* v = g_.outputs()[i];
      size_t s = g_.output_stage(i);
      if (v->stage() > s)
        fail(g_.return_node(), "output-groups", "output " + names_(v) + " of stage " + std::to_string(v->stage()) +
                                                    " is in the group of stage " + std::to_string(s));
      if (v->is_handle()) fail(g_.return_node(), "handle", "graph output " + names_(v) + " is a Handle");
    }
  }

  void check_names() const {
    std::unordered_map<std::string, const Value*> seen;
    auto visit = [&](const Value* v) {
      if (!v->has_name()) return;
      auto [it, fresh] = seen.emplace(v->name(), v);
      if (!fresh) fail(v->node(), "unique-names", "name %" + v->name() + " is used by two values");
    };
    for (Value* v : g_.inputs()) visit(v);
    for (Node* n : g_.nodes())
      for (Value* v : n->outputs()) visit(v);
  }

  const Graph& g_;
  LintOptions options_;
  std::unordered_set<const Node*> owned_;
  NameTable names_;
};

}  // namespace detail

STAGEJIT_FUNC void lint(const Graph& graph, LintOptions options) { detail::Linter(graph, options).run(); }

}  // namespace stagejit::ir
