#pragma once
/// \file
/// Bodies of ir/parser.hpp (core/config.hpp): the grammar, `detail::Parser`, and `parse`;
/// compiled once in src/compiled_bodies.cpp, or inline in every translation unit of a
/// header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/parser.hpp>
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <stagejit/core/error.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/detail/lexer.hpp>
#include <stagejit/ir/detail/literals.hpp>
#include <stagejit/ir/detail/op_words.hpp>
#include <stagejit/ir/detail/parser_dialects.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>

namespace stagejit::ir {

namespace detail {

class Parser {
 public:
  explicit Parser(std::string_view text) : lex_(text) {}

  std::shared_ptr<Graph> parse_file() {
    auto g = parse_graph(0);
    const Token& t = lex_.peek();
    if (t.kind != TokenKind::End) fail(t, "expected end of input after the graph, found " + t.describe());
    return g;
  }

 private:
  static constexpr size_t max_depth = 32;

  struct Scope {
    std::unordered_map<std::string, Value*> values;
    std::vector<dialects::PendingUses> uses;
    std::map<std::string, Node*> fusion_refs;  // fusion_group_N -> node, until its `with`
  };
  struct Literal {
    AttributeValue value;
    bool is_bool = false;
    bool is_none = false;  // Python's `None` (host op scalars only)
  };

  [[noreturn]] void fail(const Token& t, const std::string& msg) { lex_.fail(t, msg); }

  Token expect_punct(char c, std::string_view what) {
    Token t = lex_.next();
    if (!t.is(c)) fail(t, "expected '" + std::string(1, c) + "' " + std::string(what) + ", found " + t.describe());
    return t;
  }
  Token expect_ident(std::string_view what) {
    Token t = lex_.next();
    if (t.kind != TokenKind::Ident) fail(t, "expected " + std::string(what) + ", found " + t.describe());
    return t;
  }
  Token expect_keyword(std::string_view kw) {
    Token t = lex_.next();
    if (!t.is_ident(kw)) fail(t, "expected '" + std::string(kw) + "', found " + t.describe());
    return t;
  }
  bool accept(char c) {
    if (lex_.peek().is(c)) {
      lex_.next();
      return true;
    }
    return false;
  }
  int64_t parse_int(const Token& t, std::string_view what) {
    int64_t v = 0;
    if (t.kind != TokenKind::Number || !parse_number(t.text, v))
      fail(t, "expected " + std::string(what) + " (an integer), found " + t.describe());
    return v;
  }

  // `-------- stage K --------`
  size_t parse_separator(size_t current) {
    lex_.next();  // the opening dashes
    expect_keyword("stage");
    Token num = lex_.next();
    int64_t k = parse_int(num, "a stage number");
    // Graph::ensure_stage's limit, checked here so the error points at the number.
    if (k < 0 || k >= (int64_t(1) << 20))
      fail(num, "stage number " + num.text + " is out of range (0 to " + std::to_string((1 << 20) - 1) + ")");
    Token close = lex_.next();
    if (close.kind != TokenKind::Dashes) fail(close, "expected '--------' after the stage number, found " + close.describe());
    if (size_t(k) <= current)
      fail(num, "expected a stage after " + std::to_string(current) + " (stages only increase), found " + num.text);
    return size_t(k);
  }

  Type parse_type() {
    Token t = lex_.next();
    if (t.kind != TokenKind::Ident) fail(t, "expected a type (e.g. Float(2, 3), Handle), found " + t.describe());
    if (t.text == "Handle") return HandleType{};
    // 2018: `Dynamic` and `Tensor` are tensors of unknown dtype and sizes.
    if (t.text == "UNKNOWN_TYPE" || t.text == "Dynamic" || t.text == "Tensor") return UnknownType{};
    auto dtype = dtype_from_name(t.text);
    if (!dtype) {
      if (dialects::is_non_tensor_type(t.text))
        fail(t, "non-tensor type '" + t.text + "' is not supported: stagejit graphs hold tensors and handles only");
      fail(t, "unknown type '" + t.text + "'; expected a dtype such as Float, Handle, UNKNOWN_TYPE or Dynamic");
    }
    // 2018: `Float(*, *)`, a tensor of unknown sizes (its dtype is not kept).
    if (lex_.peek().is('(')) {
      lex_.next();
      if (lex_.peek().is('*')) {
        for (;;) {
          Token star = lex_.next();
          if (!star.is('*')) fail(star, "expected '*' in unknown sizes, found " + star.describe());
          Token sep = lex_.next();
          if (sep.is(')')) return UnknownType{};
          if (!sep.is(',')) fail(sep, "expected ',' or ')' in the sizes, found " + sep.describe());
        }
      }
      pending_open_ = true;
    }
    auto [sizes, marks, device] = parse_dims();
    check_strides_fit(t, sizes, marks);
    return TensorType{*dtype, DimList(sizes), ir::parse_strides(sizes, marks), device};
  }

  // The strides `parse_strides` rebuilds for these sizes and marks, and size * stride of
  // every dimension, must fit in 64 bits (as in ATen); else the type describes no tensor.
  void check_strides_fit(const Token& type, const std::vector<int64_t>& sizes, const std::vector<bool>& marks) {
    int64_t stride = 1, span = 0;
    for (size_t d = sizes.size(); d-- > 0;) {
      bool overflow = marks[d] && stride != 0 && __builtin_mul_overflow(stride, 2, &stride);
      if (marks[d] && stride == 0) stride = 1;
      if (overflow || __builtin_mul_overflow(sizes[d], stride, &span))
        fail(type, "tensor type sizes " + sizes_text(sizes) + " overflow: their strides do not fit in 64 bits");
      stride = span;
    }
  }

  // `(3, 4!, device=cuda:0)`
  std::tuple<std::vector<int64_t>, std::vector<bool>, at::Device> parse_dims() {
    if (pending_open_) pending_open_ = false;  // parse_type read the '(' already
    else expect_punct('(', "to open the sizes");
    std::vector<int64_t> sizes;
    std::vector<bool> marks;
    at::Device device = at::kCPU;
    if (accept(')')) return {sizes, marks, device};
    for (;;) {
      Token t = lex_.next();
      if (t.is_ident("device")) {
        expect_punct('=', "after 'device'");
        Token d = expect_ident("a device (cpu, cuda:0)");
        std::string spec = d.text;
        if (accept(':')) {
          // ATen keeps a device index in 8 bits: a larger one would wrap (and print back
          // as a negative index that does not parse).
          Token index = lex_.next();
          int64_t i = parse_int(index, "a device index");
          if (i < 0 || i > std::numeric_limits<c10::DeviceIndex>::max())
            fail(index, "device index " + index.text + " is out of range (0 to " +
                            std::to_string(int(std::numeric_limits<c10::DeviceIndex>::max())) + ")");
          spec += ":" + std::to_string(i);
        }
        try {
          device = at::Device(spec);
        } catch (const std::exception&) {
          fail(d, "invalid device '" + spec + "'");
        }
        expect_punct(')', "after the device");
        return {sizes, marks, device};
      }
      int64_t s = parse_int(t, "a size");
      if (s < 0) fail(t, "size " + t.text + " is negative");
      sizes.push_back(s);
      marks.push_back(accept('!'));
      Token sep = lex_.next();
      if (sep.is(')')) return {sizes, marks, device};
      if (!sep.is(',')) fail(sep, "expected ',' or ')' in the sizes, found " + sep.describe());
    }
  }

  Literal parse_literal(bool in_list = false) {
    Token t = lex_.next();
    if (t.kind == TokenKind::Number) {
      int64_t i;
      if (parse_number(t.text, i)) return {AttributeValue(i)};
      double d;
      if (t.text.find_first_of(".eEn") != std::string::npos) {
        std::string_view body = t.text;
        if (!body.empty() && (body[0] == '+' || body[0] == '-')) body.remove_prefix(1);
        if (body == "inf") return {AttributeValue(t.text[0] == '-' ? -INFINITY : INFINITY)};
        if (body == "nan") return {AttributeValue(double(NAN))};
        if (parse_number(t.text, d)) return {AttributeValue(d)};
      }
      fail(t, "number " + t.text + " is out of range");
    }
    if (t.kind == TokenKind::String) return {AttributeValue(t.text)};
    if (t.is('<')) fail(t, "elided values such as <Tensor> or <Graph> cannot be parsed");
    // 2018: a scalar tensor attribute printed `{1}` or `{0.5}`: its number.
    if (t.is('{')) {
      Token v = lex_.next();
      if (v.kind != TokenKind::Number) fail(v, "expected a number in a scalar tensor {...}, found " + v.describe());
      Literal lit = number_literal(v);
      expect_punct('}', "to close the scalar tensor");
      return lit;
    }
    // `[...]` lists; Python tuples `(3, 2)` and `(3,)` (seed-era host op scalars).
    if (t.is('[') || t.is('(')) {
      const char close = t.is('[') ? ']' : ')';
      if (in_list) fail(t, "nested lists are not supported");
      std::vector<Literal> items;
      std::vector<Token> at;
      if (!accept(close)) {
        for (;;) {
          at.push_back(lex_.peek());
          items.push_back(parse_literal(true));
          Token sep = lex_.next();
          if (sep.is(close)) break;
          if (!sep.is(',')) fail(sep, "expected ',' or '" + std::string(1, close) + "' in a list, found " + sep.describe());
          if (close == ')' && accept(')')) break;  // `(3,)`
        }
      }
      return {make_list(items, at, t)};
    }
    if (t.kind == TokenKind::Ident) {
      if (t.text == "true" || t.text == "false") return {AttributeValue(int64_t(t.text == "true")), true};
      if (t.text == "True" || t.text == "False") return {AttributeValue(int64_t(t.text == "True")), true};
      if (t.text == "None") return {AttributeValue(int64_t(0)), false, true};
      if (t.text == "inf") return {AttributeValue(double(INFINITY))};
      if (t.text == "nan") return {AttributeValue(double(NAN))};
      for (std::string_view k : {"fs", "is", "ss", "ts", "gs"}) {
        if (t.text != k) continue;
        expect_punct('[', "after a list kind");
        expect_punct(']', "(a kind-prefixed list is empty)");
        if (k == "fs") return {AttributeValue(std::vector<double>{})};
        if (k == "is") return {AttributeValue(std::vector<int64_t>{})};
        if (k == "ss") return {AttributeValue(std::vector<std::string>{})};
        if (k == "ts") return {AttributeValue(std::vector<at::Tensor>{})};
        return {AttributeValue(std::vector<std::shared_ptr<Graph>>{})};
      }
      if (auto dtype = dtype_from_name(t.text); dtype && lex_.peek().is('('))
        return {AttributeValue(parse_tensor(t, *dtype))};
      // Seed era: unquoted strings (`note=from_pyop`, a host op's `(mean)`).
      return {AttributeValue(t.text)};
    }
    fail(t, "expected a value (number, string, list or tensor literal), found " + t.describe());
  }

  Literal number_literal(const Token& t) {
    int64_t i;
    if (parse_number(t.text, i)) return {AttributeValue(i)};
    double d;
    if (parse_number(t.text, d)) return {AttributeValue(d)};
    fail(t, "number " + t.text + " is out of range");
  }

  AttributeValue make_list(const std::vector<Literal>& items, const std::vector<Token>& at, const Token& open) {
    if (items.empty()) return std::vector<int64_t>{};
    auto all = [&](auto pred) {
      for (auto& i : items)
        if (!pred(i.value)) return false;
      return true;
    };
    auto is_num = [](const AttributeValue& v) { return v.index() == 0 || v.index() == 2; };
    if (all([](auto& v) { return std::holds_alternative<int64_t>(v); })) {
      std::vector<int64_t> out;
      for (auto& i : items) out.push_back(std::get<int64_t>(i.value));
      return out;
    }
    if (all(is_num)) {
      std::vector<double> out;
      for (auto& i : items) out.push_back(*attribute_as<double>(i.value));
      return out;
    }
    if (all([](auto& v) { return std::holds_alternative<std::string>(v); })) {
      std::vector<std::string> out;
      for (auto& i : items) out.push_back(std::get<std::string>(i.value));
      return out;
    }
    if (all([](auto& v) { return std::holds_alternative<at::Tensor>(v); })) {
      std::vector<at::Tensor> out;
      for (auto& i : items) out.push_back(std::get<at::Tensor>(i.value));
      return out;
    }
    for (size_t k = 1; k < items.size(); ++k)
      if (items[k].value.index() != items[0].value.index() &&
          !(is_num(items[k].value) && is_num(items[0].value)))
        fail(at[k], "list elements must all be numbers, strings or tensors");
    fail(open, "list elements must all be numbers, strings or tensors");
  }

  // `Float(2, 2){1.0, 2.0, 3.0, 4.0}` after the dtype name. Sizes and device are checked
  // and the values counted before anything is allocated, so a literal's declared sizes
  // never allocate more than its text holds.
  at::Tensor parse_tensor(const Token& name, at::ScalarType dtype) {
    auto [sizes, marks, device] = parse_dims();
    for (size_t d = 0; d < marks.size(); ++d)
      if (marks[d]) fail(name, "a tensor literal's sizes cannot carry '!'");
    // The element count, and the extent in bytes of a contiguous tensor of these sizes
    // (zero sizes counted as 1: ATen's strides must fit too), without overflow.
    int64_t n = 1, extent = static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t s : sizes)
      if (__builtin_mul_overflow(n, s, &n) || __builtin_mul_overflow(extent, std::max<int64_t>(s, 1), &extent))
        fail(name, "tensor literal sizes " + sizes_text(sizes) + " overflow: " + std::string(c10::toString(dtype)) +
                       " tensors of these sizes do not fit in 64-bit sizes and strides");
    check_literal_device(name, device);
    Token open = expect_punct('{', "to open the tensor values");
    std::vector<Token> values;
    if (!accept('}')) {
      for (;;) {
        Token v = lex_.next();
        if (int64_t(values.size()) >= n) fail(v, "tensor literal has more than " + std::to_string(n) + " values");
        if (v.kind != TokenKind::Number && v.kind != TokenKind::Ident)
          fail(v, "expected a " + std::string(c10::toString(dtype)) + " value, found " + v.describe());
        values.push_back(std::move(v));
        Token sep = lex_.next();
        if (sep.is('}')) break;
        if (!sep.is(',')) fail(sep, "expected ',' or '}' in tensor values, found " + sep.describe());
      }
    }
    if (int64_t(values.size()) != n)
      fail(open, "tensor literal of " + std::to_string(n) + " elements has " + std::to_string(values.size()) +
                     " values");
    at::Tensor t;
    try {
      t = at::empty(sizes, at::TensorOptions().dtype(dtype));
    } catch (const c10::Error& e) {
      fail(name, "cannot allocate the tensor literal: " + first_line(e.what_without_backtrace()));
    }
    for (int64_t i = 0; i < n; ++i)
      if (!set_element(t, i, values[i].text))
        fail(values[i], "expected a " + std::string(c10::toString(dtype)) + " value, found " + values[i].describe());
    if (device.is_cpu()) return t;
    try {
      return t.to(device);
    } catch (const c10::Error& e) {
      fail(name, "cannot place the tensor literal on " + device.str() + ": " + first_line(e.what_without_backtrace()));
    }
  }

  // A tensor literal's device must be one this build and machine can hold: the CPU, or a
  // CUDA device that exists.
  void check_literal_device(const Token& name, const at::Device& device) {
    if (device.is_cpu()) return;
    if (device.is_cuda()) {
      if (!at::hasCUDA())
        fail(name, "tensor literal on " + device.str() +
                       ": no CUDA device is available to hold it (at::hasCUDA() is false)");
      if (device.has_index() && size_t(device.index()) >= at::getNumGPUs())
        fail(name, "tensor literal on " + device.str() + ": there are only " + std::to_string(at::getNumGPUs()) +
                       " CUDA devices");
      return;
    }
    fail(name, "tensor literal on " + device.str() + ": literals hold CPU or CUDA tensors only");
  }

  static std::string sizes_text(const std::vector<int64_t>& sizes) {
    std::string out = "[";
    for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
    return out + "]";
  }

  static std::string first_line(std::string_view text) { return std::string(text.substr(0, text.find('\n'))); }

  template <class K>
  K attribute_kind_from(const Token& op, AttributeList attrs, const std::vector<Token>& attr_tokens) {
    K k{};
    std::vector<bool> used(attrs.size(), false);
    boost::hana::for_each(boost::hana::accessors<K>(), [&](auto acc) {
      std::string member = boost::hana::to<const char*>(boost::hana::first(acc));
      using M = std::decay_t<decltype(boost::hana::second(acc)(k))>;
      for (size_t i = 0; i < attrs.size(); ++i) {
        if (attrs[i].first != member) continue;
        auto v = attribute_as<M>(attrs[i].second);
        if constexpr (std::is_same_v<M, at::Tensor>) {
          // 2018: `prim::Constant[value={1}]`, a scalar tensor.
          if (!v) {
            if (auto d = std::get_if<double>(&attrs[i].second)) v = at::scalar_tensor(*d, at::kDouble);
            else if (auto n = std::get_if<int64_t>(&attrs[i].second)) v = at::scalar_tensor(*n, at::kLong);
          }
        }
        if (!v)
          fail(attr_tokens[i], "attribute '" + member + "' of " + op.text + " must be of kind " +
                                   std::string(attribute_kind(AttributeValue(M{}))) + ", found " +
                                   std::string(attribute_kind(attrs[i].second)));
        boost::hana::second(acc)(k) = std::move(*v);
        used[i] = true;
        return;
      }
      if constexpr (std::is_same_v<K, Transpose>) return;  // no perm: reverse the axes (ONNX)
      fail(op, op.text + " needs attribute '" + member + "'");
    });
    for (size_t i = 0; i < attrs.size(); ++i) {
      // ONNX's opt-in broadcasting flag on a seed-era Gemm: ATen always broadcasts C.
      if constexpr (std::is_same_v<K, Gemm>)
        if (attrs[i].first == "broadcast") continue;
      if (!used[i]) fail(attr_tokens[i], op.text + " has no attribute '" + attrs[i].first + "'");
    }
    return k;
  }

  std::vector<Value*> parse_input_list(Scope& scope) {
    expect_punct('(', "to open the inputs");
    std::vector<Value*> inputs;
    if (accept(')')) return inputs;
    for (;;) {
      Token t = lex_.next();
      if (t.kind != TokenKind::ValueRef) fail(t, "expected an input value (%name), found " + t.describe());
      auto it = scope.values.find(t.text);
      if (it == scope.values.end()) fail(t, "undefined value %" + t.text);
      inputs.push_back(it->second);
      Token sep = lex_.next();
      if (sep.is(')')) return inputs;
      if (!sep.is(',')) fail(sep, "expected ',' or ')' after an input, found " + sep.describe());
    }
  }

  // A quoted op name is printable text: not empty, no control characters (a NUL would cut
  // every message that names the op).
  void check_quoted_name(const Token& t) {
    if (t.kind != TokenKind::String) return;
    if (t.text.empty()) fail(t, "an op name cannot be empty");
    for (char c : t.text)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
        fail(t, "an op name cannot hold control characters");
  }

  // `[name=value, ...]` after an op name (nothing when no `[` follows); the name tokens
  // go to `attr_tokens` for messages.
  AttributeList parse_attrs(std::vector<Token>& attr_tokens) {
    AttributeList attrs;
    if (!accept('[')) return attrs;
    if (accept(']')) return attrs;
    for (;;) {
      Token name = expect_ident("an attribute name");
      for (auto& [k, v] : attrs)
        if (k == name.text) fail(name, "attribute '" + name.text + "' is given twice");
      expect_punct('=', "after the attribute name");
      attr_tokens.push_back(name);
      if (auto dump = lex_.tensor_dump()) {  // seed era: `a= 1  1 [ CPUDoubleTensor{2} ]`
        attrs.emplace_back(name.text, dialects::dump_value(*dump));
      } else {
        Literal lit = parse_literal();
        if (lit.is_none) fail(name, "attribute '" + name.text + "' is None: no attribute kind holds None");
        attrs.emplace_back(name.text, std::move(lit.value));
      }
      Token sep = lex_.next();
      if (sep.is(']')) return attrs;
      if (!sep.is(',')) fail(sep, "expected ',' or ']' after an attribute, found " + sep.describe());
    }
  }

  // The op and inputs of one statement; returns the node (unlisted). `handle_output`:
  // the statement declares a Handle output (a seed-era CppOp with its backward).
  Node* parse_op(Graph& g, Scope& scope, bool handle_output) {
    Token t = lex_.next();
    if (t.is('^')) {
      Token name = lex_.next();  // an identifier, or a quoted name (printer-inl.hpp, op_name_text)
      if (name.kind != TokenKind::Ident && name.kind != TokenKind::String)
        fail(name, "expected a host op name after '^', found " + name.describe());
      check_quoted_name(name);
      std::optional<std::string> conv;
      Token conv_tok;
      if (accept('[')) {
        conv = "";
        if (!lex_.peek().is(']')) {
          conv_tok = expect_ident("a calling convention (letters t and s)");
          conv = conv_tok.text;
        }
        expect_punct(']', "after the calling convention");
        for (char c : *conv)
          if (c != 't' && c != 's') fail(conv_tok, "calling convention '" + *conv + "' may only contain 't' and 's'");
      }
      expect_punct('(', "to open the scalar arguments");
      std::vector<Scalar> scalars;
      if (!accept(')')) {
        for (;;) {
          Token at = lex_.peek();
          Literal lit = parse_literal();
          scalars.push_back(to_scalar(lit, at));
          Token sep = lex_.next();
          if (sep.is(')')) break;
          if (!sep.is(',')) fail(sep, "expected ',' or ')' after a scalar argument, found " + sep.describe());
        }
      }
      auto inputs = parse_input_list(scope);
      if (!conv) {
        // Seed era (no calling convention): the autograd functions of torch of that time
        // without a Handle output are ops of the table.
        if (!handle_output)
          if (auto op = dialects::host_alias(name.text, scalars, inputs.size())) return g.create(std::move(*op), inputs, {});
        conv = std::string(inputs.size(), 't') + std::string(scalars.size(), 's');
      }
      return g.create(HostOp{name.text, *conv, std::move(scalars), nullptr}, inputs, {});
    }
    if (t.kind == TokenKind::String) {  // a quoted op name (printer-inl.hpp, op_name_text)
      check_quoted_name(t);
      std::vector<Token> attr_tokens;
      AttributeList attrs = parse_attrs(attr_tokens);
      auto inputs = parse_input_list(scope);
      return g.create(Op{t.text, std::move(attrs)}, inputs, {});
    }
    if (t.kind != TokenKind::Ident) fail(t, "expected an op name, found " + t.describe());
    if (t.text == "CppOp") {
      expect_punct('[', "after CppOp");
      // The C++ type name as printed: may hold spaces and `::` (`struct torch::autograd::Neg`).
      auto [line, col] = lex_.position();
      std::string name = lex_.raw_until("]", true, "the CppOp's name");
      if (name.empty()) lex_.fail(line, col, "expected the CppOp's name inside [...]");
      for (char c : name)
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
          lex_.fail(line, col, "a CppOp's name cannot hold control characters");
      expect_punct(']', "after the CppOp's name");
      auto inputs = parse_input_list(scope);
      std::string cls = dialects::cpp_class_name(name);
      if (dialects::is_eval_name(name) || dialects::is_eval_name(cls)) return g.create(Eval{}, inputs, {});
      if (!handle_output)
        if (auto op = dialects::alias_op(lex_, t, cls, {}, {}); op && dialects::alias_arity_fits(*op, inputs.size()))
          return g.create(std::move(*op), inputs, {});
      return g.create(HostOp{name, std::string(inputs.size(), 't'), {}, nullptr}, inputs, {});
    }
    if (auto ref = dialects::fusion_ref(t.text)) {
      if (scope.fusion_refs.count(*ref)) fail(t, t.text + " is used by more than one node");
      // 2018: `prim::FusionGroup_0[device=0]`; the device is the inputs' (not kept).
      if (accept('[')) {
        Token key = expect_ident("'device'");
        if (key.text != "device") fail(key, "a fusion group takes only the attribute 'device', found '" + key.text + "'");
        expect_punct('=', "after 'device'");
        parse_int(lex_.next(), "a device index");
        expect_punct(']', "after the fusion group's device");
      }
      auto inputs = parse_input_list(scope);
      Node* n = g.create(FusionGroup{nullptr}, inputs, {});
      scope.fusion_refs[*ref] = n;
      return n;
    }
    const std::string_view bare = dialects::strip_namespace(lex_, t);
    dialects::refuse_control_flow(lex_, t, bare);
    std::vector<Token> attr_tokens;
    auto parse_attrs_tracked = [&] { return parse_attrs(attr_tokens); };
    std::optional<NodeKind> kind;
    boost::hana::for_each(kind_names, [&](auto pair) {
      using K = typename decltype(+boost::hana::first(pair))::type;
      if constexpr (!std::is_same_v<K, Op> && !std::is_same_v<K, HostOp> && !std::is_same_v<K, FusionGroup>) {
        if (kind || boost::hana::second(pair) != bare) return;
        if constexpr (std::is_same_v<K, Param> || std::is_same_v<K, Return>) {
          fail(t, t.text + " nodes cannot appear in a graph body (declare inputs in graph(...), outputs in return)");
        } else if constexpr (is_attribute_kind<K>) {
          auto attrs = parse_attrs_tracked();
          kind = attribute_kind_from<K>(t, std::move(attrs), attr_tokens);
        } else {
          if (lex_.peek().is('[')) fail(lex_.peek(), t.text + " takes no attributes");
          kind = K{};
        }
      }
    });
    if (!kind) {
      AttributeList attrs = parse_attrs_tracked();
      auto inputs = parse_input_list(scope);
      if (auto op = dialects::alias_op(lex_, t, bare, attrs, attr_tokens)) {
        if (!dialects::alias_arity_fits(*op, inputs.size()))
          fail(t, t.text + " (the table's " + std::string(op->name()) + ") takes " + dialects::arity_text(*op) + ", found " +
                      std::to_string(inputs.size()));
        return g.create(std::move(*op), inputs, {});
      }
      return g.create(Op{bare, std::move(attrs)}, inputs, {});
    }
    auto inputs = parse_input_list(scope);
    return g.create(std::move(*kind), inputs, {});
  }

  Scalar to_scalar(const Literal& lit, const Token& at) {
    if (lit.is_bool) return std::get<int64_t>(lit.value) != 0;
    if (lit.is_none) return NoneScalar{};
    return std::visit(
        [&](const auto& v) -> Scalar {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_constructible_v<Scalar, T> &&
                        !std::is_same_v<T, at::Tensor> && !std::is_same_v<T, std::vector<std::string>>) {
            return v;
          } else {
            fail(at, "a host op scalar must be a number, bool, string or number list");
          }
        },
        lit.value);
  }

  void define(Scope& scope, const Token& t, Value* v) {
    if (scope.values.count(t.text)) fail(t, "value %" + t.text + " is already defined");
    scope.values[t.text] = v;
    if (std::isdigit(static_cast<unsigned char>(t.text[0]))) return;
    if (!valid_value_name(t.text)) fail(t, "invalid value name %" + t.text + "; expected %[A-Za-z_][A-Za-z0-9_.]* or a number");
    v->set_name(t.text);
  }

  // What may follow a node's inputs: `, uses = [...]` (seed era), `, scope: A/B` (2018,
  // not kept), then `;` (optional since 2018). A `block0()` here is control flow.
  void parse_node_suffix(Scope& scope, Node* n, const Token& start) {
    while (accept(',')) {
      const Token& kw = lex_.peek();
      if (kw.is_ident("scope")) {
        lex_.next();
        expect_punct(':', "after 'scope'");
        lex_.raw_until(";", false, "the scope");
        continue;
      }
      parse_uses(scope, n, start);
    }
    const Token& end = lex_.peek();
    if (end.kind == TokenKind::Ident && end.text.rfind("block", 0) == 0)
      fail(end, "control flow blocks ('" + end.text + "') are not supported: stagejit graphs are straight-line");
    accept(';');
  }

  // `, uses = [...]` (seed era), after the node's inputs.
  void parse_uses(Scope& scope, Node* n, const Token& at) {
    Token kw = expect_keyword("uses");
    expect_punct('=', "after 'uses'");
    Token open = expect_punct('[', "to open the use list");
    dialects::PendingUses p{n, kw, false, {}};
    auto entries = [&](char close) {
      std::vector<dialects::UseRef> out;
      if (accept(close)) return out;
      for (;;) {
        Token u = lex_.next();
        size_t dot = u.text.rfind(".i");
        int64_t off = -1;
        if (u.kind != TokenKind::ValueRef || dot == std::string::npos || dot == 0 ||
            !parse_number(std::string_view(u.text).substr(dot + 2), off) || off < 0)
          fail(u, "expected a use such as %5.i0, found " + u.describe());
        out.push_back({u, u.text.substr(0, dot), size_t(off)});
        Token sep = lex_.next();
        if (sep.is(close)) return out;
        if (!sep.is(',')) fail(sep, "expected ',' or '" + std::string(1, close) + "' in a use list, found " + sep.describe());
      }
    };
    if (lex_.peek().is('[')) {
      p.nested = true;
      for (;;) {
        expect_punct('[', "to open an output's use list");
        p.per_output.push_back(entries(']'));
        Token sep = lex_.next();
        if (sep.is(']')) break;
        if (!sep.is(',')) fail(sep, "expected ',' or ']' between use lists, found " + sep.describe());
      }
    } else {
      p.per_output.push_back(entries(']'));
    }
    (void)open;
    (void)at;
    scope.uses.push_back(std::move(p));
  }

  std::shared_ptr<Graph> parse_graph(size_t depth) {
    Token kw = lex_.next();
    if (!kw.is_ident("graph")) fail(kw, "expected 'graph', found " + kw.describe());
    if (depth > max_depth) fail(kw, "fusion groups nested deeper than " + std::to_string(max_depth));
    auto g = std::make_shared<Graph>();
    Scope scope;
    expect_punct('(', "after 'graph'");
    size_t stage = 0;
    if (!accept(')')) {
      for (;;) {
        if (lex_.peek().kind == TokenKind::Dashes) {
          stage = parse_separator(stage);
          continue;
        }
        Token name = lex_.next();
        if (name.is(')')) break;
        if (name.kind != TokenKind::ValueRef) fail(name, "expected a graph input (%name : Type), found " + name.describe());
        expect_punct(':', "after the input name");
        Type type = parse_type();
        Value* input = g->add_input(type, stage);
        input->node()->set_location({name.line, name.column});
        define(scope, name, input);
        const Token& sep = lex_.peek();
        if (sep.is(')')) {
          lex_.next();
          break;
        }
        if (sep.is(',')) {
          lex_.next();
          continue;
        }
        if (sep.kind == TokenKind::ValueRef || sep.kind == TokenKind::Dashes) continue;  // seed: no commas
        fail(sep, "expected ',' or ')' after a graph input, found " + sep.describe());
      }
    }
    expect_punct('{', "to open the graph body");
    size_t body_stage = 0;
    for (;;) {
      const Token& t = lex_.peek();
      if (t.kind == TokenKind::Dashes) {
        body_stage = parse_separator(body_stage);
        g->set_current_stage(body_stage);
        continue;
      }
      if (t.is_ident("return")) break;
      if (t.kind == TokenKind::End) fail(t, "expected a node or 'return', found end of input");
      Token start = t;
      std::vector<std::pair<Token, Type>> outs;
      if (t.kind == TokenKind::ValueRef) {
        for (;;) {
          Token name = lex_.next();
          if (name.kind != TokenKind::ValueRef) fail(name, "expected an output (%name : Type), found " + name.describe());
          expect_punct(':', "after the output name");
          outs.emplace_back(name, parse_type());
          Token sep = lex_.next();
          if (sep.is('=')) break;
          if (!sep.is(',')) fail(sep, "expected ',' or '=' after an output, found " + sep.describe());
        }
      }
      bool handle_output = false;
      for (auto& [name, type] : outs) handle_output = handle_output || std::holds_alternative<HandleType>(type);
      Node* n = parse_op(*g, scope, handle_output);
      n->set_location({start.line, start.column});
      g->append(n);
      for (auto& [name, type] : outs) define(scope, name, n->add_output(type));
      parse_node_suffix(scope, n, start);
    }
    Token ret = lex_.next();
    g->return_node()->set_location({ret.line, ret.column});
    expect_punct('(', "after 'return'");
    std::vector<std::vector<std::pair<Token, Value*>>> groups(1);
    if (!accept(')')) {
      for (;;) {
        if (lex_.peek().is('|')) {
          lex_.next();
          groups.emplace_back();
          if (groups.size() > 4096) fail(ret, "too many stage groups in return");
          if (accept(')')) break;
          continue;
        }
        Token v = lex_.next();
        if (v.kind != TokenKind::ValueRef) fail(v, "expected an output value (%name) or '|', found " + v.describe());
        auto it = scope.values.find(v.text);
        if (it == scope.values.end()) fail(v, "undefined value %" + v.text);
        groups.back().emplace_back(v, it->second);
        if (groups.size() > 4096) fail(v, "too many stage groups in return");
        Token sep = lex_.next();
        if (sep.is(')')) break;
        if (sep.is('|')) {
          groups.emplace_back();
          if (groups.size() > 4096) fail(ret, "too many stage groups in return");
          if (accept(')')) break;
          continue;
        }
        if (!sep.is(',')) fail(sep, "expected ',', '|' or ')' after an output, found " + sep.describe());
      }
    }
    if (groups.size() > 1) {
      if (groups.size() < g->num_stages())
        fail(ret, "return lists " + std::to_string(groups.size()) + " stage groups but the graph has " +
                      std::to_string(g->num_stages()) + " stages");
      for (size_t s = 0; s < groups.size(); ++s) {
        g->ensure_stage(s);
        for (auto& [tok, v] : groups[s]) g->register_output(v, s);
      }
    } else {
      size_t last = 0;
      for (auto& [tok, v] : groups[0]) {
        if (v->stage() < last)
          fail(tok, "output %" + tok.text + " of stage " + std::to_string(v->stage()) +
                        " comes after an output of stage " + std::to_string(last) +
                        " (without '|', outputs are grouped by stage in order)");
        last = v->stage();
        g->register_output(v, v->stage());
      }
    }
    accept(';');  // optional since 2018
    expect_punct('}', "to close the graph body");
    dialects::check_uses(lex_, *g, scope.values, scope.uses);
    while (!scope.fusion_refs.empty()) {
      Token w = lex_.next();
      if (!w.is_ident("with"))
        fail(w, "expected 'with " + scope.fusion_refs.begin()->first + " = graph(...)', found " + w.describe());
      Token name = expect_ident("a fusion group name");
      auto ref = dialects::fusion_ref(name.text);
      auto it = ref ? scope.fusion_refs.find(*ref) : scope.fusion_refs.end();
      if (it == scope.fusion_refs.end()) fail(name, "no node uses " + name.text);
      expect_punct('=', "after the fusion group name");
      it->second->get<FusionGroup>().subgraph = parse_graph(depth + 1);
      scope.fusion_refs.erase(it);
    }
    return g;
  }

  Lexer lex_;
  bool pending_open_ = false;  // parse_type consumed the '(' of the sizes
};

}  // namespace detail

STAGEJIT_FUNC std::shared_ptr<Graph> parse(std::string_view text) {
  detail::Parser p(text);
  try {
    return p.parse_file();
  } catch (const IrError& e) {
    // A graph-building call rejected something the grammar allowed.
    throw ParseError(1, 1, std::string("invalid graph: ") + e.what());
  }
}

}  // namespace stagejit::ir
