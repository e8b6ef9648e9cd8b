// Host functions (opaque ops) and Eval (opaque subgraphs).
#include "oracle.hpp"
#include "../support/host_functions.hpp"

namespace {

using VL = sj::variable_list;

// MulConstant (y = x * c) and Mul (x * y with a backward written in stagejit ops, so it
// has a second derivative): test/support/host_functions.hpp.
using stagejit::testing::Mul;
using stagejit::testing::MulConstant;

// The libtorch / seed convention: one gradient per forward argument, undefined for the
// non-tensor ones (the seed's MulConstant returns {g * c, None}).
struct ScaleShift : sj::HostFunction<ScaleShift> {
  static sj::Variable forward(sj::HostContext* ctx, double shift, sj::Variable x, double c) {
    ctx->saved_data["c"] = c;
    return sj::Variable(x.data() * c + shift);
  }
  static VL backward(sj::HostContext* ctx, VL g) {
    return {sj::Variable(), g[0] * std::get<double>(ctx->saved_data["c"]), sj::Variable()};
  }
};

struct GradForScalar : sj::HostFunction<GradForScalar> {
  static sj::Variable forward(sj::HostContext*, sj::Variable x, double c) { return sj::Variable(x.data() * c); }
  static VL backward(sj::HostContext*, VL g) { return {g[0], g[0]}; }
};

struct TooMany : sj::HostFunction<TooMany> {
  static sj::Variable forward(sj::HostContext*, sj::Variable x) { return sj::Variable(x.data() + 1); }
  static VL backward(sj::HostContext*, VL g) { return {g[0], g[0]}; }
};

struct BadShape : sj::HostFunction<BadShape> {
  static sj::Variable forward(sj::HostContext*, sj::Variable x) { return sj::Variable(x.data().sum()); }
  static VL backward(sj::HostContext*, VL g) { return {g[0]}; }  // should be expanded
};

struct Traceable : sj::HostFunction<Traceable> {
  static constexpr bool traceable = true;
  static sj::Variable forward(sj::HostContext*, sj::Variable x) { return sj::exp(x); }
  static VL backward(sj::HostContext*, VL g) { return {g[0]}; }
};

struct Recorder : sj::TraceHook {
  std::mutex m;
  std::vector<std::string> events;
  std::vector<std::shared_ptr<sj::Function>> backward_of_outputs;
  void record_op(const sj::OpSchema& op, const sj::Attributes&, const VL&, const VL&) override {
    std::lock_guard<std::mutex> l(m);
    events.push_back("op:" + std::string(op.name));
  }
  void record_host_op(std::string_view name, std::string_view conv, const std::vector<sj::Scalar>& s,
                      const VL& in, const VL& out, const std::shared_ptr<sj::Function>& bw,
                      const sj::HostCallable&) override {
    std::lock_guard<std::mutex> l(m);
    events.push_back("host:" + std::string(name) + "/" + std::string(conv) + "/" +
                     std::to_string(s.size()) + "/" + std::to_string(in.size()) + "/" +
                     std::to_string(out.size()) + (bw ? "/bw" : "/nobw"));
  }
  void record_eval(const sj::Function& fn, const VL&, const VL&, const std::shared_ptr<sj::Function>& b) override {
    std::lock_guard<std::mutex> l(m);
    events.push_back("eval:" + fn.name());
    backward_of_outputs.push_back(b);
  }
};

}  // namespace

TEST_SUITE("autograd") {
  TEST_CASE("host functions: forward as a unit, backward on Variables") {
    sj::Variable x(at::tensor({1.0, -2.0}, at::kDouble), true);
    sj::Variable y = MulConstant::apply(x, 2.5);
    CHECK(y.grad_fn()->name() == "MulConstantBackward");
    auto g = sj::grad({sj::sum(y)}, {x});
    CHECK(oracle::max_diff(g[0].data(), at::full({2}, 2.5, at::kDouble)) == 0.0);
    // Without any input requiring grad there is no backward.
    CHECK_FALSE(MulConstant::apply(sj::Variable(x.data()), 2.0).requires_grad());
  }

  TEST_CASE("host function second derivative goes through an opaque Eval and matches libtorch") {
    at::manual_seed(21);
    at::Tensor a = at::randn({3}, at::kDouble), b = at::randn({3}, at::kDouble);
    oracle::check("host Mul", {a, b}, {true, true},
                  [](const VL& x) { return VL{sj::tanh(Mul::apply(sj::sin(x[0]), x[1]))}; },
                  [](const std::vector<torch::Tensor>& x) {
                    return std::vector<torch::Tensor>{(x[0].sin() * x[1]).tanh()};
                  }, 3);
    sj::Variable x(a, true), y(b, true);
    sj::Variable z = Mul::apply(x, y);
    auto g = sj::grad({sj::sum(z)}, {x, y}, {}, true);
    REQUIRE(g[0].grad_fn());
    CHECK(g[0].grad_fn()->is<sj::Eval>());
  }

  TEST_CASE("host function backward: one gradient per forward argument, scalars undefined (libtorch, seed)") {
    at::Tensor data = at::tensor({1.0, -2.0, 0.5}, at::kDouble);
    sj::Variable x(data, true);
    auto g = sj::grad({sj::sum(ScaleShift::apply(0.25, x, 3.0))}, {x});
    CHECK(oracle::max_diff(g[0].data(), at::full({3}, 3.0, at::kDouble)) == 0.0);
    // A defined gradient for a scalar argument is an error naming the function and slot.
    CHECK_THROWS_WITH_AS(sj::sum(GradForScalar::apply(x, 2.0)).backward(),
                         doctest::Contains("HostFunction 'GradForScalar': backward returned a defined gradient for "
                                           "argument 1, which is not a tensor"),
                         sj::Error);
  }

  TEST_CASE("host function errors name the function") {
    sj::Variable x(at::tensor({1.0, 2.0}, at::kDouble), true);
    CHECK_THROWS_WITH_AS(sj::sum(TooMany::apply(x)).backward(),
                         doctest::Contains("HostFunction 'TooMany': backward returned 2 gradients, expected 1 (one per tensor input) "
                                           "or 1 (one per forward argument"),
                         sj::Error);
    CHECK_THROWS_WITH_AS(BadShape::apply(x).backward(),
                         doctest::Contains("HostFunction 'BadShape': backward gradient 0 has shape [], expected [2]"),
                         sj::ShapeError);
  }

  TEST_CASE("the trace hook sees host ops as units and opaque backwards as evals") {
    Recorder rec;
    sj::Variable x(at::tensor({1.0, 2.0}, at::kDouble), true), w(at::tensor({3.0, 4.0}, at::kDouble), true);
    sj::TraceHookGuard guard(&rec);
    sj::Variable y = Mul::apply(sj::exp(x), w);
    sj::Variable t = Traceable::apply(y);
    CHECK(rec.events == std::vector<std::string>{"op:exp", "host:Mul/tt/0/2/1/bw", "op:exp"});
    rec.events.clear();
    auto g = sj::grad({sj::sum(t)}, {x, w}, {}, true);
    // The host backward ran as one unit (its inner muls were not reported) and, with
    // create_graph, its results got an Eval grad_fn that was reported.
    CHECK(std::count(rec.events.begin(), rec.events.end(), "eval:MulBackward") == 1);
    REQUIRE(rec.backward_of_outputs.size() == 1);
    CHECK(rec.backward_of_outputs[0] != nullptr);
    CHECK(rec.backward_of_outputs[0]->is<sj::Eval>());
    // Differentiating again runs that Eval as one unit too.
    rec.events.clear();
    auto gg = sj::grad({sj::sum(g[0] * g[1])}, {x, w});
    CHECK(std::count(rec.events.begin(), rec.events.end(), "eval:Eval") == 1);
    // By hand: Traceable's declared backward is the identity, so d sum(t)/dy = 1 and
    // g0 = exp(x) * w, g1 = exp(x).
    at::Tensor ex = x.data().exp();
    at::Tensor g0 = ex * w.data(), g1 = ex;
    CHECK(oracle::max_diff(g[0].data(), g0) <= 1e-12);
    CHECK(oracle::max_diff(g[1].data(), g1) <= 1e-12);
  }

  TEST_CASE("Eval::wrap replaces a subgraph by one Function with the same derivatives") {
    at::manual_seed(22);
    at::Tensor a0 = at::randn({4}, at::kDouble), b0 = at::randn({4}, at::kDouble);
    auto build = [&](bool wrap) {
      sj::Variable a(a0, true), b(b0, true);
      sj::Variable u = sj::sin(a) * b;                      // boundary: u and b
      sj::Variable v = sj::tanh(u) * sj::exp(b), w = u * u; // wrapped subgraph
      std::shared_ptr<sj::Function> ev;
      if (wrap) ev = sj::eval::wrap({u, b}, {v, w});
      sj::Variable loss = sj::sum(v * w);
      auto g = sj::grad({loss}, {a, b}, {}, true);
      auto gg = sj::grad({sj::sum(g[0] * g[1])}, {a, b});
      return std::make_tuple(g[0].data(), g[1].data(), gg[0].data(), gg[1].data(), ev, v);
    };
    auto [g0, g1, h0, h1, e0, v0] = build(false);
    auto [w0, w1, k0, k1, ev, v] = build(true);
    REQUIRE(ev);
    CHECK(v.grad_fn() == ev);
    CHECK(ev->next_functions.size() == 2);
    CHECK(sj::eval::backward_eval({v}) == ev);
    CHECK(oracle::max_diff(g0, w0) <= 1e-12);
    CHECK(oracle::max_diff(g1, w1) <= 1e-12);
    CHECK(oracle::max_diff(h0, k0) <= 1e-12);
    CHECK(oracle::max_diff(h1, k1) <= 1e-12);
    CHECK_FALSE(sj::eval::wrap({v}, {v}));  // a pass-through is not relevant
  }
}
