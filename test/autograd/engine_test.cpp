// The engine: graph shapes, callbacks, errors, reentrancy, concurrency, determinism.
#include "oracle.hpp"

#include <ATen/record_function.h>

#include <atomic>
#include <thread>

namespace {

using VL = sj::variable_list;

using oracle::ThreadCount;

// A Function made of a callable, for engine tests.
std::shared_ptr<sj::Function> lambda_fn(std::string name, std::function<VL(const VL&)> f,
                                        std::vector<sj::Edge> next, uint32_t inputs = 1) {
  struct Named : sj::ClosureImpl {
    std::string n;
    std::function<VL(const VL&)> f;
    VL apply(VL in) override { return f(in); }
    std::string_view name() const override { return n; }
  };
  auto impl = std::make_shared<Named>();
  impl->n = std::move(name);
  impl->f = std::move(f);
  return sj::make_function(sj::ClosureFunction{impl}, std::move(next), inputs);
}

}  // namespace

TEST_SUITE("autograd") {
  TEST_CASE("diamond, fan-out and fan-in graphs match libtorch") {
    at::manual_seed(11);
    at::Tensor x0 = at::randn({4}, at::kDouble), w0 = at::randn({4}, at::kDouble);
    oracle::check("diamond", {x0}, {true},
                  [](const VL& x) {
                    auto a = sj::tanh(x[0]);
                    auto b = sj::sin(a), c = sj::exp(a);
                    return VL{b * c};
                  },
                  [](const std::vector<torch::Tensor>& x) {
                    auto a = x[0].tanh();
                    return std::vector<torch::Tensor>{a.sin() * a.exp()};
                  }, 3);
    oracle::check("fan-out/fan-in", {x0, w0}, {true, true},
                  [](const VL& x) {
                    auto a = x[0] * x[1];
                    VL parts{sj::sin(a), sj::cos(a), a * a, sj::exp(a), a / 3.0};
                    sj::Variable s = parts[0];
                    for (std::size_t i = 1; i < parts.size(); ++i) s = s + parts[i] * x[0];
                    return VL{s, a};
                  },
                  [](const std::vector<torch::Tensor>& x) {
                    auto a = x[0] * x[1];
                    std::vector<torch::Tensor> parts{a.sin(), a.cos(), a * a, a.exp(), a / 3.0};
                    auto s = parts[0];
                    for (std::size_t i = 1; i < parts.size(); ++i) s = s + parts[i] * x[0];
                    return std::vector<torch::Tensor>{s, a};
                  }, 2);
  }

  TEST_CASE("grad and backward: roots, accumulation, errors") {
    sj::Variable x(at::tensor({1.0, 2.0}, at::kDouble), true);
    sj::Variable y = x * x;  // dy/dx = 2x
    sj::Variable z = sj::sum(y * 3.0);
    SUBCASE("multiple roots with grad_outputs") {
      auto g = sj::grad({y, z}, {x}, {sj::Variable(at::ones({2}, at::kDouble)), sj::Variable()});
      CHECK(oracle::max_diff(g[0].data(), at::tensor({2.0 + 6.0, 4.0 + 12.0}, at::kDouble)) == 0.0);
    }
    SUBCASE("the same output twice adds up; an input twice gets the same gradient") {
      auto g = sj::grad({z, z}, {x, x});
      CHECK(oracle::max_diff(g[0].data(), at::tensor({12.0, 24.0}, at::kDouble)) == 0.0);
      CHECK(oracle::max_diff(g[1].data(), g[0].data()) == 0.0);
    }
    SUBCASE("backward accumulates into leaves") {
      z.backward();
      z.backward();
      CHECK(oracle::max_diff(x.grad().data(), at::tensor({12.0, 24.0}, at::kDouble)) == 0.0);
      CHECK_FALSE(x.grad().requires_grad());
    }
    SUBCASE("grad of a non-leaf input") {
      auto g = sj::grad({z}, {y});
      CHECK(oracle::max_diff(g[0].data(), at::full({2}, 3.0, at::kDouble)) == 0.0);
      CHECK_FALSE(x.grad().defined());  // grad() does not accumulate
    }
    SUBCASE("errors") {
      CHECK_THROWS_WITH_AS(sj::grad({y}, {x}), doctest::Contains("grad can be implicitly created only for scalar outputs"), sj::Error);
      sj::Variable c(at::ones({2}, at::kDouble));
      CHECK_THROWS_WITH_AS(sj::grad({z}, {c}), doctest::Contains("element 0 of inputs does not require grad"), sj::Error);
      CHECK_THROWS_WITH_AS(sj::grad({c.detach()}, {x}), doctest::Contains("element 0 of outputs does not require grad"), sj::Error);
      CHECK_THROWS_AS(sj::grad({y}, {x}, {sj::Variable(at::ones({3}, at::kDouble))}), sj::ShapeError);
      sj::Variable unused(at::ones({1}, at::kDouble), true);
      CHECK_THROWS_WITH_AS(sj::grad({z}, {unused}), doctest::Contains("not used in the graph"), sj::Error);
      auto g = sj::grad({z}, {x, unused}, {}, false, true);
      CHECK(g[0].defined());
      CHECK_FALSE(g[1].defined());
    }
  }

  TEST_CASE("pre-callbacks returning false stop a function; post-callbacks see outputs") {
    sj::Variable x(at::tensor({1.0, 2.0}, at::kDouble), true);
    sj::Variable a = sj::exp(x), b = sj::sin(x);
    sj::Variable y = sj::sum(a + b);
    sj::ExecuteCallbacks cbs;
    int post_calls = 0;
    cbs.pre.emplace(a.grad_fn().get(), sj::GenericCallback{[](sj::Function&, VL&, VL*, sj::CallState*) { return false; }});
    cbs.post.emplace(b.grad_fn().get(), sj::GenericCallback{[&](sj::Function& f, VL& in, VL* out, sj::CallState*) {
                       ++post_calls;
                       CHECK(f.name() == "SinBackward");
                       CHECK(in.size() == 1);
                       CHECK(out->size() == 1);
                       return true;
                     }});
    sj::ExecuteOptions opts;
    opts.capture = {x.gradient_edge()};
    auto g = sj::execute({y.gradient_edge()}, {sj::Variable(at::ones({}, at::kDouble))}, opts, cbs);
    CHECK(post_calls == 1);
    CHECK(oracle::max_diff(g[0].data(), at::cos(x.data())) == 0.0);  // exp branch stopped
    // CaptureInput / CaptureOutputs policies with a CallState.
    sj::CallState state;
    sj::ExecuteCallbacks cbs2;
    cbs2.pre.emplace(b.grad_fn().get(), sj::CaptureInput{0, 1});
    cbs2.pre.emplace(a.grad_fn().get(), sj::CaptureOutputs{});
    sj::execute({y.gradient_edge()}, {sj::Variable(at::ones({}, at::kDouble))}, {}, cbs2, &state);
    REQUIRE(state.values.size() == 2);
    CHECK(oracle::max_diff(state.values[1].data(), at::ones({2}, at::kDouble)) == 0.0);
    CHECK(state.outputs.size() == 1);
    // The exp branch was stopped; the sin branch (CaptureInput continues) reached x.
    CHECK(oracle::max_diff(x.grad().data(), at::cos(x.data())) == 0.0);
    // Policies that need a CallState refuse to run without one, naming the Function.
    CHECK_THROWS_WITH_AS(sj::execute({y.gradient_edge()}, {sj::Variable(at::ones({}, at::kDouble))}, {}, cbs2),
                         doctest::Contains("needs a CallState"), sj::Error);
  }

  TEST_CASE("post policies capture outputs and Handles; one table serves concurrent executions") {
    sj::Variable x(at::tensor({0.5, 1.5}, at::kDouble), true);
    sj::Variable a = sj::exp(x);
    sj::Variable y = sj::sum(a * a);
    // The backward of sum (SumBackward) outputs the incoming gradient expanded; MulBackward
    // outputs 2a per input. Capture SumBackward's output 0 into slot 2 and, as a Handle,
    // the grad_fn of MulBackward's outputs (none: the backward runs without create_graph).
    sj::ExecuteCallbacks cbs;
    cbs.post.emplace(y.grad_fn().get(), sj::CaptureOutput{0, 2});
    cbs.post.emplace(y.grad_fn()->next_functions[0].function.get(), sj::CaptureHandle{1});
    std::vector<std::thread> threads;
    std::vector<sj::CallState> states(4);
    for (std::size_t t = 0; t < states.size(); ++t)
      threads.emplace_back([&, t] {
        sj::ExecuteOptions opts;
        opts.capture = {x.gradient_edge()};
        auto g = sj::execute({y.gradient_edge()}, {sj::Variable(at::full({}, double(t + 1), at::kDouble))},
                             opts, cbs, &states[t]);
        CHECK(oracle::max_diff(g[0].data(), 2.0 * double(t + 1) * at::exp(2.0 * x.data())) <= 1e-12);  // |g| up to 161: a few ulp
      });
    for (auto& th : threads) th.join();
    for (std::size_t t = 0; t < states.size(); ++t) {
      REQUIRE(states[t].values.size() == 3);
      CHECK(oracle::max_diff(states[t].values[2].data(), at::full({2}, double(t + 1), at::kDouble)) == 0.0);
      REQUIRE(states[t].handles.size() == 2);
      CHECK_FALSE(states[t].handles[1]);  // no grad mode: the products made no backward
    }
    // A post policy registered as pre is refused with its name.
    sj::ExecuteCallbacks wrong;
    wrong.pre.emplace(y.grad_fn().get(), sj::CaptureOutput{0, 0});
    sj::CallState st;
    CHECK_THROWS_WITH_AS(sj::execute({y.gradient_edge()}, {sj::Variable(at::ones({}, at::kDouble))}, {}, wrong, &st),
                         doctest::Contains("CaptureOutput is a post callback"), sj::Error);
  }

  TEST_CASE("an exception in a function names it; the engine stays usable") {
    for (bool single : {false, true}) {
      ThreadCount tc(single ? 1 : 4);
      sj::Variable x(at::tensor({1.0}, at::kDouble), true);
      auto boom = lambda_fn("Boom", [](const VL&) -> VL { throw std::runtime_error("kaboom"); },
                            {x.gradient_edge()});
      sj::Variable y(at::tensor({1.0}, at::kDouble), sj::Edge{boom, 0});
      sj::Variable z = sj::sum(sj::exp(y) + sj::exp(x));
      CHECK_THROWS_WITH_AS(z.backward(), "Function 'Boom': kaboom", sj::Error);
      // A shape error inside a formula keeps its type.
      auto bad = lambda_fn("BadShape", [](const VL&) -> VL {
        return {sj::Variable(at::ones({3}, at::kDouble))};
      }, {x.gradient_edge()});
      sj::Variable w(at::tensor({1.0}, at::kDouble), sj::Edge{bad, 0});
      sj::Variable u = sj::sum(w * 2.0);
      CHECK_THROWS_WITH_AS(u.backward(), doctest::Contains("AccumulateGrad: gradient of shape [3] for a leaf of shape [1]"), sj::ShapeError);
      // Wrong number of outputs.
      auto wrong = lambda_fn("Wrong", [](const VL&) -> VL { return {}; }, {x.gradient_edge()});
      sj::Variable v(at::tensor({1.0}, at::kDouble), sj::Edge{wrong, 0});
      CHECK_THROWS_WITH_AS(sj::sum(v).backward(), doctest::Contains("Function 'Wrong' returned an invalid number of outputs - expected 1, but got 0"), sj::Error);
      // Engine still works.
      sj::Variable ok = sj::sum(x * 4.0);
      auto g = sj::grad({ok}, {x});
      CHECK(g[0].data().item<double>() == 4.0);
    }
  }

  TEST_CASE("reentrant backward inside a function and inside a callback") {
    ThreadCount tc(4);
    sj::Variable x(at::tensor({0.5, -1.0}, at::kDouble), true);
    sj::Variable inner_in(at::tensor({3.0}, at::kDouble), true);
    // A function whose apply runs a nested backward.
    auto reentrant = lambda_fn("Reentrant", [inner_in](const VL& g) -> VL {
      sj::AutoGradMode enable(true);  // the outer backward runs without grad mode
      sj::Variable t = sj::sum(inner_in * inner_in);
      auto gi = sj::grad({t}, {inner_in});  // 2 * 3 = 6
      return {g[0] * gi[0].data().item<double>()};
    }, {x.gradient_edge()});
    sj::Variable y(x.data().clone(), sj::Edge{reentrant, 0});
    sj::Variable z = sj::sum(sj::exp(y));
    auto g = sj::grad({z}, {x});
    CHECK(oracle::max_diff(g[0].data(), at::exp(x.data()) * 6.0) <= 1e-15);
    // Nested backward inside a callback.
    sj::Variable a = sj::tanh(x);
    sj::Variable s = sj::sum(a);
    sj::ExecuteCallbacks cbs;
    double nested = 0;
    cbs.pre.emplace(a.grad_fn().get(), sj::GenericCallback{[&](sj::Function&, VL&, VL*, sj::CallState*) {
                      sj::AutoGradMode enable(true);
                      sj::Variable t = sj::sum(inner_in * 5.0);
                      nested = sj::grad({t}, {inner_in})[0].data().item<double>();
                      return true;
                    }});
    sj::ExecuteOptions opts;
    opts.capture = {x.gradient_edge()};
    auto g2 = sj::execute({s.gradient_edge()}, {sj::Variable(at::ones({}, at::kDouble))}, opts, cbs);
    CHECK(nested == 5.0);
    CHECK(oracle::max_diff(g2[0].data(), 1 - at::tanh(x.data()).pow(2)) <= 1e-15);
  }

  TEST_CASE("8 threads x 100 concurrent backward passes on a shared leaf") {
    ThreadCount tc(4);
    sj::Variable w(at::tensor({1.0, 2.0, 3.0}, at::kDouble), true);
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        try {
          for (int i = 0; i < 100; ++i) {
            // d/dw sum(w * k + w) = k + 1 with k = t (exact in double)
            sj::Variable y = sj::sum(w * static_cast<double>(t) + w);
            y.backward();
          }
        } catch (...) {
          ++failures;
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(failures.load() == 0);
    // sum over t of 100 * (t + 1) = 100 * 36 = 3600 for every element
    CHECK(oracle::max_diff(w.grad().data(), at::full({3}, 3600.0, at::kDouble)) == 0.0);
  }

  TEST_CASE("gradients are bit-identical with 1 and 8 threads and in single-threaded mode") {
    at::manual_seed(12);
    at::Tensor x0 = at::randn({64}, at::kFloat);
    auto run = [&](int threads, bool single) {
      ThreadCount tc(threads);
      sj::Variable x(x0, true);
      // Wide fan-out/fan-in: many branches whose float sums depend on order.
      sj::Variable acc;
      VL branches;
      for (int i = 0; i < 40; ++i) branches.push_back(sj::sin(x * (1.0 + i * 0.37)) * (i + 0.1));
      sj::Variable s = branches[0];
      for (std::size_t i = 1; i < branches.size(); ++i) s = s + branches[i];
      sj::Variable y = sj::sum(s * s);
      sj::ExecuteOptions opts;
      opts.single_threaded = single;
      opts.create_graph = true;
      opts.capture = {x.gradient_edge()};
      auto g = sj::execute({y.gradient_edge()}, {sj::Variable(at::ones({}, at::kFloat))}, opts);
      auto gg = sj::grad({sj::sum(g[0] * g[0])}, {x});
      return std::make_pair(g[0].data(), gg[0].data());
    };
    auto ref = run(1, false);
    for (int rep = 0; rep < 3; ++rep) {
      auto r8 = run(8, false);
      CHECK(at::equal(ref.first, r8.first));
      CHECK(at::equal(ref.second, r8.second));
    }
    auto rs = run(8, true);
    CHECK(at::equal(ref.first, rs.first));
    CHECK(at::equal(ref.second, rs.second));
  }

  TEST_CASE("grad mode and the trace hook reach the worker threads") {
    ThreadCount tc(4);
    struct Recorder : sj::TraceHook {
      std::mutex m;
      std::vector<std::string> ops;
      void record_op(const sj::OpSchema& op, const sj::Attributes&, const VL&, const VL&) override {
        std::lock_guard<std::mutex> l(m);
        ops.emplace_back(op.name);
      }
      void record_host_op(std::string_view, std::string_view, const std::vector<sj::Scalar>&,
                          const VL&, const VL&, const std::shared_ptr<sj::Function>&,
                          const sj::HostCallable&) override {}
      void record_eval(const sj::Function&, const VL&, const VL&,
                       const std::shared_ptr<sj::Function>&) override {}
    } rec;
    sj::Variable x(at::tensor({0.3, 0.4}, at::kDouble), true);
    sj::Variable y;
    {
      sj::TraceHookGuard guard(&rec);
      VL parts;
      for (int i = 0; i < 8; ++i) parts.push_back(sj::sin(x * (i + 1.0)));
      sj::Variable s = sj::cat(parts, 0);
      y = sj::sum(s);
      CHECK(rec.ops.size() == 8 * 2 + 2);
      rec.ops.clear();
      auto g = sj::grad({y}, {x}, {}, true);
      CHECK(g[0].requires_grad());  // grad mode was on where the formulas ran
    }
    // Backward formulas reported: sin's backward uses cos and mul, from whatever thread ran them.
    CHECK(std::count(rec.ops.begin(), rec.ops.end(), "cos") == 8);
    CHECK(std::count(rec.ops.begin(), rec.ops.end(), "narrow") == 8);
    CHECK(sj::current_trace_hook() == nullptr);
    CHECK(sj::GradMode::is_enabled());
  }

  TEST_CASE("keep_graph = false releases saved variables") {
    sj::Variable x(at::tensor({2.0}, at::kDouble), true);
    sj::Variable y = sj::sum(x * x);
    sj::ExecuteOptions opts;
    opts.keep_graph = false;
    sj::execute({y.gradient_edge()}, {sj::Variable(at::ones({}, at::kDouble))}, opts);
    CHECK(x.grad().data().item<double>() == 4.0);
    CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("saved variables were already freed"), sj::Error);
  }
}

namespace {
// z = x * y whose backward records which gradients the running backward needs
// (engine::should_compute_output, libtorch's needs_input_grad inside a backward).
struct RecordingMul : sj::HostFunction<RecordingMul> {
  static inline std::vector<bool> seen;
  static inline int calls = 0;
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, sj::Variable y) {
    ctx->save_for_backward({x, y});
    return sj::Variable(x.data() * y.data());
  }
  static sj::variable_list backward(sj::HostContext* ctx, sj::variable_list grads) {
    ++calls;
    seen = {sj::engine::should_compute_output(0), sj::engine::should_compute_output(1)};
    auto s = ctx->get_saved_variables();
    return {grads[0] * s[1], grads[0] * s[0]};
  }
};
// y = 2 a, whose backward applies another Function (`fn`) by hand and keeps its result.
struct ApplyInside : sj::HostFunction<ApplyInside> {
  static inline sj::variable_list inner;
  static inline std::shared_ptr<sj::Function> fn;
  static sj::Variable forward(sj::HostContext*, sj::Variable a) { return sj::Variable(a.data() * 2); }
  static sj::variable_list backward(sj::HostContext*, sj::variable_list grads) {
    inner = fn->apply({sj::Variable(at::ones({1, 2}, at::kDouble))});
    return {grads[0] * 2};
  }
};
}  // namespace

TEST_SUITE("autograd") {

TEST_CASE("engine::should_compute_output: only the gradients that lead to a requested input") {
  sj::Variable x(at::randn({3}, at::kDouble), true), y(at::randn({3}, at::kDouble), true);
  auto z = sj::sum(RecordingMul::apply(x, y));
  auto check = [&](auto&& run, std::vector<bool> expected) {
    RecordingMul::seen.clear();
    const int before = RecordingMul::calls;
    run();
    CHECK(RecordingMul::calls == before + 1);
    CHECK(RecordingMul::seen == expected);
  };
  check([&] { sj::grad({z}, {x}); }, {true, false});
  check([&] { sj::grad({z}, {y}); }, {false, true});
  check([&] { sj::grad({z}, {x, y}); }, {true, true});
  check([&] { sj::backward({z}); }, {true, true});
  // Outside an engine call every output counts as needed.
  CHECK(sj::engine::should_compute_output(0));
  CHECK(sj::engine::should_compute_output(7));

  // An eager op's backward skips the gradient nobody asked for: mm's backward makes one
  // product (the input's gradient), not two.
  sj::Variable w(at::randn({3, 2}, at::kDouble), true);
  auto out = sj::sum(sj::mm(sj::reshape(x, {1, 3}), w));
  static std::atomic<int> products{0};
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        const std::string_view name = fn.name();
        if (name == "aten::mm" || name == "stagejit::small_mm") ++products;
        return nullptr;
      }));
  products = 0;
  auto gx = sj::grad({out}, {x})[0];
  const int with_x_only = products.load();
  products = 0;
  sj::grad({out}, {x, w});
  const int with_both = products.load();
  at::removeCallback(handle);
  CHECK(with_x_only == 1);
  CHECK(with_both == 2);
  CHECK(at::allclose(gx.data(), w.data().sum(1)));
}

TEST_CASE("should_compute_output(self): a Function applied by hand inside another computes everything") {
  // A host function whose backward applies another Function (mm's backward) directly:
  // the engine's mask belongs to the host function, not to the Function applied inside.
  sj::Variable a(at::randn({1, 3}, at::kDouble), true), w(at::randn({3, 2}, at::kDouble), true);
  ApplyInside::fn = sj::mm(a, w).grad_fn();
  sj::Variable p(at::randn({4}, at::kDouble), true), q(at::randn({4}, at::kDouble), true);
  auto z = sj::sum(ApplyInside::apply(p) * q);
  sj::grad({z}, {q});  // the host function's own output is not needed here
  sj::grad({z}, {p});
  REQUIRE(ApplyInside::inner.size() == 2);
  CHECK(ApplyInside::inner[0].defined());
  CHECK(ApplyInside::inner[1].defined());
  ApplyInside::fn.reset();
  ApplyInside::inner.clear();
}

}  // TEST_SUITE
