// passes::fuse on hand-written IR: grouping, stages, chunk distribution, lint and
// print/parse round trip, and that the fused graph computes what the original does.
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/passes/graph_fuser.hpp>
#include <stagejit/testing/doctest.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <map>
#include <string>

namespace ir = stagejit::ir;
namespace passes = stagejit::passes;

namespace {

/// Parses, fuses, lints, checks the print/parse round trip, returns the printed result.
std::string fused(const std::string& text, size_t expected_groups) {
  auto g = ir::parse(text);
  ir::lint(*g);
  CHECK(passes::fuse(*g) == expected_groups);
  ir::lint(*g);
  const std::string out = ir::to_string(*g);
  auto again = ir::parse(out);
  ir::lint(*again);
  CHECK(ir::to_string(*again) == out);
  return out;
}

}  // namespace

TEST_SUITE("fusion") {
  TEST_CASE("fuse: one group for a chain, with an intermediate used outside becoming an output") {
    const std::string in = R"(graph(%a : Float(8),
      %b : Float(8),
      %c : Float(8)) {
  %m : Float(8) = mul(%a, %b);
  %s : Float(8) = add[alpha=1](%m, %c);
  %t : Float(8) = tanh(%s);
  %g : Float(8) = sigmoid(%a);
  %y : Float(8) = mul(%t, %g);
  %z : Float(2, 4) = reshape[shape=[2, 4]](%s);
  return (%y, %z);
}
)";
    const std::string want = R"(graph(%a : Float(8),
      %b : Float(8),
      %c : Float(8)) {
  %s : Float(8), %y : Float(8) = fusion_group_0(%a, %b, %c);
  %z : Float(2, 4) = reshape[shape=[2, 4]](%s);
  return (%y, %z);
}
with fusion_group_0 = graph(%0 : Float(8),
      %1 : Float(8),
      %2 : Float(8)) {
  %3 : Float(8) = mul(%0, %1);
  %4 : Float(8) = add[alpha=1](%3, %2);
  %5 : Float(8) = tanh(%4);
  %6 : Float(8) = sigmoid(%0);
  %7 : Float(8) = mul(%5, %6);
  return (%4, %7);
}
)";
    CHECK(fused(in, 1) == want);
  }

  TEST_CASE("fuse: each stage gets its own group; singletons and non-elementwise nodes stay") {
    const std::string in = R"(graph(%x : Float(3, 4),
      %w : Float(4, 5),
      -------- stage 1 --------
      %gy : Float(3, 5)) {
  %h : Float(3, 5) = mm(%x, %w);
  %y : Float(3, 5) = tanh(%h);
  %e : Float(3, 5) = exp(%y);
  %n : Float(3, 5) = neg(%e);
  ---------------- stage 1 ----------------
  %sq : Float(3, 5) = mul(%y, %y);
  %d : Float(3, 5) = rsub[other=1, alpha=1](%sq);
  %gh : Float(3, 5) = mul(%gy, %d);
  %wt : Float(5, 4) = t(%w);
  %gx : Float(3, 4) = mm(%gh, %wt);
  %r : Float(3, 4) = relu(%gx);
  return (%y, %n | %gx, %r);
}
)";
    const std::string want = R"(graph(%x : Float(3, 4),
      %w : Float(4, 5),
      -------- stage 1 --------
      %gy : Float(3, 5)) {
  %h : Float(3, 5) = mm(%x, %w);
  %y : Float(3, 5), %n : Float(3, 5) = fusion_group_0(%h);
  ---------------- stage 1 ----------------
  %gh : Float(3, 5) = fusion_group_1(%y, %gy);
  %wt : Float(5, 4) = t(%w);
  %gx : Float(3, 4) = mm(%gh, %wt);
  %r : Float(3, 4) = relu(%gx);
  return (%y, %n | %gx, %r);
}
with fusion_group_0 = graph(%0 : Float(3, 5)) {
  %1 : Float(3, 5) = tanh(%0);
  %2 : Float(3, 5) = exp(%1);
  %3 : Float(3, 5) = neg(%2);
  return (%1, %3);
}
with fusion_group_1 = graph(%0 : Float(3, 5),
      %1 : Float(3, 5)) {
  %2 : Float(3, 5) = mul(%0, %0);
  %3 : Float(3, 5) = rsub[other=1, alpha=1](%2);
  %4 : Float(3, 5) = mul(%1, %3);
  return (%4);
}
)";
    CHECK(fused(in, 2) == want);
  }

  TEST_CASE("fuse: LSTM cell gates distribute over chunk into one group that computes the same values") {
    const std::string in = R"(graph(%x : Float(3, 10),
      %hx : Float(3, 20),
      %cx : Float(3, 20),
      %w_ih : Float(80, 10),
      %w_hh : Float(80, 20),
      %b : Float(80)) {
  %wi : Float(10, 80) = t(%w_ih);
  %gi : Float(3, 80) = mm(%x, %wi);
  %wh : Float(20, 80) = t(%w_hh);
  %gh : Float(3, 80) = mm(%hx, %wh);
  %g0 : Float(3, 80) = add[alpha=1](%gi, %gh);
  %gates : Float(3, 80) = add[alpha=1](%g0, %b);
  %i0 : Float(3, 20), %f0 : Float(3, 20), %c0 : Float(3, 20), %o0 : Float(3, 20) = chunk[chunks=4, dim=1](%gates);
  %i : Float(3, 20) = sigmoid(%i0);
  %f : Float(3, 20) = sigmoid(%f0);
  %c : Float(3, 20) = tanh(%c0);
  %o : Float(3, 20) = sigmoid(%o0);
  %fc : Float(3, 20) = mul(%f, %cx);
  %ic : Float(3, 20) = mul(%i, %c);
  %cy : Float(3, 20) = add[alpha=1](%fc, %ic);
  %tc : Float(3, 20) = tanh(%cy);
  %hy : Float(3, 20) = mul(%o, %tc);
  return (%hy, %cy);
}
)";
    auto original = ir::parse(in);
    auto g = ir::parse(in);
    CHECK(passes::fuse(*g) == 1);
    ir::lint(*g);
    const std::string text = ir::to_string(*g);
    CHECK(ir::to_string(*ir::parse(text)) == text);
    size_t groups = 0, chunks = 0, outside_elementwise = 0;
    const ir::Node* group = nullptr;
    for (const ir::Node* n : g->nodes()) {
      if (n->is<ir::FusionGroup>()) {
        ++groups;
        group = n;
      } else if (auto op = n->get_if<ir::Op>()) {
        if (op->id() == stagejit::OpId::chunk) ++chunks;
        else if (op->schema().elementwise) ++outside_elementwise;
      }
    }
    CHECK(groups == 1);
    CHECK(chunks == 3);  // of gi, gh and the bias; the gate adds moved into the group per chunk
    CHECK(outside_elementwise == 0);
    REQUIRE(group);
    CHECK(group->outputs().size() == 2);
    // 4 chunks x 2 adds + 3 sigmoid + 2 tanh + 3 mul + 1 add
    CHECK(group->get_if<ir::FusionGroup>()->subgraph->nodes().size() == 17);

    // Both graphs run on the same inputs give the same values (groups through run_fused).
    auto run_graph = [](const ir::Graph& graph, const std::vector<at::Tensor>& inputs) {
      std::unordered_map<const ir::Value*, at::Tensor> env;
      for (size_t i = 0; i < inputs.size(); ++i) env[graph.inputs()[i]] = inputs[i];
      for (const ir::Node* n : graph.nodes()) {
        std::vector<at::Tensor> args;
        for (const ir::Value* v : n->inputs()) args.push_back(env.at(v));
        std::vector<at::Tensor> outs;
        if (auto fg = n->get_if<ir::FusionGroup>()) {
          std::string reason = "unset";
          outs = stagejit::fusion::run_fused(*fg->subgraph, args, {nullptr, "lstm group", &reason});
          CHECK(reason == "");
        } else {
          const auto& op = *n->get_if<ir::Op>();
          outs = stagejit::ops::run_forward(stagejit::ops::def(op.schema()), args, stagejit::fusion::to_core_attributes(op));
        }
        for (size_t i = 0; i < outs.size(); ++i) env[n->output(i)] = outs[i];
      }
      std::vector<at::Tensor> out;
      for (const ir::Value* v : graph.outputs()) out.push_back(env.at(v));
      return out;
    };
    at::manual_seed(7);
    std::vector<at::Tensor> inputs = {at::randn({3, 10}), at::randn({3, 20}), at::randn({3, 20}),
                                      at::randn({80, 10}), at::randn({80, 20}), at::randn({80})};
    auto want = run_graph(*original, inputs);
    auto got = run_graph(*g, inputs);
    REQUIRE(got.size() == 2);
    for (size_t i = 0; i < 2; ++i) CHECK(at::allclose(got[i], want[i], 1e-5, 1e-6));
  }

  TEST_CASE("fuse: a producer with a use before the consumer's position is not absorbed") {
    const std::string in = R"(graph(%a : Float(4)) {
  %e : Float(4) = exp(%a);
  %s : Float() = sum(%e);
  %n : Float(4) = neg(%e);
  return (%s, %n);
}
)";
    // exp's other use (sum) comes before neg, but that is fine: sum is outside and
    // before the group's anchor, so exp cannot move into a group placed at neg.
    CHECK(fused(in, 0) == ir::to_string(*ir::parse(in)));
  }

  TEST_CASE("fuse: groups that a value flows between merge (Note [Merging fusion groups])") {
    // The backward of tanh(a*b + c) * sigmoid(a): dc feeds both db (early) and da (late),
    // so growing from the anchors alone makes two groups; merged, one kernel reads gy, s,
    // t, a, b once and writes da, db, dc.
    const std::string in = R"(graph(%a : Float(8),
      %b : Float(8),
      %s : Float(8),
      %t : Float(8),
      %gy : Float(8)) {
  %gt : Float(8) = mul(%gy, %s);
  %tt : Float(8) = mul(%t, %t);
  %d : Float(8) = rsub[other=1, alpha=1](%tt);
  %dc : Float(8) = mul(%gt, %d);
  %db : Float(8) = mul(%dc, %a);
  %da1 : Float(8) = mul(%dc, %b);
  %gs : Float(8) = mul(%gy, %t);
  %om : Float(8) = rsub[other=1, alpha=1](%s);
  %q : Float(8) = mul(%gs, %om);
  %da2 : Float(8) = mul(%q, %s);
  %da : Float(8) = add[alpha=1](%da1, %da2);
  return (%da, %db, %dc);
}
)";
    const std::string out = fused(in, 1);
    auto g = ir::parse(out);
    const ir::Node* group = nullptr;
    for (const ir::Node* n : g->nodes())
      if (n->is<ir::FusionGroup>()) group = n;
    REQUIRE(group);
    CHECK(group->inputs().size() == 5);
    CHECK(group->outputs().size() == 3);
    CHECK(group->get_if<ir::FusionGroup>()->subgraph->nodes().size() == 11);
    at::manual_seed(3);
    std::vector<at::Tensor> x = {at::randn({8}), at::randn({8}), at::rand({8}), at::rand({8}), at::randn({8})};
    std::vector<at::Tensor> args;
    for (const ir::Value* v : group->inputs())
      for (size_t i = 0; i < g->inputs().size(); ++i)
        if (g->inputs()[i] == v) args.push_back(x[i]);
    REQUIRE(args.size() == 5);
    std::string reason = "unset";
    auto got = stagejit::fusion::run_fused(*group->get_if<ir::FusionGroup>()->subgraph, args, {nullptr, "merged", &reason});
    CHECK(reason == "");
    const at::Tensor &a = x[0], &b = x[1], &s = x[2], &t = x[3], &gy = x[4];
    const at::Tensor dc = gy * s * (1 - t * t);
    std::map<std::string, at::Tensor> want = {{"dc", dc}, {"db", dc * a}, {"da", dc * b + gy * t * (1 - s) * s}};
    REQUIRE(got.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      CAPTURE(group->output(i)->name());
      CHECK(at::allclose(got[i], want.at(group->output(i)->name()), 1e-6, 1e-7));
    }
  }

  TEST_CASE("fuse: a group whose value is read by another node before the later group is not merged") {
    // %m is read by mm (not fusable) before the second group's anchor: merging would
    // move its producer after its reader.
    const std::string in = R"(graph(%a : Float(2, 2),
      %b : Float(2, 2)) {
  %x : Float(2, 2) = mul(%a, %b);
  %m : Float(2, 2) = exp(%x);
  %p : Float(2, 2) = mm(%m, %a);
  %u : Float(2, 2) = neg(%m);
  %v : Float(2, 2) = mul(%u, %p);
  return (%v);
}
)";
    const std::string out = fused(in, 2);
    CHECK(out.find("mm(") < out.find("fusion_group_1("));
  }
}

