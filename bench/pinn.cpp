// bench/pinn: one training step of the Burgers PINN (Raissi et al. 2019, section 3.1;
// examples/pinn/burgers.hpp): the loss MSE_u + MSE_f, whose residual needs u_t, u_x and
// u_xx of a 2-20x8-1 tanh network, and its gradients with respect to the weights (a
// third derivative of the network), at N_f = 10 000 collocation points, in four modes:
//
//   staged compiled  the network compiled with 3 derivatives; grad(u, X), grad(u_x, X)
//                    and grad(loss, params) run its compiled stages 1, 2, 3
//   compile-loss     the whole loss, inner grads included, compiled with 1 derivative
//   stagejit eager   the same code on stagejit's eager autograd
//   libtorch eager   the same code on libtorch's autograd
//
// One ATen thread. Median over R rounds in one process after W warm-up rounds; each
// round runs every mode once, the order rotating by one every round, so drifts of the
// machine shift every mode alike. The first round's losses and gradients are checked
// against libtorch's. A separate, untimed round with ATen RecordFunction callbacks
// measures the time spent in matrix products (aten::mm, addmm, bmm, matmul, and
// stagejit::small_mm, the LIBXSMM products of ops/small_gemm.hpp; outermost
// call only): the floor no compiler of this step removes.
//
// Options: --dtype float|double (default float), --collocation N (default 10 000),
// --width W and --hidden H (the network 2-W x H-1; default the paper's 20 x 8),
// --rounds R (default 20), --warmup W (default 3), --seed S, --first-call MODE (only the
// first call of one compiled mode, in a fresh kernel cache, and where its time goes;
// with --warm-cache, in the default cache folder).
#include "../examples/cli.hpp"
#include "../examples/pinn/burgers.hpp"
#include "bench_util.hpp"
#include "first_call.hpp"
#include "gemm_profile.hpp"

#include <ATen/record_function.h>
#include <CLI/CLI.hpp>

#include <malloc.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace sj = stagejit;
using namespace pinn::burgers;

namespace {

/// max over the loss and every gradient of max |x - ref| / max |ref|.
double max_rel_diff(const at::Tensor& loss, const Params& grads, const at::Tensor& ref_loss,
                    const Params& ref_grads) {
  double d = sj::bench::max_rel_diff(loss.to(at::kDouble), ref_loss.to(at::kDouble));
  for (std::size_t i = 0; i < grads.size(); ++i)
    d = std::max(d, sj::bench::max_rel_diff(grads[i].to(at::kDouble), ref_grads[i].to(at::kDouble)));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dtype_name = "float";
  int64_t n_f = 10000;
  int rounds = 20, warmup = 3;
  uint64_t seed = 0;
  bool gemm_detail = false;
  CLI::App app{"One Burgers PINN training step (loss + parameter gradients) in four modes, "
               "median of interleaved rounds, one ATen thread."};
  app.add_option("--dtype", dtype_name, "float or double")->capture_default_str()
      ->check(CLI::IsMember({"float", "double"}));
  app.add_option("--collocation", n_f, "N_f: collocation points")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "Timed rounds (each runs every mode once)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed rounds first")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed, "Seeds the weights and the points")->capture_default_str();
  app.add_flag("--gemm-detail", gemm_detail, "In the profiled round, list each mode's products by "
               "operand shapes (time, count)");
  std::string cross_stage_opt = "auto";
  app.add_option("--cross-stage-gradients", cross_stage_opt,
                 "Staged compiled mode's CompileOptions::cross_stage_gradients: on (each backward stage stops "
                 "at the earlier stages' values and hands their gradients on), off, or auto (chosen when "
                 "compiling: off when the backward stages run row-tiled regions)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off", "auto"}));
  int64_t width = 20;
  int hidden = 8;
  app.add_option("--width", width, "Units per hidden layer (the paper's 20)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  app.add_option("--hidden", hidden, "Hidden layers (the paper's 8)")->capture_default_str()->check(CLI::Range(1, 64));
  int64_t tile_rows = sj::CompileOptions{}.tile_rows;
  app.add_option("--tile-rows", tile_rows,
                 "Both compiled modes' CompileOptions::tile_rows: rows per tile of the row-tiled "
                 "regions (0: none; a region's products are counted once per tile)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  bool no_remat = false;
  app.add_flag("--no-rematerialize", no_remat,
               "Both compiled modes with CompileOptions::rematerialize off (later stages read every "
               "earlier-stage value saved instead of recomputing cheap elementwise ones)");
  int engine_threads = sj::engine::num_threads();
  app.add_option("--engine-threads", engine_threads,
                 "stagejit's engine threads (the caller plus workers; default STAGEJIT_NUM_THREADS, else "
                 "the core count): the staged compiled mode runs independent stages of the final "
                 "backward on them at once, where libtorch's CPU backward runs on the calling thread")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  bool level_field = false;
  app.add_flag("--level-field", level_field,
               "glibc keeps freed memory in the heap (mallopt, as bench/closure's level field), so "
               "no mode pays page faults for fresh blocks: libtorch's time stops being bimodal");
  std::string first_call;
  bool warm_cache = false;
  sj::bench::add_first_call_options(app, first_call, warm_cache,
                                    "Only the first call of one compiled mode, in a fresh temporary kernel cache: "
                                    "its time and where it goes (trace, passes, closures, compiler runs, loading)");
  if (auto status = stagejit_examples::parse_command_line(app, argc, argv)) return *status;
  std::string cache_line;
  if (!first_call.empty() && (cache_line = sj::bench::first_call_cache(warm_cache)).empty()) return 2;

  if (level_field && (mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 || mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1)) {
    std::fprintf(stderr, "error: mallopt refused the level-field settings\n");
    return 2;
  }
  at::set_num_threads(1);
  if (level_field) std::printf("level field: freed memory stays in glibc's heap (no page faults for anyone)\n");
  const char* blas_env = std::getenv("OPENBLAS_NUM_THREADS");
  sj::engine::set_num_threads(engine_threads);
  std::printf("ATen threads %d; OPENBLAS_NUM_THREADS=%s; stagejit engine threads %d (libtorch's CPU backward: 1)\n",
              at::get_num_threads(), blas_env ? blas_env : "(unset)", sj::engine::num_threads());
  if (!blas_env || std::strcmp(blas_env, "1") != 0)
    std::printf("warning: OPENBLAS_NUM_THREADS is not 1: OpenBLAS's own threads spin while stagejit's "
                "engine threads wait, which on a small machine slows the stagejit modes many times "
                "over; run with OPENBLAS_NUM_THREADS=1\n");

  const at::ScalarType dtype = dtype_name == "double" ? at::kDouble : at::kFloat;
  const ReferenceSolution ref = reference_solution();
  const TrainingData data = make_training_data(ref, 100, n_f, seed + 1).to(dtype);
  std::vector<int64_t> layers{2};
  for (int i = 0; i < hidden; ++i) layers.push_back(width);
  layers.push_back(1);
  const Params params = xavier_init(layers, seed, dtype);

  const std::optional<bool> cross_stage =
      cross_stage_opt == "auto" ? std::nullopt : std::optional<bool>(cross_stage_opt == "on");
  if (!first_call.empty()) {
    const bool staged = first_call == "staged";
    Stepper stepper(staged ? Mode::Compiled : Mode::CompileLoss, data, cross_stage, tile_rows, !no_remat);
    Params g;
    const double ms = sj::bench::once_ms([&] { (void)stepper.step(params, g); });
    std::printf("%s\n", cache_line.c_str());
    sj::bench::print_first_call(staged ? "the staged compiled step" : "the compile-loss step", ms,
                                {stepper.compiled_net().stats(), stepper.compiled_loss().stats()});
    const double again = sj::bench::once_ms([&] { (void)stepper.step(params, g); });
    std::printf("  second call %.1f ms\n", again);
    const double wait = sj::bench::once_ms([] { sj::fusion::default_cpu_backend().wait_for_prefetches(); });
    sj::bench::print_first_call("all kernels built", ms + again + wait,
                                {stepper.compiled_net().stats(), stepper.compiled_loss().stats()});
    std::printf("  (the kernels finished %.0f ms after the second call)\n", wait);
    const double fused = sj::bench::once_ms([&] { (void)stepper.step(params, g); });
    std::printf("  next call, with the kernels %.1f ms\n", fused);
    return 0;
  }

  const Mode modes[] = {Mode::Compiled, Mode::CompileLoss, Mode::Eager, Mode::Libtorch};
  const char* labels[] = {"staged compiled (net, 3 derivatives)", "compile-loss (1 derivative)",
                          "stagejit eager", "libtorch eager"};
  constexpr std::size_t kModes = 4;
  std::vector<std::unique_ptr<Stepper>> steppers;
  for (Mode m : modes) steppers.push_back(std::make_unique<Stepper>(m, data, cross_stage, tile_rows, !no_remat));
  std::printf("compiled modes: row-tiled regions %s; cross-stage rematerialisation %s\n",
              tile_rows > 0 ? (std::to_string(tile_rows) + " rows per tile").c_str() : "off",
              no_remat ? "off" : "on");

  std::printf("Burgers PINN step (loss + gradients of %zu parameter tensors), network 2-%lldx%d-1 tanh, "
              "N_u %lld, N_f %lld, %s; median of %d rounds after %d warm-up rounds\n",
              params.size(), (long long)width, hidden, (long long)data.x_u.size(0), (long long)n_f,
              dtype_name.c_str(), rounds, warmup);

  // First round: the first call of each compiled mode (trace + compile), and the check.
  Params grads[kModes];
  at::Tensor loss[kModes];
  double first_ms[kModes];
  for (std::size_t m = 0; m < kModes; ++m)
    first_ms[m] = sj::bench::once_ms([&] { loss[m] = steppers[m]->step(params, grads[m]); });
  std::printf("  first call (trace + compile): staged compiled %.0f ms, compile-loss %.0f ms\n", first_ms[0],
              first_ms[1]);
  std::printf("  staged compiled: cross-stage gradients in %zu of %zu specs%s\n",
              steppers[0]->compiled_net().stats().cross_stage_traces, steppers[0]->compiled_net().stats().misses,
              cross_stage ? "" : " (chosen when compiling: CompileOptions::cross_stage_gradients unset)");
  // The compiled modes' kernels are built in the background while their first calls run
  // op by op (fusion::waits_for_kernels); the timed rounds measure them with kernels.
  sj::fusion::default_cpu_backend().wait_for_prefetches();
  double worst = 0;
  for (std::size_t m = 0; m + 1 < kModes; ++m) {
    const double d = max_rel_diff(loss[m], grads[m], loss[3], grads[3]);
    worst = std::max(worst, d);
    std::printf("  %-38s loss %.8e, max relative difference to libtorch (loss, gradients) %.2e\n",
                labels[m], loss[m].item<double>(), d);
  }

  std::vector<double> times[kModes];
  for (int r = 0; r < warmup + rounds; ++r)
    for (std::size_t k = 0; k < kModes; ++k) {
      const std::size_t m = (k + std::size_t(r)) % kModes;
      Params g;
      const double ms = sj::bench::once_ms([&] { (void)steppers[m]->step(params, g); });
      if (r >= warmup) times[m].push_back(ms);
    }
  double median[kModes];
  for (std::size_t m = 0; m < kModes; ++m) {
    auto& t = times[m];
    std::nth_element(t.begin(), t.begin() + std::ptrdiff_t(t.size() / 2), t.end());
    median[m] = t[t.size() / 2];
  }

  // Untimed profiled round: RecordFunction callbacks add a little to every ATen op, so
  // the step's total here is longer than in the timed rounds; the share is taken of it.
  double gemm_ms[kModes], gemm_sum_ms[kModes], profiled_ms[kModes];
  int64_t gemm_calls[kModes];
  for (std::size_t m = 0; m < kModes; ++m) {
    Params g;
    const sj::bench::GemmProfile prof = sj::bench::profile_gemm(
        [&] { profiled_ms[m] = sj::bench::once_ms([&] { (void)steppers[m]->step(params, g); }); }, gemm_detail);
    gemm_ms[m] = prof.wall_ms;
    gemm_sum_ms[m] = prof.sum_ms;
    gemm_calls[m] = prof.calls;
    if (gemm_detail) {
      std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> rows(prof.by_shape.begin(), prof.by_shape.end());
      std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
      std::printf("  products of %s (profiled round), by time:\n", labels[m]);
      for (const auto& [key, v] : rows)
        std::printf("    %8.3f ms %4lld x  %s\n", double(v.first) * 1e-6, (long long)v.second, key.c_str());
    }
  }

  std::printf("                                                time       vs libtorch   GEMM wall time (profiled round)  "
              "summed over threads\n");
  for (std::size_t m = 0; m < kModes; ++m)
    std::printf("  %-38s %9.2f ms   %6.2fx      %6.2f ms of %6.2f ms = %4.1f%%   %6.2f ms in %lld products\n",
                labels[m], median[m], median[3] / median[m], gemm_ms[m], profiled_ms[m],
                100 * gemm_ms[m] / profiled_ms[m], gemm_sum_ms[m], (long long)gemm_calls[m]);
  std::printf("  GEMM share of the staged compiled step: %.1f%% (the floor no compiler of this step removes)\n",
              100 * gemm_ms[0] / profiled_ms[0]);
  const double tol = dtype == at::kFloat ? 1e-5 : 1e-10;
  std::printf("  check against libtorch (first round, max relative difference %.2e <= %.0e): %s\n", worst, tol,
              worst <= tol ? "passed" : "FAILED");
  return worst <= tol ? 0 : 1;
}
