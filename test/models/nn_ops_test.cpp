// Ops for models (issue 19): see test/models/meson.build.
// Convolution, pooling, normalisation, gather and scatter_add against libtorch's autograd
// in double (<= 1e-10): eager up to the third order, compiled stage by stage, finite
// differences, batch_norm's running statistics, and one bad input per family.
#include "../autograd/oracle.hpp"
#include "../support/check_stages.hpp"

#include <stagejit/compiler.hpp>
#include <stagejit/testing/gradcheck.hpp>

#include <memory>
#include <string>

namespace {

using sj::testing::libtorch_stages;
using sj::testing::max_abs_diff;
using TorchFn = oracle::TorchFn;
using SjFn = oracle::SjFn;

at::Tensor rnd(std::vector<int64_t> shape) { return at::randn(shape, at::kDouble); }
at::Tensor channels_last(const at::Tensor& t) { return t.contiguous(at::MemoryFormat::ChannelsLast); }

// The compiled function with `k` derivatives, stage by stage against libtorch_stages
// (grad outputs of ones), twice (the second call is served from the cache). Fusion
// (elementwise chains of the backward formulas as generated kernels, each compiled once
// per machine) only where asked: the cases that fuse keep a cold run of the suite short.
void check_compiled(const SjFn& sj_fn, const TorchFn& torch_fn, const std::vector<at::Tensor>& data,
                    const std::vector<bool>& rg, int k, bool fuse = false) {
  sj::testing::check_compiled_stages(sj_fn, torch_fn, data, rg, k, {.fuse = fuse});
}

// Eager derivatives up to `order` (random grad outputs), then the compiled stages 0..order.
void check_op(const std::string& name, const std::vector<at::Tensor>& inputs, const std::vector<bool>& diff,
              const SjFn& sj_fn, const TorchFn& torch_fn, int order, bool fuse = false) {
  oracle::check(name, inputs, diff, sj_fn, torch_fn, order);
  CAPTURE(name);
  check_compiled(sj_fn, torch_fn, inputs, diff, order, fuse);
}

// gradcheck and gradgradcheck of `fn` at `inputs` (double, small).
void check_finite_differences(const std::string& name, const sj::testing::checked_fn& fn,
                              const sj::variable_list& inputs) {
  CAPTURE(name);
  std::string report;
  CHECK_MESSAGE(sj::testing::gradcheck(fn, inputs, 1e-6, 1e-5, 1e-3, &report), report);
  report.clear();
  CHECK_MESSAGE(sj::testing::gradgradcheck(fn, inputs, 1e-6, 1e-5, 1e-3, &report), report);
}

struct Conv2dCase {
  std::string name;
  std::vector<int64_t> x, w;
  bool bias;
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups;
  bool channels_last;
};

}  // namespace

TEST_SUITE("models") {
  TEST_CASE("conv2d: padding, stride, dilation, groups, bias, batch 1, channels-last, orders 1-2") {
    at::manual_seed(190);
    const std::vector<Conv2dCase> cases = {
        {"plain", {2, 3, 6, 5}, {4, 3, 3, 2}, true, {1, 1}, {0, 0}, {1, 1}, 1, false},
        {"stride, padding, dilation, no bias", {2, 3, 7, 8}, {2, 3, 3, 3}, false, {2, 1}, {1, 2}, {1, 2}, 1, false},
        {"groups, batch 1", {1, 4, 7, 6}, {6, 2, 3, 3}, true, {2, 2}, {1, 1}, {1, 1}, 2, false},
        {"depthwise, channels-last", {2, 3, 5, 5}, {3, 1, 2, 2}, true, {1, 2}, {1, 0}, {2, 1}, 3, true},
        {"channels-last", {2, 3, 6, 6}, {4, 3, 3, 3}, true, {2, 2}, {1, 1}, {1, 1}, 1, true},
    };
    for (const auto& c : cases) {
      std::vector<at::Tensor> in = {rnd(c.x), rnd(c.w)};
      if (c.channels_last) in = {channels_last(in[0]), channels_last(in[1])};
      if (c.bias) in.push_back(rnd({c.w[0]}));
      SjFn sj_fn = [c](const sj::variable_list& v) -> sj::variable_list {
        return {sj::conv2d(v[0], v[1], c.bias ? v[2] : sj::Variable(), c.stride, c.padding, c.dilation, c.groups)};
      };
      TorchFn torch_fn = [c](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        return {torch::conv2d(v[0], v[1], c.bias ? v[2] : torch::Tensor(), c.stride, c.padding, c.dilation, c.groups)};
      };
      check_op("conv2d " + c.name, in, std::vector<bool>(in.size(), true), sj_fn, torch_fn, 2);
    }
  }

  TEST_CASE("conv2d: a non-contiguous (transposed) input and an unbatched input") {
    at::manual_seed(191);
    at::Tensor x = rnd({2, 3, 5, 6}).transpose(2, 3);
    at::Tensor w = rnd({2, 3, 2, 3}), b = rnd({2});
    SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::conv2d(v[0], v[1], v[2], {1, 2}, {1, 1})};
    };
    TorchFn torch_fn = [](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      return {torch::conv2d(v[0], v[1], v[2], {1, 2}, {1, 1})};
    };
    check_op("conv2d transposed input", {x, w, b}, {true, true, true}, sj_fn, torch_fn, 2);
    check_op("conv2d unbatched", {rnd({3, 5, 4}), w, b}, {true, true, true}, sj_fn, torch_fn, 2);
  }

  TEST_CASE("conv2d: third derivatives, eager and compiled") {
    at::manual_seed(192);
    std::vector<at::Tensor> in = {rnd({1, 2, 4, 4}), rnd({2, 1, 2, 2}), rnd({2})};
    SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::conv2d(v[0], v[1], v[2], {2, 1}, {1, 1}, {1, 1}, 2)};
    };
    TorchFn torch_fn = [](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      return {torch::conv2d(v[0], v[1], v[2], {2, 1}, {1, 1}, {1, 1}, 2)};
    };
    // A product of the conv with its input makes the third derivative non-zero.
    SjFn sj_cubic = [sj_fn](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj_fn(v)[0];
      return {sj::mul(y, sj::mul(y, y))};
    };
    TorchFn torch_cubic = [torch_fn](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      auto y = torch_fn(v)[0];
      return {y * (y * y)};
    };
    check_op("conv2d", in, {true, true, true}, sj_fn, torch_fn, 3);
    check_op("conv2d cubed", in, {true, true, true}, sj_cubic, torch_cubic, 3, /*fuse=*/true);
  }

  TEST_CASE("conv1d: stride, padding, dilation, groups, orders 1-2") {
    at::manual_seed(193);
    SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::conv1d(v[0], v[1], v[2], {2}, {1}, {2})};
    };
    TorchFn torch_fn = [](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      return {torch::conv1d(v[0], v[1], v[2], {2}, {1}, {2})};
    };
    check_op("conv1d", {rnd({2, 3, 9}), rnd({5, 3, 3}), rnd({5})}, {true, true, true}, sj_fn, torch_fn, 2);
    SjFn sj_grouped = [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::conv1d(v[0], v[1], {}, {1}, {2}, {1}, 3)};
    };
    TorchFn torch_grouped = [](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      return {torch::conv1d(v[0], v[1], {}, {1}, {2}, {1}, 3)};
    };
    check_op("conv1d groups, batch 1", {rnd({1, 3, 6}), rnd({6, 1, 3})}, {true, true}, sj_grouped, torch_grouped, 2);
    at::Tensor strided = rnd({2, 7, 3}).transpose(1, 2);  // [2, 3, 7], not contiguous
    check_op("conv1d non-contiguous", {strided, rnd({5, 3, 3}), rnd({5})}, {true, true, true}, sj_fn, torch_fn, 2);
  }

  TEST_CASE("conv_transpose2d: stride, padding, output_padding, groups, dilation, channels-last, orders 1-2") {
    at::manual_seed(194);
    struct Case {
      std::string name;
      std::vector<int64_t> x, w, stride, padding, output_padding;
      int64_t groups;
      std::vector<int64_t> dilation;
      bool channels_last;
    };
    const std::vector<Case> cases = {
        {"stride 2, output_padding 1", {2, 4, 4, 3}, {4, 3, 3, 3}, {2, 2}, {1, 1}, {1, 1}, 1, {1, 1}, false},
        {"groups, dilation, batch 1", {1, 4, 3, 3}, {4, 2, 2, 3}, {1, 2}, {0, 1}, {0, 1}, 2, {2, 1}, false},
        {"channels-last", {2, 3, 3, 4}, {3, 2, 3, 2}, {2, 1}, {1, 0}, {0, 0}, 1, {1, 1}, true},
        {"output_padding >= stride (< dilation)", {1, 2, 3, 4}, {2, 3, 2, 3}, {1, 2}, {0, 1}, {1, 2}, 1, {2, 3}, false},
    };
    for (const auto& c : cases) {
      std::vector<at::Tensor> in = {rnd(c.x), rnd(c.w)};
      if (c.channels_last) in = {channels_last(in[0]), channels_last(in[1])};
      in.push_back(rnd({c.w[1] * c.groups}));
      SjFn sj_fn = [c](const sj::variable_list& v) -> sj::variable_list {
        return {sj::conv_transpose2d(v[0], v[1], v[2], c.stride, c.padding, c.output_padding, c.groups, c.dilation)};
      };
      TorchFn torch_fn = [c](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        return {torch::conv_transpose2d(v[0], v[1], v[2], c.stride, c.padding, c.output_padding, c.groups,
                                        c.dilation)};
      };
      check_op("conv_transpose2d " + c.name, in, {true, true, true}, sj_fn, torch_fn, 2);
    }
  }

  TEST_CASE("max_pool2d: padding, stride, dilation, ceil_mode, unbatched, channels-last, orders 1-2") {
    at::manual_seed(195);
    struct Case {
      std::string name;
      at::Tensor x;
      std::vector<int64_t> kernel, stride, padding, dilation;
      bool ceil_mode;
    };
    const std::vector<Case> cases = {
        {"kernel 2", rnd({2, 3, 6, 6}), {2, 2}, {}, {0, 0}, {1, 1}, false},
        {"overlapping windows, padding", rnd({2, 2, 7, 6}), {3, 3}, {2, 1}, {1, 1}, {1, 1}, false},
        {"ceil_mode, batch 1", rnd({1, 2, 6, 7}), {3, 2}, {2, 2}, {1, 0}, {1, 1}, true},
        {"dilation", rnd({2, 2, 7, 7}), {2, 3}, {1, 2}, {0, 1}, {2, 2}, false},
        {"unbatched", rnd({3, 5, 5}), {2, 2}, {2, 1}, {0, 0}, {1, 1}, true},
        {"channels-last", channels_last(rnd({2, 3, 6, 5})), {3, 2}, {2, 2}, {1, 1}, {1, 1}, false},
        // 8 channels or more: the op runs ATen's channels-last kernel on a copy.
        {"8 channels", rnd({2, 8, 6, 6}), {2, 2}, {}, {0, 0}, {1, 1}, false},
        {"9 channels, overlapping windows, ceil_mode", rnd({1, 9, 7, 6}), {3, 3}, {2, 2}, {1, 1}, {1, 1}, true},
    };
    for (const auto& c : cases) {
      SjFn sj_fn = [c](const sj::variable_list& v) -> sj::variable_list {
        return {sj::max_pool2d(v[0], c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode)};
      };
      TorchFn torch_fn = [c](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        return {torch::max_pool2d(v[0], c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode)};
      };
      // Squared, so that the second derivative (through the saved indices) is not zero.
      SjFn sj_sq = [sj_fn](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj_fn(v)[0];
        return {sj::mul(y, y)};
      };
      TorchFn torch_sq = [torch_fn](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch_fn(v)[0];
        return {y * y};
      };
      check_op("max_pool2d " + c.name, {c.x}, {true}, sj_fn, torch_fn, 2);
      check_op("max_pool2d squared " + c.name, {c.x}, {true}, sj_sq, torch_sq, 2);
    }
  }

  TEST_CASE("max_pool2d of 8 or more channels: ATen's values and indices exactly, in ATen's layout") {
    at::manual_seed(1195);
    for (auto dtype : {at::kFloat, at::kDouble}) {
      const at::Tensor x = at::randn({3, 16, 9, 10}, at::TensorOptions().dtype(dtype));
      auto [ref_values, ref_indices] = at::max_pool2d_with_indices(x, {3, 2}, {2, 2}, {1, 0}, {1, 1}, true);
      auto y = sj::ops::run_forward(sj::ops::get("max_pool2d_with_indices"), {x},
                                    {{"kernel_size", std::vector<int64_t>{3, 2}},
                                     {"stride", std::vector<int64_t>{2, 2}},
                                     {"padding", std::vector<int64_t>{1, 0}},
                                     {"dilation", std::vector<int64_t>{1, 1}},
                                     {"ceil_mode", true}});
      REQUIRE(y.size() == 2);
      CHECK(at::equal(y[0], ref_values));
      CHECK(at::equal(y[1], ref_indices));
      CHECK(y[0].is_contiguous());
      CHECK(y[1].is_contiguous());
      // Through the free function too.
      CHECK(at::equal(sj::max_pool2d(sj::Variable(x), {3, 2}, {2, 2}, {1, 0}, {1, 1}, true).data(), ref_values));
    }
  }

  TEST_CASE("avg_pool2d and adaptive_avg_pool2d: variants, orders 1-2") {
    at::manual_seed(196);
    struct Case {
      std::string name;
      at::Tensor x;
      std::vector<int64_t> kernel, stride, padding;
    };
    const std::vector<Case> cases = {
        {"kernel 2", rnd({2, 3, 6, 6}), {2, 2}, {}, {0, 0}},
        {"stride, padding, batch 1", rnd({1, 2, 7, 6}), {3, 3}, {2, 1}, {1, 1}},
        {"unbatched", rnd({3, 5, 5}), {2, 3}, {1, 2}, {1, 0}},
        {"channels-last", channels_last(rnd({2, 3, 6, 5})), {3, 2}, {2, 2}, {1, 1}},
    };
    for (const auto& c : cases) {
      SjFn sj_fn = [c](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::avg_pool2d(v[0], c.kernel, c.stride, c.padding);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_fn = [c](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch::avg_pool2d(v[0], c.kernel, c.stride, c.padding);
        return {y, y * y};
      };
      check_op("avg_pool2d " + c.name, {c.x}, {true}, sj_fn, torch_fn, 2);
    }
    const std::vector<std::pair<at::Tensor, std::vector<int64_t>>> adaptive = {
        {rnd({2, 3, 7, 5}), {3, 2}},
        {rnd({1, 2, 6, 6}), {1, 1}},
        {rnd({3, 5, 4}), {4, 3}},
        {channels_last(rnd({2, 3, 5, 7})), {2, 4}},
    };
    for (const auto& [x, size] : adaptive) {
      auto out = size;
      SjFn sj_fn = [out](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::adaptive_avg_pool2d(v[0], out);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_fn = [out](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch::adaptive_avg_pool2d(v[0], out);
        return {y, y * y};
      };
      check_op("adaptive_avg_pool2d", {x}, {true}, sj_fn, torch_fn, 2);
    }
  }

  TEST_CASE("batch_norm in training: affine or not, batch 1, 2-d input, channels-last, orders 1-2") {
    at::manual_seed(197);
    struct Case {
      std::string name;
      at::Tensor x;
      bool affine;
    };
    const std::vector<Case> cases = {
        {"affine", rnd({4, 3, 2, 2}), true},
        {"no affine, batch 1", rnd({1, 3, 3, 3}), false},
        {"2-d input", rnd({5, 3}), true},
        {"channels-last", channels_last(rnd({3, 3, 2, 3})), true},
    };
    for (const auto& c : cases) {
      const int64_t ch = c.x.size(1);
      // Each side updates its own running statistics.
      at::Tensor sj_mean = at::zeros({ch}, at::kDouble), sj_var = at::ones({ch}, at::kDouble);
      at::Tensor t_mean = sj_mean.clone(), t_var = sj_var.clone();
      const bool affine = c.affine;
      SjFn sj_fn = [=](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::batch_norm(v[0], affine ? v[1] : sj::Variable(), affine ? v[2] : sj::Variable(), sj_mean,
                                sj_var, true, 0.1, 1e-5);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_fn = [=](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch::batch_norm(v[0], affine ? v[1] : torch::Tensor(), affine ? v[2] : torch::Tensor(), t_mean,
                                   t_var, true, 0.1, 1e-5, false);
        return {y, y * y};
      };
      std::vector<at::Tensor> in = {c.x};
      if (affine) in = {c.x, rnd({ch}), rnd({ch})};
      check_op("batch_norm " + c.name, in, std::vector<bool>(in.size(), true), sj_fn, torch_fn, 2);
    }
  }

  TEST_CASE("batch_norm in evaluation mode: the running statistics, orders 1-2") {
    at::manual_seed(198);
    at::Tensor mean = rnd({3}), var = at::rand({3}, at::kDouble) + 0.5;
    SjFn sj_fn = [=](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::batch_norm(v[0], v[1], v[2], mean, var, false, 0.1, 1e-3);
      return {y, sj::mul(y, y)};
    };
    TorchFn torch_fn = [=](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      auto y = torch::batch_norm(v[0], v[1], v[2], mean, var, false, 0.1, 1e-3, false);
      return {y, y * y};
    };
    const at::Tensor mean0 = mean.clone(), var0 = var.clone();
    check_op("batch_norm eval", {rnd({2, 3, 2, 3}), rnd({3}), rnd({3})}, {true, true, true}, sj_fn, torch_fn, 2);
    check_op("batch_norm eval, batch 1", {rnd({1, 3, 4}), rnd({3}), rnd({3})}, {true, true, true}, sj_fn, torch_fn, 2);
    CHECK(at::equal(mean, mean0));  // evaluation mode leaves the statistics alone
    CHECK(at::equal(var, var0));
  }

  TEST_CASE("batch_norm: K compiled training calls update the running statistics as K eager calls") {
    at::manual_seed(199);
    const int64_t ch = 3;
    at::Tensor sj_mean = at::zeros({ch}, at::kDouble), sj_var = at::ones({ch}, at::kDouble);
    at::Tensor t_mean = sj_mean.clone(), t_var = sj_var.clone();
    at::Tensor w = rnd({ch}), b = rnd({ch});
    auto step = [&](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::batch_norm(v[0], v[1], v[2], sj_mean, sj_var, true, 0.2, 1e-5);
      return {sj::sum(sj::mul(y, y))};
    };
    auto f = sj::compile(step, {.derivatives = 1});
    const int K = 4;
    for (int call = 0; call < K; ++call) {
      CAPTURE(call);
      at::Tensor x = rnd({4, ch, 3, 2}) * (call + 1) + call;
      sj::variable_list in = {sj::Variable(x, true), sj::Variable(w, true), sj::Variable(b, true)};
      auto out = f(in);
      auto grads = sj::grad(out, in);
      auto xt = x.clone().requires_grad_(true), wt = w.clone().requires_grad_(true), bt = b.clone().requires_grad_(true);
      auto yt = torch::batch_norm(xt, wt, bt, t_mean, t_var, true, 0.2, 1e-5, false);
      auto lt = (yt * yt).sum();
      auto gt = torch::autograd::grad({lt}, {xt, wt, bt});
      CHECK(max_abs_diff(out[0].data(), lt.detach()) <= 1e-10);
      for (int i = 0; i < 3; ++i) CHECK(max_abs_diff(grads[i].data(), gt[i]) <= 1e-10);
      // Updated once per call, in the caller's tensors.
      CHECK(max_abs_diff(sj_mean, t_mean) <= 1e-12);
      CHECK(max_abs_diff(sj_var, t_var) <= 1e-12);
    }
    CHECK(f.stats().misses == 1);
    CHECK(f.stats().hits == K - 1);
    CHECK_FALSE(at::equal(sj_mean, at::zeros({ch}, at::kDouble)));

    // A compiled evaluation reads the statistics as they are at each call.
    auto eval = sj::compile([&](const sj::variable_list& v) -> sj::variable_list {
      return {sj::batch_norm(v[0], {}, {}, sj_mean, sj_var, false)};
    }, {.derivatives = 0});
    at::Tensor x = rnd({2, ch, 2, 2});
    for (int round = 0; round < 2; ++round) {
      CAPTURE(round);
      auto y = eval({sj::Variable(x)})[0];
      CHECK(max_abs_diff(y.data(), torch::batch_norm(x, {}, {}, t_mean, t_var, false, 0.1, 1e-5, false)) <= 1e-12);
      // One more training call (eager this time) moves the statistics.
      at::Tensor x2 = rnd({4, ch, 3, 2});
      sj::batch_norm(sj::Variable(x2), {}, {}, sj_mean, sj_var, true, 0.2, 1e-5);
      torch::batch_norm(x2, {}, {}, t_mean, t_var, true, 0.2, 1e-5, false);
      CHECK(max_abs_diff(sj_mean, t_mean) <= 1e-12);
    }

    // Tracing alone does not update them; the graph keeps the side-effecting op.
    const at::Tensor before = sj_mean.clone();
    auto tr = sj::trace(step, {sj::Variable(x, true), sj::Variable(w, true), sj::Variable(b, true)}, {.derivatives = 1});
    CHECK(at::equal(sj_mean, before));
    auto g = f.graph_for({sj::Variable(x, true), sj::Variable(w, true), sj::Variable(b, true)});
    int norms = 0;
    for (const auto* n : g->nodes())
      if (auto op = n->get_if<sj::ir::Op>(); op && op->id() == sj::OpId::native_batch_norm) ++norms;
    CHECK(norms == 1);
  }

  TEST_CASE("batch_norm: passes neither merge two identical calls nor remove one whose result is unused") {
    at::manual_seed(208);
    at::Tensor sj_mean = at::zeros({2}, at::kDouble), sj_var = at::ones({2}, at::kDouble);
    at::Tensor t_mean = sj_mean.clone(), t_var = sj_var.clone();
    auto f = sj::compile([&](const sj::variable_list& v) -> sj::variable_list {
      auto a = sj::batch_norm(v[0], {}, {}, sj_mean, sj_var, true);
      auto b = sj::batch_norm(v[0], {}, {}, sj_mean, sj_var, true);  // same node, a second update
      sj::batch_norm(sj::mul(v[0], 2.0), {}, {}, sj_mean, sj_var, true);  // result unused
      return {sj::sum(sj::mul(a, b))};
    }, {.derivatives = 1});
    for (int call = 0; call < 3; ++call) {
      CAPTURE(call);
      at::Tensor x = rnd({3, 2, 2}) + call;
      sj::Variable xv(x, true);
      auto out = f({xv});
      auto gx = sj::grad(out, {xv})[0];
      auto xt = x.clone().requires_grad_(true);
      auto ya = torch::batch_norm(xt, {}, {}, t_mean, t_var, true, 0.1, 1e-5, false);
      auto yb = torch::batch_norm(xt, {}, {}, t_mean, t_var, true, 0.1, 1e-5, false);
      torch::batch_norm(xt.detach() * 2.0, {}, {}, t_mean, t_var, true, 0.1, 1e-5, false);
      auto lt = (ya * yb).sum();
      CHECK(max_abs_diff(out[0].data(), lt.detach()) <= 1e-10);
      CHECK(max_abs_diff(gx.data(), torch::autograd::grad({lt}, {xt})[0]) <= 1e-10);
      CHECK(max_abs_diff(sj_mean, t_mean) <= 1e-12);
      CHECK(max_abs_diff(sj_var, t_var) <= 1e-12);
    }
    int norms = 0;
    for (const auto* n : f.graph_for({sj::Variable(rnd({3, 2, 2}), true)})->nodes())
      if (auto op = n->get_if<sj::ir::Op>(); op && op->id() == sj::OpId::native_batch_norm) ++norms;
    CHECK(norms == 3);
  }

  TEST_CASE("batch_norm: a compiled closure whose running statistics were freed says so") {
    at::manual_seed(200);
    auto holder = std::make_shared<std::pair<at::Tensor, at::Tensor>>(at::zeros({2}, at::kDouble),
                                                                      at::ones({2}, at::kDouble));
    auto f = sj::compile([holder](const sj::variable_list& v) -> sj::variable_list {
      return {sj::batch_norm(v[0], {}, {}, holder->first, holder->second, true)};
    }, {.derivatives = 0});
    at::Tensor x = rnd({3, 2});
    CHECK_NOTHROW(f({sj::Variable(x)}));
    *holder = {at::Tensor(), at::Tensor()};
    CHECK_THROWS_WITH_AS(f({sj::Variable(x)}), doctest::Contains("no longer exists"), sj::Error);
  }

  TEST_CASE("layer_norm: affine or not, several trailing dims, batch 1, non-contiguous, orders 1-2") {
    at::manual_seed(201);
    struct Case {
      std::string name;
      at::Tensor x;
      std::vector<int64_t> shape;
      bool weight, bias;
    };
    const std::vector<Case> cases = {
        {"affine", rnd({3, 4}), {4}, true, true},
        {"two dims, no affine", rnd({2, 2, 3}), {2, 3}, false, false},
        {"weight only, batch 1", rnd({1, 6}), {6}, true, false},
        {"non-contiguous", rnd({5, 3, 4}).transpose(0, 2), {3, 5}, true, true},
        {"whole tensor", rnd({3, 4}), {3, 4}, true, true},
    };
    for (const auto& c : cases) {
      std::vector<at::Tensor> in = {c.x};
      if (c.weight) in.push_back(rnd(c.shape));
      if (c.bias) in.push_back(rnd(c.shape));
      const bool hw = c.weight, hb = c.bias;
      const auto shape = c.shape;
      SjFn sj_fn = [=](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::layer_norm(v[0], shape, hw ? v[1] : sj::Variable(), hb ? v[hw ? 2 : 1] : sj::Variable(), 1e-5);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_fn = [=](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch::layer_norm(v[0], shape, hw ? v[1] : torch::Tensor(), hb ? v[hw ? 2 : 1] : torch::Tensor(), 1e-5);
        return {y, y * y};
      };
      check_op("layer_norm " + c.name, in, std::vector<bool>(in.size(), true), sj_fn, torch_fn, 2);
    }
  }

  // libtorch 1.13's own third derivative of native_layer_norm / native_batch_norm is not
  // the derivative of its second: its backward ignores the gradients that reach the saved
  // mean and inverse standard deviation (derivatives.yaml gives a formula for the first
  // output only), and layer_norm_double_backward uses them. At the third order the oracle
  // is therefore libtorch's autograd of the same normalisation written in primitive ops
  // (exact at every order), plus finite differences of stagejit's second derivatives.
  TEST_CASE("normalisation: third derivatives, eager and compiled, against libtorch's autograd of the primitive form") {
    at::manual_seed(205);
    auto normalize = [](const torch::Tensor& x, std::vector<int64_t> dims, double eps) {
      auto xc = x - x.mean(dims, true);
      return xc * ((xc * xc).mean(dims, true) + eps).rsqrt();
    };
    {
      SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::layer_norm(v[0], {4}, v[1], v[2], 1e-5);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_fn = [normalize](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = normalize(v[0], {-1}, 1e-5) * v[1] + v[2];
        return {y, y * y};
      };
      std::vector<at::Tensor> in = {rnd({3, 4}), rnd({4}), rnd({4})};
      oracle::check("layer_norm", in, {true, true, true}, sj_fn, torch_fn, 3, 1e-10, 1e-12);
      check_compiled(sj_fn, torch_fn, in, {true, true, true}, 3);
      check_compiled(sj_fn, torch_fn, in, {true, true, true}, 3, /*fuse=*/true);
    }
    {
      SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::layer_norm(v[0], {2, 3});
        return {sj::mul(y, sj::mul(y, y))};
      };
      TorchFn torch_fn = [normalize](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = normalize(v[0], {-2, -1}, 1e-5);
        return {y * (y * y)};
      };
      std::vector<at::Tensor> in = {rnd({2, 2, 3})};
      oracle::check("layer_norm two dims, cubed", in, {true}, sj_fn, torch_fn, 3, 1e-10, 1e-12);
      check_compiled(sj_fn, torch_fn, in, {true}, 3);
    }
    {
      SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::batch_norm(v[0], v[1], v[2], {}, {}, true, 0.1, 1e-5);
        return {sj::mul(y, y)};
      };
      TorchFn torch_fn = [normalize](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = normalize(v[0], {0, 2}, 1e-5) * v[1].view({1, -1, 1}) + v[2].view({1, -1, 1});
        return {y * y};
      };
      std::vector<at::Tensor> in = {rnd({3, 2, 2}), rnd({2}), rnd({2})};
      oracle::check("batch_norm", in, {true, true, true}, sj_fn, torch_fn, 3, 1e-10, 1e-12);
      check_compiled(sj_fn, torch_fn, in, {true, true, true}, 3);
    }
    {
      SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::group_norm(v[0], 2, v[1], v[2]);
        return {sj::mul(y, y)};
      };
      TorchFn torch_fn = [normalize](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = normalize(v[0].reshape({2, 2, -1}), {2}, 1e-5).reshape(v[0].sizes());
        y = y * v[1].view({1, -1, 1}) + v[2].view({1, -1, 1});
        return {y * y};
      };
      std::vector<at::Tensor> in = {rnd({2, 4, 2}), rnd({4}), rnd({4})};
      oracle::check("group_norm", in, {true, true, true}, sj_fn, torch_fn, 3, 1e-10, 1e-12);
      check_compiled(sj_fn, torch_fn, in, {true, true, true}, 3);
    }
  }

  TEST_CASE("layer_norm: third derivatives against finite differences of the second") {
    at::manual_seed(206);
    const at::Tensor c = rnd({2, 3}), u = rnd({2, 3}), uw = rnd({3});
    // x, w -> the second derivatives <u, d/d(x, w) <c, y^2>> differentiated once more.
    sj::testing::checked_fn second = [&](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::layer_norm(v[0], {3}, v[1], v[2]);
      auto l = sj::sum(sj::mul(sj::Variable(c), sj::mul(y, y)));
      auto g = sj::grad({l}, {v[0], v[1]}, {}, true);
      auto s = sj::add(sj::sum(sj::mul(g[0], sj::Variable(u))), sj::sum(sj::mul(g[1], sj::Variable(uw))));
      return sj::grad({s}, {v[0], v[1], v[2]}, {}, true, true);
    };
    sj::variable_list in = {sj::Variable(rnd({2, 3}), true), sj::Variable(rnd({3}), true), sj::Variable(rnd({3}), true)};
    std::string report;
    CHECK_MESSAGE(sj::testing::gradcheck(second, in, 1e-6, 1e-5, 1e-3, &report), report);
  }

  TEST_CASE("group_norm: groups, affine or not, batch 1, channels-last, orders 1-2") {
    at::manual_seed(202);
    struct Case {
      std::string name;
      at::Tensor x;
      int64_t groups;
      bool affine;
    };
    const std::vector<Case> cases = {
        {"3 groups, affine", rnd({2, 6, 3, 2}), 3, true},
        {"1 group, no affine", rnd({2, 4, 3}), 1, false},
        {"one channel per group, batch 1", rnd({1, 4, 5}), 4, true},
        {"channels-last", channels_last(rnd({2, 4, 2, 3})), 2, true},
    };
    for (const auto& c : cases) {
      const int64_t ch = c.x.size(1), groups = c.groups;
      const bool affine = c.affine;
      std::vector<at::Tensor> in = {c.x};
      if (affine) in = {c.x, rnd({ch}), rnd({ch})};
      SjFn sj_fn = [=](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::group_norm(v[0], groups, affine ? v[1] : sj::Variable(), affine ? v[2] : sj::Variable(), 1e-5);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_fn = [=](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch::group_norm(v[0], groups, affine ? v[1] : torch::Tensor(), affine ? v[2] : torch::Tensor(), 1e-5);
        return {y, y * y};
      };
      check_op("group_norm " + c.name, in, std::vector<bool>(in.size(), true), sj_fn, torch_fn, 2);
    }
  }

  TEST_CASE("gather and scatter_add: dims, duplicate indices, orders 1-2") {
    at::manual_seed(203);
    at::Tensor index1 = at::tensor({0, 2, 2, 1, 3, 0}, at::kLong).reshape({3, 2});     // dim 1 of [3, 4]
    at::Tensor index0 = at::tensor({2, 0, 1, 1, 0, 2, 2, 0}, at::kLong).reshape({2, 4});  // dim 0 of [3, 4]
    for (auto [dim, index] : {std::pair<int64_t, at::Tensor>{1, index1}, {0, index0}, {-1, index1}}) {
      CAPTURE(dim);
      SjFn sj_gather = [dim = dim](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::gather(v[0], dim, v[1]);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_gather = [dim = dim](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch::gather(v[0], dim, v[1]);
        return {y, y * y};
      };
      check_op("gather", {rnd({3, 4}), index}, {true, false}, sj_gather, torch_gather, 2);
      SjFn sj_scatter = [dim = dim](const sj::variable_list& v) -> sj::variable_list {
        auto y = sj::scatter_add(v[0], dim, v[1], v[2]);
        return {y, sj::mul(y, y)};
      };
      TorchFn torch_scatter = [dim = dim](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
        auto y = torch::scatter_add(v[0], dim, v[1], v[2]);
        return {y, y * y};
      };
      check_op("scatter_add", {rnd({3, 4}), index, rnd(index.sizes().vec())}, {true, false, true}, sj_scatter,
               torch_scatter, 2);
    }
    // A non-contiguous source and input.
    SjFn sj_fn = [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::scatter_add(v[0], 0, v[1], v[2])};
    };
    TorchFn torch_fn = [](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      return {torch::scatter_add(v[0], 0, v[1], v[2])};
    };
    check_op("scatter_add non-contiguous", {rnd({4, 3}).t(), index0, rnd({4, 2}).t()}, {true, false, true}, sj_fn,
             torch_fn, 2);
  }

  TEST_CASE("a small CNN of these ops, eager and compiled with two derivatives, equals libtorch") {
    at::manual_seed(207);
    // conv - batch_norm (training) - tanh - max_pool - grouped conv - group_norm -
    // adaptive_avg_pool - layer_norm - linear, and the sum of squares.
    auto rm = std::make_shared<std::pair<at::Tensor, at::Tensor>>(at::zeros({3}, at::kDouble), at::ones({3}, at::kDouble));
    auto trm = std::make_shared<std::pair<at::Tensor, at::Tensor>>(rm->first.clone(), rm->second.clone());
    SjFn sj_fn = [rm](const sj::variable_list& v) -> sj::variable_list {
      auto h = sj::conv2d(v[0], v[1], v[2], {1, 1}, {1, 1});
      h = sj::tanh(sj::batch_norm(h, v[3], v[4], rm->first, rm->second, true));
      h = sj::max_pool2d(h, {2, 2}, {}, {0, 0}, {1, 1}, true);
      h = sj::group_norm(sj::conv2d(h, v[5], {}, {1, 1}, {0, 0}, {1, 1}, 1), 2);
      h = sj::reshape(sj::adaptive_avg_pool2d(h, {1, 1}), {2, 4});
      h = sj::mm(sj::layer_norm(h, {4}), v[6]);
      return {sj::sum(sj::mul(h, h))};
    };
    TorchFn torch_fn = [trm](const std::vector<torch::Tensor>& v) -> std::vector<torch::Tensor> {
      auto h = torch::conv2d(v[0], v[1], v[2], {1, 1}, {1, 1});
      h = torch::tanh(torch::batch_norm(h, v[3], v[4], trm->first, trm->second, true, 0.1, 1e-5, false));
      h = torch::max_pool2d(h, {2, 2}, {}, {0, 0}, {1, 1}, true);
      h = torch::group_norm(torch::conv2d(h, v[5]), 2);
      h = torch::adaptive_avg_pool2d(h, {1, 1}).reshape({2, 4});
      h = torch::mm(torch::layer_norm(h, {4}), v[6]);
      return {(h * h).sum()};
    };
    std::vector<at::Tensor> in = {rnd({2, 1, 5, 5}), rnd({3, 1, 3, 3}), rnd({3}), rnd({3}), rnd({3}),
                                  rnd({4, 3, 2, 2}), rnd({4, 2})};
    check_op("cnn", in, std::vector<bool>(in.size(), true), sj_fn, torch_fn, 2, /*fuse=*/true);

    // Its traced graph prints, parses back to the same text, lints, and the reference
    // interpreter reproduces the trace's stages from the parsed graph.
    sj::variable_list leaves;
    for (const auto& t : in) leaves.emplace_back(t, true);
    auto tr = sj::trace(sj_fn, leaves, {.derivatives = 1});
    const std::string text = sj::ir::to_string(*tr.graph());
    // The input gradients of its convolutions run ATen's convolution_backward (libtorch's
    // kernels), never a transposed convolution (on CPU a far slower im2col kernel).
    CHECK(text.find("convolution_input_backward") != std::string::npos);
    CHECK(text.find("transposed=1") == std::string::npos);
    auto parsed = sj::ir::parse(text);
    CHECK(sj::ir::to_string(*parsed) == text);
    CHECK_NOTHROW(sj::ir::lint(*parsed));
    sj::variable_list graph_inputs = leaves;
    graph_inputs.emplace_back(at::ones({}, at::kDouble), false);
    auto outs = sj::interpret(*parsed, graph_inputs);
    REQUIRE(outs.size() == 1 + in.size());
    CHECK(max_abs_diff(outs[0].data(), tr.stage_outputs(0)[0].data()) <= 1e-12);
    for (std::size_t i = 0; i < in.size(); ++i)
      CHECK(max_abs_diff(outs[1 + i].data(), tr.stage_outputs(1)[i].data()) <= 1e-12);
  }

  TEST_CASE("finite differences: gradcheck and gradgradcheck of every op on small cases") {
    at::manual_seed(204);
    auto var = [](std::vector<int64_t> shape) { return sj::Variable(rnd(std::move(shape)), true); };
    check_finite_differences("conv2d", [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::conv2d(v[0], v[1], v[2], {2, 1}, {1, 0}, {1, 2}, 2)};
    }, {var({1, 2, 4, 5}), var({2, 1, 2, 2}), var({2})});
    check_finite_differences("conv1d", [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::conv1d(v[0], v[1], v[2], {2}, {1})};
    }, {var({2, 2, 5}), var({3, 2, 2}), var({3})});
    check_finite_differences("conv_transpose2d", [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::conv_transpose2d(v[0], v[1], v[2], {2, 2}, {1, 0}, {1, 0})};
    }, {var({1, 2, 3, 2}), var({2, 2, 2, 2}), var({2})});
    check_finite_differences("max_pool2d", [](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::max_pool2d(v[0], {2, 2}, {1, 1}, {1, 0}, {1, 1}, true);
      return {sj::mul(y, y)};
    }, {var({1, 2, 4, 3})});
    check_finite_differences("avg_pool2d", [](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::avg_pool2d(v[0], {2, 3}, {1, 2}, {1, 1});
      return {sj::mul(y, y)};
    }, {var({1, 2, 4, 5})});
    check_finite_differences("adaptive_avg_pool2d", [](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::adaptive_avg_pool2d(v[0], {2, 3});
      return {sj::mul(y, y)};
    }, {var({1, 2, 5, 4})});
    check_finite_differences("batch_norm", [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::batch_norm(v[0], v[1], v[2], {}, {}, true)};
    }, {var({3, 2, 2}), var({2}), var({2})});
    check_finite_differences("layer_norm", [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::layer_norm(v[0], {3}, v[1], v[2])};
    }, {var({2, 3}), var({3}), var({3})});
    check_finite_differences("group_norm", [](const sj::variable_list& v) -> sj::variable_list {
      return {sj::group_norm(v[0], 2, v[1], v[2])};
    }, {var({2, 4, 2}), var({4}), var({4})});
    const sj::Variable index(at::tensor({1, 0, 1, 2, 2, 0}, at::kLong).reshape({2, 3}));
    check_finite_differences("gather", [index](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::gather(v[0], 0, index);
      return {sj::mul(y, y)};
    }, {var({3, 3})});
    check_finite_differences("scatter_add", [index](const sj::variable_list& v) -> sj::variable_list {
      auto y = sj::scatter_add(v[0], 0, index, v[1]);
      return {sj::mul(y, y)};
    }, {var({3, 3}), var({2, 3})});
  }

  TEST_CASE("bad inputs: a clear error naming the op") {
    sj::Variable x(rnd({1, 2, 4, 4})), w(rnd({3, 2, 3, 3}));
    // Convolution
    CHECK_THROWS_WITH_AS(sj::conv2d(x, sj::Variable(rnd({3, 2, 3}))), doctest::Contains("conv2d: weight must be 4-d"),
                         sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::conv2d(x, w, {}, {1, 1}, {-1, 0}), doctest::Contains("conv2d: negative padding"),
                         sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::conv2d(sj::Variable(rnd({1, 2, 2, 2})), w), doctest::Contains("convolution"), sj::ShapeError);
    CHECK_THROWS_AS(sj::conv2d(x, sj::Variable(rnd({3, 3, 3, 3}))), sj::ShapeError);  // channels
    CHECK_THROWS_AS(sj::conv1d(sj::Variable(rnd({2, 4, 5})), sj::Variable(rnd({3, 2, 2})), {}, {1}, {0}, {1}, 3),
                    sj::ShapeError);  // groups do not divide the channels
    CHECK_THROWS_WITH_AS(sj::conv_transpose2d(x, w, {}, {1, 1}, {0}, {0, 0, 0}),
                         doctest::Contains("output_padding must have 2 values"), sj::ShapeError);
    // Pooling
    CHECK_THROWS_WITH_AS(sj::max_pool2d(x, {2, 2}, {}, {2, 0}), doctest::Contains("max_pool2d: padding 2"),
                         sj::ShapeError);
    CHECK_THROWS_AS(sj::max_pool2d(x, {5, 5}), sj::ShapeError);  // kernel larger than the input
    CHECK_THROWS_AS(sj::avg_pool2d(sj::Variable(rnd({4, 4})), {2, 2}), sj::ShapeError);
    CHECK_THROWS_AS(sj::adaptive_avg_pool2d(x, {2, 2, 2}), sj::ShapeError);
    // Normalisation
    CHECK_THROWS_WITH_AS(sj::batch_norm(x, sj::Variable(rnd({3})), {}, {}, {}, true),
                         doctest::Contains("batch_norm: weight must have sizes [2]"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::batch_norm(x, {}, {}, {}, {}, false), doctest::Contains("batch_norm: evaluation mode"),
                         sj::Error);
    CHECK_THROWS_WITH_AS(sj::layer_norm(x, {5}), doctest::Contains("native_layer_norm"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::group_norm(x, 3), doctest::Contains("group_norm: 2 channels cannot be split into 3"),
                         sj::ShapeError);
    // Indexing
    sj::Variable a(rnd({3, 4}));
    CHECK_THROWS_WITH_AS(sj::gather(a, 1, sj::Variable(at::tensor({4}, at::kLong).reshape({1, 1}))), doctest::Contains("gather"),
                         sj::ShapeError);
    // An int32 index: libtorch 1.13 rejects it, later ATen gathers by it; the op does what
    // the ATen it runs on does.
    const at::Tensor index32 = at::tensor({1}, at::kInt).reshape({1, 1});
    bool aten_gathers_int32 = true;
    try {
      (void)at::gather(a.data(), 1, index32);
    } catch (const c10::Error&) {
      aten_gathers_int32 = false;
    }
    if (aten_gathers_int32)
      CHECK(at::equal(sj::gather(a, 1, sj::Variable(index32)).data(), at::gather(a.data(), 1, index32)));
    else
      CHECK_THROWS_AS(sj::gather(a, 1, sj::Variable(index32)), sj::DtypeError);
    CHECK_THROWS_WITH_AS(sj::scatter_add(a, 0, sj::Variable(at::tensor({0, 1}, at::kLong).reshape({1, 2})), sj::Variable(rnd({1}))),
                         doctest::Contains("scatter_add"), sj::ShapeError);
  }
}
