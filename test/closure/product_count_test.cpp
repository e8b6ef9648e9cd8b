// Matrix-product FLOPs of the compiled modes against libtorch eager (issue 32, item 4:
// "no compiled mode performs more matrix-product FLOPs than libtorch eager does for the
// same requested gradients").
//
// How the products are counted. Every matrix product of a step, in every mode, goes
// through one of ATen's product ops (aten::mm, addmm, bmm, matmul) or through
// `stagejit::small_mm` (the LIBXSMM path of ops/small_gemm.hpp), and each of them reports
// itself to ATen's RecordFunction callbacks with its operands. A global callback counts
// the outermost product of each call and its FLOPs, 2 * M * K * N, from the operands'
// shapes. libtorch's autograd runs its backward formulas (MmBackward, AddmmBackward)
// through the same ops, so its count is what eager does for the requested gradients
// (libtorch computes only the input gradients a backward needs). The compiled modes run
// with `tile_rows = 0`: a row-tiled region calls LIBXSMM per tile without operands
// (`small_mm_raw`), which gives a count but no shapes; the untiled stages run the same
// product nodes of the same stage variants on the whole tensors. The counts are checked
// against the IR too: the product nodes (mm/addmm/matmul) of the stage variants that
// ran, weighted by their traced shapes, must not exceed what the callback saw.
//
// The steps: the PINN of test/support/pinn_step.hpp (third derivative of a tanh MLP),
// and a WGAN-GP critic (leaky ReLU MLP, loss mean(D(x)) + 10 mean((|grad_x D| - 1)^2)),
// each staged (the net compiled with k derivatives, the loss's grads stepping through
// its stages) and whole-loss (the loss with its inner grads compiled with 1 derivative).
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/pinn_step.hpp"
#include "../support/record_function.hpp"

#include <ATen/record_function.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace sj = stagejit;
using namespace sj::testing::pinn_step;

namespace {

// ------------------------------------------------------------------ the product counter

struct ProductCount {
  int64_t calls = 0;
  double flops = 0;
  int64_t unknown = 0;  // products reported without operands (row-tiled LIBXSMM calls)
  std::map<std::string, std::pair<int64_t, double>> by_shape;  // "op [a] [b]" -> (calls, flops)
};

std::mutex g_mutex;
ProductCount g_count;
thread_local int t_depth = 0;

bool is_product(const char* name) {
  for (const char* p : {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "stagejit::small_mm"})
    if (std::strcmp(name, p) == 0) return true;
  return false;
}

std::string dims(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!is_product(fn.name())) return nullptr;
  if (t_depth++ > 0) return nullptr;
  std::vector<at::Tensor> ts;
  for (const c10::IValue& v : fn.inputs())
    if (v.isTensor()) ts.push_back(v.toTensor());
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_count.calls;
  if (ts.size() < 2) {
    ++g_count.unknown;
    return nullptr;
  }
  // addmm (c, a, b): the last two operands; mm, bmm, matmul, small_mm (a, b).
  const at::Tensor& a = ts[ts.size() - 2];
  const at::Tensor& b = ts[ts.size() - 1];
  const double flops = 2.0 * double(a.numel()) * double(b.dim() >= 2 ? b.size(-1) : 1);
  g_count.flops += flops;
  auto& e = g_count.by_shape[std::string(fn.name()) + " " + dims(a) + " " + dims(b)];
  ++e.first;
  e.second += flops;
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (is_product(fn.name())) --t_depth;
}

/// The products `f` runs (on any thread).
template <class F>
ProductCount count_products(F&& f) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_count = {};
  }
  stagejit::testing::with_global_callback(at::RecordFunctionCallback(on_start, on_end).needsInputs(true), f);
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_count;
}

std::string describe(const char* mode, const ProductCount& c) {
  char head[160];
  std::snprintf(head, sizeof head, "%s: %lld products, %.0f FLOPs\n", mode, (long long)c.calls, c.flops);
  std::string s = head;
  for (const auto& [k, v] : c.by_shape) {
    char line[200];
    std::snprintf(line, sizeof line, "    %3lld x %s  (%.0f FLOPs)\n", (long long)v.first, k.c_str(), v.second);
    s += line;
  }
  return s;
}

// Product FLOPs of the IR: the mm/addmm/matmul nodes of stage `stage` of `g`, with the
// traced shapes of their operands (the last two inputs).
double ir_product_flops(const sj::ir::Graph& g, std::size_t stage, int64_t* count) {
  double flops = 0;
  for (const sj::ir::Node* node : g.nodes()) {
    if (node->stage() != stage) continue;
    const std::string d = node->describe();
    if (d != "mm" && d != "addmm" && d != "matmul") continue;
    const auto in = node->inputs();
    const auto* a = in[in.size() - 2]->tensor_type();
    const auto* b = in[in.size() - 1]->tensor_type();
    if (!a || !b) FAIL("product node without tensor types: ", node->describe());
    double numel = 1;
    for (auto s : a->sizes) numel *= double(s);
    flops += 2 * numel * double(b->sizes.size() >= 2 ? b->sizes.back() : 1);
    ++*count;
  }
  return flops;
}

/// Product FLOPs in the IR of every stage variant `f` built in `fn` (a fresh compiled
/// function: each variant built during `f` is the one a call of `f` ran).
double ir_variant_flops(sj::CompiledFunction& fn, const sj::variable_list& spec, int64_t* count,
                        std::string* listing) {
  double flops = 0;
  for (const auto& v : fn.closure_for(spec)->variants()) {
    int64_t n = 0;
    const double f = ir_product_flops(*v->graph, v->key.stage, &n);
    *listing += "    " + v->key.to_string() + ": " + std::to_string(n) + " products, " +
                std::to_string(int64_t(f)) + " FLOPs\n";
    flops += f;
    *count += n;
  }
  return flops;
}

double max_rel(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    d = std::max(d, ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-30)).item<double>());
  return d;
}

// ------------------------------------------------------------------ the critic

constexpr double kLambda = 10.0;

// in = {x [n, d], W1 [d, h], b1 [h], W2 [h, h], b2 [h], W3 [h, 1]}.
sj::Variable leaky(const sj::Variable& z) { return sj::where(sj::gt(z, 0.0), z, sj::mul(z, 0.2)); }
sj::variable_list critic(const sj::variable_list& in) {
  auto h = leaky(sj::add(sj::mm(in[0], in[1]), in[2]));
  h = leaky(sj::add(sj::mm(h, in[3]), in[4]));
  return {sj::mm(h, in[5])};
}
sj::Variable critic_loss_of(const sj::variable_list& in, const sj::Variable& d) {
  auto g = sj::grad({d}, {in[0]}, {sj::Variable(at::ones_like(d.data()))}, true)[0];
  auto norm = sj::sqrt(sj::add(sj::sum(sj::mul(g, g), std::vector<int64_t>{1}), 1e-12));
  auto gap = sj::sub(norm, 1.0);
  return sj::add(sj::mean(d), sj::mul(sj::mean(sj::mul(gap, gap)), kLambda));
}
sj::variable_list critic_loss(const sj::variable_list& in) { return {critic_loss_of(in, critic(in)[0])}; }

// The same critic with ReLU: its backward is masked_fill(g, mask, 0), a lone op between
// two products where leaky ReLU's is a fusion group.
sj::variable_list relu_critic(const sj::variable_list& in) {
  auto h = sj::relu(sj::add(sj::mm(in[0], in[1]), in[2]));
  h = sj::relu(sj::add(sj::mm(h, in[3]), in[4]));
  return {sj::mm(h, in[5])};
}
sj::variable_list relu_critic_loss(const sj::variable_list& in) { return {critic_loss_of(in, relu_critic(in)[0])}; }

Step torch_critic_step_with(const std::vector<at::Tensor>& data, bool relu) {
  std::vector<torch::Tensor> in;
  for (const auto& t : data) in.push_back(t.detach().clone().set_requires_grad(true));
  auto act = [relu](const torch::Tensor& z) { return relu ? torch::relu(z) : torch::leaky_relu(z, 0.2); };
  auto h = act(torch::mm(in[0], in[1]) + in[2]);
  h = act(torch::mm(h, in[3]) + in[4]);
  auto d = torch::mm(h, in[5]);
  auto g = torch::autograd::grad({d}, {in[0]}, {torch::ones_like(d)}, true, true)[0];
  auto gap = (g * g).sum(1).add(1e-12).sqrt() - 1.0;
  auto loss = d.mean() + (gap * gap).mean() * kLambda;
  std::vector<torch::Tensor> params(in.begin() + 1, in.end());
  auto gr = torch::autograd::grad({loss}, params);
  return Step{loss.to(at::kDouble).item<double>(), {gr.begin(), gr.end()}};
}
Step torch_critic_step(const std::vector<at::Tensor>& data) { return torch_critic_step_with(data, false); }

std::vector<at::Tensor> pinn_data(int64_t n, int64_t h) {
  at::manual_seed(3);
  return {at::rand({n, 2}, at::kDouble) * 2 - 1, at::randn({2, h}, at::kDouble) * 0.7,
          at::randn({h}, at::kDouble) * 0.1,     at::randn({h, h}, at::kDouble) / std::sqrt(double(h)),
          at::randn({h}, at::kDouble) * 0.1,     at::randn({h, 1}, at::kDouble) / std::sqrt(double(h))};
}

std::vector<at::Tensor> critic_data(int64_t n, int64_t d, int64_t h) {
  at::manual_seed(4);
  return {at::randn({n, d}, at::kDouble),        at::randn({d, h}, at::kDouble) / std::sqrt(double(d)),
          at::randn({h}, at::kDouble) * 0.1,     at::randn({h, h}, at::kDouble) / std::sqrt(double(h)),
          at::randn({h}, at::kDouble) * 0.1,     at::randn({h, 1}, at::kDouble) / std::sqrt(double(h))};
}

sj::variable_list as_inputs(const std::vector<at::Tensor>& data) {
  sj::variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  return in;
}

struct Measured {
  ProductCount eager, staged, whole;
  double staged_ir = 0, whole_ir = 0;
  int64_t staged_ir_count = 0, whole_ir_count = 0;
};

/// Counts the products of the staged, whole-loss and libtorch steps (each mode's first
/// call compiles untimed first; the counted call is the second) and checks the results.
template <class Staged, class Whole, class Torch>
Measured measure(const std::vector<at::Tensor>& data, sj::CompiledFunction& net, sj::CompiledFunction& loss,
                 const Staged& staged_step, const Whole& whole_step, const Torch& torch_step) {
  Measured m;
  const Step ref = torch_step(data);
  const Step s1 = staged_step(net, data);
  const Step w1 = whole_step(loss, data);
  CHECK(max_rel(s1.grads, ref.grads) < 1e-10);
  CHECK(max_rel(w1.grads, ref.grads) < 1e-10);
  CHECK(std::abs(s1.loss - ref.loss) <= 1e-10 * std::max(1.0, std::abs(ref.loss)));
  CHECK(std::abs(w1.loss - ref.loss) <= 1e-10 * std::max(1.0, std::abs(ref.loss)));
  m.eager = count_products([&] { (void)torch_step(data); });
  m.staged = count_products([&] { (void)staged_step(net, data); });
  m.whole = count_products([&] { (void)whole_step(loss, data); });
  const auto spec = as_inputs(data);
  std::string staged_variants, whole_variants;
  m.staged_ir = ir_variant_flops(net, spec, &m.staged_ir_count, &staged_variants);
  m.whole_ir = ir_variant_flops(loss, spec, &m.whole_ir_count, &whole_variants);
  // Stage 0 runs as the full stage (no variant): its products are in the graph.
  m.staged_ir += ir_product_flops(*net.graph_for(spec), 0, &m.staged_ir_count);
  m.whole_ir += ir_product_flops(*loss.graph_for(spec), 0, &m.whole_ir_count);
  const std::string report = describe("libtorch eager", m.eager) + describe("staged compiled", m.staged) +
                             describe("whole-loss compiled", m.whole) + "IR of the stage variants that ran: staged " +
                             std::to_string(m.staged_ir_count) + " products, " + std::to_string(m.staged_ir) +
                             " FLOPs; whole-loss " + std::to_string(m.whole_ir_count) + " products, " +
                             std::to_string(m.whole_ir) + " FLOPs\n  staged variants:\n" + staged_variants +
                             "  whole-loss variants:\n" + whole_variants;
  MESSAGE(report);
  // Every product ran with operands the callback could read (tile_rows = 0).
  CHECK(m.staged.unknown == 0);
  CHECK(m.whole.unknown == 0);
  CHECK(m.eager.unknown == 0);
  return m;
}

sj::CompileOptions options(int derivatives) {
  sj::CompileOptions o;
  o.derivatives = derivatives;
  o.tile_rows = 0;  // every product with its operands (see the file comment)
  return o;
}

/// The PINN step (n = 256, h = 16) measured with the net compiled for 3 derivatives,
/// CompileOptions::cross_stage_gradients set to `cross_stage_gradients` and
/// CompileOptions::joint_backward to `joint_backward`.
Measured measure_pinn_staged(bool cross_stage_gradients, bool joint_backward = true) {
  const auto data = pinn_data(256, 16);
  sj::CompileOptions o = options(3);
  o.cross_stage_gradients = cross_stage_gradients;
  o.joint_backward = joint_backward;
  auto net = sj::compile(&mlp, o);
  auto loss = sj::compile(&mlp_loss, options(1));
  return measure(data, net, loss, sj_step, sj_loss_step, torch_step);
}

}  // namespace

TEST_SUITE("closure") {

// With the default options (cross_stage_gradients unset) the staged PINN here (no row
// tiling) is compiled with cross-stage gradients (Note [Choosing cross-stage gradients] in
// closure/compile-inl.hpp), so it runs eager's products. Before that choice (main 8572e5f,
// double, n = 256, h = 16): libtorch eager 27 products / 1 777 664 FLOPs, staged 36 /
// 2 605 056 (1.47x): the final grad(loss, W) ran stage 3, 2 and 1 variants (13 + 8 + 5
// products), each differentiating back through the forward on its own. The next case
// keeps that mode (cross_stage_gradients = false) on record.
TEST_CASE("product count: the PINN step's compiled modes do no more product FLOPs than libtorch eager") {
  const auto data = pinn_data(256, 16);
  auto net = sj::compile(&mlp, options(3));
  CHECK(net.closure_for(as_inputs(data))->cross_stage);
  auto loss = sj::compile(&mlp_loss, options(1));
  const Measured m = measure(data, net, loss, sj_step, sj_loss_step, torch_step);
  CHECK(m.staged.flops <= m.eager.flops);
  CHECK(m.whole.flops <= m.eager.flops);
}

// Without cross-stage gradients and without the joint backward (each backward stage
// differentiates back through the forward on its own) the staged PINN runs more products
// than eager: 36 against 27 here, 2 605 056 against 1 777 664 FLOPs (the final grad ran
// stage 3, 2 and 1 variants of 13 + 8 + 5 products).
TEST_CASE("product count: the PINN step staged one stage at a time re-differentiates the forward") {
  const Measured m = measure_pinn_staged(false, /*joint_backward=*/false);
  CHECK(m.staged.calls == 36);
  CHECK(m.staged.flops == doctest::Approx(2605056.0));
  CHECK(m.eager.flops == doctest::Approx(1777664.0));
}

// With the joint backward (the default; Note [Joint backward] in
// closure/autograd_closure.hpp) that final grad runs one joint-stage variant, which
// differentiates the forward once: eager's products exactly.
TEST_CASE("product count: the PINN step staged with the joint backward runs eager's products") {
  const Measured m = measure_pinn_staged(false);
  CHECK(m.staged.calls == m.eager.calls);
  CHECK(m.staged.flops == doctest::Approx(m.eager.flops));
  CHECK(m.whole.flops <= m.eager.flops);
}

// The staged mode with CompileOptions::cross_stage_gradients: each backward stage stops at
// the earlier-stage values it reads and hands their gradients on, so the forward is
// differentiated once, as libtorch does; its products are eager's.
TEST_CASE("product count: the PINN step staged with cross-stage gradients does no more product FLOPs than eager") {
  const Measured m = measure_pinn_staged(true);
  CHECK(m.staged.flops <= m.eager.flops);
  CHECK(m.whole.flops <= m.eager.flops);
}

// Holds on main 8572e5f (16 products, 3 883 008 FLOPs in all three modes): leaky ReLU's
// derivative is piecewise constant, so the penalty's gradient never reaches the forward's
// activations and no backward stage re-differentiates the forward.
TEST_CASE("product count: the WGAN-GP critic's compiled modes do no more product FLOPs than libtorch eager") {
  const auto data = critic_data(256, 8, 32);
  auto net = sj::compile(&critic, options(2));
  auto loss = sj::compile(&critic_loss, options(1));
  auto staged = [](sj::CompiledFunction& f, const std::vector<at::Tensor>& d) {
    auto in = as_inputs(d);
    return step_of(critic_loss_of(in, f(in)[0]), in);
  };
  auto whole = [](sj::CompiledFunction& f, const std::vector<at::Tensor>& d) {
    auto in = as_inputs(d);
    return step_of(f(in)[0], in);
  };
  const Measured m = measure(data, net, loss, staged, whole, torch_critic_step);
  CHECK(m.staged.flops <= m.eager.flops);
  CHECK(m.whole.flops <= m.eager.flops);
}

// With row tiling (the default options), every product of the critic's step, staged and
// whole-loss, with leaky ReLU or ReLU, runs per tile inside a row-tiled region: none is
// reported with operands, so none ran whole through OpenBLAS. Before 2026-12-06 22:00:
// - a fusion group that writes a Bool mask (leaky ReLU's backward saves one for the double
//   backward) stayed outside every region. In the staged critic's stage 1 that left
//   regions of one product each, so none formed, and the stage's 6 products ran whole
//   (bench/higher_order's critic128: 13 of 237 products per step, 379 MFLOP);
// - only fusion groups read a mask. ReLU's backward, a lone masked_fill(g, mask, 0)
//   between two products, split the whole loss's backward stage the same way (a 128-wide
//   ReLU critic's whole loss: 13.5 -> 7.9 ms per step, bench/higher_order.md).
// Also with fewer rows than the layers are wide (48 rows, 128 units): the backward stages'
// weight-shaped values outnumber their rows, and the planner took N = 128, leaving the
// stages' [48, 128] x [128, 128] products whole (find_row_tiled_regions, its N).
TEST_CASE("product count: the critic's tiled steps run every product inside a row-tiled region") {
  if (!sj::ops::small_mm_enabled()) return;
  for (const auto& [rows, width, relu] : {std::tuple{int64_t(1024), int64_t(64), false},
                                          std::tuple{int64_t(1024), int64_t(64), true},
                                          std::tuple{int64_t(48), int64_t(128), false}}) {
    CAPTURE(rows);
    CAPTURE(width);
    CAPTURE(relu);
    sj::fusion::set_wait_for_kernels(true);  // every call with the kernels built: none runs a region untiled
    const auto data = critic_data(rows, 8, width);
    auto net = sj::compile(relu ? &relu_critic : &critic, {.derivatives = 2});
    auto loss = sj::compile(relu ? &relu_critic_loss : &critic_loss, {.derivatives = 1});
    const Step ref = torch_critic_step_with(data, relu);
    auto staged = [&] {
      auto in = as_inputs(data);
      return step_of(critic_loss_of(in, net(in)[0]), in);
    };
    auto whole = [&] {
      auto in = as_inputs(data);
      return step_of(loss(in)[0], in);
    };
    for (int call = 0; call < 2; ++call) {
      CAPTURE(call);
      Step s, w;
      const ProductCount cs = count_products([&] { s = staged(); });
      const ProductCount cw = count_products([&] { w = whole(); });
      CHECK(max_rel(s.grads, ref.grads) < 1e-10);
      CHECK(max_rel(w.grads, ref.grads) < 1e-10);
      CHECK(std::abs(s.loss - ref.loss) <= 1e-10 * std::max(1.0, std::abs(ref.loss)));
      CHECK(std::abs(w.loss - ref.loss) <= 1e-10 * std::max(1.0, std::abs(ref.loss)));
      if (call == 0) continue;  // the first call traces and compiles: its products are not the step's
      const std::string report = describe("staged compiled", cs) + describe("whole-loss compiled", cw);
      INFO(report);
      CHECK(cs.calls > 0);
      CHECK(cs.unknown == cs.calls);
      CHECK(cw.calls > 0);
      CHECK(cw.unknown == cw.calls);
    }
    sj::fusion::set_wait_for_kernels(false);
  }
}

}  // TEST_SUITE
