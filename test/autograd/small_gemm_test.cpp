// Thin matrix products through LIBXSMM (ops/small_gemm.hpp) against ATen's mm, for every
// layout the kernels read in place, tails of both blockings, both dtypes, and the shapes
// they must refuse; and the mm / addmm ops that use them, with their gradients.
#include <stagejit/stagejit.hpp>
#include <stagejit/ops/small_gemm.hpp>

#include <array>
#include <stagejit/testing/doctest.hpp>

#include "oracle.hpp"

namespace sj = stagejit;

namespace {

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

}  // namespace

TEST_SUITE("autograd") {

TEST_CASE("small_mm equals ATen's mm for thin and medium products in every dense layout") {
  at::manual_seed(11);
  if (!sj::ops::small_mm_enabled()) {
    MESSAGE("stagejit built without LIBXSMM (or STAGEJIT_SMALL_GEMM=0): small_mm refuses every shape");
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
      // (a classifier's W^T), left to ATen past that.
      at::Tensor gt = at::randn({7, K}, dtype).t();
      auto q = sj::ops::small_mm(h.t(), gt);
      if (K * 7 * gt.element_size() <= 32 * 1024) {
        REQUIRE(q.has_value());
        CHECK(rel_diff(*q, at::mm(h.t(), gt)) <= tol);
      } else {
        CHECK_FALSE(q.has_value());
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
    // B over 512 KiB with A's rows at most 2 KiB: passes over column blocks (256 float
    // columns at K = 512, so N = 600 leaves a tail block of 88; rows not a multiple of 64),
    // A by rows and W^T copied dense; not with A transposed.
    if (dtype == at::kFloat) {
      for (int64_t N : {512, 600}) {
        CAPTURE(N);
        at::Tensor a = at::randn({1000, 512}, dtype), w = at::randn({512, N}, dtype);
        auto p = sj::ops::small_mm(a, w);
        REQUIRE(p.has_value());
        CHECK(rel_diff(*p, at::mm(a, w)) <= tol);
        at::Tensor wt = at::randn({N, 512}, dtype).t();
        REQUIRE(sj::ops::small_mm(a, wt).has_value());
        CHECK(rel_diff(*sj::ops::small_mm(a, wt), at::mm(a, wt)) <= tol);
        CHECK_FALSE(sj::ops::small_mm(at::randn({512, 1000}, dtype).t(), w).has_value());
      }
    }
    // Past the medium bounds: rows of A over 2 KiB, A transposed with K
    // over 512, under 128 rows.
    const int64_t wide = dtype == at::kFloat ? 512 : 256;
    CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 2 * wide}, dtype), at::randn({2 * wide, wide}, dtype)).has_value());
    CHECK_FALSE(sj::ops::small_mm(at::randn({1024, 256}, dtype).t(), at::randn({1024, 64}, dtype)).has_value());
    CHECK_FALSE(sj::ops::small_mm(at::randn({100, 128}, dtype), at::randn({128, 128}, dtype)).has_value());
  }
  // Refused: small or square shapes, broadcast (stride-0) operands, other dtypes, mixed
  // dtypes, operands that require grad, non-2-D operands.
  CHECK_FALSE(sj::ops::small_mm(at::randn({100, 20}), at::randn({20, 20})).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({512, 512}, at::kDouble), at::randn({512, 512}, at::kDouble)).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({20}).expand({1000, 20}), at::randn({20, 20})).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 20}).to(at::kHalf), at::randn({20, 20}).to(at::kHalf)).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 20}), at::randn({20, 20}, at::kDouble)).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({1000, 20}).set_requires_grad(true), at::randn({20, 20})).has_value());
  CHECK_FALSE(sj::ops::small_mm(at::randn({2, 1000, 20}), at::randn({20, 20})).has_value());
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
