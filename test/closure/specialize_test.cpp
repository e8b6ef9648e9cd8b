// Stage variants (closure/specialize.hpp, Note [Stage variants]) and symbolic zeros
// (passes/zeros.hpp): a compiled stage computes only the gradients the running backward
// asks for, does no work on undefined incoming gradients, and gives libtorch's numbers
// (issue 14; the undefined-gradient NaN of issue 20, item 1).
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/staged_oracle.hpp"

#include <cmath>

namespace sj = stagejit;
using sj::testing::max_abs_diff;

namespace {

// A two-layer tanh network and a scalar of it.
sj::variable_list net(const sj::variable_list& in) {
  auto h = sj::tanh(sj::mm(in[0], in[1]));
  return {sj::sum(sj::mul(sj::tanh(sj::mm(h, in[2])), sj::sigmoid(h)))};
}
torch::Tensor torch_net(const std::vector<torch::Tensor>& in) {
  auto h = torch::tanh(torch::mm(in[0], in[1]));
  return (torch::tanh(torch::mm(h, in[2])) * torch::sigmoid(h)).sum();
}

struct Data {
  at::Tensor x = at::randn({8, 3}, at::kDouble);
  at::Tensor w1 = at::randn({3, 5}, at::kDouble);
  at::Tensor w2 = at::randn({5, 5}, at::kDouble);
};

std::vector<torch::Tensor> torch_leaves(const Data& d) {
  std::vector<torch::Tensor> out;
  for (const auto& t : {d.x, d.w1, d.w2}) out.push_back(t.detach().clone().set_requires_grad(true));
  return out;
}

}  // namespace

TEST_SUITE("closure") {

TEST_CASE("a compiled stage asked for some gradients computes only those") {
  at::manual_seed(3);
  Data d;
  for (bool fuse : {true, false}) {
    CAPTURE(fuse);
    // The stage structure of the seed's trace (each stage differentiates the earlier ones
    // again), whose variant keys this test spells out; with cross-stage gradients the
    // backward of stage 2 also runs stage 1 (test/closure/cross_stage_test.cpp).
    auto f = sj::compile(net, {.derivatives = 2, .fuse = fuse, .cross_stage_gradients = false});
    sj::Variable x(d.x, true), w1(d.w1, true), w2(d.w2, true);
    sj::variable_list in{x, w1, w2};
    auto y = f(in)[0];
    auto closure = f.closure_for(in);
    REQUIRE(closure->specialize);
    const std::size_t full_stage1 = closure->plan.stage_nodes(1).size();

    // Oracle.
    auto tl = torch_leaves(d);
    auto ty = torch_net(tl);
    auto t_gx = torch::autograd::grad({ty}, {tl[0]}, {}, true, true)[0];
    auto t_all = torch::autograd::grad({ty}, {tl[0], tl[1], tl[2]}, {}, true, true);
    auto t_gg = torch::autograd::grad({(t_gx * t_gx).sum()}, {tl[1]}, {}, true)[0];

    // d y / d x alone, with a graph: stage 1 with outputs (x) and captures.
    auto gx = sj::grad({y}, {x}, {}, /*create_graph=*/true)[0];
    CHECK(max_abs_diff(gx.data(), t_gx) <= 1e-10);
    CHECK(closure->num_variants() == 1);
    sj::closure::StageVariantKey key;
    key.stage = 1;
    key.defined_inputs.assign(1 + closure->stages[1].prev_slots.size(), 1);
    key.needed_outputs = {1, 0, 0};
    key.captures = true;
    auto v = closure->variant(key);
    REQUIRE(v);
    CHECK(v->num_nodes < full_stage1);
    CHECK(closure->num_variants() == 1);  // the call above built exactly this one

    // A later call asking for every gradient gets them all (no grad mode: the variant
    // of stage 1 with every output and no captures).
    auto all = sj::grad({y}, {x, w1, w2});
    REQUIRE(all.size() == 3);
    for (int i = 0; i < 3; ++i) CHECK(max_abs_diff(all[i].data(), t_all[i]) <= 1e-10);

    // Second order through the variant's captures: stage 2 gets a gradient for d y/d x
    // only (the others are undefined: symbolic zeros) and is asked for w1 alone.
    const std::size_t variants_before = closure->num_variants();
    auto gg = sj::grad({sj::sum(sj::mul(gx, gx))}, {w1})[0];
    CHECK(max_abs_diff(gg.data(), t_gg) <= 1e-10);
    CHECK(closure->num_variants() == variants_before + 1);
    std::shared_ptr<const sj::closure::StageVariant> v2;
    for (const auto& candidate : closure->variants()) {
      const auto& k = candidate->key;
      if (k.stage == 2 && k.defined_inputs.size() >= 3 && k.defined_inputs[0] &&
          !k.defined_inputs[1] && !k.defined_inputs[2])
        v2 = candidate;
    }
    REQUIRE(v2);
    std::vector<char> only_w1(closure->plan.stage_outputs(2).size(), 0);
    only_w1[1] = 1;
    CHECK(v2->key.needed_outputs == only_w1);
    CHECK(v2->num_nodes < closure->plan.stage_nodes(2).size());

    // Without captures (a call outside grad mode) stage 0 computes nothing for later
    // stages: its variant is no larger than the full stage. (A NoGrad call of `f` itself
    // is another ArgSpec: nothing requires grad there, so it has its own trace.)
    {
      sj::closure::StageVariantKey key0;
      key0.stage = 0;
      key0.defined_inputs.assign(3, 1);
      key0.needed_outputs = {1};
      key0.captures = false;
      auto v0 = closure->variant(key0);
      REQUIRE(v0);
      CHECK(v0->num_nodes <= closure->plan.stage_nodes(0).size());
      sj::NoGradGuard no_grad;
      CHECK(max_abs_diff(f(in)[0].data(), ty) <= 1e-10);
    }
  }
}

TEST_CASE("specialisation can be turned off and gives the same numbers") {
  at::manual_seed(4);
  Data d;
  auto on = sj::compile(net, {.derivatives = 2});
  auto off = sj::compile(net, {.derivatives = 2, .specialize = false});
  auto run = [&](sj::CompiledFunction& f) {
    sj::Variable x(d.x, true), w1(d.w1, true), w2(d.w2, true);
    auto y = f({x, w1, w2})[0];
    auto gx = sj::grad({y}, {x}, {}, true)[0];
    return std::make_pair(gx, sj::grad({sj::sum(sj::tanh(gx))}, {w2})[0]);
  };
  auto [a1, a2] = run(on);
  auto [b1, b2] = run(off);
  CHECK(max_abs_diff(a1.data(), b1.data()) <= 1e-12);
  CHECK(max_abs_diff(a2.data(), b2.data()) <= 1e-12);
  CHECK(off.closure_for({sj::Variable(d.x, true), sj::Variable(d.w1, true),
                         sj::Variable(d.w2, true)})->num_variants() == 0);
}

TEST_CASE("an undefined incoming gradient adds nothing: no NaN from zeros times inf") {
  // Issue 20, item 1: the gradient of one output of a multi-output function, where the
  // other output's backward multiplies by an infinity.
  for (bool fuse : {true, false}) {
    CAPTURE(fuse);
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {in[0] * in[1], sj::sin(in[0])};
    }, {.derivatives = 1, .fuse = fuse});
    sj::Variable x(at::tensor({1.0, 2.0, 3.0}, at::kDouble), true);
    sj::Variable y(at::full({3}, INFINITY, at::kDouble));
    auto o = f({x, y});
    auto g = sj::grad({o[1]}, {x}, {sj::Variable(at::ones({3}, at::kDouble))})[0];
    CHECK(max_abs_diff(g.data(), at::cos(x.data())) <= 1e-12);
  }
  // The reproduction at order 2: stage 2 gets no gradient for d o[0] / d x either.
  {
    auto tx = at::tensor({1.0, 2.0, 3.0}, at::kDouble).set_requires_grad(true);
    auto ty = at::full({3}, INFINITY, at::kDouble);
    auto t_o = std::vector<torch::Tensor>{tx * ty, torch::sin(tx)};
    auto t_g = torch::autograd::grad({t_o[1]}, {tx}, {torch::ones_like(tx)}, true, true)[0];
    auto t_gg = torch::autograd::grad({t_g.sum()}, {tx})[0];
    for (bool fuse : {true, false}) {
      CAPTURE(fuse);
      auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
        return {in[0] * in[1], sj::sin(in[0])};
      }, {.derivatives = 2, .fuse = fuse});
      sj::Variable x(tx.detach(), true), y(ty);
      auto o = f({x, y});
      auto g = sj::grad({o[1]}, {x}, {sj::Variable(at::ones({3}, at::kDouble))}, true)[0];
      CHECK(max_abs_diff(g.data(), t_g) <= 1e-12);
      auto gg = sj::grad({sj::sum(g)}, {x})[0];
      CHECK(max_abs_diff(gg.data(), t_gg) <= 1e-12);
      CHECK_FALSE(at::isnan(gg.data()).any().item<bool>());
    }
  }
  // The realistic form: {exp(x), tanh(x)} where exp overflows, orders 1 and 2.
  auto body = [](const sj::variable_list& in) -> sj::variable_list {
    return {sj::exp(in[0]), sj::tanh(in[0])};
  };
  at::Tensor data = at::tensor({0.5, -1.0, 1000.0}, at::kDouble);
  auto tx = data.clone().set_requires_grad(true);
  auto t_g = torch::autograd::grad({torch::tanh(tx)}, {tx}, {torch::ones_like(tx)}, true, true)[0];
  auto t_gg = torch::autograd::grad({t_g.sum()}, {tx})[0];
  // With cross-stage gradients, stage 1's extra gradient input of exp(x) meets the
  // infinite saved value in one fused group with the gradient of tanh(x): given only
  // tanh's gradient, the group must not run on materialised zeros (0 * inf); its output
  // that becomes a pass-through is copied by the kernel instead (passes/zeros.hpp).
  for (bool cut : {false, true})
    for (bool fuse : {true, false}) {
      CAPTURE(cut);
      CAPTURE(fuse);
      auto f = sj::compile(body, {.derivatives = 2, .fuse = fuse, .cross_stage_gradients = cut});
      sj::Variable x(data, true);
      auto o = f({x});
      auto g = sj::grad({o[1]}, {x}, {sj::Variable(at::ones({3}, at::kDouble))}, true)[0];
      CHECK(max_abs_diff(g.data(), t_g) <= 1e-12);
      CHECK_FALSE(at::isnan(g.data()).any().item<bool>());
      auto gg = sj::grad({sj::sum(g)}, {x})[0];
      CHECK(max_abs_diff(gg.data(), t_gg) <= 1e-12);
      CHECK_FALSE(at::isnan(gg.data()).any().item<bool>());
    }
}

TEST_CASE("propagate_zeros: linear ops vanish, additions forward, others get zeros") {
  auto g = sj::ir::parse(R"IR(
graph(%a : Double(4), %z : Double(4), %b : Double(4)) {
  %1 : Double(4) = mul(%z, %a);
  %2 : Double(4) = add(%1, %b);
  %3 : Double(4) = sub(%a, %z);
  %4 : Double(4) = tanh(%z);
  %5 : Double(4) = mul(%4, %2);
  %6 : Double() = sum(%1);
  return (%2, %3, %5, %6);
}
)IR");
  auto live = sj::passes::propagate_zeros(*g, 0, {g->inputs()[1]});
  sj::passes::eliminate_dead_code(*g);
  // %2 is %b, %3 is %a, %6 is a zero still returned, tanh reads a materialised zeros.
  REQUIRE(live.size() == 1);
  CHECK(g->outputs()[0] == g->inputs()[2]);
  CHECK(g->outputs()[1] == g->inputs()[0]);
  CHECK(g->outputs()[3] == live[0]);
  std::string text = sj::ir::to_string(*g);
  CHECK(text.find("zeros") != std::string::npos);
  CHECK(text.find("tanh(%z)") == std::string::npos);
}

TEST_CASE("propagate_zeros: an addition that broadcasts, addmm with beta 0, a fusion group") {
  auto g = sj::ir::parse(R"IR(
graph(%z : Double(4), %c : Double(1), %m : Double(4, 3), %w : Double(3, 3), %b : Double(4, 3)) {
  %1 : Double(4) = add(%z, %c);
  %2 : Double(4, 3) = addmm[beta=0.0](%b, %m, %w);
  %3 : Double(4, 3) = mul(%2, %b);
  return (%1, %3);
}
)IR");
  // Mark %m's product zero through %m: addmm with beta = 0 ignores %b (ATen), so %2
  // and %3 are zeros; the broadcasting add keeps its op and reads a materialised zeros.
  auto live = sj::passes::propagate_zeros(*g, 0, {g->inputs()[0], g->inputs()[2]});
  sj::passes::eliminate_dead_code(*g);
  REQUIRE(live.size() == 1);
  CHECK(g->outputs()[1] == live[0]);
  const std::string text = sj::ir::to_string(*g);
  CHECK(text.find("add(") != std::string::npos);
  CHECK(text.find("zeros") != std::string::npos);
  CHECK(g->outputs()[0] != g->inputs()[1]);  // not forwarded: its shape is not %c's

  // A fusion group reading a zero gets a specialised subgraph: t = a * z + b becomes b's
  // pass-through, s = tanh(a) stays computed.
  auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
    return {sj::sum(sj::mul(sj::tanh(in[0]), in[1]) * sj::sigmoid(in[0]))};
  }, {.derivatives = 2});
  sj::Variable a(at::randn({64}, at::kDouble), true), b(at::randn({64}, at::kDouble), true);
  auto y = f({a, b})[0];
  auto ga = sj::grad({y}, {a}, {}, true)[0];
  auto gg = sj::grad({sj::sum(ga)}, {b})[0];
  auto ta = a.data().clone().set_requires_grad(true), tb = b.data().clone().set_requires_grad(true);
  auto ty = (torch::tanh(ta) * tb * torch::sigmoid(ta)).sum();
  auto tga = torch::autograd::grad({ty}, {ta}, {}, true, true)[0];
  auto tgg = torch::autograd::grad({tga.sum()}, {tb})[0];
  CHECK(max_abs_diff(ga.data(), tga) <= 1e-12);
  CHECK(max_abs_diff(gg.data(), tgg) <= 1e-12);
}

}  // TEST_SUITE
