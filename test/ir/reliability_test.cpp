// Issue #34 (IR half): lint checks table ops against their schema (arity, outputs,
// attributes, statically known declared types) and refuses unknown ops unless asked to
// keep them; the parser skips a leading UTF-8 byte-order mark, resolves the `%N.k`
// output style's uses and reads 2018's one-line tensor dumps; parse, print, clone, lint,
// DCE and CSE are iterative (a chain of 2 * 10^5 nodes).
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include <chrono>
#include <string>

namespace ir = stagejit::ir;
namespace sj = stagejit;

namespace {

// Lints `text`; expects a LintError of `rule` at `line`:`column` whose message holds
// every string of `parts`.
void expect_lint(const std::string& text, const std::string& rule, size_t line, size_t column,
                 std::initializer_list<std::string> parts, ir::LintOptions options = {}) {
  CAPTURE(text);
  auto g = ir::parse(text);
  try {
    ir::lint(*g, options);
    FAIL("lint passed; expected rule " << rule);
  } catch (const ir::LintError& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(e.rule() == rule);
    CHECK(what.find("rule '" + rule + "'") != std::string::npos);
    CHECK(e.location().line == line);
    CHECK(e.location().column == column);
    for (const auto& p : parts) CHECK_MESSAGE(what.find(p) != std::string::npos, "missing: " << p);
  }
}

std::string print_lint_parse(const std::string& text, ir::LintOptions options = {}) {
  auto g = ir::parse(text);
  ir::lint(*g, options);
  const std::string printed = ir::to_string(*g);
  auto again = ir::parse(printed);
  ir::lint(*again, options);
  CHECK(ir::to_string(*again) == printed);
  return printed;
}

std::vector<sj::variable_list> run(const std::shared_ptr<ir::Graph>& g, const std::vector<sj::variable_list>& in) {
  return sj::closure::run_stages(std::make_shared<const sj::closure::MultiStageClosure>(g), in);
}

std::string chain(size_t n) {
  std::string text = "graph(%0 : Float(2)) {\n";
  text.reserve(n * 32);
  for (size_t i = 1; i <= n; ++i)
    text += "  %" + std::to_string(i) + " : Float(2) = neg(%" + std::to_string(i - 1) + ");\n";
  return text + "  return (%" + std::to_string(n) + ");\n}\n";
}

// Parse, lint, print, clone, CSE, DCE and destroy a chain of `n` nodes (none recursive).
void long_chain(size_t n) {
  const std::string text = chain(n);
  auto start = std::chrono::steady_clock::now();
  auto g = ir::parse(text);
  REQUIRE(g->nodes().size() == n);
  ir::lint(*g);
  const std::string printed = ir::to_string(*g);
  CHECK(printed.size() > text.size() / 2);
  {
    auto copy = g->clone();
    CHECK(copy->nodes().size() == n);
    ir::lint(*copy);
    CHECK(ir::to_string(*copy) == printed);
  }
  CHECK(sj::passes::eliminate_common_subexpressions(*g) == 0);
  // Cut the chain's use by the return: everything after %0 is dead.
  g->return_node()->replace_input(0, g->inputs()[0]);
  CHECK(sj::passes::eliminate_dead_code(*g) == n);
  CHECK(g->nodes().empty());
  ir::lint(*g);
  auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MESSAGE(n << "-node chain: parse, lint, print, clone, CSE, DCE: " << seconds << " s");
}

}  // namespace

TEST_SUITE("ir") {
  TEST_CASE("lint refuses an unknown op at its line:column unless asked to keep it") {
    const std::string text = "graph(%x : Float(2)) {\n  %y : Float(2) = frobnicate(%x);\n  return (%y);\n}\n";
    expect_lint(text, "unknown-op", 2, 3, {"node %y (frobnicate)", "'frobnicate' is not in the op table", "allow_unknown_ops"});
    CHECK_NOTHROW(ir::lint(*ir::parse(text), {.allow_unknown_ops = true}));
    // Inside a fusion group's subgraph too, with the same option.
    const std::string fused =
        "graph(%x : Float(2)) {\n  %y : Float(2) = fusion_group_0(%x);\n  return (%y);\n}\n"
        "with fusion_group_0 = graph(%a : Float(2)) {\n  %b : Float(2) = frobnicate(%a);\n  return (%b);\n}\n";
    expect_lint(fused, "fusion-group", 2, 3, {"subgraph", "rule 'unknown-op'", "frobnicate"});
    CHECK_NOTHROW(ir::lint(*ir::parse(fused), {.allow_unknown_ops = true}));
    // Host ops are opaque calls, not unknown ops.
    CHECK_NOTHROW(ir::lint(*ir::parse("graph(%x : Float(2)) {\n  %y : Float(2) = ^F[t]()(%x);\n  return (%y);\n}\n")));
  }

  TEST_CASE("lint checks a table op's inputs and outputs against its schema") {
    expect_lint("graph(%x : Float(2)) {\n  %y : Float(2) = tanh(%x, %x);\n  return (%y);\n}\n", "op-arity", 2, 3,
                {"node %y (tanh)", "tanh takes 1 input, found 2"});
    expect_lint("graph(%x : Float(2)) {\n  %y : Float(2), %z : Float(2) = tanh(%x);\n  return (%y);\n}\n", "op-arity",
                2, 3, {"(tanh)", "tanh has 1 output, found 2"});
    expect_lint("graph(%x : Float(2)) {\n  %y : Float(2) = mm(%x);\n  return (%y);\n}\n", "op-arity", 2, 3,
                {"mm takes 2 inputs, found 1"});
    expect_lint("graph(%x : Float(2)) {\n  %y : Float(2) = addmm(%x, %x, %x, %x);\n  return (%y);\n}\n", "op-arity",
                2, 3, {"addmm takes 3 inputs, found 4"});
    // The scalar form of a binary op needs its scalar.
    expect_lint("graph(%x : Float(2)) {\n  %y : Float(2) = mul(%x);\n  return (%y);\n}\n", "op-arity", 2, 3,
                {"mul with 1 input needs the attribute 'other'"});
    CHECK_NOTHROW(print_lint_parse("graph(%x : Float(2)) {\n  %y : Float(2) = mul[other=2](%x);\n  return (%y);\n}\n"));
    // Multi-output ops.
    expect_lint("graph(%x : Float(4)) {\n  %y : Float(4), %m : Bool(4), %z : Float(4) = dropout[p=0.5](%x);\n"
                "  return (%y);\n}\n",
                "op-arity", 2, 3, {"dropout has 1 to 2 outputs, found 3"});
    expect_lint("graph(%x : Float(4)) {\n  %a : Float(2), %b : Float(2), %c : Float(0) = chunk[chunks=2](%x);\n"
                "  return (%a);\n}\n",
                "op-arity", 2, 3, {"chunk has 1 to 2 outputs, found 3"});
    expect_lint("graph(%x : Float(4)) {\n  %a : Float(1), %b : Float(3) = split[split_size=[1, 2, 1]](%x);\n"
                "  return (%a);\n}\n",
                "op-arity", 2, 3, {"split has 3 outputs, found 2"});
    CHECK_NOTHROW(print_lint_parse(
        "graph(%x : Float(4)) {\n  %a : Float(2), %b : Float(2) = chunk[chunks=2](%x);\n  return (%a, %b);\n}\n"));
  }

  TEST_CASE("lint checks chunk's chunks and split's sizes") {
    expect_lint("graph(%x : Float(4)) {\n  %a : Float(4) = chunk[chunks=0](%x);\n  return (%a);\n}\n", "op-attribute",
                2, 3, {"node %a (chunk)", "'chunks' is 0; it must be >= 1"});
    expect_lint("graph(%x : Float(4)) {\n  %a : Float(4) = chunk[chunks=-3](%x);\n  return (%a);\n}\n", "op-attribute",
                2, 3, {"'chunks' is -3"});
    expect_lint("graph(%x : Float(4)) {\n  %a : Float(4) = chunk[dim=0](%x);\n  return (%a);\n}\n", "op-attribute", 2,
                3, {"chunk needs the attribute 'chunks'"});
    expect_lint("graph(%x : Float(4)) {\n  %a : Float(4) = chunk[chunks=1.5](%x);\n  return (%a);\n}\n",
                "op-attribute", 2, 3, {"'chunks' must be an integer"});
    expect_lint("graph(%x : Float(4)) {\n  %a : Float(4) = split[split_size=-1](%x);\n  return (%a);\n}\n",
                "op-attribute", 2, 3, {"split_size -1 is negative"});
  }

  TEST_CASE("lint checks the declared types of elementwise ops where every input's type is declared") {
    // The lie: tanh of a Float(4) declared Float(2, 3).
    expect_lint("graph(%x : Float(4)) {\n  %y : Float(2, 3) = tanh(%x);\n  return (%y);\n}\n", "declared-type", 2, 3,
                {"node %y (tanh)", "output %y is declared Float(2, 3)", "tanh of (%x : Float(4)) gives Float(4)"});
    expect_lint("graph(%x : Float(4)) {\n  %y : Double(4) = neg(%x);\n  return (%y);\n}\n", "declared-type", 2, 3,
                {"output %y is declared Double(4)", "gives Float(4)"});
    expect_lint("graph(%a : Float(2, 1), %b : Float(3)) {\n  %y : Float(3) = add(%a, %b);\n  return (%y);\n}\n",
                "declared-type", 2, 3, {"declared Float(3)", "gives Float(2, 3)"});
    expect_lint("graph(%a : Float(2), %b : Float(3)) {\n  %y : Float(3) = mul(%a, %b);\n  return (%y);\n}\n",
                "declared-type", 2, 3, {"(%a : Float(2), %b : Float(3)) do not broadcast"});
    // Broadcasting, comparisons (Bool), casts and undeclared types pass.
    CHECK_NOTHROW(print_lint_parse(
        "graph(%a : Float(2, 1), %b : Float(3)) {\n  %y : Float(2, 3) = add(%a, %b);\n"
        "  %c : Bool(2, 3) = gt(%y, %b);\n  %d : Double(2, 3) = to[dtype=7](%y);\n"
        "  %e : UNKNOWN_TYPE = exp(%d);\n  %f : Double(2, 3) = neg(%e);\n  return (%c, %d, %f);\n}\n"));
  }

  TEST_CASE("a UTF-8 byte-order mark: skipped at the start, an error elsewhere") {
    const std::string text = "graph(%x : Float(2)) {\n  %y : Float(2) = neg(%x);\n  return (%y);\n}\n";
    const std::string bom = "\xEF\xBB\xBF";
    CHECK(ir::to_string(*ir::parse(bom + text)) == ir::to_string(*ir::parse(text)));
    // Line and column of the first node are those of the text without the mark.
    auto g = ir::parse(bom + text);
    CHECK(g->nodes()[0]->location().line == 2);
    CHECK(g->nodes()[0]->location().column == 3);
    CHECK_THROWS_WITH_AS(ir::parse("graph(%x : Float(2)) {\n  " + bom + "%y : Float(2) = neg(%x);\n  return (%y);\n}\n"),
                         "2:3: unexpected UTF-8 byte-order mark (U+FEFF): one is only allowed at the start of the file",
                         sj::ParseError);
    CHECK_THROWS_WITH_AS(ir::parse(bom + bom + text), doctest::Contains("1:1: unexpected UTF-8 byte-order mark"),
                         sj::ParseError);
  }

  TEST_CASE("2017: the %N.k output style, with uses naming a node by its outputs' number") {
    // test_concat_fusion / test_lstm_fusion of October 2017: a multi-output node prints
    // its outputs as %4.0, %4.1, and `uses = [[%4.i0], ...]` names that node as a user.
    const std::string text =
        "graph(%1 : Float(3, 4)) {\n"
        "  %3.0 : Float(3, 2), %3.1 : Float(3, 2) = Chunk[chunks=2, dim=1](%1), uses = [[%4.i0], [%4.i1]];\n"
        "  %4.0 : Float(3, 2), %4.1 : Float(3, 2) = fusion_group_0(%3.0, %3.1), uses = [[%5.i0], [%0.i1]];\n"
        "  %5 : Float(3, 2) = Neg(%4.0), uses = [%0.i0];\n"
        "  return (%5, %4.1);\n}\n"
        "with fusion_group_0 = graph(%6 : Float(3, 2)\n      %7 : Float(3, 2)) {\n"
        "  %8 : Float(3, 2) = Mul(%6, %7), uses = [%0.i0];\n"
        "  %9 : Float(3, 2) = Add(%6, %7), uses = [%0.i1];\n"
        "  return (%8, %9);\n}\n";
    const std::string printed = print_lint_parse(text);
    auto g = ir::parse(text);
    ir::lint(*g);
    REQUIRE(g->nodes().size() == 3);
    at::Tensor x = at::randn({3, 4});
    auto out = run(g, {{sj::Variable(x)}});
    at::Tensor a = x.narrow(1, 0, 2), b = x.narrow(1, 2, 2);
    CHECK(out[0][0].data().equal(-(a * b)));
    CHECK(out[0][1].data().equal(a + b));
    // The uses are checked, not ignored: node 4 has one input, so %4.i1 names no use.
    CHECK_THROWS_WITH_AS(
        ir::parse("graph(%1 : Float(3, 4)) {\n"
                  "  %3.0 : Float(3, 2), %3.1 : Float(3, 2) = Chunk[chunks=2, dim=1](%1), uses = [[%4.i1], [%5.i0]];\n"
                  "  %4.0 : Float(3, 2), %4.1 : Float(3, 2) = chunk[chunks=2](%3.0), uses = [[%0.i0], [%0.i1]];\n"
                  "  %5 : Float(3, 2) = neg(%3.1), uses = [%0.i2];\n"
                  "  return (%4.0, %4.1, %5);\n}\n"),
        doctest::Contains("use %4.i1 does not match any use of this value"), sj::ParseError);
  }

  TEST_CASE("2018: a tensor dump on one line, whitespace anywhere inside it") {
    for (const std::string dump : {"value= 1.5000 -2.0000 [ CPUDoubleType{2} ]",
                                   "value=\n 1.5000\n-2.0000\n[ CPUDoubleType{2} ]\n",
                                   "value= 1.5 -2 [CPUDoubleType{ 2 }]",
                                   "value= 1.5 -2 [\n  CPUDoubleTensor {2}\n]",
                                   "value= 1.5\t-2.0 [ torch.DoubleTensor{2} ]"}) {
      CAPTURE(dump);
      const std::string text = "graph() {\n  %1 : Double(2) = Constant[" + dump + "]();\n  return (%1);\n}\n";
      auto g = ir::parse(text);
      ir::lint(*g);
      const at::Tensor& v = g->nodes()[0]->get<ir::Constant>().value;
      CHECK(bool(v.scalar_type() == at::kDouble));
      CHECK(v.equal(at::tensor({1.5, -2.0}, at::kDouble)));
      CHECK(print_lint_parse(text) == ir::to_string(*g));
    }
    // A 2 x 2 dump with spaces in its sizes.
    auto g = ir::parse("graph() {\n  %1 : Float(2, 2) = Constant[value= 1 2 3 4 [ CPUFloatType{2, 2} ]]();\n"
                       "  return (%1);\n}\n");
    CHECK(g->nodes()[0]->get<ir::Constant>().value.equal(at::tensor({1.f, 2.f, 3.f, 4.f}).reshape({2, 2})));
  }

  TEST_CASE("a chain of 2 * 10^5 nodes: parse, lint, print, clone, CSE, DCE and destruction are iterative") {
    long_chain(200000);
  }
  // 10^6 nodes take about 6 s and 1.5 GB: run by hand with -tc="*10^6*" --no-skip.
  TEST_CASE("a chain of 10^6 nodes" * doctest::skip()) { long_chain(1000000); }
}
