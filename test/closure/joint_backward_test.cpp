// The joint backward of a staged call (Note [Joint stage] in ir/graph.hpp, Note [Joint
// backward] in closure/autograd_closure.hpp, Note [Joint nodes] in src/engine.cpp; issue
// 32 item 3): one backward that reaches the compiled calls of stages 1..k of one chain
// (a PINN loss on u, u_x and u_xx) runs them as one compiled sweep. Checked against
// libtorch's autograd in double, for the full chain, a chain with a member left out, a
// chain whose members reach each other (not joined), create_graph (not joined) and with
// the option off; and against the IR: the joint stage's variant is what ran. Note [Joint
// siblings] (passes/joint_siblings.hpp): a Laplacian from one grad per input column, whose
// calls of the last stage are siblings, runs them in the same sweep.
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/pinn_step.hpp"

#include <algorithm>
#include <cmath>
#include <string>

namespace sj = stagejit;
using namespace sj::testing::pinn_step;

namespace {

sj::variable_list inputs_of(const std::vector<at::Tensor>& data) {
  sj::variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  return in;
}

std::vector<torch::Tensor> torch_inputs(const std::vector<at::Tensor>& data) {
  std::vector<torch::Tensor> in;
  for (const auto& t : data) in.push_back(t.detach().clone().set_requires_grad(true));
  return in;
}

double rel(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / (1.0 + want.abs().max().item<double>());
}

void check_grads(const std::vector<at::Tensor>& got, const std::vector<torch::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    REQUIRE(got[i].defined());
    CHECK(rel(got[i], want[i]) <= 1e-10);
  }
}

// The variants of the joint stage that were built (Note [Joint backward]).
std::size_t joint_variants(const sj::closure::MultiStageClosure& c) {
  std::size_t n = 0;
  for (const auto& v : c.variants()) n += c.joint_stage != 0 && v->key.stage == c.joint_stage;
  return n;
}

// Variants of the regular backward stages built without captures (what a final backward
// through the calls one by one runs).
std::size_t non_capturing_backward_variants(const sj::closure::MultiStageClosure& c) {
  std::size_t n = 0;
  for (const auto& v : c.variants())
    n += v->key.stage >= 1 && v->key.stage < c.num_stages() && !v->key.captures;
  return n;
}

// Note [Joint siblings]: inputs of `mlp` with `dim` input columns.
std::vector<at::Tensor> data_of_dim(int64_t n, int64_t h, int64_t dim) {
  auto d = mlp_data(n, h);
  d[0] = at::rand({n, dim}, at::kDouble) * 2 - 1;
  d[1] = at::randn({dim, h}, at::kDouble) * 0.7;
  return d;
}

// A Poisson-like loss written as a user writes a Laplacian: one grad per input column of
// u_x, each differentiated again, and a seed per column (`seeds[i]`, ones when undefined).
sj::Variable laplacian_loss(const sj::variable_list& in, const sj::Variable& u, const sj::variable_list& seeds) {
  const auto x = in[0];
  const int64_t dim = x.data().size(1);
  auto du = sj::grad({u}, {x}, {sj::Variable(at::ones_like(u.data()))}, true)[0];
  sj::Variable lap;
  for (int64_t i = 0; i < dim; ++i) {
    auto di = sj::narrow(du, 1, i, 1);
    auto seed = seeds.size() > static_cast<std::size_t>(i) && seeds[i].defined() ? seeds[i]
                                                                               : sj::Variable(at::ones_like(di.data()));
    auto dii = sj::narrow(sj::grad({di}, {x}, {seed}, true)[0], 1, i, 1);
    lap = i == 0 ? dii : sj::add(lap, dii);
  }
  auto r = sj::add(lap, sj::mul(u, u));
  return sj::add(sj::mean(sj::mul(r, r)), sj::mean(sj::mul(u, u)));
}

torch::Tensor torch_laplacian_loss(const std::vector<torch::Tensor>& in, const torch::Tensor& u,
                                   const std::vector<torch::Tensor>& seeds) {
  const auto& x = in[0];
  auto du = torch::autograd::grad({u}, {x}, {torch::ones_like(u)}, true, true)[0];
  torch::Tensor lap;
  for (int64_t i = 0; i < x.size(1); ++i) {
    auto di = du.narrow(1, i, 1);
    auto seed = seeds.size() > static_cast<std::size_t>(i) && seeds[i].defined() ? seeds[i] : torch::ones_like(di);
    auto dii = torch::autograd::grad({di}, {x}, {seed}, true, true)[0].narrow(1, i, 1);
    lap = i == 0 ? dii : lap + dii;
  }
  auto r = lap + u * u;
  return (r * r).mean() + (u * u).mean();
}

// Variants built of the regular stage `s`.
std::size_t stage_variants(const sj::closure::MultiStageClosure& c, std::size_t s) {
  std::size_t n = 0;
  for (const auto& v : c.variants()) n += v->key.stage == s;
  return n;
}

// How many sibling copies ran in the joint stage's variants: per variant, the copies
// with a defined gradient input (the inputs after the chain's, `gradients + values` per copy).
std::size_t siblings_joined(const sj::closure::MultiStageClosure& c) {
  std::size_t most = 0;
  const auto& layout = c.joint_siblings;
  if (layout.copies == 0) return 0;
  const std::size_t per_copy = layout.gradients + layout.values;
  const std::size_t inputs = c.plan.stage_inputs(c.joint_stage).size();
  const std::size_t first = inputs - layout.copies * per_copy;
  for (const auto& v : c.variants()) {
    if (v->key.stage != c.joint_stage) continue;
    std::size_t joined = 0;
    for (std::size_t j = 0; j < layout.copies; ++j) {
      bool any = false;
      for (std::size_t i = 0; i < layout.gradients; ++i) any = any || v->key.defined_inputs[first + j * per_copy + i];
      joined += any;
    }
    most = std::max(most, joined);
  }
  return most;
}

}  // namespace

TEST_SUITE("closure") {

TEST_CASE("joint siblings: a Laplacian from one grad per column runs in one sweep and equals libtorch") {
  at::manual_seed(26);
  for (int64_t dim : {2, 3, 4}) {
    for (int64_t n : {48, 4200}) {  // untiled, and row-tiled where LIBXSMM is found
      CAPTURE(dim);
      CAPTURE(n);
      const auto data = data_of_dim(n, 7, dim);
      auto tin = torch_inputs(data);
      auto tloss = torch_laplacian_loss(tin, torch_mlp(tin), {});
      auto twant = torch::autograd::grad({tloss}, std::vector<torch::Tensor>(tin.begin() + 1, tin.end()));
      auto net = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false});
      for (int round = 0; round < 2; ++round) {
        CAPTURE(round);
        auto in = inputs_of(data);
        auto loss = laplacian_loss(in, net(in)[0], {});
        CHECK(rel(loss.data(), tloss.detach()) <= 1e-12);
        auto g = sj::grad({loss}, sj::variable_list(in.begin() + 1, in.end()));
        std::vector<at::Tensor> got;
        for (const auto& v : g) got.push_back(v.data());
        check_grads(got, {twant.begin(), twant.end()});
      }
      auto closure = net.closure_for(inputs_of(data));
      REQUIRE(closure->joint_stage == 4);
      CHECK(closure->joint_siblings.copies == 2);
      CHECK(closure->joint_siblings_ok);
      // dim calls of stage 3: the chain's and dim - 1 siblings, of which two fit.
      CHECK(siblings_joined(*closure) == std::min<std::size_t>(dim - 1, 2));
      // A sibling beyond the copies runs its stage on its own.
      CHECK(stage_variants(*closure, 3) == (dim > 3 ? 1u : 0u));
    }
  }
}

TEST_CASE("joint siblings: off, each sibling runs its stage on its own with the same results") {
  at::manual_seed(27);
  const auto data = data_of_dim(40, 6, 2);
  auto tin = torch_inputs(data);
  auto tloss = torch_laplacian_loss(tin, torch_mlp(tin), {});
  auto twant = torch::autograd::grad({tloss}, std::vector<torch::Tensor>(tin.begin() + 1, tin.end()));
  sj::CompileOptions o;
  o.derivatives = 3;
  o.cross_stage_gradients = false;
  o.joint_siblings = 0;
  auto net = sj::compile(mlp, o);
  auto in = inputs_of(data);
  auto g = sj::grad({laplacian_loss(in, net(in)[0], {})}, sj::variable_list(in.begin() + 1, in.end()));
  std::vector<at::Tensor> got;
  for (const auto& v : g) got.push_back(v.data());
  check_grads(got, {twant.begin(), twant.end()});
  auto closure = net.closure_for(in);
  CHECK(closure->joint_siblings.copies == 0);
  CHECK(siblings_joined(*closure) == 0);
  CHECK(stage_variants(*closure, 3) == 1);
}

// A sibling whose grad output is computed from u reaches the chain's call of stage 1
// through it: the chain still runs as one sweep, that sibling on its own.
TEST_CASE("joint siblings: a sibling reaching a member leaves the chain joined") {
  at::manual_seed(29);
  const auto data = data_of_dim(30, 5, 2);
  auto tin = torch_inputs(data);
  auto tu = torch_mlp(tin);
  auto tloss = torch_laplacian_loss(tin, tu, {torch::Tensor(), torch::sin(tu)});
  auto twant = torch::autograd::grad({tloss}, std::vector<torch::Tensor>(tin.begin() + 1, tin.end()));
  auto net = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false});
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    auto in = inputs_of(data);
    auto u = net(in)[0];
    auto g = sj::grad({laplacian_loss(in, u, {sj::Variable(), sj::sin(u)})}, sj::variable_list(in.begin() + 1, in.end()));
    std::vector<at::Tensor> got;
    for (const auto& v : g) got.push_back(v.data());
    check_grads(got, {twant.begin(), twant.end()});
  }
  auto closure = net.closure_for(inputs_of(data));
  CHECK(joint_variants(*closure) == 1);
  CHECK(siblings_joined(*closure) == 0);
  CHECK(stage_variants(*closure, 3) == 1);
}

// A sibling whose grad output requires grad and is differentiated: the gradient of its
// own stage-2 input is needed, which the copies leave to the chain's call, so that
// sibling runs apart (the chain's call and the other sibling still run as one).
TEST_CASE("joint siblings: a sibling that needs the gradient of its own seed runs apart") {
  at::manual_seed(28);
  const auto data = data_of_dim(36, 5, 3);
  auto seed_data = at::rand({36, 1}, at::kDouble) + 0.5;
  auto tin = torch_inputs(data);
  auto tseed = seed_data.clone().set_requires_grad(true);
  auto tloss = torch_laplacian_loss(tin, torch_mlp(tin), {torch::Tensor(), tseed});
  std::vector<torch::Tensor> twrt(tin.begin() + 1, tin.end());
  twrt.push_back(tseed);
  auto twant = torch::autograd::grad({tloss}, twrt);

  auto net = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false});
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    auto in = inputs_of(data);
    sj::Variable seed(seed_data, true);
    auto loss = laplacian_loss(in, net(in)[0], {sj::Variable(), seed});
    sj::variable_list wrt(in.begin() + 1, in.end());
    wrt.push_back(seed);
    auto g = sj::grad({loss}, wrt);
    std::vector<at::Tensor> got;
    for (const auto& v : g) got.push_back(v.data());
    check_grads(got, {twant.begin(), twant.end()});
  }
  CHECK(siblings_joined(*net.closure_for(inputs_of(data))) >= 1);
}


TEST_CASE("joint backward: the PINN step's final backward runs the joint stage and equals libtorch") {
  at::manual_seed(21);
  for (int64_t n : {64, 4200}) {  // untiled, and row-tiled where LIBXSMM is found
    CAPTURE(n);
    const auto data = mlp_data(n, 8);
    const Step want = torch_step(data);
    auto net = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false});
    for (int round = 0; round < 2; ++round) {
      CAPTURE(round);
      const Step got = sj_step(net, data);
      CHECK(std::abs(got.loss - want.loss) <= 1e-12 * std::abs(want.loss));
      check_grads(got.grads, {want.grads.begin(), want.grads.end()});
    }
    auto closure = net.closure_for(inputs_of(data));
    REQUIRE(closure->joint_stage == 4);
    CHECK(closure->num_stages() == 4);
    CHECK(net.graph_for(inputs_of(data))->num_stages() == 5);
    CHECK(joint_variants(*closure) == 1);
    // The calls of stages 1..3 did not run one by one for the final backward.
    CHECK(non_capturing_backward_variants(*closure) == 0);
  }
}

TEST_CASE("joint backward: off, the stages run one by one with the same results") {
  at::manual_seed(22);
  const auto data = mlp_data(48, 6);
  const Step want = torch_step(data);
  auto net = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false, .joint_backward = false});
  check_grads(sj_step(net, data).grads, {want.grads.begin(), want.grads.end()});
  auto closure = net.closure_for(inputs_of(data));
  CHECK(closure->joint_stage == 0);
  CHECK(net.graph_for(inputs_of(data))->num_stages() == 4);
  CHECK(non_capturing_backward_variants(*closure) > 0);
}

// A loss on u and u_xx only: the call of stage 2 (u_x's grad_fn) is not reached, so the
// joint stage runs with its gradients as symbolic zeros.
TEST_CASE("joint backward: a member the backward does not reach is a zero") {
  at::manual_seed(23);
  const auto data = mlp_data(40, 6);
  auto tin = torch_inputs(data);
  auto tu = torch_mlp(tin);
  auto tdu = torch::autograd::grad({tu}, {tin[0]}, {torch::ones_like(tu)}, true, true)[0];
  auto tddu = torch::autograd::grad({tdu}, {tin[0]}, {torch::ones_like(tdu)}, true, true)[0];
  auto tloss = (tddu * tddu).sum() + (tu * tu * tu).sum();
  std::vector<torch::Tensor> tparams(tin.begin() + 1, tin.end());
  auto twant = torch::autograd::grad({tloss}, tparams);

  auto net = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false});
  for (int round = 0; round < 2; ++round) {
    auto in = inputs_of(data);
    auto u = net(in)[0];
    auto du = sj::grad({u}, {in[0]}, {sj::Variable(at::ones_like(u.data()))}, true)[0];
    auto ddu = sj::grad({du}, {in[0]}, {sj::Variable(at::ones_like(du.data()))}, true)[0];
    auto loss = sj::add(sj::sum(sj::mul(ddu, ddu)), sj::sum(sj::mul(sj::mul(u, u), u)));
    auto g = sj::grad({loss}, sj::variable_list(in.begin() + 1, in.end()));
    std::vector<at::Tensor> got;
    for (const auto& v : g) got.push_back(v.data());
    check_grads(got, {twant.begin(), twant.end()});
  }
  CHECK(joint_variants(*net.closure_for(inputs_of(data))) == 1);
}

// The grad output fed to the call of stage 1 is computed from u: the call of stage 2
// reaches the call of stage 1 through it, so the two cannot run as one (the joint node
// would wait on itself) and run one after the other.
TEST_CASE("joint backward: members that reach each other run one by one") {
  at::manual_seed(24);
  const auto data = mlp_data(32, 5);
  auto tin = torch_inputs(data);
  auto tu = torch_mlp(tin);
  auto tdu = torch::autograd::grad({tu}, {tin[0]}, {torch::sin(tu)}, true, true)[0];
  auto tloss = (tdu * tdu).sum() + tu.sum();
  std::vector<torch::Tensor> tparams(tin.begin() + 1, tin.end());
  auto twant = torch::autograd::grad({tloss}, tparams);

  auto net = sj::compile(mlp, {.derivatives = 2, .cross_stage_gradients = false});
  auto in = inputs_of(data);
  auto u = net(in)[0];
  auto du = sj::grad({u}, {in[0]}, {sj::sin(u)}, true)[0];
  auto loss = sj::add(sj::sum(sj::mul(du, du)), sj::sum(u));
  auto g = sj::grad({loss}, sj::variable_list(in.begin() + 1, in.end()));
  std::vector<at::Tensor> got;
  for (const auto& v : g) got.push_back(v.data());
  check_grads(got, {twant.begin(), twant.end()});
  CHECK(joint_variants(*net.closure_for(in)) == 0);
}

// create_graph on the final backward: the joint stage records no graph, so the calls run
// one by one and the result can be differentiated again.
TEST_CASE("joint backward: create_graph runs the stages one by one") {
  at::manual_seed(25);
  const auto data = mlp_data(24, 5);
  auto tin = torch_inputs(data);
  auto tu = torch_mlp(tin);
  auto tdu = torch::autograd::grad({tu}, {tin[0]}, {torch::ones_like(tu)}, true, true)[0];
  auto tloss = (tdu * tdu).sum() + (tu * tu).sum();
  auto tg1 = torch::autograd::grad({tloss}, {tin[5]}, {}, true, true)[0];
  auto twant = torch::autograd::grad({(tg1 * tg1).sum()}, {tin[5]})[0];

  auto net = sj::compile(mlp, {.derivatives = 3, .cross_stage_gradients = false});
  auto in = inputs_of(data);
  auto u = net(in)[0];
  auto du = sj::grad({u}, {in[0]}, {sj::Variable(at::ones_like(u.data()))}, true)[0];
  auto loss = sj::add(sj::sum(sj::mul(du, du)), sj::sum(sj::mul(u, u)));
  auto g1 = sj::grad({loss}, {in[5]}, {}, /*create_graph=*/true)[0];
  CHECK(rel(g1.data(), tg1) <= 1e-10);
  auto g2 = sj::grad({sj::sum(sj::mul(g1, g1))}, {in[5]})[0];
  CHECK(rel(g2.data(), twant) <= 1e-10);
}

}  // TEST_SUITE
