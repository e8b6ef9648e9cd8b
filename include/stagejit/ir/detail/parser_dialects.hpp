#pragma once
/// \file
/// The 2017 (seed-era) and 2018 text dialects of the IR: the tables and routines the
/// grammar of ir/parser.hpp (`detail::Parser`, the canonical form) dispatches to when it
/// meets one of their words or forms. Each routine that rejects text throws through the
/// parser's `Lexer` (`ParseError` at a token), as the grammar does.
///
/// Seed-era (2017) extras accepted:
/// - a `, uses = [...]` suffix after a node's inputs: `[%5.i0, %0.i1]` for a single
///   output, `[[...], [...]]` with one list per output. It is checked against the real
///   uses: the same number, and each `%N.iK` matches a distinct use at input `K` of the
///   node whose single output is `%N`; of the node whose outputs print as `%N.0, %N.1`
///   (the `%N.k` output style); of the return statement for `%0` when no value is
///   called `%0`; or, `%N` naming no value, of the node it is the hidden id of. The seed
///   numbered a node before its outputs and printed host ops, CppOps and fusion groups
///   through Select nodes, so `%N` is a user whose first output's number is above N: the
///   nearest such user (usually the node of `%N+1`).
/// - `^Name(scalars)(inputs)` without a calling convention: tensors first, then scalars.
///   Scalars as Python printed them: `True`, `False`, `None` (`NoneScalar`), tuples
///   `(3, 2)` and `(3,)` (int lists), bare words `mean` (strings).
/// - `CppOp[Name](inputs)` where Name is the C++ type as printed, spaces and `::`
///   included (`struct torch::autograd::Neg`, `N5torch8autograd3AddE`): an `Eval` for an
///   Eval class, a table op for an alias (below) when no Handle output is declared, else
///   a HostOp with convention `t` per input under the printed name.
/// - attribute values: unquoted words (strings: `note=from_pyop`) and tensor dumps
///   (`a= 1  1  1  1 [ CPUDoubleTensor{2,2} ]`: a tensor when its values fill its sizes,
///   else the dump's text as a string); 2018's `[ CPUDoubleType{2} ]` too, on one line
///   or across lines: whitespace inside a dump does not matter.
/// - a UTF-8 byte-order mark at the start of the text (skipped; elsewhere an error).
/// - `Transpose(%x)` without `perm`: reverse the axes (ONNX's default).
/// - `return (...)` without `|`: each output goes to the group of its producer's stage.
/// - `UNKNOWN_TYPE`, `fusion_group_N` with its `with fusion_group_N = graph(...)` block,
///   header inputs without commas, value names like `%3.1`.
/// 2018 extras: kinds with `aten::`, `prim::`, `onnx::` (`prim::Constant`,
/// `prim::FusionGroup_0[device=0]` and its `with` block, `FusionGroup_0`); nodes and the
/// return statement without `;`; `, scope: A/B[c]` suffixes (not kept); scalar tensor
/// attributes `{1}` (numbers; a Constant's value becomes a 0-dim tensor); the types
/// `Dynamic`, `Tensor` and `Float(*, *)` (`UNKNOWN_TYPE`). Control flow (`prim::If`,
/// `prim::Loop`, `block0()`) and non-tensor types (`int`, `float[]`, ...) are refused
/// with a ParseError naming them.
///
/// Note [Op aliases]: the op names of those eras are read as the table's ops, so they run
/// and fuse like their ATen twins and print canonically: `Add`/`Sub`/`Mul`/`Div`
/// (ONNX's `broadcast` dropped; a legacy `axis` broadcast is refused), `Neg`, `Tanh`,
/// `Sigmoid`, `Exp`, `Log`, `Relu`, `Sqrt`, `Abs`, `Reciprocal`, `MatMul`,
/// `Chunk[chunks, axis|dim]`, `Split[split, axis]` (-> `split[split_size, dim]`),
/// `Concat[axis]`/`Cat` (-> `cat[dim]`); the seed's Python autograd functions printed
/// `^Add()(..)`, `^MulConstant(c)`, `^AddConstant(c, inplace)`, `^Transpose(d0, d1)`,
/// `^View((sizes))` when they declare no Handle output. `Transpose` and `Gemm` are node
/// kinds of their own; `cross`, `threshold`, `select`, `split` are table ops.
///
#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/detail/lexer.hpp>
#include <stagejit/ir/detail/literals.hpp>
#include <stagejit/ir/detail/op_words.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/ops/op_schema.hpp>

namespace stagejit::ir::detail::dialects {

/// A seed-era use `%N.iK` of a `, uses = [...]` suffix (Parser::parse_uses), and the
/// suffix of one node, checked by `check_uses` once the graph body is read.
struct UseRef {
  Token token;
  std::string user;
  size_t offset;
};
struct PendingUses {
  Node* node;
  Token at;
  bool nested;
  std::vector<std::vector<UseRef>> per_output;
};

// The 2018 printer's scalar and list types (`int`, `float[]`, `Tensor[]`, ...).
inline bool is_non_tensor_type(std::string_view n) {
  for (std::string_view k : {"int", "float", "bool", "string", "str", "None", "NoneType", "Generator", "Device",
                             "Layout", "ScalarType", "Scalar", "Number", "Tuple", "List", "Optional", "Future"})
    if (n == k) return true;
  return false;
}

// A seed-era tensor dump (`1  1  1  1 [ CPUDoubleTensor{2,2} ]`, lexer.hpp) as a
// tensor when its values fill its sizes; else its text, kept as a string.
inline AttributeValue dump_value(const std::string& dump) {
  size_t open = dump.rfind('[');
  std::string_view body(dump.data(), open);
  std::string_view tail = std::string_view(dump).substr(open + 1);
  size_t lb = tail.find('{'), rb = tail.find('}');
  auto is_space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  std::string_view type_name = tail.substr(0, lb);
  while (!type_name.empty() && is_space(type_name.front())) type_name.remove_prefix(1);
  while (!type_name.empty() && is_space(type_name.back())) type_name.remove_suffix(1);
  for (std::string_view prefix : {"CPU", "CUDA", "torch.cuda.", "torch."})
    if (type_name.substr(0, prefix.size()) == prefix) type_name.remove_prefix(prefix.size());
  // "Tensor" (2017: CPUDoubleTensor) or "Type" (2018: CPUDoubleType); the lexer saw one.
  for (std::string_view suffix : {"Tensor", "Type"})
    if (type_name.size() >= suffix.size() && type_name.substr(type_name.size() - suffix.size()) == suffix) {
      type_name.remove_suffix(suffix.size());
      break;
    }
  std::optional<at::ScalarType> dtype = dtype_from_name(type_name);
  std::vector<int64_t> sizes;
  bool ok = dtype.has_value() && lb != std::string_view::npos && rb != std::string_view::npos;
  std::string_view dims = ok ? tail.substr(lb + 1, rb - lb - 1) : std::string_view();
  while (!dims.empty() && is_space(dims.back())) dims.remove_suffix(1);
  while (ok && !dims.empty()) {
    size_t comma = dims.find(',');
    int64_t v = 0;
    std::string item;
    for (char c : dims.substr(0, comma))
      if (!is_space(c)) item += c;
    ok = parse_number(item, v) && v >= 0 && v <= (int64_t(1) << 24);
    sizes.push_back(v);
    dims = comma == std::string_view::npos ? std::string_view() : dims.substr(comma + 1);
  }
  std::vector<std::string> values;
  for (size_t i = 0; ok && i < body.size();) {
    while (i < body.size() && std::isspace(static_cast<unsigned char>(body[i]))) ++i;
    size_t j = i;
    while (j < body.size() && !std::isspace(static_cast<unsigned char>(body[j]))) ++j;
    if (j > i) values.emplace_back(body.substr(i, j - i));
    i = j;
  }
  int64_t n = 1;
  for (int64_t s : sizes) ok = ok && !__builtin_mul_overflow(n, s, &n);
  if (ok && int64_t(values.size()) == n) {
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(*dtype));
    bool filled = true;
    for (int64_t i = 0; i < n && filled; ++i) filled = set_element(t, i, values[i]);
    if (filled) return t;
  }
  return dump;  // a layout this reader does not know: the text, printed back quoted
}

inline bool is_eval_name(std::string_view n) {
  return n == "Eval" || n == "N5torch8autograd4EvalE" || n == "torch_autograd_Eval";
}

// The class name inside a CppOp's C++ type: `N5torch8autograd3AddE` (Itanium-mangled),
// `struct torch::autograd::Neg` (MSVC's printout), `torch_autograd_Eval`, `ConvForward`.
inline std::string cpp_class_name(std::string_view n) {
  if (n.size() > 2 && n.front() == 'N' && n.back() == 'E') {
    std::string_view rest = n.substr(1, n.size() - 2), last;
    while (!rest.empty() && std::isdigit(static_cast<unsigned char>(rest.front()))) {
      size_t len = 0, k = 0;
      while (k < rest.size() && std::isdigit(static_cast<unsigned char>(rest[k]))) len = len * 10 + size_t(rest[k++] - '0');
      if (len == 0 || k + len > rest.size()) return std::string(n);
      last = rest.substr(k, len);
      rest.remove_prefix(k + len);
    }
    if (rest.empty() && !last.empty()) return std::string(last);
    return std::string(n);
  }
  size_t colons = n.rfind("::");
  if (colons != std::string_view::npos) return std::string(n.substr(colons + 2));
  for (std::string_view kw : {"struct ", "class "})
    if (n.substr(0, kw.size()) == kw) return std::string(n.substr(kw.size()));
  return std::string(n);
}

// `fusion_group_N`, and the 2018 spellings `FusionGroup_N`, `prim::FusionGroup_N`:
// the canonical name, or nothing.
inline std::optional<std::string> fusion_ref(std::string_view name) {
  for (std::string_view prefix : {"fusion_group_", "FusionGroup_", "prim::FusionGroup_"})
    if (detail::is_fusion_ref(name, prefix)) return "fusion_group_" + std::string(name.substr(prefix.size()));
  return std::nullopt;
}

// The kind a 2018 name (`aten::mul`, `prim::Constant`, `onnx::Add`) stands for
// without its namespace; other namespaces are kept (an unknown op). One namespace:
// what remains may not start another (`prim::onnx::Add`) nor be a fusion group's
// name (`aten::FusionGroup_0`), which the printer could not give back as they were.
inline std::string_view strip_namespace(const Lexer& lex, const Token& t) {
  std::string_view name = t.text;
  for (std::string_view ns : detail::ir_namespaces) {
    if (name.substr(0, ns.size()) != ns) continue;
    std::string_view bare = name.substr(ns.size());
    for (std::string_view inner : detail::ir_namespaces)
      if (bare.substr(0, inner.size()) == inner)
        lex.fail(t, "'" + t.text + "' has two namespaces; expected one of aten::, prim::, onnx:: before a kind");
    if (bare == "CppOp" || detail::is_fusion_ref(bare, "fusion_group_") || detail::is_fusion_ref(bare, "FusionGroup_"))
      lex.fail(t, "'" + t.text + "': " + std::string(bare) + " takes no namespace" +
                      (bare == "CppOp" ? "" : " (a fusion group is prim::FusionGroup_N)"));
    return bare;
  }
  return name;
}

inline std::string name_text(const Token& t) { return t.text; }

// Seed-era and ONNX op names onto the op table, attributes renamed (Note [Op aliases]
// in the file comment). Returns nothing for a name that is not an alias.
inline std::optional<Op> alias_op(const Lexer& lex, const Token& t, std::string_view name, AttributeList attrs,
                                  const std::vector<Token>& attr_tokens) {
  const detail::OpAlias* found = nullptr;
  for (const detail::OpAlias& a : detail::op_aliases)
    if (a.from == name) found = &a;
  if (!found) return std::nullopt;
  AttributeList out;
  for (size_t i = 0; i < attrs.size(); ++i) {
    auto& [key, value] = attrs[i];
    if (key == "broadcast") continue;  // ONNX's opt-in flag: ATen always broadcasts
    if (key == "axis") {
      if (found->to == OpId::add || found->to == OpId::sub || found->to == OpId::mul || found->to == OpId::div)
        lex.fail(attr_tokens[i], name_text(t) + ": legacy ONNX broadcasting from an 'axis' is not supported "
                                              "(ATen broadcasting aligns trailing dimensions)");
      out.emplace_back("dim", std::move(value));
      continue;
    }
    if (key == "split" && found->to == OpId::split) {
      out.emplace_back("split_size", std::move(value));
      continue;
    }
    out.emplace_back(std::move(key), std::move(value));
  }
  // ATen's argument order: chunk(chunks, dim), split(split_size, dim).
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    auto rank = [](const std::string& k) { return k == "dim" ? 1 : 0; };
    return rank(a.first) < rank(b.first);
  });
  return Op(found->to, std::move(out));
}

// Whether an aliased op takes `n` inputs: its arity in the table, and two for the binary
// arithmetic ops unless their scalar operand (`other`) is an attribute.
inline bool alias_arity_fits(const Op& op, size_t n) {
  const OpSchema& s = op.schema();
  if (int(n) < s.min_inputs || (s.max_inputs >= 0 && int(n) > s.max_inputs)) return false;
  const bool binary = op.id() == OpId::add || op.id() == OpId::sub || op.id() == OpId::mul || op.id() == OpId::div;
  return !binary || n == 2 || op.attribute("other");
}
inline std::string arity_text(const Op& op) {
  const OpSchema& s = op.schema();
  if (op.id() == OpId::add || op.id() == OpId::sub || op.id() == OpId::mul || op.id() == OpId::div)
    return "2 inputs (or 1 with the attribute 'other')";
  if (s.max_inputs < 0) return "at least " + std::to_string(s.min_inputs) + " inputs";
  if (s.min_inputs == s.max_inputs) return std::to_string(s.min_inputs) + " input" + (s.min_inputs == 1 ? "" : "s");
  return std::to_string(s.min_inputs) + " to " + std::to_string(s.max_inputs) + " inputs";
}

// The seed era's Python autograd functions (torch.autograd._functions, 2017) printed
// as `^Name(scalars)(inputs)`, onto the op table: the tensor-tensor arithmetic and
// pointwise ones, `AddConstant(c[, inplace])` and its kin, `Transpose(d0, d1)`,
// `View(sizes)`. Nothing for another name or other arguments.
inline std::optional<Op> host_alias(std::string_view name, const std::vector<Scalar>& scalars, size_t num_inputs) {
  struct Pointwise {
    std::string_view from;
    OpId to;
    size_t inputs;
  };
  static constexpr Pointwise pointwise[] = {
      {"Add", OpId::add, 2},  {"Sub", OpId::sub, 2},         {"Mul", OpId::mul, 2}, {"Div", OpId::div, 2},
      {"Neg", OpId::neg, 1},  {"Tanh", OpId::tanh, 1},       {"Sigmoid", OpId::sigmoid, 1},
      {"Exp", OpId::exp, 1},  {"Log", OpId::log, 1},
  };
  for (const Pointwise& p : pointwise)
    if (p.from == name && scalars.empty() && num_inputs == p.inputs) return Op(p.to);
  auto number = [](const Scalar& s) -> std::optional<AttributeValue> {
    if (auto d = std::get_if<double>(&s)) return AttributeValue(*d);
    if (auto i = std::get_if<int64_t>(&s)) return AttributeValue(*i);
    return std::nullopt;
  };
  // `inplace` (a trailing bool) changes where the result goes, not its value.
  const bool inplace_flag = scalars.size() == 2 && std::holds_alternative<bool>(scalars[1]);
  struct Constant {
    std::string_view from;
    OpId to;
  };
  // Not SubConstant / DivConstant: the seed printed `2 - x` (tensor second) as it printed
  // `x - 2`, so their text does not say which they compute; they stay host ops.
  static constexpr Constant constants[] = {{"AddConstant", OpId::add}, {"MulConstant", OpId::mul}};
  for (const Constant& c : constants) {
    if (c.from != name || num_inputs != 1 || scalars.empty() || (scalars.size() > 1 && !inplace_flag)) continue;
    if (auto v = number(scalars[0])) return Op(c.to, {{"other", *v}});
  }
  if (name == "Transpose" && num_inputs == 1 && scalars.size() == 2 && std::holds_alternative<int64_t>(scalars[0]) &&
      std::holds_alternative<int64_t>(scalars[1]))
    return Op(OpId::transpose, {{"dim0", std::get<int64_t>(scalars[0])}, {"dim1", std::get<int64_t>(scalars[1])}});
  if (name == "View" && num_inputs == 1 && scalars.size() == 1 && std::holds_alternative<std::vector<int64_t>>(scalars[0]))
    return Op(OpId::view, {{"size", std::get<std::vector<int64_t>>(scalars[0])}});
  return std::nullopt;
}

// Control flow of the 2018 printer (`prim::If` with `block0()`, `prim::Loop`).
inline void refuse_control_flow(const Lexer& lex, const Token& t, std::string_view bare) {
  if (bare == "If" || bare == "Loop")
    lex.fail(t, "control flow ('" + t.text + "' with blocks) is not supported: stagejit graphs are straight-line");
}

inline void check_uses(const Lexer& lex, Graph& g, const std::unordered_map<std::string, Value*>& values,
                       const std::vector<PendingUses>& uses) {
  if (uses.empty()) return;
  // The number each value has in the file (`%12` -> 12), for hidden ids.
  std::unordered_map<const Value*, int64_t> file_number;
  for (const auto& [name, value] : values) {
    int64_t n = 0;
    if (parse_number(name, n)) file_number[value] = n;
  }
  for (const auto& p : uses) {
    const auto& outs = p.node->outputs();
    if (!p.nested && outs.size() != 1)
      lex.fail(p.at, "a node with " + std::to_string(outs.size()) + " outputs needs one use list per output ([[...], ...])");
    if (p.per_output.size() != outs.size())
      lex.fail(p.at, "uses lists " + std::to_string(p.per_output.size()) + " outputs but the node has " +
                         std::to_string(outs.size()));
    for (size_t o = 0; o < outs.size(); ++o) {
      Value* v = outs[o];
      const auto& listed = p.per_output[o];
      if (listed.size() != v->uses().size())
        lex.fail(p.at, "uses of output " + std::to_string(o) + " list " + std::to_string(listed.size()) +
                           " uses but it has " + std::to_string(v->uses().size()));
      std::vector<bool> matched(v->uses().size(), false);
      for (const UseRef& r : listed) {
        auto it = values.find(r.user);
        Node* user = nullptr;
        int64_t hidden_id = -1;
        if (it != values.end()) {
          if (it->second->node()->outputs().size() != 1)
            lex.fail(r.token, "use %" + r.token.text + " names an output of a multi-output node, not a user node");
          user = it->second->node();
        } else if (auto dotted = values.find(r.user + ".0"); dotted != values.end()) {
          // The `%N.k` output style (2017): a node's outputs print as `%N.0, %N.1`, and
          // `%N.iK` names that node, by the number its outputs carry.
          user = dotted->second->node();
        } else if (r.user == "0") {
          user = g.return_node();
        } else if (!parse_number(r.user, hidden_id) || hidden_id < 0) {
          lex.fail(r.token, "use %" + r.token.text + " names no value and no node of this graph");
        }
        // A hidden id (`%N` naming no value): the seed numbered a node when it made it,
        // then its outputs (Select nodes), so `%N` is a user node whose first output's
        // number is above N; of those, the nearest one (usually `%N+1`).
        size_t best = v->uses().size();
        int64_t best_first = 0;
        for (size_t k = 0; k < v->uses().size(); ++k) {
          const Use& u = v->uses()[k];
          if (matched[k] || u.offset != r.offset) continue;
          if (user) {
            if (u.user != user) continue;
            best = k;
            break;
          }
          if (u.user->is<Return>() || u.user->outputs().empty()) continue;
          auto first = file_number.find(u.user->outputs()[0]);
          if (first == file_number.end() || first->second <= hidden_id) continue;
          if (best == v->uses().size() || first->second < best_first) best = k, best_first = first->second;
        }
        const bool ok = best < v->uses().size();
        if (ok) matched[best] = true;
        if (!ok) lex.fail(r.token, "use %" + r.token.text + " does not match any use of this value");
      }
    }
  }
}

}  // namespace stagejit::ir::detail::dialects
