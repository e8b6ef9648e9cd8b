#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

namespace ir = stagejit::ir;

namespace {
ir::Type f2() { return ir::TensorType::contiguous(at::kFloat, {2}); }

// Expects lint to fail with `rule`, a message naming `node_part`, at `line` (0: unknown).
void expect_lint(const ir::Graph& g, const std::string& rule, const std::string& node_part, size_t line = 0) {
  try {
    ir::lint(g);
    FAIL("lint passed; expected rule " << rule);
  } catch (const ir::LintError& e) {
    CHECK(e.rule() == rule);
    CHECK_MESSAGE(std::string(e.what()).find(node_part) != std::string::npos, e.what());
    CHECK_MESSAGE(std::string(e.what()).find("rule '" + rule + "'") != std::string::npos, e.what());
    if (line) CHECK(e.location().line == line);
  }
}
void expect_lint(const std::string& text, const std::string& rule, const std::string& node_part, size_t line) {
  CAPTURE(text);
  auto g = ir::parse(text);
  expect_lint(*g, rule, node_part, line);
}
}  // namespace

TEST_SUITE("ir") {
  TEST_CASE("lint: a node's stage must be >= its inputs' stages") {
    expect_lint(
        "graph(%x : Float(2),\n      -------- stage 1 --------\n      %g : Float(2)) {\n"
        "  %0 : Float(2) = mul(%x, %g);\n  return (%0 | );\n}\n",
        "stage", "node %0 (mul) at stage 0", 4);
  }
  TEST_CASE("lint: Handles only as the last output of HostOp/Eval and last input of Eval") {
    expect_lint("graph(%x : Float(2)) {\n  %0 : Handle, %1 : Float(2) = ^F[t]()(%x);\n  return (%1);\n}\n", "handle",
                "%0, %1 (^F)", 2);
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2), %1 : Handle = mul(%x, %x);\n  return (%0);\n}\n", "handle",
                "(mul)", 2);
    expect_lint(
        "graph(%x : Float(2)) {\n  %0 : Float(2), %1 : Handle = ^F[t]()(%x);\n  %2 : Float(2) = neg(%1);\n"
        "  return (%2);\n}\n",
        "handle", "%2 (neg)", 3);
    expect_lint(
        "graph(%x : Float(2)) {\n  %0 : Float(2), %1 : Handle = ^F[t]()(%x);\n  %2 : Float(2) = Eval(%1, %0);\n"
        "  return (%2);\n}\n",
        "handle", "%2 (Eval)", 3);
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2) = Eval(%x);\n  return (%0);\n}\n", "handle", "%0 (Eval)", 2);
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2), %1 : Handle = ^F[t]()(%x);\n  return (%1);\n}\n", "handle",
                "return", 3);
    expect_lint("graph(%h : Handle) {\n  return ();\n}\n", "handle", "%h (Param)", 1);
  }
  TEST_CASE("lint: errors on graph inputs carry the input's position") {
    // Issue 20, item 8: inputs were reported at 0:0.
    auto g = ir::parse("graph(%x : Float(2),\n      %h : Handle) {\n  return ();\n}\n");
    try {
      ir::lint(*g);
      FAIL("lint passed");
    } catch (const ir::LintError& e) {
      CHECK(e.rule() == "handle");
      CHECK(e.location().line == 2);
      CHECK(e.location().column == 7);
      CHECK_MESSAGE(std::string(e.what()).find("graph input %h is a Handle") != std::string::npos, e.what());
    }
  }
  TEST_CASE("lint: output groups hold outputs of their stage or earlier") {
    expect_lint(
        "graph(%x : Float(2),\n      -------- stage 1 --------\n      %g : Float(2)) {\n  return (%g | %x);\n}\n",
        "output-groups", "return", 4);
  }
  TEST_CASE("lint: Param/Constant/Undefined have no inputs; fixed arities") {
    expect_lint(
        "graph(%x : Float(2)) {\n  %0 : Float(2) = Constant[value=Float(2){1.0, 2.0}](%x);\n  return (%0);\n}\n",
        "arity", "%0 (Constant)", 2);
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2) = Undefined(%x);\n  return (%0);\n}\n", "arity",
                "%0 (Undefined)", 2);
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2) = Gemm[alpha=1.0, beta=1.0](%x, %x);\n  return (%0);\n}\n",
                "arity", "%0 (Gemm)", 2);
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2), %1 : Float(2) = Transpose[perm=[0]](%x);\n  return (%0);\n}\n",
                "arity", "(Transpose)", 2);
  }
  TEST_CASE("lint: a HostOp's calling convention counts its inputs and scalars") {
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2) = ^F[tt]()(%x);\n  return (%0);\n}\n", "calling-convention",
                "%0 (^F)", 2);
    expect_lint("graph(%x : Float(2)) {\n  %0 : Float(2) = ^F[ts]()(%x);\n  return (%0);\n}\n", "calling-convention",
                "%0 (^F)", 2);
  }
  TEST_CASE("lint: FusionGroup subgraphs match the node and lint themselves") {
    expect_lint(
        "graph(%x : Float(2)) {\n  %0 : Float(2) = fusion_group_0(%x);\n  return (%0);\n}\n"
        "with fusion_group_0 = graph(%a : Float(2),\n      %b : Float(2)) {\n  return (%a);\n}\n",
        "fusion-group", "%0 (fusion_group)", 2);
    expect_lint(
        "graph(%x : Float(2)) {\n  %0 : Float(2) = fusion_group_0(%x);\n  return (%0);\n}\n"
        "with fusion_group_0 = graph(%a : Float(2)) {\n  %0 : Float(2), %1 : Handle = neg(%a);\n  return (%0);\n}\n",
        "fusion-group", "rule 'handle'", 2);
  }
  TEST_CASE("lint: names are unique (API-built)") {
    ir::Graph g;
    ir::Value* x = g.add_input(f2(), 0, "x");
    ir::Node* n = g.create_and_append(ir::Op::with("neg"), {x}, {f2()});
    n->output()->set_name("x");
    g.register_output(n->output(), 0);
    expect_lint(g, "unique-names", "name %x");
    CHECK_THROWS_AS(n->output()->set_name("3x"), stagejit::IrError);
  }
  TEST_CASE("lint: definitions come before uses (API-built)") {
    ir::Graph g;
    ir::Value* x = g.add_input(f2(), 0, "x");
    ir::Node* a = g.create_and_append(ir::Op::with("neg"), {x}, {f2()});
    ir::Node* b = g.create_and_append(ir::Op::with("exp"), {a->output()}, {f2()});
    b->move_before(a);
    g.register_output(b->output(), 0);
    expect_lint(g, "def-before-use", "(exp)");
  }
  TEST_CASE("lint: node stages never decrease along the list (API-built)") {
    ir::Graph g;
    ir::Value* x = g.add_input(f2(), 0, "x");
    g.create_and_append(ir::Op::with("neg"), {x}, {f2()})->set_stage(1);
    ir::Node* b = g.create_and_append(ir::Op::with("exp"), {x}, {f2()});
    g.register_output(b->output(), 0);
    expect_lint(g, "stage-order", "(exp)");
  }
  TEST_CASE("lint: use lists only name listed users (API-built)") {
    ir::Graph g;
    ir::Value* x = g.add_input(f2(), 0, "x");
    g.create(ir::Op::with("neg"), {x}, {f2()});  // created, never appended
    expect_lint(g, "use-list", "%x");
  }
  TEST_CASE("lint accepts API-built multi-stage graphs and checks stage groups") {
    ir::Graph g;
    ir::Value* x = g.add_input(f2(), 0, "x");
    ir::Node* h = g.create_and_append(ir::HostOp{"Sq", "t", {}, nullptr}, {x}, {f2(), ir::HandleType{}});
    ir::Value* gy = g.add_input(f2(), 1, "gy");
    g.set_current_stage(1);
    ir::Node* e = g.create_and_append(ir::Eval{}, {gy, h->output(1)}, {f2()});
    g.register_output(h->output(0), 0);
    g.register_output(e->output(), 1);
    CHECK_NOTHROW(ir::lint(g));
    CHECK(g.stage_outputs(1) == std::vector<ir::Value*>{e->output()});
    CHECK(g.output_stage(1) == 1);
    CHECK_THROWS_AS(g.create(ir::Param{}), stagejit::IrError);
    CHECK_THROWS_AS(h->destroy(), stagejit::IrError);
  }
}
