// The higher-order workloads of bench/workloads.md (test/support/higher_order.hpp, issue
// 32) at their small sizes: in every workload the staged compiled step (the network
// compiled with k derivatives), the whole-loss compiled step (the loss with its inner
// grads compiled with one derivative) and the stagejit eager step give libtorch's loss
// and gradients (max |x - ref| / max |ref| <= 1e-5 in float, 1e-10 in double). Each
// compiled mode runs four times on its compiled functions (the first call traces and
// runs op by op while the kernels build; the second runs the cached closure; the third
// and fourth run the backward stages ahead where the seeds repeat, Note [Anticipated
// stages]), and every call is checked.
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/higher_order.hpp"

#include <cmath>
#include <string>

namespace ho = stagejit::testing::higher_order;

namespace {

void check_workload(const std::string& name, at::ScalarType dtype) {
  const double tol = dtype == at::kFloat ? 1e-5 : 1e-10;
  auto w = ho::make_workload(name, dtype, /*small=*/true);
  const ho::Result ref = w->step(ho::Mode::Libtorch);
  REQUIRE(ref.grads.size() == w->weights().size());
  // The reference is not trivial: every weight matrix's gradient has a nonzero entry (a
  // bias's may be zero: the critic's last bias cancels between D(fake) and D(real)), the
  // loss is finite.
  CHECK(std::isfinite(ref.loss));
  for (std::size_t i = 0; i < ref.grads.size(); i += 2) CHECK(ref.grads[i].abs().max().item<double>() > 0);
  for (ho::Mode m : {ho::Mode::Staged, ho::Mode::WholeLoss, ho::Mode::Eager}) {
    const int calls = m == ho::Mode::Eager ? 1 : 4;
    for (int c = 0; c < calls; ++c) {
      CAPTURE(name);
      const std::string mode = ho::mode_name(m);
      CAPTURE(mode);
      CAPTURE(c);
      const ho::Result r = w->step(m);
      REQUIRE(r.grads.size() == ref.grads.size());
      for (std::size_t i = 0; i < r.grads.size(); ++i) {
        CHECK(bool(r.grads[i].scalar_type() == dtype));
        CHECK(r.grads[i].sizes() == ref.grads[i].sizes());
      }
      const double d = ho::max_rel_diff(r, ref);
      CHECK_MESSAGE(d <= tol, name, " ", ho::mode_name(m), " call ", c + 1, ": max relative difference to libtorch ",
                    d, " (loss ", r.loss, " vs ", ref.loss, ")");
    }
  }
  // The compiled functions traced once per mode and then hit their cache.
  CHECK(w->compiled_net().stats().misses >= 1);
  CHECK(w->compiled_loss().stats().misses == 1);
  CHECK(w->compiled_loss().stats().hits == 3);
  // The whole loss's backward (seeded by the implicit 1) ran ahead in the last two steps
  // and served them; so did the staged net's stages where the seeds repeat (every
  // workload but hvp and maml, whose stage 1 is seeded by the loss's gradient).
  const auto loss_stats = w->compiled_loss().closure_for(w->last_loss_inputs())->anticipation_stats();
  CHECK(loss_stats.anticipated == 2);
  CHECK(loss_stats.misses == 0);
  CHECK(loss_stats.hits == 2);
  const auto net_stats = w->compiled_net().closure_for(w->last_net_inputs())->anticipation_stats();
  CHECK(net_stats.misses == 0);
  if (name != "hvp" && name != "maml") CHECK(net_stats.anticipated == 2);
}

}  // namespace

TEST_SUITE("closure") {

TEST_CASE("higher-order workloads: the specification's values") {
  // value[k] = scale sin(0.731 k + 1.37 t + 0.1): W1 of burgers (t 0, fan_in 2), b1 (t 1).
  auto w = ho::make_workload("burgers", at::kDouble, true);
  const at::Tensor& w1 = w->weights()[0];
  CHECK(w1.sizes() == at::IntArrayRef{2, 8});
  CHECK(w1.data_ptr<double>()[3] == doctest::Approx(std::sin(0.731 * 3 + 0.1) / std::sqrt(2.0)).epsilon(1e-15));
  CHECK(w->weights()[1].data_ptr<double>()[2] == doctest::Approx(0.1 * std::sin(0.731 * 2 + 1.37 + 0.1)).epsilon(1e-15));
  CHECK(w->weights().size() == 18);
  // X is tensor 18.
  CHECK(w->data()[0].data_ptr<double>()[5] == doctest::Approx(std::sin(0.731 * 5 + 1.37 * 18 + 0.1)).epsilon(1e-15));
  // The float tensors are the double ones cast.
  auto f = ho::make_workload("burgers", at::kFloat, true);
  CHECK(at::equal(f->weights()[4], w->weights()[4].to(at::kFloat)));
  // Every workload is listed and builds at both sizes' shapes without running.
  for (const auto& name : ho::workload_names()) CHECK_NOTHROW((void)ho::make_workload(name, at::kFloat, true));
  CHECK_THROWS_AS((void)ho::make_workload("nope", at::kFloat, true), std::invalid_argument);
}

// One subcase per workload of ho::workload_names(), each reported under its name (doctest
// reruns the case once per subcase; a failed REQUIRE ends the case, later workloads too).
TEST_CASE("higher-order workloads: every workload equals libtorch") {
  for (const std::string& name : ho::workload_names()) {
    const std::string subcase = name + " equals libtorch";
    SUBCASE(subcase.c_str()) {
      check_workload(name, at::kFloat);
      check_workload(name, at::kDouble);
    }
  }
}

TEST_CASE("higher-order workloads: the critic at full size in float is as accurate as libtorch") {
  // 2 000 rows: 16 tiles of every row-tiled region. The critic's last bias gradient is a
  // small difference of large sums (D(fake) against D(real)), so a reduction that loses
  // precision across tiles shows here: summed in one float accumulator it was 4.5x further
  // from the double result than libtorch in float (bench/higher_order.md, 2026-12-06).
  const ho::Result truth = ho::make_workload("critic128", at::kDouble, /*small=*/false)->step(ho::Mode::Libtorch);
  auto w = ho::make_workload("critic128", at::kFloat, /*small=*/false);
  const double libtorch_error = ho::max_rel_diff(w->step(ho::Mode::Libtorch), truth);
  for (ho::Mode m : {ho::Mode::Staged, ho::Mode::WholeLoss})
    for (int c = 0; c < 2; ++c) {
      const std::string mode = ho::mode_name(m);
      CAPTURE(mode);
      CAPTURE(c);
      const double error = ho::max_rel_diff(w->step(m), truth);
      CHECK_MESSAGE(error <= 2 * libtorch_error, mode, " call ", c + 1, ": error ", error, " against libtorch's ",
                    libtorch_error);
    }
}

}  // TEST_SUITE
