// Ops for models (issue 19): see test/models/meson.build.
//
// Activations, embeddings and indexing, batched products, shapes, reductions, losses and
// dropout against libtorch's autograd in double (forward exact, derivatives <= 1e-10),
// eager (oracle::check, up to the 3rd derivative) and compiled (every stage of a
// k-derivative closure against libtorch_stages), finite differences, bad inputs, dropout's
// randomness, and a transformer encoder block compiled with two derivatives.
#include "../autograd/oracle.hpp"
#include "../support/check_stages.hpp"

#include <stagejit/compiler.hpp>
#include <stagejit/testing/gradcheck.hpp>

#include <cmath>
#include <limits>
#include <string>

namespace {

using TL = std::vector<torch::Tensor>;
using VL = sj::variable_list;
using sj::testing::libtorch_stages;
using sj::testing::max_abs_diff;

at::Tensor rnd(at::IntArrayRef s) { return at::randn(s, at::kDouble); }
at::Tensor idx(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

// Shapes for the elementwise ops: plain, batch 1, 0-dim, transposed, expanded.
std::vector<std::pair<std::string, at::Tensor>> elementwise_inputs() {
  return {{"[3, 4]", rnd({3, 4})},
          {"batch 1 [1, 5]", rnd({1, 5})},
          {"0-dim", rnd({})},
          {"transposed", rnd({4, 3}).t()},
          {"expanded", rnd({3, 1}).expand({3, 4})}};
}

// Every stage of compile(sj_fn, {.derivatives = k}) against libtorch's autograd: grad
// outputs of ones, create_graph while a further stage follows, <= 1e-10; twice (trace,
// then the cache).
void check_compiled(const std::string& name, const oracle::SjFn& sj_fn, const oracle::TorchFn& torch_fn,
                    const std::vector<at::Tensor>& data, const std::vector<bool>& rg, int k) {
  CAPTURE(name);
  sj::testing::check_compiled_stages(sj_fn, torch_fn, data, rg, k);
}

// One case: eager to `eager_order`, compiled at k = 1..compiled_order (each closure's
// stage 0 checks the forward too).
struct Case {
  std::string name;
  std::vector<at::Tensor> inputs;
  std::vector<bool> differentiable;
  oracle::SjFn sj_fn;
  oracle::TorchFn torch_fn;
  int eager_order = 2;
  int compiled_order = 2;
};

void run(const Case& c) {
  oracle::check(c.name, c.inputs, c.differentiable, c.sj_fn, c.torch_fn, c.eager_order);
  for (int k = 1; k <= c.compiled_order; ++k)
    check_compiled(c.name, c.sj_fn, c.torch_fn, c.inputs, c.differentiable, k);
}

// The activations, each as (stagejit, libtorch) on one input.
struct Activation {
  std::string name;
  std::function<sj::Variable(const sj::Variable&)> sj_fn;
  std::function<torch::Tensor(const torch::Tensor&)> torch_fn;
};

std::vector<Activation> activations() {
  return {
      {"gelu", [](const sj::Variable& x) { return sj::gelu(x); }, [](const torch::Tensor& x) { return torch::gelu(x); }},
      {"gelu tanh", [](const sj::Variable& x) { return sj::gelu(x, "tanh"); },
       [](const torch::Tensor& x) { return torch::gelu(x, "tanh"); }},
      {"erf", [](const sj::Variable& x) { return sj::erf(x); }, [](const torch::Tensor& x) { return torch::erf(x); }},
      {"silu", [](const sj::Variable& x) { return sj::silu(x); }, [](const torch::Tensor& x) { return torch::silu(x); }},
      {"softplus", [](const sj::Variable& x) { return sj::softplus(x); },
       [](const torch::Tensor& x) { return torch::softplus(x); }},
      // beta 2, threshold 1: inputs above 0.5 are in the linear region.
      {"softplus beta 2 threshold 1", [](const sj::Variable& x) { return sj::softplus(x, 2, 1); },
       [](const torch::Tensor& x) { return torch::softplus(x, 2, 1); }},
      {"elu", [](const sj::Variable& x) { return sj::elu(x); }, [](const torch::Tensor& x) { return torch::elu(x); }},
      {"elu alpha 1.5", [](const sj::Variable& x) { return sj::elu(x, 1.5); },
       [](const torch::Tensor& x) { return torch::elu(x, 1.5); }},
      {"leaky_relu", [](const sj::Variable& x) { return sj::leaky_relu(x); },
       [](const torch::Tensor& x) { return torch::leaky_relu(x); }},
      {"leaky_relu 0.2", [](const sj::Variable& x) { return sj::leaky_relu(x, 0.2); },
       [](const torch::Tensor& x) { return torch::leaky_relu(x, 0.2); }},
  };
}

// A pre-LN transformer encoder block on x [B, S, D] with `heads` heads:
//   h = x + W_o MHA(LN1(x)),  y = h + W_2 gelu(W_1 LN2(h) + b_1) + b_2,
// attention from bmm / softmax with a boolean mask filled with -inf, dropout off (train =
// false). Written once for stagejit Variables and libtorch tensors (unqualified calls
// find sj:: or at:: by argument-dependent lookup); `p` = {x, ln1 w, ln1 b, Wq, bq, Wk,
// bk, Wv, bv, Wo, bo, ln2 w, ln2 b, W1, b1, W2, b2, mask}, weights as [in, out].
template <class V, class LayerNorm>
V encoder_block(const std::vector<V>& p, LayerNorm layer_norm, int64_t heads) {
  const V& x = p[0];
  const int64_t B = x.sizes()[0], S = x.sizes()[1], D = x.sizes()[2], dh = D / heads;
  const V& mask = p[17];
  auto linear = [](const V& t, const V& w, const V& b) { return addmm(b, t, w); };
  auto split_heads = [&](const V& t) {
    return reshape(permute(reshape(t, {B, S, heads, dh}), {0, 2, 1, 3}), {B * heads, S, dh});
  };
  V h1 = reshape(layer_norm(x, p[1], p[2]), {B * S, D});
  V q = split_heads(linear(h1, p[3], p[4]));
  V k = split_heads(linear(h1, p[5], p[6]));
  V v = split_heads(linear(h1, p[7], p[8]));
  V scores = bmm(q, transpose(k, 1, 2)) * (1.0 / std::sqrt(static_cast<double>(dh)));
  V attention = dropout(softmax(masked_fill(scores, mask, -std::numeric_limits<double>::infinity()), -1), 0.1, false);
  V context = reshape(permute(reshape(bmm(attention, v), {B, heads, S, dh}), {0, 2, 1, 3}), {B * S, D});
  V h = x + dropout(reshape(linear(context, p[9], p[10]), {B, S, D}), 0.1, false);
  V h2 = reshape(layer_norm(h, p[11], p[12]), {B * S, D});
  V mlp = linear(gelu(linear(h2, p[13], p[14])), p[15], p[16]);
  return h + dropout(reshape(mlp, {B, S, D}), 0.1, false);
}


std::vector<at::Tensor> encoder_block_inputs(int64_t B, int64_t S, int64_t D, int64_t F) {
  auto w = [](int64_t in, int64_t out) { return rnd({in, out}) / std::sqrt(static_cast<double>(in)); };
  return {rnd({B, S, D}),
          1.0 + 0.1 * rnd({D}), 0.1 * rnd({D}),
          w(D, D), 0.1 * rnd({D}), w(D, D), 0.1 * rnd({D}), w(D, D), 0.1 * rnd({D}), w(D, D), 0.1 * rnd({D}),
          1.0 + 0.1 * rnd({D}), 0.1 * rnd({D}),
          w(D, F), 0.1 * rnd({F}), w(F, D), 0.1 * rnd({D}),
          at::ones({S, S}, at::kBool).triu(1)};  // causal: position i sees j <= i
}

}  // namespace

TEST_SUITE("models") {
  TEST_CASE("activations: eager to the 3rd derivative over shapes, batch 1, 0-dim, non-contiguous") {
    at::manual_seed(190);
    for (const auto& act : activations()) {
      for (const auto& [shape, x] : elementwise_inputs()) {
        // Composed with a multiplication so the derivatives of every order are nonzero
        // for the piecewise-linear ones too.
        oracle::check(act.name + " " + shape, {x, rnd({}).abs() + 0.5}, {true, true},
                      [&](const VL& v) { return VL{act.sj_fn(v[0] * v[1])}; },
                      [&](const TL& v) { return TL{act.torch_fn(v[0] * v[1])}; }, 3);
      }
    }
  }

  TEST_CASE("activations: compiled, orders 0..3 (fused elementwise chains)") {
    at::manual_seed(191);
    for (const auto& act : activations()) {
      at::Tensor x = rnd({3, 5}) * 2;
      at::Tensor w = rnd({3, 5});
      for (int k = 0; k <= 3; ++k)
        check_compiled(act.name, [&](const VL& v) { return VL{act.sj_fn(v[0]) * v[1] + v[0]}; },
                       [&](const TL& v) { return TL{act.torch_fn(v[0]) * v[1] + v[0]}; }, {x, w}, {true, true}, k);
      // Non-contiguous and batch-1 inputs, second order.
      check_compiled(act.name + " transposed", [&](const VL& v) { return VL{act.sj_fn(v[0])}; },
                     [&](const TL& v) { return TL{act.torch_fn(v[0])}; }, {rnd({5, 3}).t()}, {true}, 2);
      check_compiled(act.name + " batch 1", [&](const VL& v) { return VL{act.sj_fn(v[0])}; },
                     [&](const TL& v) { return TL{act.torch_fn(v[0])}; }, {rnd({1, 4})}, {true}, 2);
    }
  }

  TEST_CASE("activations: special values follow ATen's forward") {
    const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
    at::Tensor x = at::tensor({-inf, -800.0, -30.0, -1.0, -0.0, 0.0, 1e-8, 1.0, 30.0, 800.0, inf, nan}, at::kDouble);
    for (const auto& act : activations()) {
      CAPTURE(act.name);
      CHECK(oracle::max_diff(act.sj_fn(sj::Variable(x)).data(), act.torch_fn(x)) == 0.0);
      auto f = sj::compile([&](const VL& v) { return VL{act.sj_fn(v[0] * 1.0)}; }, {.derivatives = 0});
      const double d = oracle::max_diff(f({sj::Variable(x)})[0].data(), act.torch_fn(x));
      CHECK(d >= 0);  // the same NaN pattern
      CHECK(d <= 1e-12 * 800);
    }
  }

  TEST_CASE("logsumexp and var: eager and compiled, dims, keepdim, unbiased") {
    at::manual_seed(192);
    at::Tensor x = rnd({3, 4, 5}), xt = rnd({5, 4, 3}).permute({2, 1, 0}), b1 = rnd({1, 6});
    for (bool keepdim : {false, true}) {
      for (std::vector<int64_t> dims : {std::vector<int64_t>{1}, {0, 2}, {-1}}) {
        std::string d = "dims " + std::to_string(dims.size()) + (keepdim ? " keepdim" : "");
        run({"logsumexp " + d, {x}, {true},
             [=](const VL& v) { return VL{sj::logsumexp(v[0], dims, keepdim)}; },
             [=](const TL& v) { return TL{torch::logsumexp(v[0], dims, keepdim)}; }, 3, 2});
        for (bool unbiased : {true, false})
          run({"var " + d + (unbiased ? " unbiased" : " biased"), {xt}, {true},
               [=](const VL& v) { return VL{sj::var(v[0], dims, unbiased, keepdim)}; },
               [=](const TL& v) { return TL{torch::var(v[0], dims, unbiased, keepdim)}; }, 3, 2});
      }
    }
    // An empty list reduces every dimension, as in ATen's forward; libtorch 1.13's
    // var_backward takes the empty list for no dimension (N = 1, a gradient of inf), so
    // the oracle is var over all elements.
    run({"var all dims (empty list)", {x}, {true}, [](const VL& v) { return VL{sj::var(v[0], {})}; },
         [](const TL& v) { return TL{torch::var(v[0], true)}; }, 3, 2});
    run({"logsumexp batch 1", {b1}, {true}, [](const VL& v) { return VL{sj::logsumexp(v[0], {0})}; },
         [](const TL& v) { return TL{torch::logsumexp(v[0], {0})}; }});
    run({"var batch 1", {b1}, {true}, [](const VL& v) { return VL{sj::var(v[0], {1}, true, true)}; },
         [](const TL& v) { return TL{torch::var(v[0], {1}, true, true)}; }});
    // Large values: logsumexp stays finite and its gradient is the softmax.
    run({"logsumexp large", {x * 400.0}, {true}, [](const VL& v) { return VL{sj::logsumexp(v[0], {2})}; },
         [](const TL& v) { return TL{torch::logsumexp(v[0], {2})}; }});
  }

  TEST_CASE("embedding, index_select, index_add: eager and compiled, repeated indices, int32") {
    at::manual_seed(193);
    at::Tensor w = rnd({6, 3});
    for (at::Tensor ids : {idx({{1, 4, 4, 0}}).reshape({2, 2}), idx({5}), idx({2, 2, 2}).to(at::kInt)}) {
      CAPTURE(ids);
      run({"embedding", {w, ids}, {true, false},
           [](const VL& v) { return VL{sj::embedding(v[0] * v[0], v[1])}; },
           [](const TL& v) { return TL{torch::embedding(v[0] * v[0], v[1])}; }});
    }
    run({"embedding 0-d index, batch 1 table", {rnd({1, 4}), idx({0}).reshape({})}, {true, false},
         [](const VL& v) { return VL{sj::embedding(sj::tanh(v[0]), v[1])}; },
         [](const TL& v) { return TL{torch::embedding(v[0].tanh(), v[1])}; }});
    at::Tensor x = rnd({4, 5, 3});
    for (int64_t dim : {0, 1, -1}) {
      at::Tensor index = dim == 0 ? idx({3, 0, 3}) : dim == 1 ? idx({4, 4, 1, 0}) : idx({2, 0});
      run({"index_select dim " + std::to_string(dim), {x, index}, {true, false},
           [=](const VL& v) { return VL{sj::index_select(v[0] * v[0], dim, v[1])}; },
           [=](const TL& v) { return TL{torch::index_select(v[0] * v[0], dim, v[1])}; }});
      auto src_sizes = x.sizes().vec();
      src_sizes[at::maybe_wrap_dim(dim, 3)] = index.numel();
      run({"index_add dim " + std::to_string(dim), {x, index, rnd(src_sizes)}, {true, false, true},
           [=](const VL& v) { return VL{sj::index_add(v[0] * sj::sum(v[2]), dim, v[1], v[2] * v[2])}; },
           [=](const TL& v) { return TL{torch::index_add(v[0] * v[2].sum(), dim, v[1], v[2] * v[2])}; }});
    }
    run({"index_select non-contiguous, int32", {rnd({5, 4}).t(), idx({1, 1, 3}).to(at::kInt)}, {true, false},
         [](const VL& v) { return VL{sj::index_select(sj::sin(v[0]), 1, v[1])}; },
         [](const TL& v) { return TL{torch::index_select(v[0].sin(), 1, v[1])}; }});
    // A 0-d index and source into a vector: libtorch 1.13 accepts them, later ATen wants the
    // source to have self's shape but the indexed dimension; the op does what the ATen it
    // runs on does.
    bool aten_adds_0d = true;
    try {
      (void)at::index_add(at::zeros({4}, at::kDouble), 0, idx({2}).reshape({}), at::ones({}, at::kDouble));
    } catch (const c10::Error&) {
      aten_adds_0d = false;
    }
    if (aten_adds_0d)
      run({"index_add 0-d index and source into a vector", {rnd({4}), idx({2}).reshape({}), rnd({})}, {true, false, true},
           [](const VL& v) { return VL{sj::index_add(v[0], 0, v[1], v[2] * v[2]) * v[0]}; },
           [](const TL& v) { return TL{torch::index_add(v[0], 0, v[1], v[2] * v[2]) * v[0]}; }});
    else
      CHECK_THROWS_WITH_AS(sj::index_add(sj::Variable(rnd({4})), 0, sj::Variable(idx({2}).reshape({})),
                                         sj::Variable(rnd({}))),
                           doctest::Contains("index_add"), sj::Error);
  }

  TEST_CASE("permute, flatten, bmm: eager and compiled, batch 1, non-contiguous") {
    at::manual_seed(194);
    at::Tensor x = rnd({2, 3, 4, 2});
    run({"permute", {x}, {true}, [](const VL& v) { return VL{sj::permute(v[0] * v[0], {2, 0, 3, 1})}; },
         [](const TL& v) { return TL{(v[0] * v[0]).permute({2, 0, 3, 1})}; }});
    run({"permute negative dims", {x}, {true}, [](const VL& v) { return VL{sj::exp(sj::permute(v[0], {-1, 1, 0, -2}))}; },
         [](const TL& v) { return TL{v[0].permute({-1, 1, 0, -2}).exp()}; }});
    for (auto [s, e] : {std::pair<int64_t, int64_t>{0, -1}, {1, 2}, {2, 2}, {-3, -2}}) {
      run({"flatten " + std::to_string(s) + ".." + std::to_string(e), {x}, {true},
           [s = s, e = e](const VL& v) { return VL{sj::flatten(v[0] * v[0], s, e)}; },
           [s = s, e = e](const TL& v) { return TL{(v[0] * v[0]).flatten(s, e)}; }});
    }
    run({"flatten non-contiguous", {x.permute({3, 1, 0, 2})}, {true},
         [](const VL& v) { return VL{sj::sin(sj::flatten(v[0], 1))}; },
         [](const TL& v) { return TL{v[0].flatten(1).sin()}; }});
    run({"flatten 0-d", {rnd({})}, {true}, [](const VL& v) { return VL{sj::flatten(v[0] * v[0])}; },
         [](const TL& v) { return TL{(v[0] * v[0]).flatten()}; }});
    run({"bmm", {rnd({3, 2, 4}), rnd({3, 4, 5})}, {true, true},
         [](const VL& v) { return VL{sj::bmm(v[0], sj::tanh(v[1]))}; },
         [](const TL& v) { return TL{torch::bmm(v[0], v[1].tanh())}; }});
    run({"bmm batch 1, transposed operands", {rnd({1, 4, 2}).transpose(1, 2), rnd({1, 3, 4}).transpose(1, 2)},
         {true, true}, [](const VL& v) { return VL{sj::bmm(v[0], v[1] * v[1])}; },
         [](const TL& v) { return TL{torch::bmm(v[0], v[1] * v[1])}; }});
    run({"bmm of a tensor with itself", {rnd({2, 3, 3})}, {true},
         [](const VL& v) { return VL{sj::bmm(v[0], v[0])}; }, [](const TL& v) { return TL{torch::bmm(v[0], v[0])}; }});
  }

  TEST_CASE("binary_cross_entropy_with_logits: eager and compiled, input and target differentiable") {
    at::manual_seed(195);
    at::Tensor logits = rnd({4, 3}) * 3, target = at::rand({4, 3}, at::kDouble);
    run({"bce with logits", {logits, target}, {true, true},
         [](const VL& v) { return VL{sj::binary_cross_entropy_with_logits(v[0] * v[0], v[1])}; },
         [](const TL& v) { return TL{torch::binary_cross_entropy_with_logits(v[0] * v[0], v[1])}; }, 3, 2});
    run({"bce with logits, fixed 0/1 targets, large logits", {logits * 100, at::bernoulli(target)}, {true, false},
         [](const VL& v) { return VL{sj::binary_cross_entropy_with_logits(v[0], v[1])}; },
         [](const TL& v) { return TL{torch::binary_cross_entropy_with_logits(v[0], v[1])}; }});
    run({"bce with logits batch 1, transposed", {rnd({3, 1}).t(), at::rand({1, 3}, at::kDouble)}, {true, true},
         [](const VL& v) { return VL{sj::binary_cross_entropy_with_logits(v[0], v[1] * v[1])}; },
         [](const TL& v) { return TL{torch::binary_cross_entropy_with_logits(v[0], v[1] * v[1])}; }});
  }

  TEST_CASE("gradcheck and gradgradcheck of the new ops agree with finite differences") {
    at::manual_seed(196);
    auto fn = [](const VL& v) {
      sj::Variable h = sj::gelu(sj::bmm(v[0], v[1]), "tanh") + sj::sum(sj::silu(sj::permute(v[0], {0, 2, 1})));
      sj::Variable e = sj::index_select(sj::flatten(sj::softplus(h, 2, 3), 1), 1, sj::Variable(idx({0, 3, 3})));
      return VL{sj::logsumexp(sj::elu(e, 0.7), {1}) + sj::sum(sj::var(sj::gelu(e), {0}, true)) +
                sj::binary_cross_entropy_with_logits(sj::leaky_relu(e, 0.3), sj::sigmoid(v[2]))};
    };
    sj::Variable a(rnd({2, 2, 3}), true), b(rnd({2, 3, 2}), true), t(rnd({2, 3}), true);
    std::string report;
    CHECK_MESSAGE(sj::testing::gradcheck(fn, {a, b, t}, 1e-6, 1e-5, 1e-3, &report), report);
    CHECK_MESSAGE(sj::testing::gradgradcheck(fn, {a, b, t}, 1e-6, 1e-5, 1e-3, &report), report);
    auto emb = [](const VL& v) {
      sj::Variable ids(idx({2, 0, 2}));
      return VL{sj::index_add(sj::embedding(v[0], ids), 1, sj::Variable(idx({1, 1})), v[1] * v[1])};
    };
    sj::Variable w(rnd({3, 2}), true), s(rnd({3, 2}), true);
    CHECK_MESSAGE(sj::testing::gradcheck(emb, {w, s}, 1e-6, 1e-5, 1e-3, &report), report);
    CHECK_MESSAGE(sj::testing::gradgradcheck(emb, {w, s}, 1e-6, 1e-5, 1e-3, &report), report);
  }

  TEST_CASE("bad inputs give clear stagejit errors") {
    sj::Variable x(rnd({3, 4}), true), w(rnd({5, 2}), true);
    // Indices of a floating dtype.
    CHECK_THROWS_WITH_AS(sj::embedding(w, sj::Variable(rnd({2}))),
                         doctest::Contains("op 'embedding': indices must be an int64 or int32 tensor, got Double"),
                         sj::DtypeError);
    CHECK_THROWS_WITH_AS(sj::index_select(x, 0, sj::Variable(rnd({2}))),
                         doctest::Contains("op 'index_select': index must be an int64 or int32 tensor"), sj::DtypeError);
    CHECK_THROWS_WITH_AS(sj::index_add(x, 0, sj::Variable(at::zeros({2}, at::kBool)), sj::Variable(rnd({2, 4}))),
                         doctest::Contains("op 'index_add': index must be an int64 or int32 tensor, got Bool"), sj::DtypeError);
    // An index out of range, a dimension out of range.
    CHECK_THROWS_WITH_AS(sj::embedding(w, sj::Variable(idx({7}))), doctest::Contains("op 'embedding'"), sj::Error);
    CHECK_THROWS_WITH_AS(sj::index_select(x, 2, sj::Variable(idx({0}))), doctest::Contains("op 'index_select'"),
                         sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::index_add(x, 0, sj::Variable(idx({0})), sj::Variable(rnd({1, 3}))),
                         doctest::Contains("op 'index_add'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::logsumexp(x, {3}), doctest::Contains("op 'logsumexp'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::logsumexp(x, {}), doctest::Contains("op 'logsumexp': dim must name at least one dimension"),
                         sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::var(x, {-3}), doctest::Contains("op 'var'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::permute(x, {0, 0}), doctest::Contains("op 'permute'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::permute(x, {1}), doctest::Contains("op 'permute'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::flatten(x, 2), doctest::Contains("op 'flatten'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::bmm(x, x), doctest::Contains("op 'bmm'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::bmm(sj::Variable(rnd({2, 3, 4})), sj::Variable(rnd({2, 3, 4}))),
                         doctest::Contains("op 'bmm'"), sj::ShapeError);
    CHECK_THROWS_WITH_AS(sj::binary_cross_entropy_with_logits(x, sj::Variable(rnd({4, 3}))),
                         doctest::Contains("op 'binary_cross_entropy_with_logits'"), sj::ShapeError);
    // Activations: an unknown GELU form, integer inputs.
    CHECK_THROWS_WITH_AS(sj::gelu(x, "erf"), doctest::Contains("op 'gelu': approximate must be the string \"none\" or \"tanh\", got \"erf\""),
                         sj::Error);
    CHECK_THROWS_AS(sj::gelu(sj::Variable(idx({1, 2}))), sj::DtypeError);
    CHECK_THROWS_AS(sj::softplus(sj::Variable(idx({1, 2}))), sj::DtypeError);
    // Dropout probability outside [0, 1].
    CHECK_THROWS_WITH_AS(sj::dropout(x, 1.5, true),
                         doctest::Contains("dropout probability has to be between 0 and 1, but got 1.5"), sj::Error);
    CHECK_THROWS_WITH_AS(sj::dropout(x, -0.1, false), doctest::Contains("between 0 and 1"), sj::Error);
  }

  TEST_CASE("dropout: eager and compiled draw ATen's mask under a seed; the backward uses it") {
    at::Tensor x = rnd({8, 16});
    for (double p : {0.1, 0.5, 0.9}) {
      CAPTURE(p);
      at::manual_seed(7);
      at::Tensor torch_out = torch::dropout(x, p, true);
      at::manual_seed(7);
      sj::Variable xv(x, true);
      sj::Variable eager = sj::dropout(xv, p, true);
      CHECK(oracle::max_diff(eager.data(), torch_out) == 0.0);
      auto f = sj::compile([p](const VL& v) { return VL{sj::dropout(v[0], p, true) * 2.0}; }, {.derivatives = 2});
      for (int call = 0; call < 3; ++call) {  // the first traces, the others hit the cache
        CAPTURE(call);
        at::manual_seed(7);
        sj::Variable xc(x, true);
        VL out = f({xc});
        CHECK(oracle::max_diff(out[0].data(), torch_out * 2.0) == 0.0);
        // The backward multiplies by the mask of this call, scaled: libtorch's gradient
        // under the same seed.
        at::manual_seed(7);
        torch::Tensor xt = x.detach().requires_grad_(true);
        torch::Tensor yt = torch::dropout(xt, p, true) * 2.0;
        torch::Tensor gt = torch::autograd::grad({yt}, {xt}, {torch::ones_like(yt)}, true, true)[0];
        VL g = sj::grad({out[0]}, {xc}, {sj::Variable(at::ones_like(x), true)}, true);
        CHECK(oracle::max_diff(g[0].data(), gt) == 0.0);
        CHECK(at::equal(g[0].data() != 0, torch_out != 0));
        // Second stage: the mask does not depend on x, so nothing flows further.
        VL gg = sj::grad({sj::sum(g[0])}, {xc}, {}, false, true);
        CHECK((!gg[0].defined() || gg[0].data().abs().max().item<double>() == 0.0));
      }
      CHECK(f.stats().misses == 1);
    }
    // p == 1 as ATen: all zeros, zero gradient.
    sj::Variable xv(x, true);
    sj::Variable all = sj::dropout(xv, 1.0, true);
    CHECK(oracle::max_diff(all.data(), torch::dropout(x, 1.0, true)) == 0.0);
    CHECK(all.data().abs().max().item<double>() == 0.0);
    CHECK(sj::grad({sj::sum(all)}, {xv})[0].data().abs().max().item<double>() == 0.0);
  }

  TEST_CASE("dropout: fresh masks on every compiled call, the expected zero fraction, the draw in the graph") {
    at::manual_seed(197);
    const double p = 0.3;
    const int64_t n = 1 << 20;
    at::Tensor x = at::rand({n}, at::kDouble) + 1.0;  // never zero
    auto f = sj::compile([p](const VL& v) { return VL{sj::dropout(v[0], p, true)}; }, {.derivatives = 1});
    at::Tensor first = f({sj::Variable(x, true)})[0].data();
    at::Tensor second = f({sj::Variable(x, true)})[0].data();
    at::Tensor third = f({sj::Variable(x, true)})[0].data();
    CHECK_FALSE(at::equal(first == 0, second == 0));
    CHECK_FALSE(at::equal(second == 0, third == 0));
    // Zero fraction within 6 standard deviations of p (Bernoulli, n draws).
    const double bound = 6 * std::sqrt(p * (1 - p) / static_cast<double>(n));
    for (const at::Tensor& out : {first, second, third}) {
      const double zeros = (out == 0).sum().item<double>() / static_cast<double>(n);
      CHECK(std::abs(zeros - p) <= bound);
      // Kept elements scaled by 1 / (1 - p).
      at::Tensor kept = out != 0;
      CHECK(oracle::max_diff(out.masked_select(kept), x.masked_select(kept) * (1.0 / (1.0 - p))) == 0.0);
    }
    // The random draw is its own node, with the result and the bool mask as outputs, and
    // the backward stage reads that mask; no tensor of x's size is a constant.
    sj::Variable xs(rnd({4}), true);
    auto g = f.graph_for({xs});
    const std::string text = sj::ir::to_string(*g);
    CAPTURE(text);
    CHECK(text.find("Bool(4) = dropout[p=0.3, train=1](") != std::string::npos);
    int draws = 0;
    for (auto* node : g->nodes())
      if (auto* op = node->get_if<sj::ir::Op>(); op && op->id() == sj::OpId::dropout) {
        ++draws;
        CHECK(node->outputs().size() == 2);
      }
    CHECK(draws == 1);
    CHECK(text.find("Constant") == std::string::npos);
  }

  TEST_CASE("dropout: the identity in eval and for p == 0, eager and compiled") {
    at::manual_seed(198);
    at::Tensor x = rnd({5, 3});
    sj::Variable xv(x, true);
    CHECK(sj::dropout(xv, 0.5, false).data().unsafeGetTensorImpl() == x.unsafeGetTensorImpl());
    CHECK(sj::dropout(xv, 0.0, true).data().unsafeGetTensorImpl() == x.unsafeGetTensorImpl());
    for (bool train : {false, true}) {
      const double p = train ? 0.0 : 0.5;
      run({std::string("dropout ") + (train ? "p = 0" : "eval"), {x}, {true},
           [=](const VL& v) { return VL{sj::dropout(sj::tanh(v[0]), p, train)}; },
           [=](const TL& v) { return TL{torch::dropout(v[0].tanh(), p, train)}; }, 3, 2});
    }
    // No random node, so the generator is untouched.
    auto f = sj::compile([](const VL& v) { return VL{sj::dropout(v[0], 0.5, false) * 3.0}; }, {.derivatives = 1});
    CHECK(sj::ir::to_string(*f.graph_for({xv})).find("dropout") == std::string::npos);
    // The op run from IR text with train=false: ATen's native_dropout in eval (a copy and
    // an all-true mask).
    auto r = sj::ops::run_forward(sj::ops::get("dropout"), {x}, {{"p", 0.5}, {"train", false}});
    CHECK(oracle::max_diff(r[0], x) == 0.0);
    CHECK((r[1].scalar_type() == at::kBool));
    CHECK(r[1].all().item<bool>());
  }

  TEST_CASE("transformer encoder block: compiled with two derivatives equals libtorch at orders 0..2") {
    at::manual_seed(199);
    auto sj_block = [](const VL& v) {
      auto ln = [](const sj::Variable& x, const sj::Variable& w, const sj::Variable& b) {
        return sj::layer_norm(x, {x.sizes().back()}, w, b, 1e-5);
      };
      return VL{encoder_block(v, ln, 2)};
    };
    auto torch_block = [](const TL& v) {
      auto ln = [](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
        return torch::layer_norm(x, {x.size(-1)}, w, b, 1e-5);
      };
      return TL{encoder_block(v, ln, 2)};
    };
    for (auto [B, S] : {std::pair<int64_t, int64_t>{2, 5}, {1, 3}}) {
      CAPTURE(B);
      std::vector<at::Tensor> data = encoder_block_inputs(B, S, 8, 16);
      std::vector<bool> rg(data.size(), true);
      rg.back() = false;  // the mask
      oracle::check("encoder block", data, rg, sj_block, torch_block, 2);
      for (int k = 0; k <= 2; ++k) check_compiled("encoder block", sj_block, torch_block, data, rg, k);
    }
  }
}
