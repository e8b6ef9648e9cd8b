// Issue 34 (items 1, 3, 8, 9c): host-function argument kinds on eager and compiled calls,
// host backwards returning broadcast or extra undefined gradients (libtorch's
// validate_outputs and Function<T>), and long chains freed without recursion.
#include "oracle.hpp"
#include "../support/host_functions.hpp"

#include <chrono>
#include <string>
#include <vector>

namespace {

using VL = sj::variable_list;

// ------------------------------------------------------------------ argument kinds
// y = x * len(s); the length is kept for backward.
struct StrScale : sj::HostFunction<StrScale> {
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, std::string s) {
    ctx->saved_data["n"] = static_cast<int64_t>(s.size());
    return sj::Variable(x.data() * static_cast<double>(s.size()));
  }
  static VL backward(sj::HostContext* ctx, VL g) {
    return {g[0] * static_cast<double>(std::get<int64_t>(ctx->saved_data.at("n")))};
  }
};

// The same with a const reference parameter.
struct StrScaleRef : sj::HostFunction<StrScaleRef> {
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, const std::string& s) {
    ctx->saved_data["n"] = static_cast<int64_t>(s.size());
    return sj::Variable(x.data() * static_cast<double>(s.size()));
  }
  static VL backward(sj::HostContext* ctx, VL g) {
    return {g[0] * static_cast<double>(std::get<int64_t>(ctx->saved_data.at("n")))};
  }
};

// y = x * w elementwise, w a vector<double> of x's length (checked with .at()).
struct VecScale : sj::HostFunction<VecScale> {
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, std::vector<double> w) {
    at::Tensor t = at::empty({static_cast<int64_t>(w.size())}, at::kDouble);
    for (std::size_t i = 0; i < w.size(); ++i) t[i] = w.at(i);
    ctx->saved_data["w"] = w;
    return sj::Variable(x.data() * t);
  }
  static VL backward(sj::HostContext* ctx, VL g) {
    const auto& w = std::get<std::vector<double>>(ctx->saved_data.at("w"));
    return {g[0] * sj::Variable(at::tensor(w, at::kDouble))};
  }
};

// The same taking its vector by rvalue reference (the re-run passes its copy as an rvalue).
struct VecScaleRvalue : sj::HostFunction<VecScaleRvalue> {
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, std::vector<double>&& w) {
    std::vector<double> mine = std::move(w);
    ctx->saved_data["w"] = mine;
    return sj::Variable(x.data() * at::tensor(mine, at::kDouble));
  }
  static VL backward(sj::HostContext* ctx, VL g) {
    const auto& w = std::get<std::vector<double>>(ctx->saved_data.at("w"));
    return {g[0] * sj::Variable(at::tensor(w, at::kDouble))};
  }
};

// y = x[idx] (index_select along dim 0); backward: index_add of the gradient.
struct Gather : sj::HostFunction<Gather> {
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, std::vector<int64_t> idx) {
    ctx->saved_data["idx"] = idx;
    ctx->saved_data["n"] = x.size(0);
    return sj::Variable(x.data().index_select(0, at::tensor(idx, at::kLong)));
  }
  static VL backward(sj::HostContext* ctx, VL g) {
    const auto& idx = std::get<std::vector<int64_t>>(ctx->saved_data.at("idx"));
    const int64_t n = std::get<int64_t>(ctx->saved_data.at("n"));
    at::Tensor r = at::zeros({n}, g[0].options()).index_add(0, at::tensor(idx, at::kLong), g[0].data());
    return {sj::Variable(r)};
  }
};

// Every kind in one call, scalars before and after the tensors:
// y = (x * len(s) + w) * v[0] * k, flag ? y : -y.
struct Mixed : sj::HostFunction<Mixed> {
  static sj::Variable forward(sj::HostContext* ctx, std::string s, sj::Variable x, std::vector<double> v,
                              sj::Variable w, int64_t k, bool flag) {
    const double n = static_cast<double>(s.size()), d = v.at(0) * static_cast<double>(k) * (flag ? 1.0 : -1.0);
    ctx->saved_data["n"] = n;
    ctx->saved_data["d"] = d;
    return sj::Variable((x.data() * n + w.data()) * d);
  }
  // In libtorch's order: the gradient of u = x * n + w is g * d, then x's is that * n.
  static VL backward(sj::HostContext* ctx, VL g) {
    sj::Variable gu = g[0] * std::get<double>(ctx->saved_data.at("d"));
    return {gu * std::get<double>(ctx->saved_data.at("n")), gu};
  }
};

// A user struct is not an argument kind (see HostArgument): it could not be printed in or
// compared as a HostOp's scalars. Calling `apply` with one stops at the static_assert.
struct UserOptions {
  double scale = 2.0;
};
static_assert(!sj::HostArgument<UserOptions>);
static_assert(!sj::HostArgument<const UserOptions&>);
static_assert(!sj::HostArgument<std::string_view>);
static_assert(sj::HostArgument<std::string&&>);
static_assert(sj::HostArgument<const std::string&>);
static_assert(sj::HostArgument<const char (&)[5]>);
static_assert(sj::HostArgument<const char*>);
static_assert(sj::HostArgument<std::vector<double>&>);
static_assert(sj::HostArgument<const std::vector<int64_t>&>);
static_assert(sj::HostArgument<sj::Variable&>);
static_assert(sj::HostArgument<int>);
static_assert(sj::HostArgument<float>);
static_assert(sj::HostArgument<bool>);

at::Tensor value(const sj::Variable& v) { return v.data(); }

// Runs `sj_call` (x -> y) eagerly and compiled (the tracing call with `a`, then a compiled
// call with `b`) and compares y and d sum(y * r)/dx with libtorch's autograd on `torch_fn`.
template <class SjCall, class TorchFn>
void check_kind(const char* what, SjCall sj_call, TorchFn torch_fn, at::Tensor a, at::Tensor b) {
  CAPTURE(what);
  auto expect = [&](const at::Tensor& data) {
    torch::Tensor x = data.detach().clone().requires_grad_(true);
    torch::Tensor y = torch_fn(x);
    torch::Tensor r = at::linspace(0.5, 1.5, y.numel(), at::kDouble).reshape(y.sizes());
    auto g = torch::autograd::grad({(y * r).sum()}, {x});
    return std::make_tuple(y.detach(), g[0], r);
  };
  // Eager.
  {
    auto [y0, g0, r] = expect(a);
    sj::Variable x(a, true);
    sj::Variable y = sj_call(x);
    CHECK(oracle::max_diff(value(y), y0) == 0.0);
    auto g = sj::grad({sj::sum(y * sj::Variable(r))}, {x});
    CHECK(oracle::max_diff(g[0].data(), g0) == 0.0);
  }
  // Compiled: the tracing call, then a call from the cache with new inputs.
  auto f = sj::compile([sj_call](const VL& in) -> VL { return {sj_call(in[0])}; }, {.derivatives = 1});
  for (const at::Tensor& data : {a, b}) {
    auto [y0, g0, r] = expect(data);
    sj::Variable x(data, true);
    VL y = f({x});
    REQUIRE(y.size() == 1);
    CHECK(oracle::max_diff(value(y[0]), y0) == 0.0);
    auto g = sj::grad({y[0]}, {x}, {sj::Variable(r)});
    CHECK(oracle::max_diff(g[0].data(), g0) == 0.0);
  }
  CHECK(f.stats().misses == 1);
  CHECK(f.stats().hits == 1);
}

// ------------------------------------------------------------------ backward shapes
// y = x * w with x [3], w [2, 3]; the backward returns x's gradient unreduced ([2, 3]).
// The forward and backward of stagejit::testing::Mul, under its own name.
struct BroadcastGrad : sj::HostFunction<BroadcastGrad> {
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, sj::Variable w) {
    return stagejit::testing::Mul::forward(ctx, std::move(x), std::move(w));
  }
  static VL backward(sj::HostContext* ctx, VL g) { return stagejit::testing::Mul::backward(ctx, std::move(g)); }
};
// The same in libtorch: its engine sums the [2, 3] gradient to x's [3].
struct TorchBroadcastGrad : torch::autograd::Function<TorchBroadcastGrad> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto s = ctx->get_saved_variables();
    return {g[0] * s[1], g[0] * s[0]};
  }
};

// y = 3 x with x [3]; the backward returns [1, 3] and two trailing undefined gradients.
struct KeepDimGrad : sj::HostFunction<KeepDimGrad> {
  static sj::Variable forward(sj::HostContext*, sj::Variable x) { return sj::Variable(x.data() * 3.0); }
  static VL backward(sj::HostContext*, VL g) {
    return {sj::unsqueeze(g[0] * 3.0, 0), sj::Variable(), sj::Variable()};
  }
};
struct TorchKeepDimGrad : torch::autograd::Function<TorchKeepDimGrad> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x * 3.0; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {(g[0] * 3.0).unsqueeze(0), torch::Tensor(), torch::Tensor()};
  }
};

// Returns a gradient of ones of shape [n] for its input (not broadcastable to [3] unless
// n is 3).
struct WrongGrad : sj::HostFunction<WrongGrad> {
  static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, int64_t n) {
    ctx->saved_data["n"] = n;
    return sj::Variable(x.data() * 2.0);
  }
  static VL backward(sj::HostContext* ctx, VL g) {
    const int64_t n = std::get<int64_t>(ctx->saved_data.at("n"));
    return {sj::Variable(at::ones({n}, at::kDouble)), sj::Variable()};
  }
};

// A defined extra gradient past the forward arguments is still an error.
struct ExtraDefined : sj::HostFunction<ExtraDefined> {
  static sj::Variable forward(sj::HostContext*, sj::Variable x) { return sj::Variable(x.data() * 2.0); }
  static VL backward(sj::HostContext*, VL g) { return {g[0] * 2.0, sj::Variable(), g[0]}; }
};

// A chain of n negations.
sj::Variable neg_chain(sj::Variable y, int n) {
  for (int i = 0; i < n; ++i) y = -y;
  return y;
}

// check_kind for a host function F taking a std::vector<T> by value, given `value` as an
// rvalue, an lvalue, a const lvalue and a moved-from caller variable.
template <class F, class T, class TorchFn>
void check_vector_kinds(const std::vector<T>& value, TorchFn torch_fn, at::Tensor a, at::Tensor b) {
  check_kind("rvalue", [value](const sj::Variable& x) {
    return F::apply(x, std::vector<T>(value));
  }, torch_fn, a, b);
  check_kind("lvalue", [value](const sj::Variable& x) {
    std::vector<T> v = value;
    return F::apply(x, v);
  }, torch_fn, a, b);
  check_kind("const lvalue", [value](const sj::Variable& x) { return F::apply(x, value); }, torch_fn, a, b);
  check_kind("moved-from caller variable", [value](const sj::Variable& x) {
    std::vector<T> v = value;
    return F::apply(x, std::move(v));
  }, torch_fn, a, b);
}

}  // namespace

TEST_SUITE("autograd") {
  TEST_CASE("host function string argument: rvalue, lvalue, const lvalue, moved-from, literal; eager and compiled") {
    at::manual_seed(34);
    at::Tensor a = at::randn({4}, at::kDouble), b = at::randn({4}, at::kDouble);
    auto torch4 = [](const torch::Tensor& x) { return x * 4.0; };
    check_kind("rvalue", [](const sj::Variable& x) { return StrScale::apply(x, std::string("abcd")); }, torch4, a, b);
    check_kind("lvalue", [](const sj::Variable& x) {
      std::string s = "abcd";
      sj::Variable y = StrScale::apply(x, s);
      CHECK(s == "abcd");
      return y;
    }, torch4, a, b);
    check_kind("const lvalue", [](const sj::Variable& x) {
      const std::string s = "abcd";
      return StrScale::apply(x, s);
    }, torch4, a, b);
    check_kind("moved-from caller variable", [](const sj::Variable& x) {
      std::string s = "abcd";
      return StrScale::apply(x, std::move(s));
    }, torch4, a, b);
    check_kind("string literal", [](const sj::Variable& x) { return StrScale::apply(x, "abcd"); }, torch4, a, b);
    check_kind("const char*", [](const sj::Variable& x) {
      const char* p = "abcd";
      return StrScale::apply(x, p);
    }, torch4, a, b);
    check_kind("rvalue into const std::string&", [](const sj::Variable& x) {
      return StrScaleRef::apply(x, std::string("abcd"));
    }, torch4, a, b);
    check_kind("moved-from into const std::string&", [](const sj::Variable& x) {
      std::string s = "abcd";
      return StrScaleRef::apply(x, std::move(s));
    }, torch4, a, b);
  }

  TEST_CASE("host function vector<double> argument: rvalue, lvalue, const lvalue, moved-from, rvalue-reference parameter") {
    at::manual_seed(35);
    at::Tensor a = at::randn({3}, at::kDouble), b = at::randn({3}, at::kDouble);
    const std::vector<double> w = {0.5, -2.0, 3.0};
    auto torch_w = [w](const torch::Tensor& x) { return x * at::tensor(w, at::kDouble); };
    check_vector_kinds<VecScale>(w, torch_w, a, b);
    check_kind("rvalue into vector<double>&&", [](const sj::Variable& x) {
      return VecScaleRvalue::apply(x, std::vector<double>{0.5, -2.0, 3.0});
    }, torch_w, a, b);
    check_kind("moved-from into vector<double>&&", [w](const sj::Variable& x) {
      std::vector<double> v = w;
      return VecScaleRvalue::apply(x, std::move(v));
    }, torch_w, a, b);
  }

  TEST_CASE("host function vector<int64_t> argument: rvalue, lvalue, const lvalue, moved-from") {
    at::manual_seed(36);
    at::Tensor a = at::randn({4}, at::kDouble), b = at::randn({4}, at::kDouble);
    const std::vector<int64_t> idx = {3, 0, 0, 2, 1};
    auto torch_idx = [idx](const torch::Tensor& x) { return x.index_select(0, at::tensor(idx, at::kLong)); };
    check_vector_kinds<Gather>(idx, torch_idx, a, b);
  }

  TEST_CASE("host function with every argument kind at once, scalars around the tensors, eager and compiled") {
    at::manual_seed(37);
    at::Tensor w0 = at::randn({3}, at::kDouble);
    // d = v[0] * k * (flag ? 1 : -1) = 1.5 * 2 * -1; y = (x * 3 + w) * d.
    auto torch_fn = [w0](const torch::Tensor& x) { return (x * 3.0 + w0) * (1.5 * 2.0 * -1.0); };
    at::Tensor a = at::randn({3}, at::kDouble), b = at::randn({3}, at::kDouble);
    check_kind("rvalues", [w0](const sj::Variable& x) {
      return Mixed::apply(std::string("abc"), x, std::vector<double>{1.5, 9.0}, sj::Variable(w0), int64_t{2}, false);
    }, torch_fn, a, b);
    check_kind("lvalues and moved-from", [w0](const sj::Variable& x) {
      std::string s = "abc";
      const std::vector<double> v = {1.5, 9.0};
      sj::Variable w(w0);
      int k = 2;
      const bool flag = false;
      return Mixed::apply(std::move(s), x, v, w, k, flag);
    }, torch_fn, a, b);
  }

  TEST_CASE("host backward: a gradient broadcastable to its input is summed to the input's shape (libtorch validate_outputs)") {
    at::manual_seed(38);
    at::Tensor a = at::randn({3}, at::kDouble), w0 = at::randn({2, 3}, at::kDouble);
    torch::Tensor tx = a.clone().requires_grad_(true), tw = w0.clone().requires_grad_(true);
    auto tg = torch::autograd::grad({TorchBroadcastGrad::apply(tx, tw).sum()}, {tx, tw});
    // Eager.
    sj::Variable x(a, true), w(w0, true);
    auto g = sj::grad({sj::sum(BroadcastGrad::apply(x, w))}, {x, w});
    CHECK(g[0].sizes() == at::IntArrayRef{3});
    CHECK(oracle::max_diff(g[0].data(), tg[0]) == 0.0);
    CHECK(oracle::max_diff(g[1].data(), tg[1]) == 0.0);
    // Compiled: the tracing call and a cached one with new inputs.
    auto f = sj::compile([](const VL& in) -> VL { return {BroadcastGrad::apply(in[0], in[1])}; }, {.derivatives = 1});
    for (int call = 0; call < 2; ++call) {
      CAPTURE(call);
      at::Tensor ac = call == 0 ? a : at::randn({3}, at::kDouble), wc = call == 0 ? w0 : at::randn({2, 3}, at::kDouble);
      torch::Tensor cx = ac.clone().requires_grad_(true), cw = wc.clone().requires_grad_(true);
      torch::Tensor ty = TorchBroadcastGrad::apply(cx, cw);
      auto ctg = torch::autograd::grad({ty.sum()}, {cx, cw});
      sj::Variable xc(ac, true), wcv(wc, true);
      VL y = f({xc, wcv});
      CHECK(oracle::max_diff(y[0].data(), ty.detach()) == 0.0);
      auto gc = sj::grad({sj::sum(y[0])}, {xc, wcv});
      CHECK(oracle::max_diff(gc[0].data(), ctg[0]) == 0.0);
      CHECK(oracle::max_diff(gc[1].data(), ctg[1]) == 0.0);
    }
    // By hand: d sum(x * w)/dx = w summed over its rows.
    CHECK(oracle::max_diff(g[0].data(), w0.sum(0)) == 0.0);
  }

  TEST_CASE("host backward: [1, 3] for a [3] input and extra trailing undefined gradients are accepted (libtorch)") {
    at::Tensor a = at::tensor({1.0, -2.0, 0.5}, at::kDouble);
    torch::Tensor tx = a.clone().requires_grad_(true);
    auto tg = torch::autograd::grad({TorchKeepDimGrad::apply(tx).sum()}, {tx});
    sj::Variable x(a, true);
    auto g = sj::grad({sj::sum(KeepDimGrad::apply(x))}, {x});
    CHECK(g[0].sizes() == at::IntArrayRef{3});
    CHECK(oracle::max_diff(g[0].data(), tg[0]) == 0.0);
    CHECK(oracle::max_diff(g[0].data(), at::full({3}, 3.0, at::kDouble)) == 0.0);
    // Second derivative through the summed gradient (create_graph): d/dx sum(g * x) = g.
    sj::Variable x2(a, true);
    auto g2 = sj::grad({sj::sum(KeepDimGrad::apply(x2 * x2))}, {x2}, {}, /*create_graph=*/true);
    torch::Tensor tx2 = a.clone().requires_grad_(true);
    auto tg2 = torch::autograd::grad({TorchKeepDimGrad::apply(tx2 * tx2).sum()}, {tx2}, {}, true, true);
    CHECK(oracle::max_diff(g2[0].data(), tg2[0].detach()) == 0.0);
    auto gg = sj::grad({sj::sum(g2[0])}, {x2});
    auto tgg = torch::autograd::grad({tg2[0].sum()}, {tx2});
    CHECK(oracle::max_diff(gg[0].data(), tgg[0]) == 0.0);
  }

  TEST_CASE("host backward: a gradient not broadcastable to its input is a ShapeError naming the function and input") {
    sj::Variable x(at::tensor({1.0, 2.0, 3.0}, at::kDouble), true);
    // libtorch refuses the same: [4] does not expand from [3].
    CHECK_THROWS_WITH_AS(sj::sum(WrongGrad::apply(x, 4)).backward(),
                         doctest::Contains("HostFunction 'WrongGrad': backward gradient 0 has shape [4], expected [3] "
                                           "(the shape of input 0) or a shape [3] broadcasts to"),
                         sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::sum(WrongGrad::apply(x, 2)).backward(),
                         doctest::Contains("backward gradient 0 has shape [2], expected [3]"), sj::ShapeError);
    // [1] is smaller than the input: [3] does not expand to [1], libtorch refuses it too.
    CHECK_THROWS_AS(sj::sum(WrongGrad::apply(x, 1)).backward(), sj::ShapeError);
    // A defined extra gradient is still refused.
    CHECK_THROWS_WITH_AS(sj::sum(ExtraDefined::apply(x)).backward(),
                         doctest::Contains("HostFunction 'ExtraDefined': backward returned 3 gradients"), sj::Error);
  }

  TEST_CASE("a 300 000-op eager chain is freed without recursion; grad through 100 000 ops") {
    sj::Variable x(at::tensor({1.5, -2.0}, at::kDouble), true);
    { sj::Variable y = neg_chain(x, 300000); }  // destroyed here
    sj::Variable y = neg_chain(x, 100001);
    auto g = sj::grad({sj::sum(y)}, {x});
    CHECK(oracle::max_diff(g[0].data(), at::full({2}, -1.0, at::kDouble)) == 0.0);
    CHECK(oracle::max_diff(y.data(), -x.data()) == 0.0);
    // A chain whose Functions are reached through saved variables too (exp saves its
    // output, mul its inputs) and freed from its leaf end.
    sj::Variable z = x;
    for (int i = 0; i < 100000; ++i) z = (i % 2 == 0) ? z * 1.0 : sj::exp(z) - sj::exp(z) + z;
    CHECK(oracle::max_diff(z.data(), x.data()) == 0.0);
    z = sj::Variable();
  }

  TEST_CASE("a compiled function of a 100 000-op chain traces, runs, differentiates and is freed") {
    const int n = 100000;
    auto f = sj::compile([n](const VL& in) -> VL { return {neg_chain(in[0], n)}; },
                         {.derivatives = 1, .fuse = false});
    for (int call = 0; call < 2; ++call) {
      CAPTURE(call);
      at::Tensor data = call == 0 ? at::tensor({1.5, -2.0}, at::kDouble) : at::tensor({0.25, 4.0}, at::kDouble);
      sj::Variable x(data, true);
      VL y = f({x});
      CHECK(oracle::max_diff(y[0].data(), data) == 0.0);  // an even number of negations
      auto g = sj::grad({sj::sum(y[0])}, {x});
      CHECK(oracle::max_diff(g[0].data(), at::ones({2}, at::kDouble)) == 0.0);
    }
  }
}
