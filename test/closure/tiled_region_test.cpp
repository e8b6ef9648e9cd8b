// Row-tiled regions (Note [Row-tiled regions] in closure/tiled_plan.hpp; issue 14): the
// row-local nodes of a compiled stage on tall tensors run tile by tile; and cross-stage
// rematerialisation (passes/rematerialize.hpp), the other half of keeping a PINN's stages
// off the memory bus. Checked against
// libtorch's autograd at every order of a physics-informed step (float and double), against
// the same stages untiled, and through the region runner directly (its untiled fallback for
// inputs that do not match the trace, or that LIBXSMM cannot read).
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/pinn_step.hpp"
#include "../support/staged_oracle.hpp"

#include <cmath>
#include <algorithm>
#include <map>
#include <string>
#include <type_traits>

namespace sj = stagejit;
using sj::testing::max_abs_diff;
using namespace sj::testing::pinn_step;

namespace {

// n rows: more than kMinTiledRows, and a multiple neither of the tile sizes below nor of
// LIBXSMM's 64-row and 256-column blocks, so every tail is exercised.
constexpr int64_t kRows = 2500;

std::vector<at::Tensor> mlp_data(at::ScalarType dtype) {
  auto o = at::TensorOptions().dtype(dtype);
  return {at::rand({kRows, 2}, o) * 2 - 1, at::randn({2, 20}, o) * 0.7, at::randn({20}, o) * 0.1,
          at::randn({20, 20}, o) * 0.3,    at::randn({20}, o) * 0.1,   at::randn({20, 1}, o) * 0.3};
}

// mlp_data(dtype) after at::manual_seed(seed), and libtorch's step on it.
struct Reference {
  std::vector<at::Tensor> data;
  Step want;
};
Reference reference_step(uint64_t seed, at::ScalarType dtype) {
  at::manual_seed(seed);
  auto data = mlp_data(dtype);
  Step want = torch_step(data);
  return {std::move(data), std::move(want)};
}

// Largest |a - b| / (1 + max |b|) over the loss and the gradients.
double step_difference(const Step& got, const Step& want) {
  double d = std::abs(got.loss - want.loss) / (1 + std::abs(want.loss));
  REQUIRE(got.grads.size() == want.grads.size());
  for (std::size_t i = 0; i < want.grads.size(); ++i) {
    REQUIRE(got.grads[i].defined());
    const at::Tensor w = want.grads[i].to(at::kDouble);
    d = std::max(d, max_abs_diff(got.grads[i].to(at::kDouble), w) / (1 + w.abs().max().item<double>()));
  }
  return d;
}

// `rounds` calls of `step` (the later ones run cached closures), each checked against
// libtorch's `want` within `tol` (step_difference).
template <class StepFn>
void check_rounds(int rounds, StepFn step, const Step& want, double tol) {
  for (int round = 0; round < rounds; ++round) {
    CAPTURE(round);
    CHECK(step_difference(step(), want) <= tol);
  }
}

// The Functions of the stages of `c` that run row-tiled regions.
// Every region call in scope runs tiled with its kernels built (a call made while one is
// compiling runs untiled, and a runner's step counts then read its plan, not its run).
struct WaitForKernels {
  bool before = sj::fusion::set_wait_for_kernels(true);
  ~WaitForKernels() { sj::fusion::set_wait_for_kernels(before); }
};

std::size_t count_regions(const sj::closure::MultiStageClosure& c) {
  std::size_t n = 0;
  for (const auto& stage : c.stages)
    for (const auto& fn : stage.functions)
      if (fn->name() == "FusedKernel(tiled_region)") ++n;
  return n;
}

// The weights of an 8-width-width-1 critic in double, after at::manual_seed(seed): the
// second and last layers scaled by `scale`.
std::vector<at::Tensor> critic_weights(uint64_t seed, int64_t width, double scale) {
  at::manual_seed(seed);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({8, width}, o) * 0.3, at::randn({width}, o) * 0.1, at::randn({width, width}, o) * scale,
          at::randn({width}, o) * 0.1,     at::randn({width, 1}, o) * scale, at::randn({1}, o) * 0.1};
}

// The critic on Variables or libtorch tensors: layers h @ W + b, leaky ReLU (0.2) between.
template <class V>
V leaky_critic(const V& x, const std::vector<V>& p) {
  V h = x;
  for (std::size_t l = 0; l + 2 < p.size(); l += 2) {
    if constexpr (std::is_same_v<V, sj::Variable>) h = sj::leaky_relu(sj::mm(h, p[l]) + p[l + 1], 0.2);
    else h = torch::leaky_relu(torch::mm(h, p[l]) + p[l + 1], 0.2);
  }
  if constexpr (std::is_same_v<V, sj::Variable>) return sj::mm(h, p[p.size() - 2]) + p.back();
  else return torch::mm(h, p[p.size() - 2]) + p.back();
}

// Checks a gradient-penalty step of leaky_critic, the loss mean(D(x)) + 10 mean((|grad_x
// D| - 1)^2) and its gradients in the weights, against libtorch's in double (1e-10).
void check_penalty_step(const sj::Variable& loss, const sj::variable_list& grads, const std::vector<at::Tensor>& w,
                        const at::Tensor& x) {
  std::vector<torch::Tensor> tp;
  for (const auto& t : w) tp.push_back(t.clone().requires_grad_(true));
  const torch::Tensor tx = x.clone().requires_grad_(true);
  const torch::Tensor td = leaky_critic(tx, tp);
  const torch::Tensor tg = torch::autograd::grad({td}, {tx}, {torch::ones_like(td)}, true, true)[0];
  const torch::Tensor tgap = (tg * tg).sum(1, true).sqrt() - 1.0;
  const torch::Tensor tloss = td.mean() + 10.0 * (tgap * tgap).mean();
  const auto want = torch::autograd::grad({tloss}, tp);
  CHECK(std::abs(loss.data().item<double>() - tloss.item<double>()) <= 1e-10 * (1 + std::abs(tloss.item<double>())));
  REQUIRE(grads.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(max_abs_diff(grads[i].data(), want[i]) <= 1e-10 * (1 + want[i].abs().max().item<double>()));
  }
}

}  // namespace

TEST_SUITE("closure") {

TEST_CASE("row-tiled regions: a third-order step equals libtorch in double, tiled or not") {
  if (!sj::ops::small_mm_enabled()) return;  // regions need LIBXSMM
  const auto [data, want] = reference_step(5, at::kDouble);
  for (int64_t tile : {int64_t(0), int64_t(256), int64_t(1000)})
    for (bool fuse : {true, false})
      for (bool specialize : {true, false}) {
        CAPTURE(tile);
        CAPTURE(fuse);
        CAPTURE(specialize);
        auto net = sj::compile(mlp, {.derivatives = 3, .fuse = fuse, .specialize = specialize, .tile_rows = tile});
        // Three rounds: the later ones run the cached stage variants of several masks.
        check_rounds(3, [&] { return sj_step(net, data); }, want, 1e-10);
      }
}

TEST_CASE("row-tiled regions: a third-order step equals libtorch in float") {
  if (!sj::ops::small_mm_enabled()) return;
  const auto [data, want] = reference_step(6, at::kFloat);
  auto net = sj::compile(mlp, {.derivatives = 3, .tile_rows = 512});
  check_rounds(3, [&] { return sj_step(net, data); }, want, 1e-5);
}

TEST_CASE("row-tiled regions: a compiled loss with inner grads (narrow, cat, lone ops) equals libtorch") {
  if (!sj::ops::small_mm_enabled()) return;
  const auto [data, want] = reference_step(9, at::kDouble);
  for (int64_t tile : {int64_t(0), int64_t(256), int64_t(1000)}) {
    CAPTURE(tile);
    auto loss = sj::compile(mlp_loss, {.derivatives = 1, .tile_rows = tile});
    check_rounds(2, [&] { return sj_loss_step(loss, data); }, want, 1e-10);
  }
  // Stage 1 (the loss's gradient) reads narrow's gradient (cat with zeros) and products
  // the fuser left alone; in its regions they are column copies and one-node kernels,
  // nothing runs through ATen per tile.
  auto loss = sj::compile(mlp_loss, {.derivatives = 1});
  sj::variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  auto closure = loss.closure_for(in);
  std::map<std::string, std::size_t> counts;
  std::size_t groups = 0;
  for (const auto& region : sj::closure::find_row_tiled_regions(closure->plan.stage_nodes(1), 2048)) {
    for (const auto& [kind, n] : sj::closure::TiledRegionRunner(region, 256, {}).step_counts()) counts[kind] += n;
    for (const sj::ir::Node* n : region.nodes) groups += n->is<sj::ir::FusionGroup>();
  }
  CHECK(counts["copy"] >= 1);
  CHECK(counts["kernel"] > groups);  // fusion groups and lone ops
  CHECK(counts["product"] >= 1);
  CHECK(counts["reduction"] >= 1);
  CHECK(counts["aten"] == 0);
}

TEST_CASE("row-tiled regions: a lone elementwise op runs as a kernel, narrow and cat as column copies") {
  if (!sj::ops::small_mm_enabled()) return;
  const WaitForKernels built;
  at::manual_seed(12);
  // Parsed, not fused: the mul and the sigmoid are lone ops between products. narrow
  // takes a negative start; cat's second input is a strided view of a graph input.
  auto g = sj::ir::parse(R"(graph(%x : Double(2500, 20),
      %w : Double(20, 20),
      %s : Double(20),
      %y : Double(2500, 4)) {
  %a : Double(2500, 20) = mm(%x, %w);
  %b : Double(2500, 20) = mul(%a, %s);
  %c : Double(2500, 20) = mm(%b, %w);
  %e : Double(2500, 20) = sigmoid(%c);
  %d : Double(2500, 44) = cat[dim=1](%e, %y, %a);
  %n : Double(2500, 22) = narrow[dim=1, start=-30, length=22](%d);
  %z : Double(2500, 20) = mm(%e, %w);
  return (%n, %z);
})");
  const auto regions = sj::closure::find_row_tiled_regions(g->nodes(), 2048);
  REQUIRE(regions.size() == 1);
  sj::closure::TiledRegionRunner runner(regions[0], 384, {});
  CHECK(runner.step_counts().at("copy") == 2);
  std::map<const sj::ir::Value*, at::Tensor> given = {
      {g->inputs()[0], at::randn({kRows, 20}, at::kDouble)},
      {g->inputs()[1], at::randn({20, 20}, at::kDouble) * 0.3},
      {g->inputs()[2], at::randn({20}, at::kDouble)},
      {g->inputs()[3], at::randn({kRows, 8}, at::kDouble).slice(1, 1, 8, 2)}};
  sj::variable_list in;
  for (const sj::ir::Value* v : regions[0].inputs) in.emplace_back(given.at(v));
  const auto tiled = runner.run(in);
  const auto plain = runner.run_untiled(in);
  REQUIRE(tiled.size() == plain.size());
  for (std::size_t j = 0; j < tiled.size(); ++j) {
    CAPTURE(j);
    CHECK(tiled[j].data().sizes() == plain[j].data().sizes());
    CHECK(max_abs_diff(tiled[j].data(), plain[j].data()) <= 1e-12);
  }
  // After the run: both lone ops ran as kernels, nothing through ATen.
  const auto counts = runner.step_counts();
  CHECK(counts.at("kernel") == 2);
  CHECK(counts.count("aten") == 0);
  CHECK(counts.at("product") == 3);
  // The narrow (columns 14..35 of e | y | a) against ATen.
  const at::Tensor a = at::mm(given.at(g->inputs()[0]), given.at(g->inputs()[1]));
  const at::Tensor e = at::sigmoid(at::mm(a * given.at(g->inputs()[2]), given.at(g->inputs()[1])));
  const at::Tensor want = at::cat({e, given.at(g->inputs()[3]), a}, 1).narrow(1, 14, 22);
  const auto out_index = [&](const sj::ir::Value* v) {
    const auto& outs = regions[0].outputs;
    return std::size_t(std::find(outs.begin(), outs.end(), v) - outs.begin());
  };
  const std::size_t n_at = out_index(g->outputs()[0]);
  REQUIRE(n_at < tiled.size());
  CHECK(max_abs_diff(tiled[n_at].data(), want) <= 1e-12);
}

TEST_CASE("row-tiled regions: an inner grad's seed (ones_like) and a zeros_like stay in the region") {
  if (!sj::ops::small_mm_enabled()) return;
  const WaitForKernels built;
  at::manual_seed(13);
  // What a whole loss's first stage holds at grad(u, x, ones_like(u), create_graph): the
  // seed between the forward's last product and the backward's first. Left out of the
  // region, it split the stage in two; here one region runs every node, the seed and the
  // zeros as one-node kernels.
  auto g = sj::ir::parse(R"(graph(%x : Double(2500, 2),
      %w1 : Double(2, 20),
      %b1 : Double(20),
      %w2 : Double(20, 1),
      %w2t : Double(1, 20),
      %w1t : Double(20, 2)) {
  %a : Double(2500, 20) = mm(%x, %w1);
  %z : Double(2500, 20) = add(%a, %b1);
  %h : Double(2500, 20) = tanh(%z);
  %u : Double(2500, 1) = mm(%h, %w2);
  %s : Double(2500, 1) = ones_like(%u);
  %gh : Double(2500, 20) = mm(%s, %w2t);
  %o : Double(2500, 20) = zeros_like(%gh);
  %d : Double(2500, 20) = mul(%gh, %h);
  %e : Double(2500, 20) = add(%d, %o);
  %dx : Double(2500, 2) = mm(%e, %w1t);
  return (%u, %dx);
})");
  const auto regions = sj::closure::find_row_tiled_regions(g->nodes(), 2048);
  REQUIRE(regions.size() == 1);
  CHECK(regions[0].nodes.size() == g->nodes().size());
  sj::closure::TiledRegionRunner runner(regions[0], 384, {});
  const at::Tensor x = at::randn({kRows, 2}, at::kDouble), w1 = at::randn({2, 20}, at::kDouble) * 0.7,
                   b1 = at::randn({20}, at::kDouble) * 0.1, w2 = at::randn({20, 1}, at::kDouble) * 0.3;
  std::map<const sj::ir::Value*, at::Tensor> given = {{g->inputs()[0], x},
                                                      {g->inputs()[1], w1},
                                                      {g->inputs()[2], b1},
                                                      {g->inputs()[3], w2},
                                                      {g->inputs()[4], w2.t().contiguous()},
                                                      {g->inputs()[5], w1.t().contiguous()}};
  sj::variable_list in;
  for (const sj::ir::Value* v : regions[0].inputs) in.emplace_back(given.at(v));
  const auto tiled = runner.run(in);
  const auto plain = runner.run_untiled(in);
  REQUIRE(tiled.size() == 2);
  REQUIRE(plain.size() == 2);
  // ATen's: u = tanh(x w1 + b1) w2 and the backward-shaped chain ((1 w2^T) * h) w1^T (h
  // standing in for the activation's derivative).
  const at::Tensor h = at::tanh(at::mm(x, w1) + b1);
  const at::Tensor u = at::mm(h, w2), dx = at::mm(at::mm(at::ones_like(u), w2.t()) * h, w1.t());
  for (std::size_t j = 0; j < 2; ++j) {
    CAPTURE(j);
    const at::Tensor& want = regions[0].outputs[j] == g->outputs()[0] ? u : dx;
    CHECK(max_abs_diff(tiled[j].data(), want) <= 1e-12);
    CHECK(max_abs_diff(plain[j].data(), want) <= 1e-12);
  }
  const auto counts = runner.step_counts();
  CHECK(counts.count("aten") == 0);
  CHECK(counts.at("kernel") == 6);  // add, tanh, ones_like, zeros_like, mul, add
  CHECK(counts.at("product") == 4);
}

TEST_CASE("cross-stage rematerialisation: fewer values cross stages, the same step as libtorch") {
  const auto [data, want] = reference_step(10, at::kDouble);
  std::map<std::pair<bool, int64_t>, std::size_t> saved;
  for (bool remat : {false, true}) {
    CAPTURE(remat);
    for (int64_t tile : {int64_t(0), int64_t(512)}) {
      CAPTURE(tile);
      auto net = sj::compile(mlp, {.derivatives = 3,
                                   .cross_stage_gradients = false,  // where rematerialisation runs
                                   .tile_rows = tile,
                                   .rematerialize = remat});
      check_rounds(2, [&] { return sj_step(net, data); }, want, 1e-10);
      sj::variable_list in;
      for (const auto& t : data) in.emplace_back(t, true);
      auto closure = net.closure_for(in);
      std::size_t n = 0;
      for (std::size_t s = 0; s < closure->num_stages(); ++s) n += closure->plan.captures(s).size();
      saved[{remat, tile}] = n;
    }
  }
  // Tiling runs what the graph says: it saves as much.
  CHECK(saved[{false, 0}] == saved[{false, 512}]);
  CHECK(saved[{true, 0}] == saved[{true, 512}]);
  // The tanh derivative 1 - h^2 of each layer, among others, is recomputed where read.
  CHECK(saved[{true, 0}] + 2 <= saved[{false, 0}]);
}

// A 16-dimensional Laplacian, sum_d d2u/dx_d2 (x [2100, 16], net 16-24-24-1 tanh): the
// loss's backward fuses one group of more than 64 arguments (tiling::kMaxTiledKernelArgs),
// which runs whole beside the region; it used to reach the tile runner and throw.
template <class V, class GradFn, class NarrowFn>
V laplacian_loss(const std::vector<V>& in, GradFn grad_of, NarrowFn column) {
  V h = in[0];  // in: x, then (W, b) per hidden layer, then the output layer's W (no bias:
  std::size_t l = 1;  // the Laplacian does not read it)
  for (; l + 1 < in.size(); l += 2) h = tanh(mm(h, in[l]) + in[l + 1]);
  h = mm(h, in[l]);
  const V du = grad_of(h, in[0]);  // [n, 16]
  V lap = column(grad_of(column(du, 0), in[0]), 0);
  for (int64_t d = 1; d < 16; ++d) lap = lap + column(grad_of(column(du, d), in[0]), d);
  return mean(lap * lap);
}

TEST_CASE("row-tiled regions: a 16-dimensional Laplacian (a fusion group of more than 64 arguments) equals libtorch") {
  if (!sj::ops::small_mm_enabled()) return;
  at::manual_seed(11);
  auto o = at::TensorOptions().dtype(at::kDouble);
  const std::vector<at::Tensor> data = {at::rand({2100, 16}, o), at::randn({16, 24}, o) * 0.3, at::randn({24}, o) * 0.1,
                                        at::randn({24, 24}, o) * 0.3, at::randn({24}, o) * 0.1,
                                        at::randn({24, 1}, o) * 0.3};
  // libtorch
  std::vector<torch::Tensor> tin;
  for (const auto& x : data) tin.push_back(x.detach().clone().set_requires_grad(true));
  const torch::Tensor tloss = laplacian_loss<torch::Tensor>(
      tin,
      [](const torch::Tensor& y, const torch::Tensor& x) {
        return torch::autograd::grad({y}, {x}, {torch::ones_like(y)}, true, true)[0];
      },
      [](const torch::Tensor& y, int64_t d) { return y.narrow(1, d, 1); });
  const std::vector<torch::Tensor> tparams(tin.begin() + 1, tin.end());
  const auto want = torch::autograd::grad({tloss}, tparams);
  // stagejit: the whole loss compiled, tiles of 128 rows
  auto loss_fn = [](const sj::variable_list& in) -> sj::variable_list {
    return {laplacian_loss<sj::Variable>(
        in,
        [](const sj::Variable& y, const sj::Variable& x) {
          return sj::grad({y}, {x}, {sj::Variable(at::ones_like(y.data()))}, true)[0];
        },
        [](const sj::Variable& y, int64_t d) { return sj::narrow(y, 1, d, 1); })};
  };
  auto compiled = sj::compile(loss_fn, {.derivatives = 1, .tile_rows = 128});
  for (int round = 0; round < 2; ++round) {  // the second runs the compiled kernels
    CAPTURE(round);
    sj::variable_list in;
    for (const auto& x : data) in.emplace_back(x, true);
    const sj::Variable loss = compiled(in)[0];
    const sj::variable_list params(in.begin() + 1, in.end());
    const auto got = sj::grad({loss}, params);
    CHECK(std::abs(loss.data().item<double>() - tloss.item<double>()) <= 1e-10 * (1 + std::abs(tloss.item<double>())));
    for (std::size_t i = 0; i < got.size(); ++i)
      CHECK(max_abs_diff(got[i].data(), want[i]) <= 1e-10 * (1 + want[i].abs().max().item<double>()));
  }
  sj::variable_list in;
  for (const auto& x : data) in.emplace_back(x, true);
  CHECK(count_regions(*compiled.closure_for(in)) > 0);
}

TEST_CASE("row-tiled regions: broadcast kernel inputs and product biases of every shape equal libtorch") {
  // The runner copies an input every tile reads alike into a dense [tile, C] block (a
  // [C] or [1, C] bias, a 0-d or [1] scalar, a row expanded with stride 0) and a product's
  // bias into one row (Note [Row-tiled regions]); each form, over tiles with a tail, at
  // every derivative, against libtorch in double.
  if (!sj::ops::small_mm_enabled()) return;
  WaitForKernels wait;
  constexpr int64_t N = 300, C = 12;
  at::manual_seed(21);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  const std::vector<at::Tensor> data = {
      at::randn({N, 3}, o),             // x
      at::randn({3, C}, o) * 0.5,       // W1
      at::randn({C}, o) * 0.1,          // b1 [C]: the product's bias
      at::randn({C, C}, o) * 0.3,       // W2
      at::randn({1, C}, o) * 0.1,       // b2 [1, C]: the second product's bias
      at::randn({1, C}, o),             // r [1, C]
      at::randn({}, o),                 // s 0-d
      at::randn({1}, o),                // s1 [1]
      at::randn({C}, o).expand({N, C})  // e [N, C], rows alike (stride 0)
  };
  auto body = [](const auto& in, auto mm, auto tanh, auto sum) {
    auto h = tanh(mm(in[0], in[1]) + in[2]);
    auto u = tanh(mm(h, in[3]) + in[4]) * in[5] + h * in[6] + in[7] * in[8] * h;
    return sum(u * u);
  };
  auto f = sj::compile([&](const sj::variable_list& in) -> sj::variable_list {
    return {body(in, [](auto a, auto b) { return sj::mm(a, b); }, [](auto a) { return sj::tanh(a); },
                 [](auto a) { return sj::sum(a); })};
  }, {.derivatives = 2, .tile_rows = 128});
  std::vector<torch::Tensor> tin;
  for (const auto& t : data) tin.push_back(t.clone().requires_grad_(true));
  const torch::Tensor tl = body(tin, [](auto a, auto b) { return torch::mm(a, b); },
                                [](auto a) { return torch::tanh(a); }, [](auto a) { return torch::sum(a); });
  const torch::Tensor tgx = torch::autograd::grad({tl}, {tin[0]}, {}, true, true)[0];
  const auto want = torch::autograd::grad({(tgx * tgx).sum()}, {tin[0], tin[1], tin[3]});
  for (int call = 0; call < 2; ++call) {  // the trace, then the compiled stages
    CAPTURE(call);
    sj::variable_list in;
    for (std::size_t i = 0; i < data.size(); ++i) in.emplace_back(data[i], i == 0 || i == 1 || i == 3);
    const sj::Variable loss = f(in)[0];
    CHECK(std::abs(loss.data().item<double>() - tl.item<double>()) <= 1e-10 * (1 + std::abs(tl.item<double>())));
    const sj::Variable gx = sj::grad({loss}, {in[0]}, {}, /*create_graph=*/true)[0];
    CHECK(max_abs_diff(gx.data(), tgx) <= 1e-10 * (1 + tgx.abs().max().item<double>()));
    const auto got = sj::grad({sj::sum(gx * gx)}, {in[0], in[1], in[3]});
    for (std::size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      CHECK(max_abs_diff(got[i].data(), want[i]) <= 1e-10 * (1 + want[i].abs().max().item<double>()));
    }
  }
  sj::variable_list in;
  for (std::size_t i = 0; i < data.size(); ++i) in.emplace_back(data[i], i == 0 || i == 1 || i == 3);
  CHECK(count_regions(*f.closure_for(in)) > 0);
}

TEST_CASE("row-tiled regions: stages shorter than one tile equal libtorch in double") {
  if (!sj::ops::small_mm_enabled()) return;
  for (int64_t rows : {1, 2, 3, 100}) {
    CAPTURE(rows);
    at::manual_seed(11);
    auto data = mlp_data(at::kDouble);
    data[0] = at::rand({rows, 2}, at::kDouble) * 2 - 1;
    const Step want = torch_step(data);
    auto net = sj::compile(mlp, {.derivatives = 3, .tile_rows = 128});
    check_rounds(2, [&] { return sj_step(net, data); }, want, 1e-10);
    auto loss = sj::compile(mlp_loss, {.derivatives = 1, .tile_rows = 128});
    check_rounds(2, [&] { return sj_loss_step(loss, data); }, want, 1e-10);
  }
}

// A softplus network u = W4 sp(W3 sp(W2 sp(W1 x + b1) + b2) + b3) + b4 (torch's [out, in]
// weights, read through t()) and the Laplacian loss mean((u_xx + u_yy + 1)^2) + mean(u^2):
// at 100 rows, under one tile of 128, a region reads a row broadcast with stride 0 (the
// found case: its dense block took 128 rows of a 100-row tensor and threw).
template <class V, class Grad>
V softplus_laplacian_loss(const std::vector<V>& in, Grad grad_sum) {
  V h = in[0];
  for (std::size_t l = 1; l + 1 < in.size(); l += 2) {
    h = matmul(h, t(in[l])) + in[l + 1];
    if (l + 2 < in.size()) h = softplus(h);
  }
  const V g = grad_sum(h, in[0]);
  const V uxx = narrow(grad_sum(narrow(g, 1, 0, 1), in[0]), 1, 0, 1);
  const V uyy = narrow(grad_sum(narrow(g, 1, 1, 1), in[0]), 1, 1, 1);
  const V r = uxx + uyy + 1.0;
  return mean(r * r) + mean(h * h);
}

// The softplus Laplacian step at `rows` points and hidden width `width`, staged and whole,
// checked against libtorch in double (both rounds of both modes). Returns the Functions of
// the staged and the whole-loss closures together, and the row-tiled regions of each stage
// of the staged network.
std::pair<std::size_t, std::vector<std::size_t>> check_softplus_laplacian(int64_t rows, int64_t width) {
  at::manual_seed(12);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  std::vector<at::Tensor> data{at::rand({rows, 2}, o)};
  for (auto [out, in] : {std::pair<int64_t, int64_t>{width, 2}, {width, width}, {width, width}, {1, width}}) {
    data.push_back(at::randn({out, in}, o) / std::sqrt(double(in)));
    data.push_back(at::randn({out}, o) * 0.1);
  }
  std::vector<torch::Tensor> tin;
  for (const auto& x : data) tin.push_back(x.clone().requires_grad_(true));
  const auto tloss = softplus_laplacian_loss<torch::Tensor>(tin, [](const torch::Tensor& y, const torch::Tensor& x) {
    return torch::autograd::grad({y}, {x}, {torch::ones_like(y)}, true, true)[0];
  });
  const auto want = torch::autograd::grad({tloss}, std::vector<torch::Tensor>(tin.begin() + 1, tin.end()));
  auto sj_grad_sum = [](const sj::Variable& y, const sj::Variable& x) {
    return sj::grad({y}, {x}, {sj::ones_like(y)}, true)[0];
  };
  // Staged (the network compiled with three derivatives) and the whole loss compiled.
  auto net = sj::compile([](const sj::variable_list& in) {
    sj::Variable h = in[0];
    for (std::size_t l = 1; l + 1 < in.size(); l += 2) {
      h = matmul(h, t(in[l])) + in[l + 1];
      if (l + 2 < in.size()) h = softplus(h);
    }
    return sj::variable_list{h};
  }, {.derivatives = 3});
  auto whole = sj::compile([&](const sj::variable_list& in) {
    return sj::variable_list{softplus_laplacian_loss<sj::Variable>(in, sj_grad_sum)};
  }, {.derivatives = 1});
  for (int mode = 0; mode < 2; ++mode)
    for (int round = 0; round < 2; ++round) {
      CAPTURE(mode);
      CAPTURE(round);
      sj::variable_list in;
      for (const auto& x : data) in.emplace_back(x, true);
      sj::Variable loss;
      if (mode == 1) {
        loss = whole(in)[0];
      } else {
        // The staged form: the same loss with the compiled network as its u.
        const sj::Variable u = net(in)[0];
        const sj::Variable g = sj_grad_sum(u, in[0]);
        const sj::Variable uxx = narrow(sj_grad_sum(narrow(g, 1, 0, 1), in[0]), 1, 0, 1);
        const sj::Variable uyy = narrow(sj_grad_sum(narrow(g, 1, 1, 1), in[0]), 1, 1, 1);
        const sj::Variable r = uxx + uyy + 1.0;
        loss = mean(r * r) + mean(u * u);
      }
      const auto got = sj::grad({loss}, sj::variable_list(in.begin() + 1, in.end()));
      CHECK(std::abs(loss.data().item<double>() - tloss.item<double>()) <= 1e-10 * (1 + std::abs(tloss.item<double>())));
      for (std::size_t i = 0; i < got.size(); ++i)
        CHECK(max_abs_diff(got[i].data(), want[i]) <= 1e-10 * (1 + want[i].abs().max().item<double>()));
      CHECK(count_regions(*(mode == 1 ? whole : net).closure_for(in)) > 0);
    }
  sj::variable_list in;
  for (const auto& x : data) in.emplace_back(x, true);
  std::size_t functions = 0;
  for (const auto* c : {net.closure_for(in).get(), whole.closure_for(in).get()})
    for (const auto& st : c->stages) functions += st.functions.size();
  std::vector<std::size_t> regions;
  for (const auto& st : net.closure_for(in)->stages)
    regions.push_back(std::size_t(std::count_if(st.functions.begin(), st.functions.end(), [](const auto& fn) {
      return fn->name() == "FusedKernel(tiled_region)";
    })));
  return {functions, regions};
}

TEST_CASE("row-tiled regions: a softplus Laplacian loss under one tile equals libtorch in double") {
  if (!sj::ops::small_mm_enabled()) return;
  check_softplus_laplacian(100, 50);
}

TEST_CASE("row-tiled regions: as many rows as the width (square weights) tile as any other size") {
  // A [50, 50] weight of a 50-row batch has the shape of a row value, a t() of a row from
  // an earlier stage that of a weight, and a [50] bias that of a column. The plan reads
  // each as its product or broadcast does, so the stages come out as they do at 49 rows
  // (the square case once ran its products untiled, below eager). The forward stage has a
  // region: its matmul(h, t(W)) is a row product, as mm is.
  if (!sj::ops::small_mm_enabled()) return;
  const auto square = check_softplus_laplacian(50, 50);
  const auto other = check_softplus_laplacian(49, 50);
  CHECK(square.first == other.first);
  CHECK(square.second == other.second);
  REQUIRE(!square.second.empty());
  CHECK(square.second[0] > 0);
}

TEST_CASE("row-tiled regions: tall stages get regions, short ones and tile_rows = 0 none") {
  if (!sj::ops::small_mm_enabled()) return;
  at::manual_seed(7);
  auto closure_of = [](int64_t rows, int64_t tile) {
    auto data = mlp_data(at::kDouble);
    data[0] = at::rand({rows, 2}, at::kDouble);
    auto net = sj::compile(mlp, {.derivatives = 3, .tile_rows = tile});
    sj::variable_list in;
    for (const auto& t : data) in.emplace_back(t, true);
    return net.closure_for(in);
  };
  auto tiled = closure_of(kRows, 256);
  // Every stage: the forward, its backward, and the two backward-of-backward stages.
  CHECK(count_regions(*tiled) >= tiled->num_stages());
  std::size_t tiled_functions = 0, plain_functions = 0;
  for (const auto& st : tiled->stages) tiled_functions += st.functions.size();
  auto plain = closure_of(kRows, 0);
  CHECK(count_regions(*plain) == 0);
  for (const auto& st : plain->stages) plain_functions += st.functions.size();
  CHECK(tiled_functions < plain_functions);
  // From kMinTiledRows rows on, also when every stage is shorter than one tile (a region
  // of one tile saves the per-node overhead, bench/higher_order.md "Regions from 2 rows").
  CHECK(count_regions(*closure_of(sj::closure::kMinTiledRows, 128)) > 0);
  CHECK(count_regions(*closure_of(300, 512)) > 0);
  // The region names what it runs.
  for (const auto& fn : tiled->stages[0].functions)
    if (fn->name() == "FusedKernel(tiled_region)") CHECK(fn->origin.find("row-tiled region 0 of stage 0") != std::string::npos);
}

TEST_CASE("row-tiled regions: the runner falls back to the nodes one by one, with the same values") {
  if (!sj::ops::small_mm_enabled()) return;
  at::manual_seed(8);
  const auto data = mlp_data(at::kDouble);
  auto net = sj::compile(mlp, {.derivatives = 1});
  sj::variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  auto closure = net.closure_for(in);
  const auto regions = sj::closure::find_row_tiled_regions(closure->plan.stage_nodes(0), 2048);
  REQUIRE(regions.size() == 1);
  const sj::closure::TiledRegion& region = regions[0];
  CHECK(region.rows == kRows);
  CHECK((region.dtype == at::kDouble));
  // Stage 0's region reads graph inputs only: feed each its tensor.
  auto inputs_for = [&](std::vector<at::Tensor> tensors) {
    sj::variable_list vals;
    for (sj::ir::Value* v : region.inputs) {
      const auto& gin = closure->graph->inputs();
      auto it = std::find(gin.begin(), gin.end(), v);
      REQUIRE(it != gin.end());
      vals.emplace_back(tensors.at(std::size_t(it - gin.begin())));
    }
    return vals;
  };
  sj::closure::TiledRegionRunner runner(region, 384, {});
  auto check_same = [&](const sj::variable_list& vals) {
    const auto tiled = runner.run(vals);
    const auto plain = runner.run_untiled(vals);
    REQUIRE(tiled.size() == region.outputs.size());
    REQUIRE(plain.size() == tiled.size());
    for (std::size_t j = 0; j < tiled.size(); ++j) {
      CAPTURE(j);
      REQUIRE(tiled[j].defined());
      CHECK(tiled[j].data().sizes() == plain[j].data().sizes());
      CHECK(max_abs_diff(tiled[j].data(), plain[j].data()) <= 1e-12);
    }
  };
  check_same(inputs_for(data));
  // X with every other column of a wider tensor: neither its rows nor its columns are
  // dense, LIBXSMM cannot read it, and the call runs untiled.
  auto wide = data;
  wide[0] = at::randn({kRows, 4}, at::kDouble).slice(1, 0, 4, 2);
  check_same(inputs_for(wide));
  // Inputs of other sizes than the trace recorded: untiled, results of the new size.
  auto other = data;
  other[0] = at::randn({kRows + 7, 2}, at::kDouble);
  const auto vals = inputs_for(other);
  const auto out = runner.run(vals);
  const auto plain = runner.run_untiled(vals);
  for (std::size_t j = 0; j < out.size(); ++j) CHECK(max_abs_diff(out[j].data(), plain[j].data()) == 0);
  // A region that is not worth it: the tile size must be positive.
  CHECK_THROWS_AS(sj::closure::TiledRegionRunner(region, 0, {}), sj::CompileError);
}

TEST_CASE("row-tiled regions: layers up to 128 wide tile, and a where's zeros fuse, with libtorch's values") {
  // A gradient-penalty critic (leaky ReLU, whose double backward has where(mask, g,
  // zeros_like(g))): its whole loss compiled, against libtorch in double. At width 128
  // the forward and backward stages run regions; at 160 their products are too wide for
  // one (tiling::kMaxTiledWidth). zeros_like is fused into kernels, never a node of its own that splits
  // a region.
  if (!sj::ops::small_mm_enabled()) return;
  for (int64_t width : {int64_t(128), int64_t(160)}) {
    CAPTURE(width);
    const std::vector<at::Tensor> w = critic_weights(21, width, 0.1);
    const at::Tensor x = at::randn({kRows, 8}, at::kDouble);
    auto loss_fn = [&](const sj::variable_list& in) {
      const sj::variable_list p(in.begin(), in.end() - 1);
      const sj::Variable& xx = in.back();
      const sj::Variable d = leaky_critic(xx, p);
      const sj::Variable g = sj::grad({d}, {xx}, {sj::ones_like(d)}, /*create_graph=*/true)[0];
      const sj::Variable gap = sj::sqrt(sj::sum(g * g, std::vector<int64_t>{1}, true)) - 1.0;
      return sj::variable_list{sj::mean(d) + 10.0 * sj::mean(gap * gap)};
    };
    auto compiled = sj::compile(loss_fn, {.derivatives = 1, .tile_rows = 128});
    sj::variable_list in;
    for (const auto& t : w) in.emplace_back(t, true);
    in.emplace_back(x, true);
    const sj::variable_list p(in.begin(), in.end() - 1);
    const sj::Variable loss = compiled(in)[0];
    const auto grads = sj::grad({loss}, p);

    check_penalty_step(loss, grads, w, x);

    auto closure = compiled.closure_for(in);
    std::vector<std::size_t> regions(closure->stages.size(), 0);
    for (std::size_t s = 0; s < closure->stages.size(); ++s)
      for (const auto& fn : closure->stages[s].functions) regions[s] += fn->name() == "FusedKernel(tiled_region)";
    REQUIRE(regions.size() == 2);
    // Stage 0 is products and activations: tiled only when its products are. Stage 1
    // tiles at 128; at 160 only its kernels can form a region.
    CHECK((regions[0] > 0) == (width <= 128));
    if (width <= 128) CHECK(regions[1] > 0);
    std::size_t tiled_products = 0;
    for (std::size_t s = 0; s < 2; ++s)
      for (const auto& region : sj::closure::find_row_tiled_regions(closure->plan.stage_nodes(s), 2))
        for (const sj::ir::Node* n : region.nodes) tiled_products += sj::closure::tiling::is_matrix_product(*n);
    CHECK((tiled_products > 0) == (width <= 128));
    for (const sj::ir::Node* n : compiled.graph_for(in)->nodes()) CHECK(n->describe() != "zeros_like");
  }
}

TEST_CASE("row-tiled regions: Bool masks an earlier stage saved are row inputs of a region's kernels") {
  // A staged gradient-penalty critic with leaky ReLU: stage 1 saves the activation's
  // masks (Bool [N, C]), which stage 2's fusion groups read. Those groups join stage 2's
  // region (their kernels built for Bool inputs) instead of splitting it; the step equals
  // libtorch in double, on the first call and with the kernels built.
  if (!sj::ops::small_mm_enabled()) return;
  sj::fusion::set_wait_for_kernels(true);
  const std::vector<at::Tensor> w = critic_weights(22, 48, 0.2);
  const at::Tensor x = at::randn({kRows, 8}, at::kDouble);
  auto net = sj::compile(
      [](const sj::variable_list& in) {
        return sj::variable_list{leaky_critic(in[0], sj::variable_list(in.begin() + 1, in.end()))};
      },
      {.derivatives = 2});

  sj::variable_list in{sj::Variable(x, true)};
  for (const auto& t : w) in.emplace_back(t, true);
  for (int call = 0; call < 2; ++call) {
    CAPTURE(call);
    const sj::variable_list p(in.begin() + 1, in.end());
    const sj::Variable d = net(in)[0];
    const sj::Variable g = sj::grad({d}, {in[0]}, {sj::ones_like(d)}, /*create_graph=*/true)[0];
    const sj::Variable gap = sj::sqrt(sj::sum(g * g, std::vector<int64_t>{1}, true)) - 1.0;
    const sj::Variable loss = sj::mean(d) + 10.0 * sj::mean(gap * gap);
    check_penalty_step(loss, sj::grad({loss}, p), w, x);
  }
  sj::fusion::set_wait_for_kernels(false);

  // Stage 2 has a region that reads a Bool mask of kRows rows.
  auto closure = net.closure_for(in);
  bool mask_input = false;
  for (const auto& region : sj::closure::find_row_tiled_regions(closure->plan.stage_nodes(2), 2))
    for (const sj::ir::Value* v : region.inputs)
      if (const auto* t = v->tensor_type(); t && t->dtype == at::kBool && t->sizes.size() == 2 && t->sizes[0] == kRows)
        mask_input = true;
  CHECK(mask_input);
}

}  // TEST_SUITE
