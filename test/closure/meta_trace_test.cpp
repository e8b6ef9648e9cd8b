// CompileOptions::trace_on_meta (issue 33): compile() traces on meta tensors where that
// trace stands for the real one, and traces the real tensors otherwise. Checked: the
// graph equals the real trace's, the results equal libtorch's, and each case that must
// fall back does (CompiledFunction::Stats::meta_traces), with the real trace's errors.
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/host_functions.hpp"
#include "../support/models.hpp"
#include "../support/pinn_step.hpp"

#include <string>
#include <vector>

namespace sj = stagejit;
using sj::Variable;
using sj::variable_list;

namespace {

sj::CompileOptions options_with(int derivatives, bool meta) {
  sj::CompileOptions o;
  o.derivatives = derivatives;
  o.trace_on_meta = meta;
  return o;
}

variable_list leaves_of(const std::vector<at::Tensor>& data, bool rg = true) {
  variable_list in;
  for (const auto& t : data) in.emplace_back(t, rg);
  return in;
}

double rel(const at::Tensor& x, const at::Tensor& ref) {
  return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item<double>();
}

std::vector<at::Tensor> pinn_data(at::ScalarType dtype) {
  at::manual_seed(7);
  const int64_t n = 64, h = 8;
  return {at::rand({n, 2}, dtype), at::randn({2, h}, dtype) * 0.5, at::randn({h}, dtype) * 0.1,
          at::randn({h, h}, dtype) * 0.3, at::randn({h}, dtype) * 0.1, at::randn({h, 1}, dtype) * 0.3};
}

}  // namespace

TEST_SUITE("closure") {
  TEST_CASE("meta trace: the staged PINN net (3 derivatives) is traced on meta, same graph, libtorch's numbers") {
    namespace ps = sj::testing::pinn_step;
    for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      CAPTURE(dtype);
      const auto data = pinn_data(dtype);
      sj::CompiledFunction on = sj::compile(ps::mlp, options_with(3, true));
      sj::CompiledFunction off = sj::compile(ps::mlp, options_with(3, false));
      const ps::Step a = ps::sj_step(on, data), b = ps::sj_step(off, data), ref = ps::torch_step(data);
      CHECK(on.stats().misses == 1);
      CHECK(on.stats().meta_traces == 1);
      CHECK(off.stats().meta_traces == 0);
      // Same optimised, fused graph, types (device cpu) included.
      const auto in = leaves_of(data);
      CHECK(sj::ir::to_string(*on.graph_for(in)) == sj::ir::to_string(*off.graph_for(in)));
      const double tol = dtype == at::kDouble ? 1e-10 : 1e-5;
      CHECK(std::abs(a.loss - ref.loss) <= tol * std::abs(ref.loss));
      REQUIRE(a.grads.size() == ref.grads.size());
      for (std::size_t i = 0; i < ref.grads.size(); ++i) {
        CAPTURE(i);
        CHECK(rel(a.grads[i], ref.grads[i]) <= tol);
        CHECK(at::equal(a.grads[i], b.grads[i]));  // the same compiled program
      }
    }
  }

  TEST_CASE("meta trace: LSTM cell, orders 0..3: same graph as the real trace (zeros of chunk's backward on the inputs' device)") {
    at::manual_seed(5);
    const std::vector<at::Tensor> data = {at::randn({3, 4}, at::kDouble), at::randn({3, 5}, at::kDouble),
                                          at::randn({3, 5}, at::kDouble), at::randn({20, 4}, at::kDouble),
                                          at::randn({20, 5}, at::kDouble), at::randn({20}, at::kDouble)};
    auto fn = [](const variable_list& in) { return sj::testing::lstm_cell(in); };
    for (int k = 0; k <= 3; ++k) {
      CAPTURE(k);
      sj::CompiledFunction on = sj::compile(fn, options_with(k, true));
      sj::CompiledFunction off = sj::compile(fn, options_with(k, false));
      const auto in = leaves_of(data);
      CHECK(sj::ir::to_string(*on.graph_for(in)) == sj::ir::to_string(*off.graph_for(in)));
      CHECK(on.stats().meta_traces == 1);
    }
  }

  TEST_CASE("meta trace: a constant made from an input's data falls back to the real trace") {
    // grad_outputs of ones made inside the traced function (compile-loss style): on meta
    // the constant would have no values, so compile traces the real tensors.
    auto fn = [](const variable_list& in) {
      auto y = sj::tanh(sj::mm(in[0], in[1]));
      auto g = sj::grad({y}, {in[0]}, {Variable(at::ones_like(y.data()))}, true)[0];
      return variable_list{sj::sum(sj::mul(g, g))};
    };
    at::manual_seed(3);
    const std::vector<at::Tensor> data = {at::randn({5, 3}, at::kDouble), at::randn({3, 4}, at::kDouble)};
    sj::CompiledFunction f = sj::compile(fn, options_with(1, true));
    const auto in = leaves_of(data);
    auto loss = f(in)[0];
    auto g = sj::grad({loss}, {in[1]})[0];
    CHECK(f.stats().meta_traces == 0);
    // libtorch
    auto x = data[0].clone().requires_grad_(true), w = data[1].clone().requires_grad_(true);
    auto y = torch::tanh(torch::mm(x, w));
    auto gx = torch::autograd::grad({y}, {x}, {torch::ones_like(y)}, true, true)[0];
    auto tl = (gx * gx).sum();
    auto tg = torch::autograd::grad({tl}, {w})[0];
    CHECK(std::abs(loss.data().item<double>() - tl.item<double>()) <= 1e-12 * std::abs(tl.item<double>()));
    CHECK(rel(g.data(), tg) <= 1e-10);
  }

  TEST_CASE("meta trace: a value read with item() falls back, and the value is the real one") {
    auto fn = [](const variable_list& in) {
      const double m = in[0].data().abs().max().item<double>();  // data-dependent
      return variable_list{sj::mul(sj::tanh(in[0]), 1.0 / m)};
    };
    const at::Tensor x = at::tensor({0.5, -2.0, 1.0}, at::kDouble);
    sj::CompiledFunction f = sj::compile(fn, options_with(1, true));
    auto in = leaves_of({x});
    auto y = f(in)[0];
    CHECK(f.stats().meta_traces == 0);
    CHECK(at::allclose(y.data(), at::tanh(x) / 2.0, 0, 1e-15));
  }

  TEST_CASE("meta trace: a host function falls back (its forward is never run on meta)") {
    auto fn = [](const variable_list& in) {
      return variable_list{sj::testing::MulConstant::apply(sj::tanh(in[0]), 3.0)};
    };
    const at::Tensor x = at::tensor({0.25, -1.5}, at::kDouble);
    sj::CompiledFunction f = sj::compile(fn, options_with(2, true));
    auto in = leaves_of({x});
    auto y = f(in)[0];
    auto g = sj::grad({y}, {in[0]}, {Variable(at::ones_like(x))}, true)[0];
    CHECK(f.stats().meta_traces == 0);
    CHECK(at::allclose(y.data(), at::tanh(x) * 3.0, 0, 1e-15));
    CHECK(at::allclose(g.data(), (1 - at::tanh(x).pow(2)) * 3.0, 0, 1e-14));
  }

  TEST_CASE("meta trace: a shape error is the real trace's error") {
    auto fn = [](const variable_list& in) { return variable_list{sj::mm(in[0], in[1])}; };
    auto in = leaves_of({at::ones({2, 3}, at::kDouble), at::ones({4, 5}, at::kDouble)});
    std::string with_meta, without;
    try {
      sj::compile(fn, options_with(1, true))(in);
    } catch (const sj::Error& e) {
      with_meta = e.what();
    }
    try {
      sj::compile(fn, options_with(1, false))(in);
    } catch (const sj::Error& e) {
      without = e.what();
    }
    CHECK(!with_meta.empty());
    CHECK(with_meta == without);
    CHECK(with_meta.find("meta") == std::string::npos);
  }

  TEST_CASE("meta trace: dropout draws what eager draws after the same seed") {
    auto fn = [](const variable_list& in) { return variable_list{sj::dropout(sj::tanh(in[0]), 0.5, true)}; };
    const at::Tensor x = at::linspace(0.1, 1.0, 64, at::kDouble);
    sj::CompiledFunction f = sj::compile(fn, options_with(1, true));
    at::manual_seed(11);
    auto y = f(leaves_of({x}))[0].data();
    at::manual_seed(11);
    auto ref = sj::dropout(sj::tanh(Variable(x, true)), 0.5, true).data();
    // native_dropout has no meta kernel in libtorch 1.13, so the real trace serves this
    // function there; either way the draws are eager's.
    CHECK(f.stats().misses == 1);
    CHECK(at::equal(y, ref));
  }
}
