// Note [Anticipated stages] (closure/anticipate.hpp): once two chains of calls fed the
// backward stages the same seeds, a forward call runs them ahead as one graph and the
// later calls return what it computed. Checked against libtorch's autograd in double at
// every step: the staged PINN (stages 1 and 2 ahead, undefined seeds of stage 2), the
// whole loss (its backward ahead), a seed other than the pattern's, a served call
// applied again, an input modified in place after the forward, chains that never call
// the stages (they disarm it; three misses turn it off), and the option off.
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/pinn_step.hpp"

#include <cmath>

namespace sj = stagejit;
using namespace sj::testing::pinn_step;

namespace {

double rel(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / (1.0 + want.abs().max().item<double>());
}

void check_step(const Step& got, const Step& want) {
  CHECK(std::abs(got.loss - want.loss) <= 1e-10 * (1 + std::abs(want.loss)));
  REQUIRE(got.grads.size() == want.grads.size());
  for (std::size_t i = 0; i < want.grads.size(); ++i) {
    CAPTURE(i);
    REQUIRE(got.grads[i].defined());
    CHECK(rel(got.grads[i], want.grads[i]) <= 1e-10);
  }
}

sj::variable_list leaves(const std::vector<at::Tensor>& data) {
  sj::variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  return in;
}

// u_x and u_xx of the compiled net with seeds `c` * ones (stagejit) ...
std::pair<at::Tensor, at::Tensor> sj_derivatives(sj::CompiledFunction& net, const std::vector<at::Tensor>& data, double c) {
  auto in = leaves(data);
  auto u = net(in)[0];
  auto du = sj::grad({u}, {in[0]}, {sj::Variable(at::ones_like(u.data()) * c)}, true)[0];
  auto u_x = sj::narrow(du, 1, 1, 1);
  auto ddu = sj::grad({u_x}, {in[0]}, {sj::Variable(at::ones_like(u_x.data()) * c)}, true)[0];
  return {du.data(), ddu.data()};
}
// ... and libtorch's.
std::pair<at::Tensor, at::Tensor> torch_derivatives(const std::vector<at::Tensor>& data, double c) {
  std::vector<torch::Tensor> in;
  for (const auto& t : data) in.push_back(t.detach().clone().set_requires_grad(true));
  auto u = torch_mlp(in);
  auto du = torch::autograd::grad({u}, {in[0]}, {torch::ones_like(u) * c}, true, true)[0];
  auto ddu = torch::autograd::grad({du.narrow(1, 1, 1)}, {in[0]}, {torch::ones_like(u) * c}, true, true)[0];
  return {du.detach(), ddu.detach()};
}

}  // namespace

TEST_CASE("a staged PINN step runs its derivatives ahead from the third step and equals libtorch") {
  at::manual_seed(11);
  sj::CompiledFunction net = sj::compile(mlp, sj::CompileOptions{.derivatives = 3});
  std::vector<at::Tensor> data;
  for (int step = 0; step < 5; ++step) {
    CAPTURE(step);
    data = mlp_data(40, 6);  // new points and weights each step: only the seeds repeat
    check_step(sj_step(net, data), torch_step(data));
  }
  const auto stats = net.closure_for(leaves(data))->anticipation_stats();
  CHECK(stats.chains == 5);
  CHECK(stats.anticipated == 3);  // steps 2, 3 and 4
  CHECK(stats.hits == 6);         // the grad calls of stages 1 and 2 in each
  CHECK(stats.misses == 0);
  CHECK_FALSE(stats.disabled);
}

TEST_CASE("a whole loss runs its backward ahead from the third step and equals libtorch") {
  at::manual_seed(12);
  sj::CompiledFunction loss = sj::compile(mlp_loss, sj::CompileOptions{.derivatives = 1});
  std::vector<at::Tensor> data;
  for (int step = 0; step < 4; ++step) {
    CAPTURE(step);
    data = mlp_data(40, 6);
    check_step(sj_loss_step(loss, data), torch_step(data));
  }
  const auto stats = loss.closure_for(leaves(data))->anticipation_stats();
  CHECK(stats.anticipated == 2);
  CHECK(stats.hits == 2);
  CHECK(stats.misses == 0);
}

TEST_CASE("a seed other than the pattern's runs its stage from the forward's inputs") {
  at::manual_seed(13);
  sj::CompiledFunction net = sj::compile(mlp, sj::CompileOptions{.derivatives = 3});
  const auto data = mlp_data(30, 5);
  for (int step = 0; step < 3; ++step) check_step(sj_step(net, data), torch_step(data));
  // Armed: the next forward runs stages 1 and 2 ahead for seeds of ones.
  for (double c : {2.0, 1.0, -0.5}) {
    CAPTURE(c);
    const auto [du, ddu] = sj_derivatives(net, data, c);
    const auto [want_du, want_ddu] = torch_derivatives(data, c);
    CHECK(rel(du, want_du) <= 1e-10);
    CHECK(rel(ddu, want_ddu) <= 1e-10);
  }
  const auto stats = net.closure_for(leaves(data))->anticipation_stats();
  CHECK(stats.misses >= 1);
  check_step(sj_step(net, data), torch_step(data));
}

TEST_CASE("a served stage call applied again, and an input modified after the forward") {
  at::manual_seed(14);
  sj::CompiledFunction net = sj::compile(mlp, sj::CompileOptions{.derivatives = 3});
  const auto data = mlp_data(30, 5);
  for (int step = 0; step < 3; ++step) check_step(sj_step(net, data), torch_step(data));
  const auto [want_du, want_ddu] = torch_derivatives(data, 1.0);
  {
    auto in = leaves(data);
    auto u = net(in)[0];
    const sj::Variable ones(at::ones_like(u.data()));
    auto du1 = sj::grad({u}, {in[0]}, {ones}, true)[0];  // served by the run ahead
    auto du2 = sj::grad({u}, {in[0]}, {ones}, true)[0];  // the same call again: runs its stage
    CHECK(rel(du1.data(), want_du) <= 1e-10);
    CHECK(rel(du2.data(), want_du) <= 1e-10);
    auto ddu = sj::grad({sj::narrow(du2, 1, 1, 1)}, {in[0]}, {sj::Variable(at::ones_like(u.data()))}, true)[0];
    CHECK(rel(ddu.data(), want_ddu) <= 1e-10);
  }
  for (bool anticipate : {true, false}) {
    CAPTURE(anticipate);
    sj::CompiledFunction f = sj::compile(mlp, sj::CompileOptions{.derivatives = 3, .anticipate_stages = anticipate});
    for (int step = 0; step < 3; ++step) check_step(sj_step(f, data), torch_step(data));
    std::vector<at::Tensor> copy;
    for (const auto& t : data) copy.push_back(t.clone());
    auto in = leaves(copy);
    auto u = f(in)[0];
    copy[3].add_(1.0);  // W2, read saved by stage 1, modified in place
    CHECK_THROWS_AS(sj::grad({u}, {in[0]}, {sj::Variable(at::ones_like(u.data()))}, true), sj::Error);
    CHECK(f.closure_for(in)->anticipation_stats().anticipated == (anticipate ? 1u : 0u));
  }
}

TEST_CASE("chains that leave the pattern disarm it; three misses turn anticipation off") {
  at::manual_seed(15);
  sj::CompiledFunction net = sj::compile(mlp, sj::CompileOptions{.derivatives = 3});
  const auto data = mlp_data(30, 5);
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    // Two chains confirm the pattern, the third runs ahead ...
    for (int step = 0; step < 3; ++step) check_step(sj_step(net, data), torch_step(data));
    // ... and so does this forward, whose derivatives are never asked for: a miss, and
    // the pattern waits for two confirming chains again.
    auto in = leaves(data);
    (void)net(in)[0];
  }
  const auto stats = net.closure_for(leaves(data))->anticipation_stats();
  CHECK(stats.anticipated == 6);
  CHECK(stats.hits == 6);
  CHECK(stats.misses == 3);
  CHECK(stats.disabled);
  for (int step = 0; step < 3; ++step) check_step(sj_step(net, data), torch_step(data));
  CHECK(net.closure_for(leaves(data))->anticipation_stats().anticipated == 6);
}

TEST_CASE("seeds of another dtype are not anticipated; a seed or weight modified between calls is treated as without") {
  at::manual_seed(16);
  const auto data = mlp_data(30, 5);
  const auto [want_du, want_ddu] = torch_derivatives(data, 1.0);
  {
    // A double net differentiated with float seeds: each call casts them (as libtorch's
    // engine casts a gradient to its input's dtype); nothing runs ahead of such calls.
    sj::CompiledFunction net = sj::compile(mlp, sj::CompileOptions{.derivatives = 3});
    for (int step = 0; step < 4; ++step) {
      CAPTURE(step);
      auto in = leaves(data);
      auto u = net(in)[0];
      auto du = sj::grad({u}, {in[0]}, {sj::Variable(at::ones({30, 1}, at::kFloat))}, true)[0];
      auto ddu = sj::grad({sj::narrow(du, 1, 1, 1)}, {in[0]}, {sj::Variable(at::ones({30, 1}, at::kFloat))}, true)[0];
      CHECK(bool(du.data().scalar_type() == at::kDouble));
      CHECK(rel(du.data(), want_du) <= 1e-10);
      CHECK(rel(ddu.data(), want_ddu) <= 1e-10);
    }
    CHECK(net.closure_for(leaves(data))->anticipation_stats().anticipated == 0);
  }
  // A seed, or a weight, modified in place between the calls of stages 1 and 2: a served
  // call refuses (or takes) it exactly as a call running its stage does.
  for (int what : {0, 1}) {
    CAPTURE(what);
    bool threw[2] = {false, false};
    for (bool anticipate : {true, false}) {
      CAPTURE(anticipate);
      sj::CompiledFunction net = sj::compile(mlp, sj::CompileOptions{.derivatives = 3, .anticipate_stages = anticipate});
      std::vector<at::Tensor> copy;
      for (const auto& t : data) copy.push_back(t.clone());
      for (int step = 0; step < 3; ++step) check_step(sj_step(net, copy), torch_step(copy));
      auto in = leaves(copy);
      auto u = net(in)[0];
      at::Tensor seed = at::ones_like(u.data());
      auto du = sj::grad({u}, {in[0]}, {sj::Variable(seed)}, true)[0];
      CHECK(rel(du.data(), want_du) <= 1e-10);
      (what == 0 ? seed : copy[3]).mul_(2.0);
      try {
        auto ddu = sj::grad({sj::narrow(du, 1, 1, 1)}, {in[0]}, {sj::Variable(at::ones_like(u.data()))}, true)[0];
        CHECK(rel(ddu.data(), want_ddu) <= 1e-10);  // what it read was saved before the change
      } catch (const sj::Error&) {
        threw[anticipate ? 1 : 0] = true;
      }
      CHECK(net.closure_for(in)->anticipation_stats().anticipated == (anticipate ? 1u : 0u));
    }
    CHECK(threw[0] == threw[1]);
    if (what == 1) CHECK(threw[1]);  // stage 2 reads W2 saved
  }
}

TEST_CASE("a bias changed in place after a run ahead, then a call with other seeds: as libtorch") {
  // libtorch saves no bias for the backward, so it takes the change; so must a call that
  // runs its stage after all (stage 0 reruns from the forward's own inputs).
  at::manual_seed(17);
  const auto data = mlp_data(30, 5);
  const auto [want_du, want_ddu] = torch_derivatives(data, 2.0);
  sj::CompiledFunction net = sj::compile(mlp, sj::CompileOptions{.derivatives = 3});
  std::vector<at::Tensor> copy;
  for (const auto& t : data) copy.push_back(t.clone());
  for (int step = 0; step < 3; ++step) check_step(sj_step(net, copy), torch_step(copy));
  auto in = leaves(copy);
  auto u = net(in)[0];  // runs stages 1 and 2 ahead for seeds of ones
  copy[4].add_(0.25);   // b2
  auto du = sj::grad({u}, {in[0]}, {sj::Variable(at::ones_like(u.data()) * 2.0)}, true)[0];
  CHECK(rel(du.data(), want_du) <= 1e-10);
  auto ddu = sj::grad({sj::narrow(du, 1, 1, 1)}, {in[0]}, {sj::Variable(at::ones_like(u.data()) * 2.0)}, true)[0];
  CHECK(rel(ddu.data(), want_ddu) <= 1e-10);
  CHECK(net.closure_for(in)->anticipation_stats().anticipated == 1);
}

// Note [Forward calls whose backward never comes]: a training step with its gradients
// inside, compiled with the default one derivative, is called in grad mode and its
// outputs are never differentiated: from the third call the forward saves nothing for
// stage 1. A backward asked for after all reruns the forward from its inputs' copies.
namespace {

// in = mlp's inputs; returns the loss and its gradients in the weights (with a graph, so
// that stage 1 can differentiate them).
sj::variable_list step_with_grads(const sj::variable_list& in) {
  sj::Variable loss = step_loss(in, mlp(in)[0]);
  sj::variable_list out{loss};
  for (const auto& g : sj::grad({loss}, sj::variable_list(in.begin() + 1, in.end()), {}, true)) out.push_back(g);
  return out;
}

// The gradient of sum(dloss/dW2 * v) in W3, where v is fixed: through stage 1 (stagejit)
// and libtorch's double backward.
at::Tensor torch_mixed(const std::vector<at::Tensor>& data, const at::Tensor& v) {
  std::vector<torch::Tensor> in;
  for (const auto& t : data) in.push_back(t.detach().clone().set_requires_grad(true));
  auto loss = torch_loss(in);
  auto g_w2 = torch::autograd::grad({loss}, {in[3]}, {}, true, true)[0];
  return torch::autograd::grad({(g_w2 * v).sum()}, {in[5]})[0].detach();
}

}  // namespace

TEST_CASE("a step whose outputs are never differentiated saves nothing for stage 1 from the third call") {
  at::manual_seed(18);
  sj::CompiledFunction step = sj::compile(step_with_grads);  // one derivative: the default
  std::vector<at::Tensor> data;
  for (int call = 0; call < 5; ++call) {
    CAPTURE(call);
    data = mlp_data(40, 6);
    auto out = step(leaves(data));
    const Step want = torch_step(data);
    Step got{out[0].data().item<double>(), {}};
    for (std::size_t i = 1; i < out.size(); ++i) got.grads.push_back(out[i].data());
    check_step(got, want);
  }
  auto stats = step.closure_for(leaves(data))->anticipation_stats();
  CHECK(stats.chains == 5);
  CHECK(stats.uncaptured == 3);  // calls 2, 3 and 4
  CHECK(stats.uncaptured_misses == 0);
  CHECK(stats.anticipated == 0);

  // A backward after all, through an uncaptured call: stage 1 reruns the forward.
  const at::Tensor v = at::randn({6, 6}, at::kDouble);
  for (int call = 0; call < 2; ++call) {
    CAPTURE(call);
    auto in = leaves(data);
    auto out = step(in);
    auto got = sj::grad({sj::sum(sj::mul(out[3], sj::Variable(v)))}, {in[5]})[0];
    CHECK(rel(got.data(), torch_mixed(data, v)) <= 1e-10);
  }
  stats = step.closure_for(leaves(data))->anticipation_stats();
  CHECK(stats.uncaptured == 4);  // the first of the two (the second follows a chain that called stage 1)
  CHECK(stats.uncaptured_misses == 1);
  CHECK_FALSE(stats.uncaptured_disabled);
}

TEST_CASE("an uncaptured forward refuses a weight modified in place before its backward, as without") {
  at::manual_seed(19);
  const auto data = mlp_data(30, 5);
  const at::Tensor v = at::randn({5, 5}, at::kDouble);
  for (int what : {0, 1}) {  // 0: W2, which stage 1 reads saved; 1: the returned gradient of W2
    CAPTURE(what);
    bool threw[2] = {false, false};
    for (bool anticipate : {true, false}) {
      CAPTURE(anticipate);
      sj::CompiledFunction step = sj::compile(step_with_grads, sj::CompileOptions{.anticipate_stages = anticipate});
      std::vector<at::Tensor> copy;
      for (const auto& t : data) copy.push_back(t.clone());
      for (int call = 0; call < 2; ++call) (void)step(leaves(copy));
      auto in = leaves(copy);
      auto out = step(in);
      CHECK(step.closure_for(in)->anticipation_stats().uncaptured == 0);  // counted when its chain ends
      if (what == 0)
        copy[3].add_(0.5);
      else
        out[3].data().mul_(2.0);
      try {
        auto got = sj::grad({sj::sum(sj::mul(out[3], sj::Variable(v)))}, {in[5]})[0];
        CHECK(rel(got.data(), torch_mixed(data, v)) <= 1e-10);  // what it read was saved before
      } catch (const sj::Error&) {
        threw[anticipate ? 1 : 0] = true;
      }
    }
    CHECK(threw[0] == threw[1]);
  }
}

TEST_CASE("an uncaptured forward's saved views count the versions of what they view, as without") {
  // (a) stage 1 reads a view of an input (narrow(x)); (b) the forward returns a view
  // (reshape) of a value stage 1 reads. An in-place change of x, or of the returned view,
  // before the backward: refused (or taken) exactly as with the option off.
  at::manual_seed(20);
  const at::Tensor x0 = at::randn({16, 2}, at::kDouble), w0 = at::randn({2, 3}, at::kDouble);
  auto view_of_input = [](const sj::variable_list& in) {
    sj::Variable y = sj::mul(sj::narrow(in[0], 1, 0, 1), sj::tanh(sj::mm(in[0], in[1])));
    sj::Variable loss = sj::sum(sj::mul(y, y));
    return sj::variable_list{loss, sj::grad({loss}, {in[1]}, {}, true)[0]};
  };
  auto returns_a_view = [](const sj::variable_list& in) {
    sj::Variable h = sj::tanh(sj::mm(in[0], in[1]));
    sj::Variable loss = sj::sum(sj::mul(h, h));
    return sj::variable_list{sj::reshape(h, {-1}), sj::grad({loss}, {in[1]}, {}, true)[0]};
  };
  for (int which : {0, 1}) {
    CAPTURE(which);
    bool threw[2] = {false, false};
    at::Tensor got[2];
    for (bool anticipate : {true, false}) {
      CAPTURE(anticipate);
      sj::CompiledFunction f = sj::compile(which == 0 ? sj::traced_fn(view_of_input)
                                                      : sj::traced_fn(returns_a_view),
                                           sj::CompileOptions{.anticipate_stages = anticipate});
      at::Tensor x = x0.clone(), w = w0.clone();
      for (int call = 0; call < 2; ++call) (void)f({sj::Variable(x, true), sj::Variable(w, true)});
      sj::variable_list in{sj::Variable(x, true), sj::Variable(w, true)};
      auto out = f(in);
      if (which == 0)
        x.add_(0.5);
      else
        out[0].data().mul_(2.0);
      try {
        got[anticipate ? 1 : 0] = sj::grad({sj::sum(out[1])}, {in[which == 0 ? 1 : 0]})[0].data();
      } catch (const sj::Error&) {
        threw[anticipate ? 1 : 0] = true;
      }
    }
    CHECK(threw[0] == threw[1]);
    if (!threw[0] && !threw[1]) CHECK(rel(got[1], got[0]) <= 1e-12);
  }
}
