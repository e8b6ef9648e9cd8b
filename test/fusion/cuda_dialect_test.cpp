// The CUDA dialect of fusion::generate, without a GPU: the generated source (scalar body
// per thread, grid-stride loop, 64-bit indices, loads and stores converting half and
// bfloat16 to float, literals in the compute type), what it refuses, NVRTC compiling it
// to PTX (skipped without NVRTC), and the planner's routing by device.
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/testing/doctest.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include "groups.hpp"
#include "ptx_check.hpp"

#include <cmath>
#include <limits>
#include <string>

namespace ir = stagejit::ir;
namespace fusion = stagejit::fusion;
using namespace stagejit::fusion::testing;

namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// Meta tensors (no storage) of `dtype` with the sizes of `shapes`.
std::vector<at::Tensor> metas(at::ScalarType dtype, const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<at::Tensor> out;
  for (const auto& s : shapes) out.push_back(at::empty(s, at::TensorOptions().dtype(dtype).device(at::kMeta)));
  return out;
}

}  // namespace

TEST_SUITE("fusion") {
  TEST_CASE("generate, CUDA dialect: grid-stride scalar body in the compute type, loads and stores by storage type") {
    auto g = ir::parse(tanh_sigmoid_group);
    const auto ks = fusion::generate(*g, metas(at::kFloat, {{16, 4}, {4}, {16, 1}}), fusion::DeviceKind::CUDA, 1);
    CHECK(ks.entry == "stagejit_fused");
    CHECK((ks.key.device == fusion::DeviceKind::CUDA));
    CHECK(ks.key.device_index == 1);
    CHECK(has(ks.source, "extern \"C\" __global__ void stagejit_fused(long long begin, long long end, int rank, "
                         "stagejit_Args<4> p)"));
    CHECK(has(ks.source, "typedef float T;"));
    CHECK(has(ks.source, "SJ_GRID_STRIDE_LOOP(i, begin, end)"));
    CHECK(has(ks.source, "const T x0 = sj_load_as<T, float>(p.t[0], rank, i);"));
    CHECK(has(ks.source, "sj_store_as<T, float>(p.t[3], rank, i, t4);"));
    CHECK(has(ks.source, "sjf_tanh("));
    CHECK(has(ks.source, "(T(1) / (T(1) + sjf_exp(-x0)))"));  // sigmoid: literals in T
    CHECK(!has(ks.source, "Vectorized"));
    REQUIRE(ks.key.outputs.size() == 1);
    CHECK((ks.key.outputs[0].dtype == at::kFloat));
    CHECK(ks.key.outputs[0].rank == 2);

    // Half and bfloat16: stored 16-bit, computed in float; outputs keep the storage dtype.
    const auto half = fusion::generate(*g, metas(at::kHalf, {{8}, {8}, {8}}), fusion::DeviceKind::CUDA);
    CHECK(has(half.source, "typedef float T;"));
    CHECK(has(half.source, "sj_load_as<T, sj_half>"));
    CHECK(has(half.source, "sj_store_as<T, sj_half>"));
    CHECK((half.key.outputs[0].dtype == at::kHalf));
    const auto bf16 = fusion::generate(*g, metas(at::kBFloat16, {{8}, {8}, {8}}), fusion::DeviceKind::CUDA);
    CHECK(has(bf16.source, "sj_load_as<T, sj_bfloat16>"));
    CHECK((fusion::output_dtypes(*g, metas(at::kBFloat16, {{8}, {8}, {8}}), fusion::DeviceKind::CUDA) ==
           std::vector<at::ScalarType>{at::kBFloat16}));
    const auto dbl = fusion::generate(*g, metas(at::kDouble, {{8}, {8}, {8}}), fusion::DeviceKind::CUDA);
    CHECK(has(dbl.source, "typedef double T;"));

    // The CPU dialect of the same group is the Vectorized kernel, and refuses half.
    const auto cpu = fusion::generate(*g, metas(at::kFloat, {{8}, {8}, {8}}), fusion::DeviceKind::CPU);
    CHECK(has(cpu.source, "sjk::elementwise<T"));
    CHECK_THROWS_WITH_AS(fusion::generate(*g, metas(at::kHalf, {{8}, {8}, {8}}), fusion::DeviceKind::CPU),
                         doctest::Contains("is not float or double (CPU dialect)"), stagejit::FusionError);
  }

  TEST_CASE("generate, CUDA dialect: special values, predicates and pow follow ATen's CUDA kernels") {
    auto sv = ir::parse(special_values_group);
    const auto s = fusion::generate(*sv, metas(at::kFloat, {{12}, {12}}), fusion::DeviceKind::CUDA).source;
    CHECK(has(s, "((x0 != x0 || x0 > x1) ? x0 : x1)"));  // maximum keeps a NaN of either side
    CHECK(has(s, "sj_clamp_max(sj_clamp_min(x0, T(-1)), T(2))"));
    CHECK(has(s, "sj_clamp_min(x0, T(0))"));  // relu
    CHECK(has(s, "(t6 * T(1.5))"));           // scalar mul: a literal in T
    auto pg = ir::parse(predicates_group);
    const auto ks = fusion::generate(*pg, metas(at::kDouble, {{6, 5}, {5}}), fusion::DeviceKind::CUDA);
    const std::string& p = ks.source;
    CHECK(has(p, "T(x0 > x1)"));
    CHECK(has(p, "(t0 != T(0) ? x0 : x1)"));             // where
    CHECK(has(p, "(t2 != T(0) ? T(-7) : t1)"));          // masked_fill
    CHECK(has(p, "(t3 - T(2) * x1)"));                   // sub with alpha
    CHECK(has(p, "(t4 * t4)"));                          // pow 2
    CHECK(has(p, "sjf_pow(x0, T(2.5))"));                // pow 2.5
    CHECK(has(p, "sjf_rsqrt(t10)"));                     // rsqrt and pow -0.5
    CHECK(has(p, "(x0 <= T(0.10000000000000001) ? T(20) : x0)"));  // threshold
    CHECK(has(p, "(T(1) - x0)"));                        // rsub, scalar form
    // Bool outputs are stored as bool.
    CHECK(has(p, "sj_store_as<T, bool>(p.t[2], rank, i, t0);"));
    CHECK((ks.key.outputs[0].dtype == at::kBool));
    CHECK((ks.key.outputs[1].dtype == at::kDouble));
    CHECK(fusion::detail::literal(std::numeric_limits<double>::quiet_NaN(), true) == "sj_nan<T>()");
    CHECK(fusion::detail::literal(-std::numeric_limits<double>::infinity(), true) == "(-sj_inf<T>())");
  }

  TEST_CASE("generate, CUDA dialect: refusals name the op, dtype or limit") {
    auto to = ir::parse(R"(graph(%a : Float(4)) {
  %0 : Double(4) = to[dtype=7](%a);
  %1 : Double(4) = exp(%0);
  return (%1);
}
)");
    CHECK_THROWS_WITH_AS(fusion::generate(*to, metas(at::kFloat, {{4}}), fusion::DeviceKind::CUDA),
                         doctest::Contains("op 'to'"), stagejit::FusionError);
    auto g = ir::parse(tanh_sigmoid_group);
    CHECK_THROWS_WITH_AS(fusion::generate(*g, metas(at::kLong, {{4}, {4}, {4}}), fusion::DeviceKind::CUDA),
                         doctest::Contains("not float, double, half or bfloat16"), stagejit::FusionError);
    // More tensors than one launch's argument pack holds (a sum of n inputs: n + 1 tensors).
    auto sum_of = [](int n) {
      std::string text = "graph(";
      for (int i = 0; i < n; ++i) text += std::string(i ? ", " : "") + "%x" + std::to_string(i) + " : Float(4)";
      text += ") {\n  %s0 : Float(4) = add(%x0, %x1);\n";
      for (int i = 2; i < n; ++i)
        text += "  %s" + std::to_string(i - 1) + " : Float(4) = add(%s" + std::to_string(i - 2) + ", %x" +
                std::to_string(i) + ");\n";
      return ir::parse(text + "  return (%s" + std::to_string(n - 2) + ");\n}\n");
    };
    const int n = fusion::kMaxCudaArgs;
    auto wide = sum_of(n);
    CHECK_THROWS_WITH_AS(
        fusion::generate(*wide, metas(at::kFloat, std::vector<std::vector<int64_t>>(n, {4})), fusion::DeviceKind::CUDA),
        doctest::Contains(("a CUDA kernel takes at most " + std::to_string(n) + " tensors").c_str()), stagejit::FusionError);
    // The CPU dialect has no such limit.
    CHECK_NOTHROW(fusion::generate(*wide, metas(at::kFloat, std::vector<std::vector<int64_t>>(n, {4})),
                                   fusion::DeviceKind::CPU));
    // 40 tensors (beyond the classic 4 KiB of kernel parameters) are one launch's pack.
    auto forty = sum_of(39);
    const auto ks = fusion::generate(*forty, metas(at::kFloat, std::vector<std::vector<int64_t>>(39, {4})),
                                     fusion::DeviceKind::CUDA);
    CHECK(has(ks.source, "stagejit_Args<40> p"));
    if (fusion::nvrtc_available())
      CHECK(has(fusion::compile_to_ptx(fusion::cuda_prelude() + ks.source), ".entry stagejit_fused("));
  }

  TEST_CASE("plan_group routes by device: mixed devices are refused at plan time naming the group") {
    auto g = ir::parse(tanh_sigmoid_group);
    const std::string text = ir::to_string(*g);
    std::vector<at::Tensor> mixed = {at::randn({4}), at::empty({4}, at::TensorOptions().device(at::kMeta)),
                                     at::randn({4})};
    auto plan = fusion::detail::plan_group(*g, text, mixed, {}, "fusion_group_3 of stage 0");
    CHECK(plan.kernel == nullptr);
    CHECK(plan.cuda_kernel == nullptr);
    CHECK(has(plan.fallback, "fusion_group_3 of stage 0: inputs on more than one device (input 0 on cpu, input 1 "
                             "on meta)"));
    // One device that has no dialect.
    auto meta = fusion::detail::plan_group(*g, text, metas(at::kFloat, {{4}, {4}, {4}}), {}, "g");
    CHECK(has(meta.fallback, "no fused kernels on device meta"));
    // CPU tensors: the CPU dialect and backend.
    auto cpu = fusion::detail::plan_group(*g, text, {at::randn({4}), at::randn({4}), at::randn({4})}, {}, "g");
    CHECK(cpu.fallback == "");
    CHECK(cpu.kernel != nullptr);
    CHECK((cpu.device == at::Device(at::kCPU)));
  }

  TEST_CASE("generate, CUDA dialect: the activations of the ops for models follow ATen's CUDA kernels") {
    auto g = ir::parse(activations_group);
    const auto s = fusion::generate(*g, metas(at::kFloat, {{12}, {12}}), fusion::DeviceKind::CUDA).source;
    CAPTURE(s);
    CHECK(has(s, "(x0 * T(0.5) * (T(1) + sjf_erf(x0 * T(0.70710678118654757))))"));  // exact gelu
    CHECK(has(s, "sjf_tanh(T(0.79788456080286541) * (x0 + T(0.044714999999999998) * (x0 * x0 * x0)))"));
    CHECK(has(s, "sjf_erf(x0)"));
    CHECK(has(s, "(x0 / (T(1) + sjf_exp(-x0)))"));  // silu
    CHECK(has(s, "(x1 * T(2) > T(1) ? x1 : sjf_log1p(sjf_exp(x1 * T(2))) / T(2))"));  // softplus
    CHECK(has(s, "(x1 <= T(0) ? (sjf_exp(x1) - T(1)) * T(1.5) : x1)"));  // elu
    CHECK(has(s, "(x1 > T(0) ? x1 : x1 * T(0.20000000000000001))"));  // leaky_relu
    auto bad = ir::parse(R"(graph(%x : Float(4)) {
  %0 : Float(4) = gelu[approximate="erf"](%x);
  return (%0);
}
)");
    CHECK_THROWS_WITH_AS(fusion::generate(*bad, metas(at::kFloat, {{4}}), fusion::DeviceKind::CUDA),
                         doctest::Contains("attribute 'approximate' of op 'gelu'"), stagejit::FusionError);
  }

  TEST_CASE("NVRTC compiles the CUDA dialect of every test group to PTX, in float, double, half and bfloat16" *
            doctest::skip(!fusion::nvrtc_available())) {
    MESSAGE("NVRTC " << fusion::nvrtc_version());
    struct Case {
      const std::string* text;
      std::vector<std::vector<int64_t>> shapes;
    };
    const std::vector<Case> cases = {{&tanh_sigmoid_group, {{16, 4}, {4}, {16, 1}}},
                                     {&special_values_group, {{12}, {12}}},
                                     {&predicates_group, {{6, 5}, {5}}},
                                     {&activations_group, {{12}, {12}}}};
    for (const auto& c : cases) {
      auto g = ir::parse(*c.text);
      for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
        const std::string dtype_name = c10::toString(dtype);
        CAPTURE(dtype_name);
        const auto ks = fusion::generate(*g, metas(dtype, c.shapes), fusion::DeviceKind::CUDA);
        const std::string ptx = fusion::compile_to_ptx(fusion::cuda_prelude() + ks.source);
        CHECK(has(ptx, ".entry stagejit_fused("));
      }
    }
  }
}

TEST_SUITE("fusion") {
  // The suite-wide check (every group any test fuses) is reported by main(); this shows
  // it is on in this run, or says why not.
  TEST_CASE("the PTX check of every fused group of the run is installed under meson test") {
    const char* env = std::getenv("STAGEJIT_PTX_CHECK");
    if (!env || std::string(env) != "1") {
      MESSAGE("STAGEJIT_PTX_CHECK is not 1: fused groups of this run are not compiled with NVRTC");
      return;
    }
    if (!fusion::nvrtc_available()) {
      MESSAGE("NVRTC is not available: the PTX check of fused groups is skipped");
      return;
    }
    auto g = ir::parse(tanh_sigmoid_group);
    const auto before = stagejit::testing::ptx_check_counts();
    // A signature no other test uses: one new group signature, compiled as float, double and half.
    fusion::run_fused(*g, {at::randn({3, 1, 7}), at::randn({7}), at::randn({1, 5, 1})});
    const auto after = stagejit::testing::ptx_check_counts();
    CHECK(after.groups == before.groups + 1);
    CHECK(after.sources >= before.sources);  // sources depend on the dtypes, not the sizes
    CHECK(after.failures == before.failures);
  }
}
