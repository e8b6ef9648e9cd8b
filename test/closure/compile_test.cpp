// compile(): staged closures checked against stagejit eager and libtorch's autograd at
// orders 0..3, plus the bug-log cases of the seed era (issue 5).
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/host_functions.hpp"
#include "../support/models.hpp"
#include "../support/check_stages.hpp"
#include "../support/staged_oracle.hpp"

#include <thread>

namespace sj = stagejit;
using sj::testing::libtorch_stages;
using sj::testing::max_abs_diff;

namespace {

at::Tensor rand_d(std::vector<int64_t> shape) { return at::randn(shape, at::kDouble); }

// Runs the compiled function and then, stage by stage, the compiled backward with
// grad outputs of ones (create_graph while a further stage follows), exactly as
// libtorch_stages does with libtorch; compares every stage within 1e-10.
template <class SjFn, class TorchFn>
void check_compiled(SjFn sj_fn, TorchFn torch_fn, const std::vector<at::Tensor>& data,
                    const std::vector<bool>& rg, int k) {
  sj::testing::check_compiled_stages(sj_fn, torch_fn, data, rg, k);
}

using sj::testing::Mul;
using sj::testing::MulConstant;

}  // namespace

TEST_SUITE("closure") {
  TEST_CASE("tanh MLP compiled, orders 0..3") {
    at::manual_seed(11);
    std::vector<at::Tensor> data = {rand_d({3, 4}), rand_d({4, 5}), rand_d({5}), rand_d({5, 2})};
    for (int k = 0; k <= 3; ++k)
      check_compiled(sj::testing::tanh_mlp<sj::Variable>, sj::testing::tanh_mlp<torch::Tensor>,
                     data, {false, true, true, true}, k);
  }

  TEST_CASE("LSTM cell compiled, orders 0..3") {
    at::manual_seed(12);
    std::vector<at::Tensor> data = {rand_d({2, 3}), rand_d({2, 4}), rand_d({2, 4}),
                                    rand_d({16, 3}), rand_d({16, 4}), rand_d({16})};
    for (int k = 0; k <= 3; ++k)
      check_compiled(sj::testing::lstm_cell<sj::Variable>, sj::testing::lstm_cell<torch::Tensor>,
                     data, {true, true, true, true, true, true}, k);
  }

  TEST_CASE("log_softmax + nll_loss (via cross_entropy and where) compiled, orders 0..3") {
    at::manual_seed(13);
    auto target = at::tensor({1, 0, 3}, at::kLong);
    auto sj_fn = [target](const sj::variable_list& in) {
      return sj::testing::classifier_loss(in, sj::Variable(target));
    };
    auto torch_fn = [target](const std::vector<torch::Tensor>& in) {
      return sj::testing::classifier_loss(in, target);
    };
    std::vector<at::Tensor> data = {rand_d({3, 4}), rand_d({3, 4})};
    for (int k = 0; k <= 3; ++k) check_compiled(sj_fn, torch_fn, data, {true, true}, k);
  }

  TEST_CASE("an output used twice, a constant, an undefined gradient") {
    auto c = at::tensor({0.5, -1.5}, at::kDouble);
    auto sj_fn = [c](const sj::variable_list& in) -> sj::variable_list {
      auto y = sj::tanh(in[0]) * sj::Variable(c);
      return {y * y + y, in[1] * 2.0};  // y used twice; in[1] unrelated to output 0
    };
    auto torch_fn = [c](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
      auto y = at::tanh(in[0]) * c;
      return {y * y + y, in[1] * 2.0};
    };
    std::vector<at::Tensor> data = {at::tensor({0.3, -0.7}, at::kDouble),
                                    at::tensor({1.0, 2.0}, at::kDouble)};
    for (int k = 0; k <= 3; ++k) check_compiled(sj_fn, torch_fn, data, {true, true}, k);
  }

  TEST_CASE("seed example: MulConstant and Mul host functions, Handles two stages later") {
    auto sj_fn = [](const sj::variable_list& in) -> sj::variable_list {
      return {Mul::apply(MulConstant::apply(in[1], 2.0), in[0])};
    };
    auto torch_fn = [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
      return {(in[1] * 2.0) * in[0]};
    };
    std::vector<at::Tensor> data = {at::tensor({1.5, -2.0}, at::kDouble),
                                    at::tensor({0.5, 3.0}, at::kDouble)};
    for (int k = 0; k <= 2; ++k) check_compiled(sj_fn, torch_fn, data, {true, true}, k);
  }

  TEST_CASE("host function returning one gradient per forward argument (scalars undefined), compiled") {
    struct MulConstantArgs : sj::HostFunction<MulConstantArgs> {
      static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, double c) {
        ctx->saved_data["c"] = c;
        return sj::Variable(x.data() * c);
      }
      static sj::variable_list backward(sj::HostContext* ctx, sj::variable_list g) {
        return {g[0] * std::get<double>(ctx->saved_data.at("c")), sj::Variable()};
      }
    };
    auto sj_fn = [](const sj::variable_list& in) -> sj::variable_list {
      return {Mul::apply(MulConstantArgs::apply(in[1], 2.0), in[0])};
    };
    auto torch_fn = [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
      return {(in[1] * 2.0) * in[0]};
    };
    std::vector<at::Tensor> data = {at::tensor({1.5, -2.0}, at::kDouble), at::tensor({0.5, 3.0}, at::kDouble)};
    for (int k = 0; k <= 2; ++k) check_compiled(sj_fn, torch_fn, data, {true, true}, k);
  }

  TEST_CASE("a host function using libtorch's own autograd runs inside compiled stages") {
    // Compiled stages run below libtorch's autograd keys (Note [Below libtorch's autograd
    // keys]); a host function's forward and backward get them back, so libtorch records
    // the graph its code builds on its own tensors, as it would eagerly.
    struct CubeByLibtorch : sj::HostFunction<CubeByLibtorch> {
      static sj::Variable forward(sj::HostContext* ctx, sj::Variable x) {
        ctx->save_for_backward({x});
        at::Tensor t = x.data().detach().requires_grad_(true);
        at::Tensor y = t.pow(3);
        REQUIRE(y.requires_grad());
        // 3 x^2 through libtorch's autograd, checked against the formula.
        at::Tensor dy = torch::autograd::grad({y.sum()}, {t})[0];
        CHECK(max_abs_diff(dy, 3 * x.data().pow(2)) < 1e-12);
        return sj::Variable(y.detach());
      }
      static sj::variable_list backward(sj::HostContext* ctx, sj::variable_list g) {
        at::Tensor t = ctx->get_saved_variables()[0].data().detach().requires_grad_(true);
        at::Tensor y = t.pow(3);
        return {sj::Variable(torch::autograd::grad({y}, {t}, {g[0].data()})[0])};
      }
    };
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::tanh(CubeByLibtorch::apply(sj::sin(in[0])))};
    }, {.derivatives = 1});
    const at::Tensor data = at::tensor({0.3, -1.2, 2.0}, at::kDouble);
    auto x = sj::Variable(data, true);
    for (int call = 0; call < 2; ++call) {  // the trace, then the compiled stages
      auto y = f({x})[0];
      auto g = sj::grad({sj::sum(y)}, {x})[0];
      const at::Tensor s = data.sin();
      const at::Tensor u = s.pow(3).tanh();
      CHECK(max_abs_diff(y.data(), u) < 1e-12);
      CHECK(max_abs_diff(g.data(), (1 - u * u) * 3 * s * s * data.cos()) < 1e-12);
    }
  }

  TEST_CASE("dispatch-key guards: user code gets back only the keys stagejit excluded") {
    // Note [Below libtorch's autograd keys]: AtenAutogradKeys undoes BelowAtenAutograd,
    // nested either way, and leaves keys a caller excluded itself (InferenceMode, a
    // libtorch kernel's AutoDispatchBelowADInplaceOrView) excluded.
    auto excluded = [] { return c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::ADInplaceOrView); };
    REQUIRE(!excluded());
    {
      sj::AtenAutogradKeys user;
      CHECK(!excluded());
    }
    {
      sj::BelowAtenAutograd stage;
      CHECK(excluded());
      {
        sj::AtenAutogradKeys user;
        CHECK(!excluded());
        {
          sj::BelowAtenAutograd inner;
          CHECK(excluded());
        }
        CHECK(!excluded());
      }
      CHECK(excluded());
      sj::BelowAtenAutograd off(false);
      CHECK(excluded());
    }
    CHECK(!excluded());
    {
      at::AutoDispatchBelowADInplaceOrView caller;
      {
        sj::AtenAutogradKeys user;
        CHECK(excluded());
      }
      sj::BelowAtenAutograd stage;
      {
        sj::AtenAutogradKeys user;
        CHECK(excluded());
      }
    }
    CHECK(!excluded());
  }

  TEST_CASE("bug log: x^5 at 1 with 2 derivatives gives 5 and 20; with 1, the second throws") {
    auto f2 = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::pow(in[0], 5.0)};
    }, {.derivatives = 2});
    auto x = sj::Variable(at::tensor({1.0}, at::kDouble), true);
    auto y = f2({x})[0];
    auto g = sj::grad({y}, {x}, {}, /*create_graph=*/true)[0];
    CHECK(g.data().item<double>() == 5.0);
    auto gg = sj::grad({g}, {x})[0];
    CHECK(gg.data().item<double>() == 20.0);

    auto f1 = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::pow(in[0], 5.0)};
    }, {.derivatives = 1});
    auto y1 = f1({x})[0];
    auto g1 = sj::grad({y1}, {x}, {}, /*create_graph=*/true)[0];
    CHECK(g1.data().item<double>() == 5.0);
    CHECK_THROWS_WITH_AS(sj::grad({g1}, {x}), doctest::Contains("compiled only for 1 derivatives"),
                         sj::Error);
  }

  TEST_CASE("bug log: two outputs both used by a loss outside count both paths") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      auto a = in[0] * 2.0;
      auto b = a * 3.0;
      return {a, b};
    });
    auto x = sj::Variable(at::tensor({1.0, 2.0}, at::kDouble), true);
    auto out = f({x});
    auto L = sj::sum(out[0]) * 10.0 + sj::sum(out[1]);
    L.backward();
    CHECK(at::equal(x.grad().data(), at::tensor({26.0, 26.0}, at::kDouble)));
  }

  TEST_CASE("bug log: the same Variable in two input slots adds its gradients") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(in[0] * in[1] + in[0])};
    });
    auto x = sj::Variable(at::tensor({1.0, 3.0}, at::kDouble), true);
    auto g = sj::grad(f({x, x}), {x})[0];
    CHECK(at::allclose(g.data(), at::tensor({3.0, 7.0}, at::kDouble), 0, 0));
  }

  TEST_CASE("bug log: flipping requires_grad between calls is a new spec, gradients correct") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(in[0] * in[1])};
    });
    auto a = sj::Variable(at::tensor({1.0, 2.0}, at::kDouble), true);
    auto b = sj::Variable(at::tensor({3.0, 4.0}, at::kDouble), false);
    sj::backward(f({a, b}));
    CHECK(at::equal(a.grad().data(), b.data()));
    CHECK_FALSE(b.grad().defined());
    auto a2 = sj::Variable(a.data(), false);
    auto b2 = sj::Variable(b.data(), true);
    sj::backward(f({a2, b2}));
    CHECK(at::equal(b2.grad().data(), a.data()));
    CHECK_FALSE(a2.grad().defined());
    CHECK(f.stats().misses == 2);
  }

  TEST_CASE("an output that folds to an input is a view of it, not the caller's tensor") {
    // t(t(W)) folds to W (fold_double_transposes): the output must behave as eager's view.
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::t(sj::t(in[0])), in[0] * 2.0};
    });
    const at::Tensor w = at::arange(6, at::kDouble).reshape({2, 3});
    auto x = sj::Variable(w, true);
    auto outs = f({x});
    // The fold did happen: no transpose is left in the forward.
    for (auto* n : f.graph_for({x})->nodes())
      if (n->stage() == 0) CHECK_FALSE(n->describe() == "t");
    at::Tensor y = outs[0].data();
    CHECK(y.unsafeGetTensorImpl() != w.unsafeGetTensorImpl());
    CHECK(y.is_alias_of(w));
    y.t_();  // a metadata change of the output does not reach W
    CHECK(w.sizes() == at::IntArrayRef({2, 3}));
    CHECK(x.data().sizes() == at::IntArrayRef({2, 3}));
    y.t_();
    // and the gradient still flows through the folded output
    auto g = sj::grad({sj::sum(outs[0]) + sj::sum(outs[1])}, {x})[0];
    CHECK(at::allclose(g.data(), at::full({2, 3}, 3.0, at::kDouble), 0, 0));

    // Stage 1: the backward of t(t(x)) hands the grad output through; the result is a
    // view of it, not the caller's grad output tensor.
    auto h = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::t(sj::t(in[0]))};
    });
    const at::Tensor go = at::ones({2, 3}, at::kDouble);
    auto gx = sj::grad(h({x}), {x}, {sj::Variable(go)})[0].data();
    CHECK(at::equal(gx, go));
    CHECK(gx.unsafeGetTensorImpl() != go.unsafeGetTensorImpl());
  }

  TEST_CASE("bug log: a shape change re-traces") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(sj::reshape(in[0], {-1}) * 2.0)};
    });
    auto x1 = sj::Variable(at::ones({2, 3}, at::kDouble), true);
    auto x2 = sj::Variable(at::ones({4, 5}, at::kDouble), true);
    CHECK(f({x1})[0].data().item<double>() == 12.0);
    CHECK(f({x2})[0].data().item<double>() == 40.0);
    auto g = sj::grad(f({x2}), {x2})[0];
    CHECK(g.sizes() == at::IntArrayRef({4, 5}));
    CHECK(f.stats().misses == 2);
    CHECK(f.stats().hits == 1);
  }

  TEST_CASE("bug log: 1000 calls with backward give identical results") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(sj::tanh(in[0]) * in[1])};
    });
    auto xd = at::tensor({0.1, 0.2, -0.3}, at::kDouble);
    auto wd = at::tensor({1.0, -2.0, 0.5}, at::kDouble);
    at::Tensor first_y, first_g;
    for (int i = 0; i < 1000; ++i) {
      auto x = sj::Variable(xd, true);
      auto y = f({x, sj::Variable(wd)})[0];
      auto g = sj::grad({y}, {x})[0];
      if (i == 0) {
        first_y = y.data().clone();
        first_g = g.data().clone();
      } else if (!at::equal(y.data(), first_y) || !at::equal(g.data(), first_g)) {
        FAIL("call ", i, " differs from the first");
      }
    }
    CHECK(f.stats().misses == 1);
  }

  TEST_CASE("concurrency: 8 threads x 200 calls with backward, each checking its own results") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(sj::sigmoid(in[0] * in[1]))};
    });
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        auto xd = at::full({5}, 0.1 * (t + 1), at::kDouble);
        auto wd = at::linspace(-1.0, 1.0, 5, at::kDouble);
        auto s = at::sigmoid(xd * wd);
        auto expected_g = s * (1 - s) * wd;
        auto expected_y = s.sum();
        for (int i = 0; i < 200; ++i) {
          auto x = sj::Variable(xd, true);
          auto y = f({x, sj::Variable(wd)})[0];
          auto g = sj::grad({y}, {x})[0];
          if (!at::allclose(y.data(), expected_y, 1e-14, 1e-14) ||
              !at::allclose(g.data(), expected_g, 1e-14, 1e-14))
            ++failures;
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(failures == 0);
  }

  TEST_CASE("memory: compiled stages reuse large CPU blocks (cache_host_memory), also from 4 threads") {
    auto& cache = sj::memory::HostCachingAllocator::get();
    auto body = [](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(sj::tanh(sj::mm(in[0], in[1])) * in[0])};
    };
    auto xd = at::randn({128, 128}, at::kDouble);  // 128 KiB: above the cache's threshold
    auto wd = at::randn({128, 128}, at::kDouble) * 0.1;
    auto tx = xd.clone().requires_grad_(true), tw = wd.clone().requires_grad_(true);
    auto want = torch::autograd::grad({at::sum(at::tanh(at::mm(tx, tw)) * tx)}, {tx, tw});
    auto step = [&](sj::CompiledFunction& f) {
      sj::variable_list in = {sj::Variable(xd, true), sj::Variable(wd, true)};
      return sj::grad(f(in), in);
    };
    auto check = [&](const sj::variable_list& g) {
      return max_abs_diff(g[0].data(), want[0]) <= 1e-10 && max_abs_diff(g[1].data(), want[1]) <= 1e-10;
    };
    auto off = sj::compile(body, {.cache_host_memory = false});
    step(off);
    auto before = cache.stats();
    CHECK(check(step(off)));
    CHECK(cache.stats().hits == before.hits);
    CHECK(cache.stats().misses == before.misses);
    {
      // A stage compiled with the cache off runs in a NoHostCacheScope, also when called
      // inside an open scope (another function's cached stage): the innermost one wins.
      REQUIRE(sj::memory::install_host_cache());
      sj::memory::HostCacheScope outer;
      CHECK(check(step(off)));
      CHECK(sj::memory::HostCacheScope::active());
      {
        sj::memory::NoHostCacheScope inner;
        CHECK_FALSE(sj::memory::HostCacheScope::active());
        {
          sj::memory::HostCacheScope again;
          CHECK(sj::memory::HostCacheScope::active());
        }
        CHECK_FALSE(sj::memory::HostCacheScope::active());
      }
      CHECK(sj::memory::HostCacheScope::active());
    }

    auto on = sj::compile(body);
    CHECK(check(step(on)));  // compiles, fills the cache
    before = cache.stats();
    CHECK(check(step(on)));
    CHECK(cache.stats().hits > before.hits);  // the second call reuses blocks
    CHECK(cache.stats().misses == before.misses);

    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&] {
        for (int i = 0; i < 50; ++i)
          if (!check(step(on))) ++failures;
      });
    for (auto& th : threads) th.join();
    CHECK(failures == 0);
  }

  // Note [Eager ops allocate from the host cache] (ops/op_table-inl.hpp): once compile()
  // has installed the cache, a staged program's eager loss between compiled calls reuses
  // blocks as its compiled stages do; libtorch's own ATen calls keep c10's allocator, and
  // a stage compiled with cache_host_memory off stays out of the cache.
  TEST_CASE("memory: stagejit's eager ops reuse large CPU blocks once the host cache is installed") {
    REQUIRE(sj::memory::install_host_cache());
    auto& cache = sj::memory::HostCachingAllocator::get();
    const at::Tensor a = at::randn({128, 128}, at::kDouble);  // 128 KiB
    auto eager_step = [&] {
      sj::Variable v(a, true);
      const sj::Variable y = sj::tanh(v * 0.5) * v - 1.0;
      return sj::grad({sj::sum(y * y)}, {v})[0].data();
    };
    const at::Tensor t = a.clone().requires_grad_(true);
    const at::Tensor ty = at::tanh(t * 0.5) * t - 1.0;
    const at::Tensor want = torch::autograd::grad({(ty * ty).sum()}, {t})[0];
    CHECK(max_abs_diff(eager_step(), want) <= 1e-12);
    auto before = cache.stats();
    for (int i = 0; i < 3; ++i) CHECK(max_abs_diff(eager_step(), want) <= 1e-12);
    CHECK(cache.stats().hits > before.hits);
    CHECK(cache.stats().misses == before.misses);
    // ATen called directly, outside stagejit's ops, is not routed.
    before = cache.stats();
    for (int i = 0; i < 3; ++i) (void)(at::tanh(a * 0.5) * a);
    CHECK(cache.stats().hits == before.hits);
    CHECK(cache.stats().misses == before.misses);
    // Inside a NoHostCacheScope (a stage compiled with the cache off runs in one), neither.
    {
      sj::memory::NoHostCacheScope off;
      before = cache.stats();
      for (int i = 0; i < 3; ++i) CHECK(max_abs_diff(eager_step(), want) <= 1e-12);
      CHECK(cache.stats().hits == before.hits);
      CHECK(cache.stats().misses == before.misses);
    }
  }

  // Note [Least recently used sizes] (core/memory/host_allocator.hpp): a full cache makes
  // room for the size in use by releasing the sizes used least recently; it used to
  // release the block just freed, so every later tensor of a new size was mapped again.
  TEST_CASE("memory: a full host cache releases the sizes used least recently, not the size in use") {
    auto& cache = sj::memory::HostCachingAllocator::get();
    const std::size_t saved_capacity = cache.capacity();
    cache.empty_cache();
    cache.set_capacity(std::size_t{4} << 20);  // 4 MiB
    auto block = [](int64_t doubles) { return sj::memory::empty_cached({doubles}, at::kDouble); };
    {
      // Fill the cache with 1 MiB blocks of a size that is then never asked for again.
      std::vector<at::Tensor> old;
      for (int i = 0; i < 4; ++i) old.push_back(block(131072));
    }
    CHECK(cache.stats().cached_bytes == (std::size_t{4} << 20));
    // A new size, freed and asked for again call after call, is served from the cache.
    (void)block(65536);  // 512 KiB: a miss, then freed into the full cache
    const auto before = cache.stats();
    for (int i = 0; i < 10; ++i) (void)block(65536);
    const auto after = cache.stats();
    CHECK(after.hits - before.hits == 10);
    CHECK(after.misses == before.misses);
    CHECK(after.cached_bytes <= cache.capacity());
    // A block larger than the whole capacity goes back to the system.
    (void)block(1 << 20);  // 8 MiB
    CHECK(cache.stats().cached_bytes <= cache.capacity());
    cache.set_capacity(0);
    CHECK(cache.stats().cached_bytes == 0);
    cache.set_capacity(saved_capacity);
  }

  TEST_CASE("memory: captured tensors are freed when outputs are dropped (backward or not)") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(sj::tanh(in[0]) * sj::exp(in[0]))};
    });
    auto x = sj::Variable(at::randn({64}, at::kDouble), true);
    (void)f({x});  // compile once
    std::weak_ptr<stagejit::Function> weak_fn;
    {
      auto y = f({x})[0];
      weak_fn = y.grad_fn();
      CHECK_FALSE(weak_fn.expired());
    }
    CHECK(weak_fn.expired());  // never backpropagated: the closure and its captures are gone
    {
      auto y = f({x})[0];
      weak_fn = y.grad_fn();
      sj::backward({y});
    }
    CHECK(weak_fn.expired());
  }

  TEST_CASE("graph_for returns the optimised graph; it lints and has both stages") {
    auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      auto a = sj::tanh(in[0]);
      auto b = sj::tanh(in[0]);  // CSE removes the duplicate
      return {sj::sum(a * b)};
    }, {.fuse = false});
    auto x = sj::Variable(at::ones({3}, at::kDouble), true);
    auto g = f.graph_for({x});
    CHECK_NOTHROW(sj::ir::lint(*g));
    CHECK(g->num_stages() == 2);
    int tanhs = 0;
    for (auto* n : g->nodes())
      if (auto* op = n->get_if<sj::ir::Op>(); op && op->id() == sj::OpId::tanh) ++tanhs;
    CHECK(tanhs == 1);
  }
}

TEST_SUITE("closure") {
  TEST_CASE("fusion inside compile(): every stage of tanh(a*b + c) * sigmoid(a) is fused") {
    auto fn = [](const sj::variable_list& in) -> sj::variable_list {
      return {sj::sum(sj::tanh(in[0] * in[1] + in[2]) * sj::sigmoid(in[0]))};
    };
    auto fused = sj::compile(fn, {.derivatives = 2, .fuse = true});
    auto unfused = sj::compile(fn, {.derivatives = 2, .fuse = false});
    at::manual_seed(21);
    std::vector<at::Tensor> data = {rand_d({16, 4}), rand_d({4}), rand_d({16, 1})};
    sj::variable_list in;
    for (auto& d : data) in.emplace_back(d, true);
    auto g = fused.graph_for(in);
    CHECK_NOTHROW(sj::ir::lint(*g));
    std::vector<int> groups(g->num_stages(), 0);
    for (auto* n : g->nodes()) groups[n->stage()] += n->is<sj::ir::FusionGroup>();
    CHECK(groups[0] >= 1);
    CHECK(groups[1] >= 1);
    std::string text = sj::ir::to_string(*g);
    CHECK(text.find("with fusion_group_") != std::string::npos);

    auto y1 = fused(in)[0];
    auto y2 = unfused(in)[0];
    CHECK(max_abs_diff(y1.data(), y2.data()) <= 1e-12);
    auto g1 = sj::grad({y1}, in, {}, true);
    auto g2 = sj::grad({y2}, in, {}, true);
    for (std::size_t i = 0; i < in.size(); ++i) CHECK(max_abs_diff(g1[i].data(), g2[i].data()) <= 1e-12);
    auto s1 = sj::sum(g1[0]), s2 = sj::sum(g2[0]);
    auto gg1 = sj::grad({s1}, in, {}, false, true);
    auto gg2 = sj::grad({s2}, in, {}, false, true);
    for (std::size_t i = 0; i < in.size(); ++i) {
      CAPTURE(i);
      CHECK(max_abs_diff(gg1[i].data(), gg2[i].data()) <= 1e-12);
    }
  }

  TEST_CASE("fusion inside compile(): a forward and its sj::grad traced in one stage are one kernel") {
    // bench/fusion's one-stage step: y and dy/d(a, b, c) for a grad output given as an
    // input, compiled with no derivative. Forward and backward are one trace, so the fuser
    // makes one group reading a, b, c, gy and writing y and the three gradients.
    auto step = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
      const sj::variable_list x = {in[0], in[1], in[2]};
      sj::Variable y = sj::tanh(in[0] * in[1] + in[2]) * sj::sigmoid(in[0]);
      sj::variable_list out = sj::grad({y}, x, {in[3]});
      out.insert(out.begin(), y);
      return out;
    }, {.derivatives = 0, .fuse = true});
    at::manual_seed(22);
    const std::vector<at::Tensor> data = {rand_d({4096}), rand_d({4096}), rand_d({4096}), rand_d({4096})};
    const sj::variable_list in = {sj::Variable(data[0], true), sj::Variable(data[1], true),
                                  sj::Variable(data[2], true), sj::Variable(data[3])};
    auto g = step.graph_for(in);
    CHECK_NOTHROW(sj::ir::lint(*g));
    CHECK(g->num_stages() == 1);
    int groups = 0, others = 0;
    for (auto* n : g->nodes()) (n->is<sj::ir::FusionGroup>() ? groups : others) += 1;
    CHECK(groups == 1);
    CHECK(others == 0);
    for (auto* n : g->nodes())
      if (auto* fg = n->get_if<sj::ir::FusionGroup>()) {
        CHECK(fg->subgraph->inputs().size() == 4);
        CHECK(fg->subgraph->outputs().size() == 4);
      }

    const sj::variable_list out = step(in);
    REQUIRE(out.size() == 4);
    std::vector<torch::Tensor> leaves;
    for (int i = 0; i < 3; ++i) leaves.push_back(data[i].detach().requires_grad_(true));
    const torch::Tensor y = torch::tanh(leaves[0] * leaves[1] + leaves[2]) * torch::sigmoid(leaves[0]);
    const auto want = torch::autograd::grad({y}, leaves, {data[3]});
    CHECK(max_abs_diff(out[0].data(), y.detach()) <= 1e-12);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(max_abs_diff(out[i + 1].data(), want[i]) <= 1e-12);
    }
  }
}

TEST_SUITE("closure") {
  TEST_CASE("run_stages: a parsed two-stage graph run through the closures equals libtorch") {
    // The tanh MLP of examples/tanh_mlp.ir in doubles: stage 0 forward, stage 1 the
    // gradients of the weights for a grad output %gy.
    auto g = sj::ir::parse(R"IR(graph(%x : Double(4, 3), %w1 : Double(3, 5), %b1 : Double(5),
      %w2 : Double(5, 2), %b2 : Double(2),
      -------- stage 1 --------
      %gy : Double(4, 2)) {
  %z1 : Double(4, 5) = addmm[beta=1, alpha=1](%b1, %x, %w1);
  %h : Double(4, 5) = tanh(%z1);
  %y : Double(4, 2) = addmm[beta=1, alpha=1](%b2, %h, %w2);
  ---------------- stage 1 ----------------
  %ht : Double(5!, 4!) = t(%h);
  %gw2 : Double(5, 2) = mm(%ht, %gy);
  %gb2 : Double(2) = sum[dim=[0], keepdim=0](%gy);
  %w2t : Double(2!, 5!) = t(%w2);
  %gh : Double(4, 5) = mm(%gy, %w2t);
  %hh : Double(4, 5) = mul(%h, %h);
  %dtanh : Double(4, 5) = rsub[other=1, alpha=1](%hh);
  %gz : Double(4, 5) = mul(%gh, %dtanh);
  %xt : Double(3!, 4!) = t(%x);
  %gw1 : Double(3, 5) = mm(%xt, %gz);
  %gb1 : Double(5) = sum[dim=[0], keepdim=0](%gz);
  return (%y | %gw1, %gb1, %gw2, %gb2);
})IR");
    for (bool fuse : {false, true}) {
      CAPTURE(fuse);
      auto graph = g->clone();
      if (fuse) sj::passes::fuse(*graph);
      auto closure = std::make_shared<const sj::closure::MultiStageClosure>(graph);
      CHECK_FALSE(closure->linked());
      at::manual_seed(5);
      std::vector<at::Tensor> p = {rand_d({4, 3}), rand_d({3, 5}), rand_d({5}), rand_d({5, 2}),
                                   rand_d({2})};
      at::Tensor gy = rand_d({4, 2});
      sj::variable_list in0;
      for (auto& t : p) in0.emplace_back(t);
      auto out = sj::closure::run_stages(closure, {in0, {sj::Variable(gy)}});
      REQUIRE(out.size() == 2);
      REQUIRE(out[1].size() == 4);

      std::vector<torch::Tensor> leaves;
      for (auto& t : p) leaves.push_back(t.clone().requires_grad_(true));
      auto y = torch::addmm(leaves[4], torch::tanh(torch::addmm(leaves[2], leaves[0], leaves[1])),
                            leaves[3]);
      auto grads = torch::autograd::grad({y}, {leaves[1], leaves[2], leaves[3], leaves[4]}, {gy});
      CHECK(max_abs_diff(out[0][0].data(), y.detach()) <= 1e-12);
      for (std::size_t i = 0; i < 4; ++i) {
        CAPTURE(i);
        CHECK(max_abs_diff(out[1][i].data(), grads[i]) <= 1e-12);
      }
      // Outputs of an unlinked closure carry no grad_fn, and a stage past the last throws.
      CHECK_FALSE(out[0][0].requires_grad());
      CHECK_THROWS_WITH_AS(sj::closure::run_stages(closure, {in0, {sj::Variable(gy)}, {}}),
                           doctest::Contains("input lists for a graph of 2 stages"), sj::Error);
    }
  }
}
