// Cross-stage gradients (Note [Cross-stage gradients] in trace/trace.hpp; issue 14): a
// compiled backward stage stops at the earlier-stage values it reads and hands their
// gradients to the call that differentiates their producers, so a backward through
// stages 1..k differentiates the forward once. Checked against libtorch's autograd at
// every order, with the option on and off, fused and not, specialised and not.
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/pinn_step.hpp"
#include "../support/staged_oracle.hpp"

#include <cmath>

namespace sj = stagejit;
using sj::testing::max_abs_diff;
using namespace sj::testing::pinn_step;

namespace {

std::vector<at::Tensor> mlp_data() {
  return {at::randn({12, 2}, at::kDouble), at::randn({2, 6}, at::kDouble) * 0.7,
          at::randn({6}, at::kDouble) * 0.1,  at::randn({6, 6}, at::kDouble) * 0.5,
          at::randn({6}, at::kDouble) * 0.1,  at::randn({6, 1}, at::kDouble) * 0.5};
}

// Number of matrix products (mm, addmm, matmul, Gemm nodes) in stages >= `from` of `g`.
std::size_t count_products(const sj::ir::Graph& g, std::size_t from) {
  std::size_t n = 0;
  for (const sj::ir::Node* node : g.nodes()) {
    const std::string d = node->describe();
    if (node->stage() >= from && (d == "mm" || d == "addmm" || d == "matmul" || d == "Gemm")) ++n;
  }
  return n;
}

}  // namespace

TEST_SUITE("closure") {

TEST_CASE("cross-stage gradients: a third-order step through compiled stages equals libtorch") {
  at::manual_seed(11);
  const auto data = mlp_data();
  const Step want = torch_step(data);
  for (bool cut : {true, false})
    for (bool fuse : {true, false})
      for (bool specialize : {true, false}) {
        CAPTURE(cut);
        CAPTURE(fuse);
        CAPTURE(specialize);
        auto net = sj::compile(mlp, {.derivatives = 3, .fuse = fuse, .specialize = specialize,
                                     .cross_stage_gradients = cut});
        // Twice: the second step runs the cached stage variants.
        for (int round = 0; round < 2; ++round) {
          CAPTURE(round);
          const Step got = sj_step(net, data);
          CHECK(std::abs(got.loss - want.loss) <= 1e-12 * std::abs(want.loss));
          REQUIRE(got.grads.size() == want.grads.size());
          for (std::size_t i = 0; i < want.grads.size(); ++i) {
            CAPTURE(i);
            REQUIRE(got.grads[i].defined());
            CHECK(max_abs_diff(got.grads[i], want.grads[i]) <= 1e-10 * (1 + want.grads[i].abs().max().item<double>()));
          }
        }
      }
}

TEST_CASE("cross-stage gradients: the later stages no longer differentiate the forward again") {
  at::manual_seed(12);
  const auto data = mlp_data();
  sj::variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  auto cut = sj::compile(mlp, {.derivatives = 3, .fuse = false, .cross_stage_gradients = true});
  auto whole = sj::compile(mlp, {.derivatives = 3, .fuse = false, .cross_stage_gradients = false});
  const auto& gc = *cut.graph_for(in);
  const auto& gw = *whole.graph_for(in);
  // Stages 2 and 3 hold fewer matrix products: they stop at the activations of stage 0
  // (and at the values of stage 1) instead of differentiating the forward's products again.
  const std::size_t mm_cut = count_products(gc, 2), mm_whole = count_products(gw, 2);
  CAPTURE(mm_cut);
  CAPTURE(mm_whole);
  CHECK(mm_cut < mm_whole);

  // The trace's bookkeeping: stages 2 and 3 feed gradient inputs of stages 1 and 2, every
  // reference names an existing input, and the flags match the graph.
  sj::Trace tr = sj::trace(mlp, in, {.derivatives = 3, .cross_stage_gradients = true});
  const auto& g = *tr.graph();
  std::size_t fed = 0;
  for (std::size_t s = 0; s < tr.num_stages(); ++s) {
    CAPTURE(s);
    CHECK(tr.flags(s).inputs.size() == g.stage_inputs(s).size());
    CHECK(tr.flags(s).outputs.size() == g.stage_outputs(s).size());
    CHECK(tr.gradient_of(s).size() + tr.feeds(s).size() == g.stage_outputs(s).size() - (s == 0 ? g.stage_outputs(0).size() : 0));
    for (std::size_t gi : tr.gradient_of(s)) CHECK(gi < g.inputs().size());
    for (const auto& f : tr.feeds(s)) {
      CHECK(f.stage >= 1);
      CHECK(f.stage < s);
      CHECK(f.index < g.stage_inputs(f.stage).size());
      // An extra input, after the regular ones (one per output of the stage before that
      // requires grad).
      std::size_t regular = 0;
      for (const auto& fl : tr.flags(f.stage - 1).outputs) regular += fl.requires_grad ? 1 : 0;
      CHECK(f.index >= regular);
      ++fed;
    }
  }
  CHECK(fed > 0);
  // The seed's trace (the default of `trace`) has no cross-stage gradients.
  sj::Trace seed = sj::trace(mlp, in, {.derivatives = 3});
  for (std::size_t s = 0; s < seed.num_stages(); ++s) CHECK(seed.feeds(s).empty());
}

TEST_CASE("cross-stage gradients: first and second derivatives of a twice-compiled function") {
  at::manual_seed(13);
  const auto data = mlp_data();
  std::vector<torch::Tensor> tl;
  for (const auto& t : data) tl.push_back(t.detach().clone().set_requires_grad(true));
  auto tu = torch_mlp(tl).sum();
  auto t_gx = torch::autograd::grad({tu}, {tl[0]}, {}, true, true)[0];
  auto t_gw = torch::autograd::grad({(t_gx * t_gx).sum()}, {tl[1], tl[3], tl[0]}, {}, true);
  for (bool specialize : {true, false}) {
    CAPTURE(specialize);
    auto f = sj::compile(mlp, {.derivatives = 2, .specialize = specialize, .cross_stage_gradients = true});
    sj::variable_list in;
    for (const auto& t : data) in.emplace_back(t, true);
    auto u = sj::sum(f(in)[0]);
    auto gx = sj::grad({u}, {in[0]}, {}, true)[0];
    CHECK(max_abs_diff(gx.data(), t_gx) <= 1e-12);
    auto gw = sj::grad({sj::sum(sj::mul(gx, gx))}, {in[1], in[3], in[0]}, {}, /*create_graph=*/true);
    for (std::size_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(max_abs_diff(gw[i].data(), t_gw[i]) <= 1e-10);
    }
    // A third derivative was not compiled: asking for one throws, whichever way its
    // gradient would flow.
    CHECK_THROWS_WITH_AS(sj::grad({sj::sum(gw[0])}, {in[1]}), doctest::Contains("compiled only for 2 derivatives"),
                         sj::Error);
  }
}

TEST_CASE("cross-stage gradients: pruned zero outputs keep the graph valid; off changes nothing") {
  at::manual_seed(14);
  // w's product is never used: stage 1's extra input for it is never fed, and stage 1's
  // gradient of w becomes an undefined output made at stage 1 (placed among stage 1's
  // nodes: node stages never decrease along the list).
  auto f = [](const sj::variable_list& in) -> sj::variable_list {
    (void)sj::mul(in[1], 2.0);
    return {sj::sum(sj::tanh(sj::mul(in[0], in[0])))};
  };
  sj::variable_list in{sj::Variable(at::randn({5}, at::kDouble), true),
                       sj::Variable(at::randn({5}, at::kDouble), true)};
  sj::Trace tr = sj::trace(f, in, {.derivatives = 2, .cross_stage_gradients = true});
  CHECK_NOTHROW(sj::ir::lint(*tr.graph()));
  auto cf = sj::compile(f, {.derivatives = 2, .cross_stage_gradients = true});
  CHECK_NOTHROW(sj::ir::lint(*cf.graph_for(in)));

  // Off (the default): the grad_fn past the last compiled stage, which throws when run,
  // has only the inputs' edges, as before (no edge to the chain's compiled calls, which
  // would keep their saved activations alive and make more of the graph reachable).
  auto once = sj::compile(f, {.derivatives = 1});
  auto y = once(in)[0];
  auto g = sj::grad({y}, {in[0]}, {}, /*create_graph=*/true)[0];
  REQUIRE(g.grad_fn());
  for (const auto& e : g.grad_fn()->next_functions) {
    REQUIRE(e.function);
    CHECK_FALSE(std::holds_alternative<sj::ClosureFunction>(e.function->kind));
  }
  auto unused = sj::grad({sj::sum(g)}, {y}, {}, false, /*allow_unused=*/true);
  CHECK_FALSE(unused[0].defined());
}

// Note [Choosing cross-stage gradients] (closure/compile-inl.hpp): unset, the option is
// chosen per input spec: off where a backward stage runs its products in row-tiled regions
// (layers of at most 128 units, any number of rows from 2: also 96 units, which were traced
// with them until the regions were counted at their own width), on elsewhere (here: layers
// of 160 units, products the regions do not take); set, it is what was asked. Results
// equal libtorch's either way.
TEST_CASE("cross-stage gradients: chosen per spec when the option is unset") {
  at::manual_seed(13);
  auto layers_of = [](int64_t rows, int64_t h) {
    return std::vector<at::Tensor>{at::randn({rows, 2}, at::kDouble), at::randn({2, h}, at::kDouble) * 0.7,
                                   at::randn({h}, at::kDouble) * 0.1, at::randn({h, h}, at::kDouble) * 0.1,
                                   at::randn({h}, at::kDouble) * 0.1, at::randn({h, 1}, at::kDouble) * 0.1};
  };
  const std::vector<at::Tensor> wide = layers_of(12, 160), medium = layers_of(300, 96);
  auto tall = mlp_data();
  tall[0] = at::randn({4096, 2}, at::kDouble);
  auto as_in = [](const std::vector<at::Tensor>& d) {
    sj::variable_list in;
    for (const auto& t : d) in.emplace_back(t, true);
    return in;
  };
  auto net = sj::compile(mlp, {.derivatives = 3});
  CHECK(net.closure_for(as_in(wide))->cross_stage);
  CHECK(net.stats().cross_stage_traces == 1);
  if (sj::ops::small_mm_enabled()) {
    CHECK_FALSE(net.closure_for(as_in(tall))->cross_stage);  // row-tiled: re-differentiating is cheaper
    CHECK_FALSE(net.closure_for(as_in(medium))->cross_stage);
  } else {
    CHECK(net.closure_for(as_in(tall))->cross_stage);  // no LIBXSMM, no row-tiled regions
    CHECK(net.closure_for(as_in(medium))->cross_stage);
  }
  auto untiled = sj::compile(mlp, {.derivatives = 3, .tile_rows = 0});
  CHECK(untiled.closure_for(as_in(tall))->cross_stage);
  auto off = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false});
  CHECK_FALSE(off.closure_for(as_in(wide))->cross_stage);
  CHECK(off.stats().cross_stage_traces == 0);
  auto on = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = true});
  CHECK(on.closure_for(as_in(tall))->cross_stage);
  // One derivative has no cross-stage gradients to hand on.
  auto first = sj::compile(mlp, {.derivatives = 1});
  CHECK_FALSE(first.closure_for(as_in(wide))->cross_stage);
  // Both choices give libtorch's step.
  for (const std::vector<at::Tensor>* d : {&wide, &medium, static_cast<const std::vector<at::Tensor>*>(&tall)}) {
    const Step want = torch_step(*d);
    const Step got = sj_step(net, *d);
    CHECK(std::abs(got.loss - want.loss) <= 1e-12 * std::abs(want.loss));
    for (std::size_t i = 0; i < want.grads.size(); ++i)
      CHECK(max_abs_diff(got.grads[i], want.grads[i]) <= 1e-10 * (1 + want.grads[i].abs().max().item<double>()));
  }
}

}  // TEST_SUITE
