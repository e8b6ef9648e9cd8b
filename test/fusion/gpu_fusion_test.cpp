// The `gpu` suite, fused groups on CUDA tensors: fusion::run_fused (CUDA dialect, NVRTC,
// driver launch on the current stream) against the same nodes run one by one by ATen on
// CUDA and against ATen on the CPU, over broadcast/strided/expanded/0-dim/empty inputs,
// float/double/half and special values; then compiled closures with fusion on CUDA
// (every stage of the tanh-sigmoid chain and of the LSTM cell) against the same closures
// without fusion and against libtorch's autograd on CUDA. Compiles everywhere; skipped
// (reported by doctest) unless libtorch has CUDA and a GPU is present (scripts/gpu-check).
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/models.hpp"
#include "../support/staged_oracle.hpp"
#include "groups.hpp"

#include <cmath>
#include <limits>
#include <string>

namespace ir = stagejit::ir;
namespace sj = stagejit;
namespace fusion = stagejit::fusion;
using namespace stagejit::fusion::testing;

namespace {

bool no_cuda_tensors() { return !at::hasCUDA() || !fusion::cuda_driver_available(); }

at::TensorOptions on_gpu(at::ScalarType dtype) { return at::TensorOptions().dtype(dtype).device(at::kCUDA, 0); }

// Runs `body` with float, double and half, the dtype's name captured.
template <class Body>
void for_gpu_dtypes(Body body) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf}) {
    const std::string dtype_name = c10::toString(dtype);
    CAPTURE(dtype_name);
    body(dtype);
  }
}

/// rtol/atol for comparing a fused result (computed in one pass in the compute type)
/// with ATen's op-by-op result of the same dtype.
double tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return 1e-12;
    case at::kFloat: return 2e-6;
    default: return 2e-2;  // half, bfloat16: ATen rounds every intermediate, the kernel only the outputs
  }
}

/// `got` and `want` have the same dtype, shape and NaNs; their values agree within `tol`.
void check_same(const at::Tensor& got, const at::Tensor& want, double tol) {
  REQUIRE(got.sizes() == want.sizes());
  REQUIRE((got.scalar_type() == want.scalar_type()));
  REQUIRE(got.device() == want.device());
  if (got.scalar_type() == at::kBool) {
    CHECK(at::equal(got.cpu(), want.cpu()));
    return;
  }
  const at::Tensor g = got.cpu().to(at::kDouble), w = want.cpu().to(at::kDouble);
  CHECK(at::equal(at::isnan(g), at::isnan(w)));
  CHECK_MESSAGE(at::allclose(g, w, tol, tol, /*equal_nan=*/true),
                "max |diff| " << (g - w).abs().nan_to_num(0, 0, 0).max().item<double>());
}

/// Runs `text` fused on `inputs` (CUDA tensors), asserting that the CUDA kernel ran, and
/// compares with the nodes run one by one by ATen on CUDA and on the CPU.
void check_group_cuda(const std::string& text, const std::vector<at::Tensor>& inputs) {
  auto g = ir::parse(text);
  std::string reason = "unset";
  auto got = fusion::run_fused(*g, inputs, {nullptr, "gpu test group", &reason});
  CHECK_MESSAGE(reason == "", reason);  // the CUDA kernel ran
  auto want = fusion::run_unfused(*g, inputs);
  std::vector<at::Tensor> host;
  for (const auto& x : inputs) host.push_back(x.cpu());
  auto want_cpu = fusion::run_unfused(*g, host);
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].is_cuda());
    CHECK(got[i].is_contiguous());
    const double tol = tolerance(got[i].scalar_type());
    check_same(got[i], want[i], tol);
    check_same(got[i].cpu(), want_cpu[i], std::max(tol, got[i].scalar_type() == at::kFloat ? 1e-5 : tol));
  }
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("the CUDA environment: ATen's CUDA hooks and stagejit's driver (reported; the cases below skip without them)") {
    // On a machine with a GPU every case of this suite needs both; this says which is
    // missing when they skip (scripts/gpu-check prints it).
    MESSAGE("at::hasCUDA(): ", at::hasCUDA(), "; stagejit CUDA driver: ", fusion::cuda_driver_available(),
            "; devices: ", fusion::cuda_device_count());
    if (!fusion::cuda_driver_available()) {
      try {
        (void)fusion::cuda_device_info(0);
      } catch (const std::exception& e) {
        const std::string why = e.what();
        MESSAGE("driver: ", why);
      }
    }
    CHECK(no_cuda_tensors() == !(at::hasCUDA() && fusion::cuda_driver_available()));
  }

  TEST_CASE("fused tanh(a*b + c) * sigmoid(a) on CUDA: shapes, layouts, float/double/half" *
            doctest::skip(no_cuda_tensors())) {
    at::manual_seed(1);
    for_gpu_dtypes([&](at::ScalarType dtype) {
      auto o = on_gpu(dtype);
      check_group_cuda(tanh_sigmoid_group, {at::randn({1000}, o), at::randn({1000}, o), at::randn({1000}, o)});
      check_group_cuda(tanh_sigmoid_group, {at::randn({1 << 20}, o), at::randn({1 << 20}, o), at::randn({1 << 20}, o)});
      // broadcast [16, 1] x [4]
      check_group_cuda(tanh_sigmoid_group, {at::randn({16, 1}, o), at::randn({4}, o), at::randn({16, 4}, o)});
      // transposed, expanded and sliced (strided) inputs
      check_group_cuda(tanh_sigmoid_group,
                       {at::randn({4, 16}, o).t(), at::randn({16, 4}, o), at::randn({1, 4}, o).expand({16, 4})});
      check_group_cuda(tanh_sigmoid_group,
                       {at::randn({5, 7, 3}, o).permute({2, 0, 1}), at::randn({7}, o), at::randn({3, 5, 7}, o)});
      check_group_cuda(tanh_sigmoid_group, {at::randn({64, 64}, o).slice(1, 0, 64, 3), at::randn({64, 22}, o),
                                            at::randn({22}, o)});
      // 0-dim and empty
      check_group_cuda(tanh_sigmoid_group, {at::randn({}, o), at::randn({}, o), at::randn({}, o)});
      check_group_cuda(tanh_sigmoid_group, {at::randn({0, 4}, o), at::randn({4}, o), at::randn({0, 4}, o)});
      check_group_cuda(tanh_sigmoid_group, {at::randn({}, o), at::randn({3}, o), at::randn({}, o)});
    });
  }

  TEST_CASE("fused special values on CUDA: NaN-propagating max/min/clamp/relu, saturating tanh/sigmoid" *
            doctest::skip(no_cuda_tensors())) {
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    const std::vector<double> vals = {nan, inf, -inf, 0.0, -0.0, 1.0, -2.5, 50, -50, -100, 3e38, 1e-30};
    for_gpu_dtypes([&](at::ScalarType dtype) {
      auto x = at::tensor(vals, at::TensorOptions().dtype(at::kDouble)).to(on_gpu(dtype));
      auto y = x.flip({0});
      check_group_cuda(special_values_group, {x, y});
      check_group_cuda(special_values_group, {y, x});
    });
  }

  TEST_CASE("fused predicates on CUDA: bool outputs, where/masked_fill, pow, sign, threshold" *
            doctest::skip(no_cuda_tensors())) {
    at::manual_seed(2);
    for_gpu_dtypes([&](at::ScalarType dtype) {
      auto o = on_gpu(dtype);
      check_group_cuda(predicates_group, {at::randn({6, 5}, o), at::randn({5}, o)});
      check_group_cuda(predicates_group, {at::rand({6, 5}, o), at::randn({5}, o)});
    });
  }

  TEST_CASE("fused activations on CUDA: gelu (both forms), erf, silu, softplus, elu, leaky_relu" *
            doctest::skip(no_cuda_tensors())) {
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    const std::vector<double> vals = {nan, inf, -inf, 0.0, -0.0, 1.0, -2.5, 50, -50, -100, 3e38, 1e-30};
    at::manual_seed(5);
    for (auto dtype : {at::kFloat, at::kDouble}) {
      const std::string dtype_name = c10::toString(dtype);
      CAPTURE(dtype_name);
      auto x = at::tensor(vals, at::TensorOptions().dtype(at::kDouble)).to(on_gpu(dtype));
      check_group_cuda(activations_group, {x, x.flip({0})});
      check_group_cuda(activations_group, {at::randn({1000}, on_gpu(dtype)) * 4, at::randn({1000}, on_gpu(dtype)) * 4});
    }
  }

  TEST_CASE("a group on CUDA and CPU tensors is refused at plan time and runs op by op" *
            doctest::skip(no_cuda_tensors())) {
    auto g = ir::parse(tanh_sigmoid_group);
    const auto o = on_gpu(at::kFloat);
    // ATen itself accepts a 0-dim CPU tensor beside CUDA tensors.
    std::vector<at::Tensor> in = {at::randn({8}, o), at::randn({}), at::randn({8}, o)};
    std::string reason;
    auto got = fusion::run_fused(*g, in, {nullptr, "fusion_group_9", &reason});
    CHECK(reason.find("fusion_group_9: inputs on more than one device (input 0 on cuda:0, input 1 on cpu)") !=
          std::string::npos);
    check_same(got[0], at::tanh(in[0] * in[1] + in[2]) * at::sigmoid(in[0]), 1e-6);
  }

  TEST_CASE("compiled stages with fusion on CUDA: tanh-sigmoid chain and LSTM cell, every stage" *
            doctest::skip(no_cuda_tensors())) {
    auto chain_sj = [](const sj::variable_list& in) -> sj::variable_list {
      return {sj::tanh(in[0] * in[1] + in[2]) * sj::sigmoid(in[0])};
    };
    auto chain_torch = [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
      return {torch::tanh(in[0] * in[1] + in[2]) * torch::sigmoid(in[0])};
    };
    struct Model {
      std::string name;
      sj::traced_fn sj_fn;
      sj::testing::TorchFn torch_fn;
      std::vector<std::vector<int64_t>> shapes;
    };
    const std::vector<Model> models = {
        {"tanh-sigmoid chain", chain_sj, chain_torch, {{64, 33}, {33}, {64, 1}}},
        {"LSTM cell", sj::testing::lstm_cell<sj::Variable>, sj::testing::lstm_cell<torch::Tensor>,
         {{8, 3}, {8, 4}, {8, 4}, {16, 3}, {16, 4}, {16}}},
    };
    constexpr int k = 2;
    for (const auto& m : models) {
      for (auto dtype : {at::kDouble, at::kFloat}) {
        const std::string dtype_name = c10::toString(dtype);
        CAPTURE(m.name);
        CAPTURE(dtype_name);
        at::manual_seed(12);
        std::vector<at::Tensor> data;
        for (const auto& s : m.shapes) data.push_back(at::randn(s, on_gpu(dtype)));
        const std::vector<bool> rg(data.size(), true);
        const auto oracle = sj::testing::libtorch_stages(m.torch_fn, data, rg, k);
        const double tol = dtype == at::kDouble ? 1e-10 : 1e-4;
        for (bool fuse : {true, false}) {
          CAPTURE(fuse);
          auto f = sj::compile(m.sj_fn, {.derivatives = k, .fuse = fuse});
          sj::variable_list inputs;
          for (const auto& d : data) inputs.emplace_back(d, true);
          sj::variable_list all_inputs = inputs;
          sj::variable_list outs = f(inputs);
          int groups = 0;
          for (const auto* node : f.graph_for(inputs)->nodes()) groups += node->is<ir::FusionGroup>();
          CHECK(((groups > 0) == fuse));
          REQUIRE(outs.size() == oracle.outputs[0].size());
          for (size_t i = 0; i < outs.size(); ++i) {
            CHECK(outs[i].data().is_cuda());
            CHECK(sj::testing::max_abs_diff(outs[i].data(), oracle.outputs[0][i]) <= tol);
          }
          for (int s = 1; s <= k; ++s) {
            CAPTURE(s);
            sj::variable_list roots, grads_in;
            for (auto& o : outs)
              if (o.defined() && o.requires_grad()) {
                roots.push_back(o);
                grads_in.emplace_back(at::ones_like(o.data()), s < k);
              }
            sj::variable_list wrt;
            for (auto& v : all_inputs)
              if (v.requires_grad()) wrt.push_back(v);
            sj::variable_list res = sj::grad(roots, wrt, grads_in, s < k, /*allow_unused=*/true);
            const auto& expected = oracle.outputs[s];
            REQUIRE(res.size() == expected.size());
            for (size_t i = 0; i < res.size(); ++i) {
              CAPTURE(i);
              if (!expected[i].defined()) {
                if (res[i].defined()) CHECK(res[i].data().abs().max().item<double>() == 0.0);
              } else {
                CHECK(res[i].data().is_cuda());
                CHECK(sj::testing::max_abs_diff(res[i].data(), expected[i]) <= tol);
              }
            }
            for (auto& gi : grads_in) all_inputs.push_back(gi);
            outs = res;
          }
        }
      }
    }
  }
}
