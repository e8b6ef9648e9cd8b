// fusion::generate + run_fused: generated CPU kernels against ATen eager run node by node
// (ops::run_forward through run_unfused), shapes, layouts, dtypes, special values, and
// the fallback when no compiler is available.
#include <ATen/Parallel.h>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/testing/doctest.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include "check_close.hpp"
#include "groups.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include <unistd.h>

namespace ir = stagejit::ir;
namespace fusion = stagejit::fusion;

namespace {

using stagejit::testing::check_close;

/// Runs the subgraph fused (asserting the kernel ran) and node by node; compares. The fused
/// outputs are contiguous, or with `layout_of_inputs` have the strides of `inputs[0]` (every
/// full-size input sharing one permuted dense layout, as ATen's outputs follow it).
void check_group(const std::string& text, const std::vector<at::Tensor>& inputs, bool layout_of_inputs = false) {
  auto g = ir::parse(text);
  std::string reason = "unset";
  auto got = fusion::run_fused(*g, inputs, {nullptr, "test group", &reason});
  CHECK_MESSAGE(reason == "", reason);
  auto want = fusion::run_unfused(*g, inputs);
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    if (layout_of_inputs)
      CHECK(got[i].strides() == inputs[0].strides());
    else
      CHECK(got[i].is_contiguous());
    check_close(got[i], want[i]);
  }
}

const std::string& tanh_sigmoid = stagejit::fusion::testing::tanh_sigmoid_group;  // groups.hpp

}  // namespace

TEST_SUITE("fusion") {
  TEST_CASE("generate: float math uses T literals and the Vectorized kernel ABI") {
    auto g = ir::parse(R"(graph(%a : Float(4)) {
  %0 : Float(4) = mul[other=2](%a);
  %1 : Float(4) = rsub[other=1.5, alpha=1](%0);
  return (%1);
}
)");
    auto ks = fusion::generate(*g, {at::ones({4})});
    CHECK(ks.source.find("using T = float;") != std::string::npos);
    CHECK(ks.source.find("V(T(2))") != std::string::npos);
    CHECK(ks.source.find("V(T(1.5))") != std::string::npos);
    CHECK(ks.source.find("sjk::elementwise<T, sjk::types<float>, sjk::types<float>>") != std::string::npos);
    CHECK(ks.key.inputs.size() == 1);
    CHECK(ks.key.outputs.size() == 1);
    CHECK_THROWS_AS(fusion::generate(*g, {at::ones({4}, at::kLong)}), stagejit::FusionError);
    CHECK_THROWS_AS(fusion::generate(*g, {}), stagejit::FusionError);
  }

  TEST_CASE("run_fused: tanh(a*b + c) * sigmoid(a) in float and double, over shapes and layouts") {
    at::manual_seed(1);
    for (auto dtype : {at::kFloat, at::kDouble}) {
      CAPTURE(dtype);
      auto o = at::TensorOptions().dtype(dtype);
      check_group(tanh_sigmoid, {at::randn({1000}, o), at::randn({1000}, o), at::randn({1000}, o)});
      // broadcast [16, 1] x [4]
      check_group(tanh_sigmoid, {at::randn({16, 1}, o), at::randn({4}, o), at::randn({16, 4}, o)});
      // transposed and expanded inputs
      check_group(tanh_sigmoid, {at::randn({4, 16}, o).t(), at::randn({16, 4}, o), at::randn({1, 4}, o).expand({16, 4})});
      check_group(tanh_sigmoid, {at::randn({5, 7, 3}, o).permute({2, 0, 1}), at::randn({7}, o), at::randn({3, 5, 7}, o)});
      // every full-size input transposed alike (a weight gradient summed from transposed
      // products): the outputs take that layout, and the kernel runs it as one row
      check_group(tanh_sigmoid, {at::randn({4, 16}, o).t(), at::randn({4, 16}, o).t(), at::randn({4, 16}, o).t()}, true);
      check_group(tanh_sigmoid, {at::randn({37, 21}, o).t(), at::randn({21}, o).unsqueeze(1), at::randn({37, 21}, o).t()}, true);
      check_group(tanh_sigmoid, {at::randn({5, 7, 3}, o).permute({2, 0, 1}), at::randn({5, 7, 3}, o).permute({2, 0, 1}),
                                 at::randn({7}, o)}, true);
      // 0-dim and empty
      check_group(tanh_sigmoid, {at::randn({}, o), at::randn({}, o), at::randn({}, o)});
      check_group(tanh_sigmoid, {at::randn({0, 4}, o), at::randn({4}, o), at::randn({0, 4}, o)});
      // an output shape check: 0-dim with a vector broadcasts to the vector
      auto out = fusion::run_fused(*ir::parse(tanh_sigmoid), {at::randn({}, o), at::randn({3}, o), at::randn({}, o)});
      CHECK(out[0].sizes() == at::IntArrayRef({3}));
    }
  }

  TEST_CASE("run_fused: NaN and infinities through maximum/minimum/clamp/relu, saturating tanh/sigmoid, 1.5 / x") {
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    const std::vector<double> vals = {nan, inf, -inf, 0.0, -0.0, 1.0, -2.5, 50, -50, -100, 3e38, 1e-30};
    const std::string& text = stagejit::fusion::testing::special_values_group;  // groups.hpp
    for (auto dtype : {at::kFloat, at::kDouble}) {
      CAPTURE(dtype);
      auto x = at::tensor(vals, at::TensorOptions().dtype(at::kDouble)).to(dtype);
      auto y = x.flip({0});  // NaN meets finite values on both sides, inf meets -inf ...
      check_group(text, {x, y});
      check_group(text, {y, x});
    }
  }

  TEST_CASE("run_fused: the activations of the ops for models, on special values and random inputs") {
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    const std::vector<double> vals = {nan, inf, -inf, 0.0, -0.0, 1.0, -2.5, 50, -50, -100, 3e38, 1e-30};
    at::manual_seed(4);
    for (auto dtype : {at::kFloat, at::kDouble}) {
      CAPTURE(dtype);
      // Float without GELU: its known gap (fusion/detail/codegen_ops-inl.hpp, OpId::gelu).
      const std::string& text = dtype == at::kDouble ? stagejit::fusion::testing::activations_group
                                                     : stagejit::fusion::testing::activations_without_gelu_group;
      auto o = at::TensorOptions().dtype(dtype);
      auto x = at::tensor(vals, at::TensorOptions().dtype(at::kDouble)).to(dtype);
      auto y = x.flip({0});
      check_group(text, {x, y});
      check_group(text, {y, x});
      check_group(text, {at::randn({1000}, o) * 4, at::randn({1000}, o) * 4});
      check_group(text, {at::randn({16, 4}, o).t() * 4, at::randn({4, 16}, o) * 4});
    }
  }

  TEST_CASE("run_fused: comparisons give bool outputs, where/masked_fill read them; scalar forms; pow") {
    at::manual_seed(2);
    const std::string text = stagejit::fusion::testing::predicates_head + "  return (%0, %3, %5, %6, %8, %9);\n}\n";
    for (auto dtype : {at::kFloat, at::kDouble}) {
      CAPTURE(dtype);
      auto o = at::TensorOptions().dtype(dtype);
      check_group(text, {at::randn({6, 5}, o), at::randn({5}, o)});
      check_group(text, {at::rand({6, 5}, o), at::randn({5}, o)});
    }
  }

  TEST_CASE("run_fused: bool inputs and outputs of whole contiguous vectors (vector lanes) match ATen") {
    // Long contiguous bool tensors go through the prelude's bool_lanes_load/store (one
    // instruction per vector on AVX2 / AVX-512); the tail, short and strided ones through
    // the element loop. NaN, -0 and inf among the values; masks read back by where and
    // masked_fill, and combined by logical_and.
    at::manual_seed(4);
    const std::string text = R"(graph(%a : Float(8), %b : Float(8), %m : Bool(8)) {
  %0 : Bool(8) = gt(%a, %b);
  %1 : Float(8) = where(%m, %a, %b);
  %2 : Bool(8) = logical_and(%0, %m);
  %3 : Float(8) = masked_fill[value=-7](%1, %2);
  %4 : Bool(8) = ne[other=0](%a);
  return (%0, %2, %3, %4);
}
)";
    for (auto dtype : {at::kFloat, at::kDouble}) {
      CAPTURE(dtype);
      auto o = at::TensorOptions().dtype(dtype);
      for (int64_t n : {int64_t(8), int64_t(16), int64_t(1003)}) {
        CAPTURE(n);
        at::Tensor a = at::randn({n}, o), b = at::randn({n}, o);
        a.index_put_({0}, NAN);
        a.index_put_({1}, -0.0);
        a.index_put_({2}, INFINITY);
        a.index_put_({3}, 0.0);
        b.index_put_({4}, NAN);
        const at::Tensor m = at::rand({n}) > 0.5;
        check_group(text, {a, b, m});
        check_group(text, {a.slice(0, 0, n, 2), b.slice(0, 0, n, 2), m.slice(0, 0, n, 2)});
      }
    }
  }

  TEST_CASE("run_fused: outputs of different shapes, mixed dtypes and missing compilers fall back op by op") {
    at::manual_seed(3);
    auto g = ir::parse(tanh_sigmoid);
    std::vector<at::Tensor> in = {at::randn({8}), at::randn({8}), at::randn({8})};

    // A backend whose compiler does not exist: FusionError, fallback, one warning.
    fusion::CpuBackendOptions opts = fusion::CpuBackendOptions::from_environment();
    opts.compiler = {"/nonexistent/c++"};
    opts.cache_dir = std::filesystem::temp_directory_path() / ("stagejit-codegen-nocxx-" + std::to_string(::getpid()));
    fusion::CpuBackend broken(opts);
    std::ostringstream captured;
    auto* old = std::cerr.rdbuf(captured.rdbuf());
    std::string reason;
    std::vector<at::Tensor> got, got2;
    try {
      got = fusion::run_fused(*g, in, {&broken, "fusion_group_7", &reason});
      got2 = fusion::run_fused(*g, in, {&broken, "fusion_group_7", nullptr});
    } catch (...) {
      std::cerr.rdbuf(old);
      throw;
    }
    std::cerr.rdbuf(old);
    std::filesystem::remove_all(opts.cache_dir);
    CHECK(reason != "");
    const std::string warning = captured.str();
    CHECK(warning.find("fusion_group_7") != std::string::npos);
    CHECK(warning.find("fusion_group_7", warning.find("fusion_group_7") + 1) == std::string::npos);  // once
    auto want = fusion::run_unfused(*g, in);
    check_close(got[0], want[0]);
    check_close(got2[0], want[0]);
    // The oracle itself is ATen eager.
    check_close(want[0], at::tanh(in[0] * in[1] + in[2]) * at::sigmoid(in[0]));

    // Mixed float/double inputs: op-by-op promotion, no kernel.
    std::vector<at::Tensor> mixed = {at::randn({8}), at::randn({8}, at::kDouble), at::randn({8})};
    reason.clear();
    auto m = fusion::run_fused(*g, mixed, {nullptr, "mixed", &reason});
    CHECK(reason.find("mixed") != std::string::npos);
    check_close(m[0], at::tanh(mixed[0] * mixed[1] + mixed[2]) * at::sigmoid(mixed[0]));

    // Arguments the launch cannot take (9 dimensions that do not merge: one input reversed,
    // one contiguous, so no layout is shared): op by op, and the reason is reported.
    auto nine = ir::parse(R"(graph(%a : Double(2, 2, 2, 2, 2, 2, 2, 2, 2), %b : Double(2, 2, 2, 2, 2, 2, 2, 2, 2)) {
  %0 : Double(2, 2, 2, 2, 2, 2, 2, 2, 2) = tanh(%a);
  %1 : Double(2, 2, 2, 2, 2, 2, 2, 2, 2) = mul(%0, %b);
  return (%1);
})");
    at::Tensor reversed = at::randn(std::vector<int64_t>(9, 2), at::kDouble).permute({8, 7, 6, 5, 4, 3, 2, 1, 0});
    at::Tensor plain = at::randn(std::vector<int64_t>(9, 2), at::kDouble);
    reason.clear();
    auto n9 = fusion::run_fused(*nine, {reversed, plain}, {nullptr, "nine", &reason});
    CHECK_MESSAGE(reason.find("dimensions") != std::string::npos, reason);
    check_close(n9[0], at::tanh(reversed) * plain);
    // Both reversed alike: the output takes their layout and the kernel runs it as one row.
    reason = "unset";
    auto r9 = fusion::run_fused(*nine, {reversed, reversed}, {nullptr, "nine reversed", &reason});
    CHECK_MESSAGE(reason == "", reason);
    check_close(r9[0], at::tanh(reversed) * reversed);

    // An output smaller than the iteration shape.
    auto two = ir::parse(R"(graph(%a : Float(4), %b : Float(3, 4)) {
  %0 : Float(4) = exp(%a);
  %1 : Float(3, 4) = mul(%0, %b);
  return (%0, %1);
}
)");
    std::vector<at::Tensor> ab = {at::randn({4}), at::randn({3, 4})};
    reason.clear();
    auto r = fusion::run_fused(*two, ab, {nullptr, "two shapes", &reason});
    CHECK(reason != "");
    check_close(r[0], at::exp(ab[0]));
    check_close(r[1], at::exp(ab[0]) * ab[1]);
  }
}

TEST_SUITE("fusion") {
  TEST_CASE("FusedGroup memoises one plan per input signature; results equal run_fused") {
    auto g = std::shared_ptr<const ir::Graph>(ir::parse(tanh_sigmoid));
    fusion::FusedGroup group(g, "memo group");
    at::manual_seed(3);
    for (int round = 0; round < 2; ++round) {
      // Contiguous, then a transposed layout, then another size: three signatures, each
      // planned once and reused the second round.
      std::vector<std::vector<at::Tensor>> calls = {
          {at::randn({4}), at::randn({4}), at::randn({4})},
          {at::randn({3, 5}).t(), at::randn({5, 3}), at::randn({3})},
          {at::randn({7}), at::randn({7}), at::randn({})}};
      for (const auto& in : calls) {
        auto got = group.run(in);
        auto want = fusion::run_unfused(*g, in);
        REQUIRE(got.size() == want.size());
        for (size_t i = 0; i < got.size(); ++i) check_close(got[i], want[i]);
      }
    }
    CHECK_THROWS_WITH_AS(group.run({at::randn({4})}), doctest::Contains("memo group has 3 inputs"),
                         stagejit::FusionError);
  }

  TEST_CASE("HostCachingAllocator: freed blocks of 64 KiB or more are reused, small ones are not cached") {
    auto& alloc = stagejit::memory::HostCachingAllocator::get();
    alloc.empty_cache();
    const auto before = alloc.stats();
    void* first = nullptr;
    {
      at::Tensor t = stagejit::memory::empty_cached({1 << 20}, at::kFloat);  // 4 MiB
      first = t.data_ptr();
      CHECK(reinterpret_cast<uintptr_t>(first) % 64 == 0);
      t.fill_(2.0f);
      CHECK(t.sum().item<double>() == doctest::Approx(2.0 * (1 << 20)));
      CHECK(alloc.stats().in_use_bytes >= before.in_use_bytes + (4u << 20));
    }
    CHECK(alloc.stats().cached_bytes >= (4u << 20));
    at::Tensor again = stagejit::memory::empty_cached({1024, 1024}, at::kFloat);  // same byte size
    CHECK(again.data_ptr() == first);
    CHECK(alloc.stats().hits == before.hits + 1);
    CHECK(again.sizes() == at::IntArrayRef({1024, 1024}));
    CHECK(again.is_contiguous());
    // Small tensors come from c10's allocator: nothing cached for them.
    const auto cached = alloc.stats().cached_bytes;
    { at::Tensor small = stagejit::memory::empty_cached({16}, at::kDouble); }
    CHECK(alloc.stats().cached_bytes == cached);
    // A capacity below the cached bytes releases them; freed blocks above it are not kept.
    const auto capacity = alloc.capacity();
    alloc.set_capacity(0);
    CHECK(alloc.stats().cached_bytes == 0);
    again = at::Tensor();
    CHECK(alloc.stats().cached_bytes == 0);
    alloc.set_capacity(capacity);
    // A size that cannot be rounded up is refused, not wrapped to a tiny block.
    CHECK_THROWS_AS(alloc.allocate(std::numeric_limits<std::size_t>::max() - 3), std::bad_alloc);
  }

  TEST_CASE("HostCacheScope routes ATen's large CPU allocations through the cache, only inside the scope") {
    auto& alloc = stagejit::memory::HostCachingAllocator::get();
    REQUIRE(stagejit::memory::install_host_cache());
    CHECK(stagejit::memory::install_host_cache());  // idempotent
    alloc.empty_cache();
    const auto before = alloc.stats();
    // Outside a scope: c10's default allocator, the cache is not involved.
    { at::Tensor t = at::empty({1 << 15}, at::kFloat); }  // 128 KiB
    CHECK(alloc.stats().misses == before.misses);
    CHECK(alloc.stats().cached_bytes == 0);
    void* first = nullptr;
    at::Tensor kept;
    {
      stagejit::memory::HostCacheScope scope;
      CHECK(stagejit::memory::HostCacheScope::active());
      {
        at::Tensor t = at::ones({256, 128}, at::kFloat);  // 128 KiB, made by an ATen op
        first = t.data_ptr();
        CHECK(reinterpret_cast<uintptr_t>(first) % 64 == 0);
        CHECK(alloc.stats().misses == before.misses + 1);
        CHECK(t.sum().item<double>() == 256.0 * 128.0);
      }
      CHECK(alloc.stats().cached_bytes == (128u << 10));
      kept = at::zeros({1 << 15}, at::kFloat);  // same byte size: the freed block again
      CHECK(kept.data_ptr() == first);
      CHECK(alloc.stats().hits == before.hits + 1);
      // Small tensors and raw allocations still work; raw blocks of either kind free.
      { at::Tensor small = at::ones({8}); CHECK(small.sum().item<double>() == 8.0); }
      c10::Allocator* cpu = c10::GetCPUAllocator();
      void* raw_big = cpu->raw_allocate(1 << 20);
      void* raw_small = cpu->raw_allocate(64);
      cpu->raw_deallocate(raw_big);
      cpu->raw_deallocate(raw_small);
      { stagejit::memory::HostCacheScope nested(false); CHECK(stagejit::memory::HostCacheScope::active()); }
    }
    CHECK_FALSE(stagejit::memory::HostCacheScope::active());
    // Growing it outside the scope allocates through the routing allocator, which is
    // outside a scope c10's own: the cache sees no new request.
    const auto misses = alloc.stats().misses;
    kept.resize_({1 << 17});
    CHECK(alloc.stats().misses == misses);
    // A block handed out inside the scope may be freed outside it.
    kept = at::Tensor();
    CHECK(alloc.stats().in_use_bytes == before.in_use_bytes);
    alloc.empty_cache();
    CHECK(alloc.stats().cached_bytes == 0);
  }

  TEST_CASE("run_fused: the prelude's float tanh is within 1 ulp of the correctly rounded tanh, keeps -0, and streams large outputs") {
    // Dense sweep over [-12, 12] plus special values (src/fusion_cpu_prelude.cpp).
    const std::string text = R"(graph(%x : Float(1)) {
  %0 : Float(1) = tanh(%x);
  %1 : Float(1) = neg(%0);
  return (%0, %1);
}
)";
    at::Tensor x = at::linspace(-12, 12, 400001, at::kFloat);
    x = at::cat({x, at::tensor({0.f, -0.f, 1e-30f, -1e-40f, 0.625f, -0.625f, 0.62499f, 9.f, 100.f}, at::kFloat)});
    auto g = ir::parse(text);
    std::string reason = "unset";
    auto got = fusion::run_fused(*g, {x}, {nullptr, "tanh sweep", &reason});
    CHECK_MESSAGE(reason == "", reason);
    const at::Tensor want = at::tanh(x);
    // Within 1 ulp of the correctly rounded tanh (double's, rounded to float). Not of
    // ATen's float tanh, which itself differs by version (libtorch 2.11's is up to 1 ulp
    // off the other way: 2 ulp from this one, measured on the GPU machine).
    const at::Tensor exact = at::tanh(x.to(at::kDouble)).to(at::kFloat);
    int64_t worst = 0;
    for (int64_t i = 0; i < x.numel(); ++i)
      worst = std::max(worst, stagejit::testing::ulps(got[0].data_ptr<float>()[i], exact.data_ptr<float>()[i]));
    CHECK(worst <= 1);
    // The kernels call the prelude's polynomial, not ATen's SLEEF tanh: on AVX2 / AVX-512
    // machines (where the prelude has it) some results are one ulp from ATen's (4.6 % of
    // this sweep).
    // A generated kernel's `sjf::tanh` that silently fell back to `Vectorized::tanh` (as it
    // did once the kernels got namespaces of their own) gives ATen's bits everywhere.
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      const int64_t differ = got[0].ne(want).sum().item<int64_t>();
      CHECK_MESSAGE(differ > 0, "fused float tanh gave ATen's bits at every one of ", x.numel(), " points");
    }
    const int64_t n = x.numel();
    CHECK(std::signbit(got[0].data_ptr<float>()[n - 8]));   // tanh(-0) = -0
    CHECK(!std::signbit(got[0].data_ptr<float>()[n - 9]));  // tanh(+0) = +0
    // Outputs of 4 MiB and more are written with streaming stores; an input slice at
    // an odd offset and two threads (chunks starting anywhere) exercise the peeling.
    const int threads = at::get_num_threads();
    at::set_num_threads(2);
    at::Tensor big = at::randn({(int64_t(1) << 20) + 7}, at::kFloat).mul_(3).slice(0, 3);
    got = fusion::run_fused(*g, {big}, {nullptr, "tanh big", &reason});
    at::set_num_threads(threads);
    CHECK_MESSAGE(reason == "", reason);
    const at::Tensor want_big = at::tanh(big.to(at::kDouble)).to(at::kFloat);
    worst = 0;
    for (int64_t i = 0; i < big.numel(); ++i) {
      worst = std::max(worst, stagejit::testing::ulps(got[0].data_ptr<float>()[i], want_big.data_ptr<float>()[i]));
      worst = std::max(worst, stagejit::testing::ulps(got[1].data_ptr<float>()[i], -want_big.data_ptr<float>()[i]));
    }
    CHECK(worst <= 1);
  }
}
