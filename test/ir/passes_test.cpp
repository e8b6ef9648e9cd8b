#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include <set>

namespace ir = stagejit::ir;
namespace passes = stagejit::passes;

namespace {
std::string run(const std::string& text, bool dce, bool cse) {
  auto g = ir::parse(text);
  ir::lint(*g, {.allow_unknown_ops = true});  // add_, randn_like: side effects the table lacks
  if (cse) passes::eliminate_common_subexpressions(*g);
  if (dce) passes::eliminate_dead_code(*g);
  ir::lint(*g, {.allow_unknown_ops = true});
  return ir::to_string(*g);
}
}  // namespace

TEST_SUITE("ir") {
  TEST_CASE("DCE removes unused chains and keeps every stage's outputs and live handles") {
    std::string in =
        "graph(%x : Float(2),\n"
        "      -------- stage 1 --------\n"
        "      %g : Float(2)) {\n"
        "  %a : Float(2), %ha : Handle = ^Sq[t]()(%x);\n"
        "  %b : Float(2), %hb : Handle = ^Cube[t]()(%x);\n"
        "  %dead1 : Float(2) = exp(%x);\n"
        "  %dead2 : Float(2) = neg(%dead1);\n"
        "  ---------------- stage 1 ----------------\n"
        "  %ga : Float(2) = Eval(%g, %ha);\n"
        "  %gb : Float(2) = Eval(%g, %hb);\n"
        "  %dead3 : Float(2) = mul(%ga, %a);\n"
        "  return (%b | %ga);\n"
        "}\n";
    // %gb is unused, so its Eval goes, then ^Cube's handle is unused but its tensor
    // output %b is a stage-0 output: ^Cube stays. ^Sq stays for the live Eval %ga.
    CHECK(run(in, true, false) ==
          "graph(%x : Float(2),\n"
          "      -------- stage 1 --------\n"
          "      %g : Float(2)) {\n"
          "  %a : Float(2), %ha : Handle = ^Sq[t]()(%x);\n"
          "  %b : Float(2), %hb : Handle = ^Cube[t]()(%x);\n"
          "  ---------------- stage 1 ----------------\n"
          "  %ga : Float(2) = Eval(%g, %ha);\n"
          "  return (%b | %ga);\n"
          "}\n");
  }
  TEST_CASE("DCE removes a dead Eval and then the HostOp that only fed it") {
    std::string in =
        "graph(%x : Float(2),\n"
        "      -------- stage 1 --------\n"
        "      %g : Float(2)) {\n"
        "  %a : Float(2), %ha : Handle = ^Sq[t]()(%x);\n"
        "  %y : Float(2) = relu(%x);\n"
        "  ---------------- stage 1 ----------------\n"
        "  %ga : Float(2) = Eval(%g, %ha);\n"
        "  return (%y | %g);\n"
        "}\n";
    CHECK(run(in, true, false) ==
          "graph(%x : Float(2),\n"
          "      -------- stage 1 --------\n"
          "      %g : Float(2)) {\n"
          "  %y : Float(2) = relu(%x);\n"
          "  return (%y | %g);\n"
          "}\n");
  }
  TEST_CASE("DCE keeps ops with side effects and inside fusion groups keeps the outputs") {
    // The outer graph stays as it is (its nodes have side effects or are a fusion group).
    const std::string outer =
        "graph(%x : Float(2)) {\n"
        "  %0 : Float(2) = add_[alpha=1](%x, %x);\n"
        "  %1 : Float(2) = dropout[p=0.5, train=1](%x);\n"
        "  %2 : Float(2) = fusion_group_0(%x);\n"
        "  return (%2);\n"
        "}\n";
    std::string in = outer +
        "with fusion_group_0 = graph(%0 : Float(2)) {\n"
        "  %1 : Float(2) = exp(%0);\n"
        "  %2 : Float(2) = neg(%0);\n"
        "  return (%2);\n"
        "}\n";
    CHECK(run(in, true, false) == outer +
          "with fusion_group_0 = graph(%0 : Float(2)) {\n"
          "  %1 : Float(2) = neg(%0);\n"
          "  return (%1);\n"
          "}\n");
  }
  TEST_CASE("CSE merges equal nodes of one stage, by kind, attributes and inputs") {
    std::string in =
        "graph(%x : Float(2),\n"
        "      %y : Float(2)) {\n"
        "  %a : Float(2) = mul(%x, %y);\n"
        "  %b : Float(2) = mul(%x, %y);\n"
        "  %c : Float(2) = mul(%y, %x);\n"
        "  %d : Float(2) = add[alpha=1](%a, %b);\n"
        "  %e : Float(2) = add[alpha=2](%a, %b);\n"
        "  %f : Float(2) = add[alpha=1](%a, %a);\n"
        "  return (%c, %d, %e, %f);\n"
        "}\n";
    CHECK(run(in, false, true) ==
          "graph(%x : Float(2),\n"
          "      %y : Float(2)) {\n"
          "  %a : Float(2) = mul(%x, %y);\n"
          "  %c : Float(2) = mul(%y, %x);\n"
          "  %d : Float(2) = add[alpha=1](%a, %a);\n"
          "  %e : Float(2) = add[alpha=2](%a, %a);\n"
          "  return (%c, %d, %e, %d);\n"
          "}\n");
  }
  TEST_CASE("CSE across stages keeps the earlier-stage node; never merges HostOp, Eval or Handles") {
    // Stage 0 stays as it is (the two ^Sq HostOps are not merged).
    const std::string stage0 =
        "graph(%x : Float(2),\n"
        "      -------- stage 1 --------\n"
        "      %g : Float(2)) {\n"
        "  %s : Float(2) = sigmoid(%x);\n"
        "  %h1 : Float(2), %k1 : Handle = ^Sq[t]()(%x);\n"
        "  %h2 : Float(2), %k2 : Handle = ^Sq[t]()(%x);\n"
        "  ---------------- stage 1 ----------------\n";
    std::string in = stage0 +
        "  %s2 : Float(2) = sigmoid(%x);\n"
        "  %m : Float(2) = mul(%g, %s2);\n"
        "  %e1 : Float(2) = Eval(%m, %k1);\n"
        "  %e2 : Float(2) = Eval(%m, %k1);\n"
        "  return (%s, %h1, %h2 | %e1, %e2);\n"
        "}\n";
    CHECK(run(in, false, true) == stage0 +
          "  %m : Float(2) = mul(%g, %s);\n"
          "  %e1 : Float(2) = Eval(%m, %k1);\n"
          "  %e2 : Float(2) = Eval(%m, %k1);\n"
          "  return (%s, %h1, %h2 | %e1, %e2);\n"
          "}\n");
  }
  TEST_CASE("CSE merges Constants only when dtype, shape and values are equal; then DCE") {
    std::string in =
        "graph(%x : Float(2)) {\n"
        "  %c1 : Float(2) = Constant[value=Float(2){1.0, 2.0}]();\n"
        "  %c2 : Float(2) = Constant[value=Float(2){1.0, 2.0}]();\n"
        "  %c3 : Double(2) = Constant[value=Double(2){1.0, 2.0}]();\n"
        "  %c4 : Float(2) = Constant[value=Float(2){1.0, 3.0}]();\n"
        "  %u1 : UNKNOWN_TYPE = Undefined();\n"
        "  %u2 : UNKNOWN_TYPE = Undefined();\n"
        "  %a : Float(2) = add[alpha=1](%c1, %c2);\n"
        "  %b : Float(2) = mul(%c4, %x);\n"
        "  %n : Float(2) = exp(%x);\n"
        "  return (%a, %b, %c3, %u1, %u2);\n"
        "}\n";
    CHECK(run(in, true, true) ==
          "graph(%x : Float(2)) {\n"
          "  %c1 : Float(2) = Constant[value=Float(2){1.0, 2.0}]();\n"
          "  %c3 : Double(2) = Constant[value=Double(2){1.0, 2.0}]();\n"
          "  %c4 : Float(2) = Constant[value=Float(2){1.0, 3.0}]();\n"
          "  %u1 : UNKNOWN_TYPE = Undefined();\n"
          "  %a : Float(2) = add[alpha=1](%c1, %c1);\n"
          "  %b : Float(2) = mul(%c4, %x);\n"
          "  return (%a, %b, %c3, %u1, %u1);\n"
          "}\n");
  }
  TEST_CASE("passes keep the tanh MLP example valid and CSE finds nothing to merge there") {
    std::string text = "";
    auto g = ir::parse(
        "graph(%x : Float(3)) {\n  %0 : Float(3) = tanh(%x);\n  %1 : Float(3) = tanh(%x);\n"
        "  %2 : Float(3) = mul(%0, %1);\n  return (%2);\n}\n");
    CHECK(passes::eliminate_common_subexpressions(*g) == 1);
    CHECK(ir::to_string(*g) == "graph(%x : Float(3)) {\n  %0 : Float(3) = tanh(%x);\n  %1 : Float(3) = mul(%0, %0);\n  return (%1);\n}\n");
    CHECK(passes::eliminate_dead_code(*g) == 0);
  }
}

TEST_SUITE("ir") {
  TEST_CASE("Graph storage: destroyed nodes and erased outputs free their cells for reuse; owns and all_nodes stay right") {
    ir::Graph g;
    auto type = ir::TensorType::contiguous(at::kFloat, {4});
    ir::Value* x = g.add_input(type, 0, "x");
    std::vector<ir::Node*> made;
    for (int i = 0; i < 300; ++i)  // several blocks of cells
      made.push_back(g.create_and_append(ir::Op::with("neg"), {i ? made.back()->output() : x}, {type}));
    g.register_output(made.back()->output(), 0);
    const std::size_t owned = g.all_nodes().size();
    CHECK(owned == 300 + 2);  // + the Param and the Return node
    // Remove the first 100 (they feed each other, so last first); the chain is re-rooted.
    made[100]->replace_input(0, x);
    for (int i = 99; i >= 0; --i) {
      CHECK(g.owns(made[i]));
      made[i]->destroy();
    }
    CHECK(g.all_nodes().size() == owned - 100);
    for (ir::Node* n : g.all_nodes()) CHECK(g.owns(n));
    // New nodes reuse the freed cells.
    std::set<const void*> freed(made.begin(), made.begin() + 100);
    int reused = 0;
    for (int i = 0; i < 100; ++i) {
      ir::Node* n = g.create_and_append(ir::Op::with("relu"), {x}, {type});
      reused += freed.count(n) ? 1 : 0;
      n->add_output(type);  // a second output, erased again: its cell is reused too
      n->erase_output(1);
    }
    CHECK(reused == 100);
    ir::lint(g);
    // A clone has its own storage and the same text; destroying the original leaves it intact.
    auto copy = g.clone();
    const std::string text = ir::to_string(g);
    CHECK(ir::to_string(*copy) == text);
    ir::Graph other;
    CHECK_FALSE(other.owns(made[150]));
    CHECK_FALSE(copy->owns(made[150]));
  }
}

TEST_SUITE("ir") {
  TEST_CASE("fold_double_transposes: t(t(x)) -> x within and across stages, outputs included") {
    auto g = ir::parse(R"(graph(%x : Float(3, 4),
      %w : Float(5, 4),
      -------- stage 1 --------
      %g : Float(3, 5)) {
  %wt : Float(4!, 5!) = t(%w);
  %y : Float(3, 5) = mm(%x, %wt);
  ---------------- stage 1 ----------------
  %w2 : Float(5, 4) = t(%wt);
  %gx : Float(3, 4) = mm(%g, %w2);
  %gt : Float(5!, 3!) = t(%g);
  %gw : Float(5, 4) = mm(%gt, %x);
  %a : Float(4!, 5!) = t(%gw);
  %b : Float(5, 4) = t(%a);
  return (%y | %gx, %b);
})");
    CHECK(passes::fold_double_transposes(*g) == 2);
    passes::eliminate_dead_code(*g);
    const std::string text = ir::to_string(*g);
    CHECK(text.find("mm(%g, %w)") != std::string::npos);
    CHECK(text.find("%a") == std::string::npos);  // t(t(gw)) gone: the output is %gw
    CHECK(text.find("return (%y | %gx, %gw)") != std::string::npos);
    CHECK(passes::fold_double_transposes(*g) == 0);
    // t of a 3-D value fails in ATen; a graph that says so is left to fail.
    auto three = ir::parse(R"(graph(%x : Float(2, 3, 4)) {
  %a : Float(2, 3, 4) = t(%x);
  %b : Float(2, 3, 4) = t(%a);
  return (%b);
})");
    CHECK(passes::fold_double_transposes(*three) == 0);
  }
  TEST_CASE("rematerialize: a later stage recomputes cheap values from what it reads anyway") {
    const std::string in = R"(graph(%x : Float(2),
      -------- stage 1 --------
      %g : Float(2)) {
  %h : Float(2) = tanh(%x);
  %s : Float(2) = mul(%h, %h);
  %d : Float(2) = rsub[other=1.0](%s);
  %r : Float(2) = exp(%x);
  %n : Float(2) = randn_like(%h);
  %k : Float(2) = mul(%h, %n);
  ---------------- stage 1 ----------------
  %a : Float(2) = mul(%g, %d);
  %b : Float(2) = mul(%a, %h);
  %c : Float(2) = mul(%b, %r);
  %e : Float(2) = add(%c, %k);
  return (%h | %e);
})";
    // Stage 1 reads %h, %d, %r and %k. %d = 1 - h * h is recomputed from %h (h * h
    // with it); %r needs %x, which stage 1 does not read; %k reads %n, made by a random
    // op (not elementwise, never copied).
    auto g = ir::parse(in);
    ir::lint(*g, {.allow_unknown_ops = true});  // randn_like: not in the op table
    CHECK(passes::rematerialize_cross_stage(*g, 1) == 1);
    ir::lint(*g, {.allow_unknown_ops = true});
    CHECK(ir::to_string(*g) == R"(graph(%x : Float(2),
      -------- stage 1 --------
      %g : Float(2)) {
  %h : Float(2) = tanh(%x);
  %r : Float(2) = exp(%x);
  %n : Float(2) = randn_like(%h);
  %k : Float(2) = mul(%h, %n);
  ---------------- stage 1 ----------------
  %0 : Float(2) = mul(%h, %h);
  %1 : Float(2) = rsub[other=1.0](%0);
  %a : Float(2) = mul(%g, %1);
  %b : Float(2) = mul(%a, %h);
  %c : Float(2) = mul(%b, %r);
  %e : Float(2) = add(%c, %k);
  return (%h | %e);
}
)");
    CHECK(passes::rematerialize_cross_stage(*g, 1) == 0);  // nothing left to recompute
    // Values below the size limit (16 384 elements by default) stay saved.
    auto small = ir::parse(in);
    CHECK(passes::rematerialize_cross_stage(*small) == 0);
    CHECK(ir::to_string(*small) == ir::to_string(*ir::parse(in)));
    // A value the later stage returns, or that an in-place op of that stage reads, is
    // not copied.
    for (const char* user : {"  %o : Float(2) = mul_(%d, %g);\n  return (%h | %o);\n",
                             "  %o : Float(2) = mul(%d, %g);\n  return (%h | %o, %d);\n"}) {
      CAPTURE(user);
      auto kept = ir::parse(std::string("graph(%x : Float(2),\n      -------- stage 1 --------\n"
                                        "      %g : Float(2)) {\n"
                                        "  %h : Float(2) = tanh(%x);\n"
                                        "  %s : Float(2) = mul(%h, %h);\n"
                                        "  %d : Float(2) = rsub[other=1.0](%s);\n"
                                        "  ---------------- stage 1 ----------------\n"
                                        "  %c : Float(2) = mul(%h, %g);\n") +
                            user + "}\n");
      const std::string before = ir::to_string(*kept);
      CHECK(passes::rematerialize_cross_stage(*kept, 1) == 0);
      CHECK(ir::to_string(*kept) == before);
    }
    // Over three stages: each later stage on its own; a returned value stays returned.
    auto three = ir::parse(R"(graph(%x : Float(3),
      -------- stage 1 --------
      %g : Float(3),
      -------- stage 2 --------
      %gg : Float(3)) {
  %h : Float(3) = sigmoid(%x);
  %q : Float(3) = mul(%h, %x);
  ---------------- stage 1 ----------------
  %a : Float(3) = mul(%g, %q);
  %z : Float(3) = mul(%a, %x);
  ---------------- stage 2 ----------------
  %w : Float(3) = mul(%gg, %q);
  %v : Float(3) = mul(%w, %h);
  return (%q | %z | %v);
})");
    // Stage 1 reads %q and %x: it recomputes h = sigmoid(x), then q. Stage 2 reads %q
    // and %h, but not x: it keeps reading %q. Stage 0 still returns %q.
    CHECK(passes::rematerialize_cross_stage(*three, 1) == 1);
    ir::lint(*three);
    const std::string text = ir::to_string(*three);
    CHECK(text.find("  ---------------- stage 1 ----------------\n"
                    "  %0 : Float(3) = sigmoid(%x);\n"
                    "  %1 : Float(3) = mul(%0, %x);\n"
                    "  %a : Float(3) = mul(%g, %1);\n") != std::string::npos);
    CHECK(text.find("%w : Float(3) = mul(%gg, %q);") != std::string::npos);
    CHECK(text.find("return (%q | %z | %v);") != std::string::npos);
    // A value whose op holds a logarithm, erf or expm1 (softplus, log, erf, gelu, elu),
    // or whose derivatives are written in its input (silu, sin, cos), costs more to
    // recompute than to read back, and so does an exp, sigmoid or tanh of such an op's
    // input, or of a value at most two elementwise steps from it (what those backwards
    // build from it: elu's exp(x) %p, silu's and softplus's sigmoid(x) %q, gelu's
    // exp(-x*x/2) %r, and %ce, the exp of %cm that sin reads): they stay saved. Recomputed
    // from what stage 1 reads anyway: the tanh and exp of %y, which feeds nothing costly;
    // the tanh of %x3, which is a step *above* %cm, not below; and %r3, three steps from %x.
    // (A sigmoid of anything else is cheap: the test above.)
    const std::string costly_in = R"(graph(%x : Float(2),
      %y : Float(2),
      %x3 : Float(2),
      -------- stage 1 --------
      %g : Float(2)) {
  %s : Float(2) = softplus[beta=1.0, threshold=20.0](%x);
  %l : Float(2) = log(%x);
  %u : Float(2) = elu(%x);
  %h : Float(2) = tanh(%y);
  %q : Float(2) = sigmoid(%x);
  %w : Float(2) = silu(%x);
  %n : Float(2) = sin(%x);
  %k : Float(2) = cos(%x);
  %p : Float(2) = exp(%x);
  %v : Float(2) = mul(%x, %x);
  %z : Float(2) = mul[other=-0.5](%v);
  %r : Float(2) = exp(%z);
  %t : Float(2) = exp(%y);
  %cm : Float(2) = mul[other=3.0](%x3);
  %cs : Float(2) = sin(%cm);
  %ce : Float(2) = exp(%cm);
  %ct : Float(2) = tanh(%x3);
  %z3 : Float(2) = mul[other=2.0](%z);
  %r3 : Float(2) = exp(%z3);
  ---------------- stage 1 ----------------
  %a : Float(2) = mul(%g, %s);
  %b : Float(2) = mul(%a, %l);
  %c : Float(2) = mul(%b, %u);
  %d : Float(2) = mul(%c, %h);
  %e : Float(2) = mul(%d, %x);
  %f : Float(2) = mul(%e, %q);
  %i : Float(2) = mul(%f, %w);
  %j : Float(2) = mul(%i, %n);
  %m : Float(2) = mul(%j, %k);
  %o : Float(2) = mul(%m, %p);
  %o2 : Float(2) = mul(%o, %r);
  %o3 : Float(2) = mul(%o2, %t);
  %o4 : Float(2) = mul(%o3, %y);
  %o5 : Float(2) = mul(%o4, %cs);
  %o6 : Float(2) = mul(%o5, %ce);
  %o7 : Float(2) = mul(%o6, %ct);
  %o8 : Float(2) = mul(%o7, %x3);
  %o9 : Float(2) = mul(%o8, %r3);
  return (%s | %o9);
})";
    auto costly = ir::parse(costly_in);
    CHECK(passes::rematerialize_cross_stage(*costly, 1) == 4);
    ir::lint(*costly);
    const std::string costly_text = ir::to_string(*costly);
    CHECK_MESSAGE(costly_text.find("  ---------------- stage 1 ----------------\n"
                                   "  %0 : Float(2) = tanh(%y);\n"
                                   "  %1 : Float(2) = exp(%y);\n"
                                   "  %2 : Float(2) = tanh(%x3);\n"
                                   "  %3 : Float(2) = mul(%x, %x);\n"
                                   "  %4 : Float(2) = mul[other=-0.5](%3);\n"
                                   "  %5 : Float(2) = mul[other=2.0](%4);\n"
                                   "  %6 : Float(2) = exp(%5);\n"
                                   "  %a : Float(2) = mul(%g, %s);\n") != std::string::npos,
                  costly_text);
    for (const char* line :
         {"%b : Float(2) = mul(%a, %l);", "%c : Float(2) = mul(%b, %u);", "%d : Float(2) = mul(%c, %0);",
          "%f : Float(2) = mul(%e, %q);", "%i : Float(2) = mul(%f, %w);", "%j : Float(2) = mul(%i, %n);",
          "%m : Float(2) = mul(%j, %k);", "%o : Float(2) = mul(%m, %p);", "%o2 : Float(2) = mul(%o, %r);",
          "%o3 : Float(2) = mul(%o2, %1);", "%o5 : Float(2) = mul(%o4, %cs);", "%o6 : Float(2) = mul(%o5, %ce);",
          "%o7 : Float(2) = mul(%o6, %2);", "%o9 : Float(2) = mul(%o8, %6);"})
      CHECK_MESSAGE(costly_text.find(line) != std::string::npos, line, "\n", costly_text);
  }
}
