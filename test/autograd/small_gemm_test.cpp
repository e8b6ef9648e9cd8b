// Thin matrix products through LIBXSMM (ops/small_gemm.hpp) against ATen's mm, for every
// layout the kernels read in place, tails of both blockings, both dtypes, and the shapes
// they must refuse; wide float products through oneDNN; and the mm / addmm ops that use
// them, with their gradients.
#include <stagejit/stagejit.hpp>
#include <stagejit/ops/small_gemm.hpp>

#include <ATen/record_function.h>

#include <array>
#include <atomic>
#include <string_view>
#include <stagejit/testing/doctest.hpp>

#include "oracle.hpp"

namespace sj = stagejit;

namespace {

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

// A product LIBXSMM refuses: taken by oneDNN (and equal to ATen's) when it is float, not
// thin (K, N <= 64 or M, N <= 64), with at least 2^20 multiply-adds, and oneDNN is built
// in; refused otherwise.
void check_refused_unless_dnnl(const at::Tensor& a, const at::Tensor& b) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const bool thin = (K <= 64 && N <= 64) || (M <= 64 && N <= 64);
  const bool dnnl = a.scalar_type() == at::kFloat && sj::ops::dnnl_mm_enabled() && !thin && M * K * N >= (int64_t{1} << 20);
  auto p = sj::ops::small_mm(a, b);
  CHECK(p.has_value() == dnnl);
  if (p) CHECK(rel_diff(*p, at::mm(a, b)) <= 1e-5);
}

}  // namespace

TEST_SUITE("autograd") {

TEST_CASE("small_mm equals ATen's mm for thin and medium products in every dense layout") {
  at::manual_seed(11);
  if (!sj::ops::small_mm_enabled()) {
    MESSAGE("stagejit built without LIBXSMM (or STAGEJIT_SMALL_GEMM=0): small_mm refuses every thin shape");
    CHECK_FALSE(sj::ops::small_mm(at::randn({512, 8}), at::randn({8, 8})).has_value());
    return;
  }
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-12;
    CAPTURE(dtype);
    // Tall: [M, K] x [K, N], M a multiple of the 64-row block and not.
    for (int64_t M : {256, 1000, 10000}) {
      for (int64_t K : {1, 20, 64}) {
        CAPTURE(M);
        CAPTURE(K);
        at::Tensor a = at::randn({M, K}, dtype), w = at::randn({K, 20}, dtype);
        auto p = sj::ops::small_mm(a, w);
        REQUIRE(p.has_value());
        CHECK(p->is_contiguous());
        CHECK(rel_diff(*p, at::mm(a, w)) <= tol);
        // B read transposed (a transposed view of a contiguous [N, K]).
        at::Tensor wt = at::randn({20, K}, dtype).t();
        REQUIRE(sj::ops::small_mm(a, wt).has_value());
        CHECK(rel_diff(*sj::ops::small_mm(a, wt), at::mm(a, wt)) <= tol);
        // A read transposed, and A with a leading dimension larger than K.
        at::Tensor at_ = at::randn({K, M}, dtype).t();
        CHECK(rel_diff(*sj::ops::small_mm(at_, w), at::mm(at_, w)) <= tol);
        at::Tensor wide = at::randn({M, K + 5}, dtype).narrow(1, 2, K);
        CHECK(rel_diff(*sj::ops::small_mm(wide, w), at::mm(wide, w)) <= tol);
      }
    }
    // Reduction: [M, K] x [K, N] with K long (a weight gradient h^T g), K a multiple of
    // the 256 block and not.
    for (int64_t K : {256, 1000, 10000}) {
      CAPTURE(K);
      at::Tensor h = at::randn({K, 20}, dtype), g = at::randn({K, 7}, dtype);
      auto p = sj::ops::small_mm(h.t(), g);
      REQUIRE(p.has_value());
      CHECK(rel_diff(*p, at::mm(h.t(), g)) <= tol);
      // A `g` with dense columns is copied whole first: taken while it is at most 32 KiB
      // (a classifier's W^T), left to ATen past that (a thin product: never oneDNN).
      at::Tensor gt = at::randn({7, K}, dtype).t();
      if (K * 7 * gt.element_size() <= 32 * 1024) {
        auto q = sj::ops::small_mm(h.t(), gt);
        REQUIRE(q.has_value());
        CHECK(rel_diff(*q, at::mm(h.t(), gt)) <= tol);
      } else {
        check_refused_unless_dnnl(h.t(), gt);
      }
    }
    // Medium (Note [Medium products]): layers of 128-256 units on 128 to 2 000 rows, with
    // a row count that is not a multiple of the 64-row block; B read transposed (W^T,
    // copied dense) and A read transposed (a weight gradient h^T g, K <= 512).
    for (auto [M, K, N] : {std::array<int64_t, 3>{128, 256, 10}, {512, 256, 256}, {1000, 128, 128},
                           {2000, 64, 256}, {130, 200, 100}}) {
      CAPTURE(M);
      CAPTURE(K);
      CAPTURE(N);
      at::Tensor a = at::randn({M, K}, dtype), w = at::randn({K, N}, dtype);
      if (K * N * int64_t(a.element_size()) > 512 * 1024) continue;
      auto p = sj::ops::small_mm(a, w);
      REQUIRE(p.has_value());
      CHECK(p->is_contiguous());
      CHECK(rel_diff(*p, at::mm(a, w)) <= tol);
      at::Tensor wt = at::randn({N, K}, dtype).t();
      REQUIRE(sj::ops::small_mm(a, wt).has_value());
      CHECK(rel_diff(*sj::ops::small_mm(a, wt), at::mm(a, wt)) <= tol);
      if (K <= 512) {
        at::Tensor at_ = at::randn({K, M}, dtype).t();
        REQUIRE(sj::ops::small_mm(at_, w).has_value());
        CHECK(rel_diff(*sj::ops::small_mm(at_, w), at::mm(at_, w)) <= tol);
      }
    }
    // B over 512 KiB and under 1 MiB (past it oneDNN takes float products) with A's rows
    // at most 2 KiB: passes over column blocks (256 float columns at K = 512, so N = 300
    // and 400 leave tail blocks of 44 and 144; rows not a multiple of 64), A by rows and
    // W^T copied dense; not with A transposed.
    if (dtype == at::kFloat) {
      for (int64_t N : {300, 400}) {
        CAPTURE(N);
        at::Tensor a = at::randn({1000, 512}, dtype), w = at::randn({512, N}, dtype);
        auto p = sj::ops::small_mm(a, w);
        REQUIRE(p.has_value());
        CHECK(rel_diff(*p, at::mm(a, w)) <= tol);
        at::Tensor wt = at::randn({N, 512}, dtype).t();
        REQUIRE(sj::ops::small_mm(a, wt).has_value());
        CHECK(rel_diff(*sj::ops::small_mm(a, wt), at::mm(a, wt)) <= tol);
        check_refused_unless_dnnl(at::randn({512, 1000}, dtype).t(), w);
      }
    }
    // Past the medium bounds: rows of A over 2 KiB, A transposed with K
    // over 512, under 128 rows.
    const int64_t wide = dtype == at::kFloat ? 512 : 256;
    check_refused_unless_dnnl(at::randn({1000, 2 * wide}, dtype), at::randn({2 * wide, wide}, dtype));
    check_refused_unless_dnnl(at::randn({1024, 256}, dtype).t(), at::randn({1024, 64}, dtype));
    check_refused_unless_dnnl(at::randn({100, 128}, dtype), at::randn({128, 128}, dtype));
  }
  // Refused: small or square shapes, broadcast (stride-0) operands, other dtypes, mixed
  // dtypes, operands that require grad, non-2-D operands.
  CHECK_FALSE(sj::ops::small_mm(at::randn({100, 20}), at::randn({20, 20})).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({64, 64}), at::randn({64, 64})).has_value());  // under 2^20 multiply-adds
  CHECK_FALSE(sj::ops::small_mm(at::randn({20}).expand({1000, 20}), at::randn({20, 512})).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({512, 512}, at::kDouble), at::randn({512, 512}, at::kDouble)).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({20}).expand({1000, 20}), at::randn({20, 20})).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 20}).to(at::kHalf), at::randn({20, 20}).to(at::kHalf)).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 20}), at::randn({20, 20}, at::kDouble)).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 20}).set_requires_grad(true), at::randn({20, 20})).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({2, 1000, 20}), at::randn({20, 20})).has_value());
}

TEST_CASE("small_mm runs wide float products through oneDNN, equal to ATen's mm in every dense layout") {
  at::manual_seed(12);
  if (!sj::ops::dnnl_mm_enabled()) {
    MESSAGE("stagejit built without oneDNN (or STAGEJIT_DNNL_SGEMM=0): wide products go to ATen");
    CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 1024}), at::randn({1024, 1024})).has_value());
    return;
  }
  // Layers of 512 and 1 024 units (B 1 MiB and more), the weight gradients h^T g of
  // layers LIBXSMM leaves to ATen (K = 2 000 rows, and a first layer of 32 inputs), row
  // counts that are no multiple of any block.
  for (auto [M, K, N] : {std::array<int64_t, 3>{2000, 512, 512}, {1000, 1024, 1024}, {333, 768, 200},
                         {512, 2000, 512}, {32, 2000, 512}, {256, 1999, 130}}) {
    CAPTURE(M);
    CAPTURE(K);
    CAPTURE(N);
    const at::Tensor w = at::randn({K, N}), wt = at::randn({N, K}).t();
    const at::Tensor a = at::randn({M, K}), at_ = at::randn({K, M}).t();
    const at::Tensor padded = at::randn({M, K + 3}).narrow(1, 1, K);  // lda = K + 3
    for (const at::Tensor* x : {&a, &at_, &padded})
      for (const at::Tensor* y : {&w, &wt}) {
        auto p = sj::ops::small_mm(*x, *y);
        REQUIRE(p.has_value());
        CHECK(p->is_contiguous());
        CHECK((p->scalar_type() == at::kFloat));
        CHECK(rel_diff(*p, at::mm(*x, *y)) <= 1e-5);
      }
    // Doubles stay with ATen (oneDNN has no dgemm) unless LIBXSMM's medium blocks take them.
    if (K * N * 8 > 512 * 1024)
      CHECK_FALSE(sj::ops::small_mm(a.to(at::kDouble), w.to(at::kDouble)).has_value());
  }
  // Padded leading dimensions of column-dense operands (lda > M, ldb > K), a B with a
  // storage offset, M = 1 (exactly 2^20 multiply-adds) and N = 1 (a column slice).
  {
    const at::Tensor a = at::randn({700, 600 + 3}).narrow(1, 1, 600).t();  // [600, 700], ld 603
    const at::Tensor b = at::randn({900, 700 + 5}).narrow(1, 2, 700).t();  // [700, 900], ld 705
    const at::Tensor bo = at::randn({701 * 900}).narrow(0, 900, 700 * 900).view({700, 900});
    for (const at::Tensor* y : {&b, &bo}) {
      auto p = sj::ops::small_mm(a, *y);
      REQUIRE(p.has_value());
      CHECK(rel_diff(*p, at::mm(a, *y)) <= 1e-5);
    }
    const at::Tensor row = at::randn({1, 1024}), w = at::randn({1024, 1024});
    REQUIRE(sj::ops::small_mm(row, w).has_value());
    CHECK(rel_diff(*sj::ops::small_mm(row, w), at::mm(row, w)) <= 1e-5);
    const at::Tensor x = at::randn({2000, 2000}), col = at::randn({2000, 3}).narrow(1, 1, 1);
    REQUIRE(sj::ops::small_mm(x, col).has_value());
    CHECK(rel_diff(*sj::ops::small_mm(x, col), at::mm(x, col)) <= 1e-5);
  }
  // A thin product LIBXSMM refuses (a reduction whose B, read transposed, is over 32 KiB)
  // goes to ATen, not to oneDNN.
  CHECK_FALSE(sj::ops::small_mm(at::randn({10000, 20}).t(), at::randn({7, 10000}).t()).has_value());
  // An operand with neither dense rows nor dense columns is left to ATen.
  CHECK_FALSE(sj::ops::small_mm(at::randn({2000, 1024}).slice(1, 0, 1024, 2), at::randn({512, 512})).has_value());
  // The mm op (eager autograd) through it: values and gradients equal libtorch's, and its
  // three products (y, and both gradients) all ran as stagejit::small_mm.
  const at::Tensor xa = at::randn({600, 512}), wa = at::randn({512, 512});
  sj::Variable x(xa.clone(), true), wv(wa.clone(), true);
  static std::atomic<int> ours{0}, atens{0};
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        const std::string_view name = fn.name();
        if (name == "stagejit::small_mm") ++ours;
        if (name == "aten::mm") ++atens;
        return nullptr;
      }));
  ours = 0;
  atens = 0;
  auto y = sj::mm(x, wv);
  auto g = sj::grad({sj::sum(sj::mul(y, y))}, {x, wv});
  at::removeCallback(handle);
  CHECK(ours.load() == 3);
  CHECK(atens.load() == 0);
  auto tx = xa.clone().set_requires_grad(true), tw = wa.clone().set_requires_grad(true);
  auto ty = torch::mm(tx, tw);
  auto tg = torch::autograd::grad({(ty * ty).sum()}, {tx, tw});
  CHECK(rel_diff(y.data(), ty.detach()) <= 1e-5);
  CHECK(rel_diff(g[0].data(), tg[0]) <= 1e-5);
  CHECK(rel_diff(g[1].data(), tg[1]) <= 1e-5);
}

TEST_CASE("mm and addmm on thin shapes: values and gradients equal libtorch's") {
  at::manual_seed(12);
  at::Tensor x = at::randn({1000, 20}, at::kDouble), w = at::randn({20, 10}, at::kDouble),
             b = at::randn({10}, at::kDouble);
  for (double beta : {1.0, 0.5, 0.0}) {
    CAPTURE(beta);
    sj::Variable sx(x, true), sw(w, true), sb(b, true);
    auto y = sj::addmm(sb, sx, sw, beta, 2.0);
    auto loss = sj::sum(sj::tanh(sj::mm(y, sj::t(sw))));
    auto g = sj::grad({loss}, {sx, sw, sb});
    auto tx = x.clone().set_requires_grad(true), tw = w.clone().set_requires_grad(true),
         tb = b.clone().set_requires_grad(true);
    auto ty = torch::addmm(tb, tx, tw, beta, 2.0);
    auto tl = torch::tanh(torch::mm(ty, tw.t())).sum();
    auto tg = torch::autograd::grad({tl}, {tx, tw, tb}, {}, false, true);
    CHECK(rel_diff(y.data(), ty.detach()) <= 1e-12);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      if (!tg[i].defined()) {
        CHECK((!g[i].defined() || g[i].data().abs().max().item<double>() == 0));
        continue;
      }
      CHECK(rel_diff(g[i].data(), tg[i]) <= 1e-10);
    }
  }
}

}  // TEST_SUITE
