// bench/higher_order: the higher-order workloads of bench/workloads.md (issue 32;
// test/support/higher_order.hpp): the Burgers PINN with and without its boundary term,
// a KdV residual, energy/force matching (SiLU, softplus), WGAN-GP critics (widths 128,
// 512), a Hessian-vector product and a MAML step, each one training step (loss and
// gradients in the weights) in four modes:
//
//   staged       the network compiled with k derivatives; the loss's inner grads and the
//                final grad run its compiled stages
//   whole-loss   the whole loss, inner grads included, compiled with 1 derivative
//   eager        the same code on stagejit's eager autograd
//   libtorch     the same code on libtorch's autograd
//
// in float and double, in one process. One ATen thread. Per workload and dtype: the
// losses and gradients of the first round (groups op by op while their kernels build) and
// of a second one (with the kernels) against libtorch's (max relative difference), then the
// median over R rounds after W warm-up rounds, each round running every mode for B steps
// in a row (--block, default 4), the order of the modes shuffled every round: a mode's
// ms/step is the median of its steady steps (2..B of each block); the first step of each
// block, right after another mode's, is printed apart (Note [Steps in blocks]). An untimed profiled round per mode counts the
// matrix products (outermost aten::mm/addmm/bmm/matmul and stagejit::small_mm, with
// their FLOPs 2 M K N from the operands; bench/gemm_profile.hpp) and the time in them:
// the GEMM share of libtorch eager's step is the floor no compiler of the step removes.
// Products a row-tiled LIBXSMM region runs per tile report no operands: they are counted
// but their FLOPs are not (the "unknown" column).
//
// Options: --workload NAME (repeatable or a comma list; default all), --dtype
// float|double|both, --engine-threads N, --rounds R, --warmup W, --small (the tests'
// sizes), --first-call staged|compile-loss (only the first call of that compiled mode of
// each selected workload, in a fresh kernel cache, and where its time goes; with
// --warm-cache, in the default cache folder), --only MODE --steps N (after the first
// round, N steps of that one mode and nothing else: the run to put under `perf record`),
// --print-graphs (after one staged and one whole-loss step, the optimised graphs of the
// staged net and of the whole loss, every stage, each stage's row-tiled regions and the stage
// variants the steps ran, and nothing else), --print-products (each
// mode's products of the profiled step by operator and operand shapes).
#include "../examples/cli.hpp"
#include "../test/support/higher_order.hpp"
#include "bench_util.hpp"
#include "first_call.hpp"
#include "gemm_profile.hpp"

#include <stagejit/ir/printer.hpp>

#include <CLI/CLI.hpp>

#include <iostream>

#include <algorithm>
#include <array>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <unordered_set>
#include <vector>

namespace sj = stagejit;
namespace ho = stagejit::testing::higher_order;

namespace {

constexpr std::size_t kModes = 4;  // ho::kModes: staged, whole-loss, eager, libtorch
constexpr std::size_t kLibtorch = 3;

const char* kLabels[kModes] = {"staged compiled", "whole-loss compiled", "stagejit eager", "libtorch eager"};
const std::string kOnlyNames[kModes] = {"staged", "whole-loss", "eager", "libtorch"};

double median(std::vector<double> t) {
  std::nth_element(t.begin(), t.begin() + std::ptrdiff_t(t.size() / 2), t.end());
  return t[t.size() / 2];
}

struct Summary {
  std::string workload;
  at::ScalarType dtype;
  double ratio[kModes] = {0, 0, 0, 1};
  double ratio_first[kModes] = {0, 0, 0, 1};  // steps right after another mode's
  double libtorch_gemm_share = 0;
  double flops[kModes] = {0, 0, 0, 0};
};

const char* dtype_name(at::ScalarType t) { return t == at::kFloat ? "float" : "double"; }

// Only the first call of one compiled mode, then the second, then with all kernels.
void first_call_of(ho::Workload& w, bool staged) {
  const ho::Mode m = staged ? ho::Mode::Staged : ho::Mode::WholeLoss;
  const std::string label = w.name() + " (" + dtype_name(w.dtype()) + ", " + (staged ? "staged" : "whole-loss") + ")";
  const double ms = sj::bench::once_ms([&] { (void)w.step(m); });
  sj::bench::print_first_call(label.c_str(), ms, {w.compiled_net().stats(), w.compiled_loss().stats()});
  const double again = sj::bench::once_ms([&] { (void)w.step(m); });
  std::printf("  second call %.1f ms\n", again);
  const double wait = sj::bench::once_ms([] { sj::fusion::default_cpu_backend().wait_for_prefetches(); });
  sj::bench::print_first_call(("all kernels of " + label + " built").c_str(), ms + again + wait,
                              {w.compiled_net().stats(), w.compiled_loss().stats()});
  std::printf("  (the kernels finished %.0f ms after the second call)\n", wait);
  const double fused = sj::bench::once_ms([&] { (void)w.step(m); });
  std::printf("  next call, with the kernels %.1f ms\n", fused);
}

// The first round (check), the timed rounds and the profiled round of one workload.
// Returns false when a mode's results differ from libtorch's beyond the tolerance.
bool run_workload(ho::Workload& w, bool small, int rounds, int warmup, int block, bool print_products, Summary& sum) {
  const double tol = w.dtype() == at::kFloat ? 1e-5 : 1e-10;
  std::printf("\n%s, %s: %s; staged: the net compiled with %d derivatives; %zu weight tensors\n", w.name().c_str(),
              dtype_name(w.dtype()), w.describe().c_str(), w.derivatives(), w.weights().size());

  // First round: each compiled mode's first call (trace + compile), and the check.
  ho::Result first[kModes];
  double first_ms[kModes];
  for (std::size_t m = 0; m < kModes; ++m)
    first_ms[m] = sj::bench::once_ms([&] { first[m] = w.step(ho::kModes[m]); });
  // The kernels are built in the background while the first calls run op by op; the
  // timed rounds measure the compiled modes with them.
  sj::fusion::default_cpu_backend().wait_for_prefetches();
  std::printf("  first call (trace + compile): staged %.0f ms, whole-loss %.0f ms; staged: cross-stage gradients in %zu of %zu specs\n",
              first_ms[0], first_ms[1], w.compiled_net().stats().cross_stage_traces, w.compiled_net().stats().misses);
  // Float's own error: every mode, libtorch's included, against libtorch in double on the
  // same values (the workloads build them in double and cast). At full size libtorch's
  // float sits 1e-5 or more from that reference itself (sums of 10 000 terms), so a float
  // mode that misses 1e-5 against libtorch's float but is as close to the double
  // reference as libtorch's float (within twice libtorch's own distance: a wrong
  // derivative is off by orders of magnitude) differs from it by rounding: it passes,
  // marked "(rounding)".
  // The first round ran the groups op by op while their kernels were built; a second
  // round, with the kernels, is checked too (the compiled code the timed rounds run).
  // Two more steps of the compiled modes: where a mode's backward seeds repeat, the
  // third step runs them ahead (Note [Anticipated stages]), whose kernels are built
  // here too.
  for (std::size_t m = 0; m < 2; ++m)
    for (int again = 0; again < 2; ++again) (void)w.step(ho::kModes[m]);
  sj::fusion::default_cpu_backend().wait_for_prefetches();
  ho::Result built[kModes];
  for (std::size_t m = 0; m < kModes; ++m) built[m] = w.step(ho::kModes[m]);
  const ho::Result ref =
      w.dtype() == at::kFloat ? ho::make_workload(w.name(), at::kDouble, small)->step(ho::Mode::Libtorch) : ho::Result{};
  bool ok = true;
  double err[kModes] = {0, 0, 0, 0};
  for (const ho::Result* round : {first, built}) {
    if (w.dtype() == at::kFloat)
      for (std::size_t m = 0; m < kModes; ++m) err[m] = ho::max_rel_diff(round[m], ref);
    std::printf("  check (%s), max relative difference to libtorch (loss %.8e; loss and gradients):",
                round == first ? "first round" : "with the kernels built", round[kLibtorch].loss);
    bool round_ok = true;
    for (std::size_t m = 0; m < kLibtorch; ++m) {
      const double d = ho::max_rel_diff(round[m], round[kLibtorch]);
      const bool rounding = d > tol && w.dtype() == at::kFloat && err[m] <= 2 * err[kLibtorch];
      round_ok = round_ok && (d <= tol || rounding);
      std::printf(" %s %.2e%s", m == 0 ? "staged" : m == 1 ? "whole-loss" : "eager", d,
                  d <= tol ? "" : rounding ? " (rounding)" : " (FAILED)");
    }
    std::printf("; %s (<= %.0e, or float's error <= 2x libtorch's)\n", round_ok ? "passed" : "FAILED", tol);
    ok = ok && round_ok;
  }
  if (w.dtype() == at::kFloat) {
    std::printf("  float's error, max relative difference to libtorch in double:");
    for (std::size_t m = 0; m < kModes; ++m)
      std::printf(" %s %.2e", m == 0 ? "staged" : m == 1 ? "whole-loss" : m == 2 ? "eager" : "libtorch", err[m]);
    std::printf("\n");
  }

  // Note [Steps in blocks]: a step timed right after another mode's step pays for that
  // mode: libtorch's eager step faults in about 100 MB of fresh pages (glibc hands its
  // freed tensors back to the system), and on this VM the next 20 ms of any compute run
  // 20-25 % slower after it, whatever that compute is (bench/higher_order.md, 2026-12-06).
  // A training loop runs one mode step after step, so each mode runs `block` steps in a
  // row per round: the first is reported apart ("after another mode"), the rest are the
  // steady steps whose median is the mode's ms/step. With --block 1 every step follows
  // another mode (the bench before 2026-12-06).
  const auto st0 = sj::fusion::default_cpu_backend().stats();
  std::vector<double> times[kModes], first_of_block[kModes];
  // The order of the modes is shuffled every round (a fixed seed): rotating one order
  // would have each mode always follow the same other mode (staged always after libtorch).
  std::array<std::size_t, kModes> order;
  for (std::size_t m = 0; m < kModes; ++m) order[m] = m;
  std::mt19937 shuffler(2026);
  for (int r = 0; r < warmup + rounds; ++r) {
    std::shuffle(order.begin(), order.end(), shuffler);
    for (const std::size_t m : order) {
      for (int b = 0; b < block; ++b) {
        const double ms = sj::bench::once_ms([&] { (void)w.step(ho::kModes[m]); });
        if (r < warmup) continue;
        (b == 0 ? first_of_block[m] : times[m]).push_back(ms);
      }
    }
  }
  if (block == 1)
    for (std::size_t m = 0; m < kModes; ++m) times[m] = first_of_block[m];
  {
    const auto st1 = sj::fusion::default_cpu_backend().stats();
    // Kernels compiled while the rounds ran mean some rounds ran groups op by op.
    if (st1.compiles != st0.compiles)
      std::printf("  warning: %lld kernel compiler runs during the timed rounds (their groups ran op by op "
                  "until built)\n",
                  (long long)(st1.compiles - st0.compiles));
  }
  double med[kModes], med_first[kModes];
  for (std::size_t m = 0; m < kModes; ++m) {
    med[m] = median(times[m]);
    med_first[m] = median(first_of_block[m]);
  }

  // Untimed profiled round: the callbacks add a little to every ATen op, so the step's
  // time here is longer than in the timed rounds; the GEMM share is taken of it.
  sj::bench::GemmProfile prof[kModes];
  double profiled_ms[kModes];
  for (std::size_t m = 0; m < kModes; ++m)
    prof[m] = sj::bench::profile_gemm(
        [&] { profiled_ms[m] = sj::bench::once_ms([&] { (void)w.step(ho::kModes[m]); }); }, /*with_inputs=*/true);

  std::printf("  %-22s %10s %9s %17s %10s %11s %8s   %s\n", "mode", "ms/step", "vs torch", "after other mode",
              "products", "MFLOP", "unknown", "GEMM wall time of the profiled step");
  for (std::size_t m = 0; m < kModes; ++m) {
    std::printf("  %-22s %10.3f %8.2fx %9.3f %6.2fx %10lld %11.3f %8lld   %.3f of %.3f ms = %4.1f%%\n", kLabels[m],
                med[m], med[kLibtorch] / med[m], med_first[m], med_first[kLibtorch] / med_first[m],
                (long long)prof[m].calls, prof[m].flops * 1e-6, (long long)prof[m].unknown, prof[m].wall_ms,
                profiled_ms[m], 100 * prof[m].wall_ms / profiled_ms[m]);
    sum.ratio[m] = med[kLibtorch] / med[m];
    sum.ratio_first[m] = med_first[kLibtorch] / med_first[m];
    sum.flops[m] = prof[m].flops;
  }
  sum.libtorch_gemm_share = prof[kLibtorch].wall_ms / profiled_ms[kLibtorch];
  if (print_products)
    for (std::size_t m = 0; m < kModes; ++m) {
      std::printf("  products of %s's profiled step (op and operand shapes: calls, ms; row-tiled products show no "
                  "operands):\n",
                  kLabels[m]);
      for (const auto& [shape, e] : prof[m].by_shape)
        std::printf("    %-48s %6lld %9.3f\n", shape.c_str(), (long long)e.second, double(e.first) * 1e-6);
    }
  std::printf("  GEMM share of libtorch eager's step: %.1f%%\n", 100 * sum.libtorch_gemm_share);
  return ok;
}

}  // namespace

// --print-graphs: each stage's row-tiled regions (rows, nodes, products) and the nodes left
// outside that read a row value made in a region: each such node ends a region, and what
// runs after it reads the region's values back whole (Note [Row-tiled regions]).
void print_stage_regions(const std::string& label, const std::vector<sj::ir::Node*>& nodes) {
  const auto regions = sj::closure::find_row_tiled_regions(nodes, sj::closure::kMinTiledRows);
  std::unordered_set<const sj::ir::Value*> made;  // row values made in a region
  std::unordered_set<const sj::ir::Node*> inside;
  std::size_t products = 0;
  for (const sj::ir::Node* n : nodes)
    products += sj::closure::tiling::is_matrix_product(*n) || n->describe() == "addmm";
  std::printf("  %s: %zu nodes, %zu products, %zu row-tiled regions", label.c_str(), nodes.size(), products,
              regions.size());
  for (const auto& r : regions) {
    std::size_t in_region = 0;
    for (const sj::ir::Node* n : r.nodes) {
      inside.insert(n);
      in_region += sj::closure::tiling::is_matrix_product(*n) || n->describe() == "addmm";
      for (const sj::ir::Value* o : n->outputs()) {
        const sj::ir::TensorType* t = o->tensor_type();
        if (t && t->sizes.size() == 2 && t->sizes[0] == r.rows) made.insert(o);
      }
    }
    std::printf(" [%zu rows: %zu nodes, %zu products]", std::size_t(r.rows), r.nodes.size(), in_region);
  }
  std::printf("\n");
  for (const sj::ir::Node* n : nodes) {
    if (inside.count(n)) continue;
    for (const sj::ir::Value* v : n->inputs())
      if (made.count(v)) {
        std::printf("    outside, reads row value %%%zu of a region: %%%zu = %s\n", std::size_t(v->id()),
                    n->outputs().empty() ? std::size_t(0) : std::size_t(n->outputs()[0]->id()), n->describe().c_str());
        break;
      }
  }
}

// The base stages, then the stage variants the steps built and ran (Note [Stage variants]:
// a call runs its stage specialised on the gradients it gets, the outputs it must give and
// whether later stages will run; the joint backward is one of them).
void print_regions(const sj::closure::MultiStageClosure& c) {
  for (std::size_t s = 0; s < c.plan.num_stages(); ++s)
    print_stage_regions("stage " + std::to_string(s), c.plan.stage_nodes(s));
  auto variants = c.variants();
  std::sort(variants.begin(), variants.end(), [](const auto& a, const auto& b) {
    return a->key.stage != b->key.stage ? a->key.stage < b->key.stage : a->key.to_string() < b->key.to_string();
  });
  for (const auto& v : variants) {
    std::vector<sj::ir::Node*> nodes;
    for (sj::ir::Node* n : v->graph->nodes())
      if (n->stage() == v->key.stage) nodes.push_back(n);
    print_stage_regions("variant (" + v->key.to_string() + ")", nodes);
  }
}

int main(int argc, char** argv) {
  std::vector<std::string> workloads;
  std::string dtype_opt = "both";
  int rounds = 6, warmup = 1, block = 4;
  bool small = false;
  std::string first_call;
  int engine_threads = sj::engine::num_threads();
  const std::vector<std::string> all = ho::workload_names();

  CLI::App app{"The higher-order workloads of bench/workloads.md: one training step each, staged compiled, "
               "whole-loss compiled, stagejit eager and libtorch eager, float and double, median of "
               "interleaved rounds, one ATen thread."};
  app.add_option("--workload", workloads, "Workloads to run (repeatable or a comma list; default all)")
      ->delimiter(',')
      ->check(CLI::IsMember(all));
  app.add_option("--dtype", dtype_opt, "float, double or both")->capture_default_str()
      ->check(CLI::IsMember({"float", "double", "both"}));
  app.add_option("--rounds", rounds, "Timed rounds (each runs every mode --block steps in a row)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed rounds first")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--block", block,
                 "Steps each mode runs in a row per round: the first is reported apart (after another mode's "
                 "step), the median of the others is the mode's ms/step; 1: every step follows another mode")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_flag("--small", small, "The tests' small sizes (test/closure/higher_order_workloads_test.cpp)");
  app.add_option("--engine-threads", engine_threads,
                 "stagejit's engine threads (the caller plus workers; default STAGEJIT_NUM_THREADS, else the core "
                 "count); libtorch's CPU backward runs on the calling thread")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  bool warm_cache = false;
  sj::bench::add_first_call_options(
      app, first_call, warm_cache,
      "Only the first call of one compiled mode of each selected workload, in a fresh temporary kernel "
      "cache: its time and where it goes (the backend's counters add up over the workloads)");
  std::string only;
  int steps = 200;
  app.add_option("--only", only,
                 "After a first step, run only this mode for --steps steps (nothing else timed or checked): "
                 "the run to put under perf record")
      ->check(CLI::IsMember(std::vector<std::string>(std::begin(kOnlyNames), std::end(kOnlyNames))));
  app.add_option("--steps", steps, "Steps of the --only mode")->capture_default_str()->check(CLI::PositiveNumber);
  bool print_graphs = false;
  bool print_products = false;
  app.add_flag("--print-products", print_products,
               "After each workload's table, the products of every mode's profiled step by operator and operand "
               "shapes (calls and time)");
  app.add_flag("--print-graphs", print_graphs,
               "After one staged and one whole-loss step, print the optimised graphs of the staged net and of "
               "the whole loss (every stage), each stage's row-tiled regions and the stage variants the steps "
               "ran, and nothing else");
  if (auto status = stagejit_examples::parse_command_line(app, argc, argv)) return *status;
  if (workloads.empty()) workloads = all;

  std::string cache_line;
  if (!first_call.empty() && (cache_line = sj::bench::first_call_cache(warm_cache)).empty()) return 2;

  at::set_num_threads(1);
  sj::engine::set_num_threads(engine_threads);
  const char* blas_env = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("ATen threads %d; OPENBLAS_NUM_THREADS=%s; stagejit engine threads %d (libtorch's CPU backward: 1); "
              "%s sizes; %d rounds after %d warm-up rounds, each mode %d steps in a row per round\n",
              at::get_num_threads(), blas_env ? blas_env : "(unset)", sj::engine::num_threads(),
              small ? "small (test)" : "default", rounds, warmup, block);
  if (!blas_env || std::strcmp(blas_env, "1") != 0)
    std::printf("warning: OPENBLAS_NUM_THREADS is not 1: OpenBLAS's own threads spin while stagejit's engine "
                "threads wait; run with OPENBLAS_NUM_THREADS=1\n");

  std::vector<at::ScalarType> dtypes;
  if (dtype_opt != "double") dtypes.push_back(at::kFloat);
  if (dtype_opt != "float") dtypes.push_back(at::kDouble);

  if (!first_call.empty()) {
    std::printf("%s\n", cache_line.c_str());
    for (at::ScalarType dt : dtypes)
      for (const auto& name : workloads) {
        auto w = ho::make_workload(name, dt, small);
        try {
          first_call_of(*w, first_call == "staged");
        } catch (const std::exception& e) {
          std::printf("%s, %s: error: %s\n", name.c_str(), dtype_name(dt), e.what());
          return 1;
        }
      }
    return 0;
  }

  if (print_graphs) {
    for (at::ScalarType dt : dtypes)
      for (const auto& name : workloads) {
        auto w = ho::make_workload(name, dt, small);
        (void)w->step(ho::Mode::Staged);
        (void)w->step(ho::Mode::WholeLoss);
        std::cout << "# " << name << ", " << dtype_name(dt) << ": the staged net\n"
                  << *w->compiled_net().graph_for(w->last_net_inputs()) << "\n";
        print_regions(*w->compiled_net().closure_for(w->last_net_inputs()));
        std::cout << "# " << name << ", " << dtype_name(dt) << ": the whole loss\n"
                  << *w->compiled_loss().graph_for(w->last_loss_inputs()) << "\n";
        print_regions(*w->compiled_loss().closure_for(w->last_loss_inputs()));
      }
    return 0;
  }

  if (!only.empty()) {
    const std::size_t m = std::size_t(std::find(std::begin(kOnlyNames), std::end(kOnlyNames), only) -
                                      std::begin(kOnlyNames));
    for (at::ScalarType dt : dtypes)
      for (const auto& name : workloads) {
        auto w = ho::make_workload(name, dt, small);
        // Three steps first: the third runs the backward stages ahead where their seeds
        // repeat (Note [Anticipated stages]); their kernels are built before timing.
        for (int i = 0; i < 3; ++i) (void)w->step(ho::kModes[m]);
        sj::fusion::default_cpu_backend().wait_for_prefetches();
        std::vector<double> t;
        for (int i = 0; i < steps; ++i) t.push_back(sj::bench::once_ms([&] { (void)w->step(ho::kModes[m]); }));
        std::printf("%s, %s, %s only: %d steps, median %.3f ms\n", name.c_str(), dtype_name(dt), kLabels[m], steps,
                    median(t));
      }
    return 0;
  }

  bool all_ok = true;
  std::vector<Summary> summaries;
  for (at::ScalarType dt : dtypes)
    for (const auto& name : workloads) {
      auto w = ho::make_workload(name, dt, small);
      Summary s{name, dt};
      try {
        all_ok = run_workload(*w, small, rounds, warmup, block, print_products, s) && all_ok;
        summaries.push_back(s);
      } catch (const std::exception& e) {
        std::printf("  error: %s\n", e.what());
        all_ok = false;
      }
    }

  std::printf("\nsummary (ratio to libtorch eager, steady steps; the same after another mode's step, staged / "
              "whole-loss; MFLOP of products per step, staged / whole-loss / libtorch; GEMM share of libtorch's "
              "step)\n");
  std::printf("  %-18s %-7s %8s %11s %8s %14s   %12s %12s %12s %7s\n", "workload", "dtype", "staged", "whole-loss",
              "eager", "after other", "staged", "whole-loss", "libtorch", "GEMM");
  for (const auto& s : summaries)
    std::printf("  %-18s %-7s %7.2fx %10.2fx %7.2fx %6.2fx %6.2fx   %12.3f %12.3f %12.3f %6.1f%%\n",
                s.workload.c_str(), dtype_name(s.dtype), s.ratio[0], s.ratio[1], s.ratio[2], s.ratio_first[0],
                s.ratio_first[1], s.flops[0] * 1e-6, s.flops[1] * 1e-6, s.flops[3] * 1e-6,
                100 * s.libtorch_gemm_share);
  for (std::size_t m = 0; m < 2; ++m)
    for (at::ScalarType dt : dtypes) {
      const Summary* worst = nullptr;
      for (const auto& s : summaries)
        if (s.dtype == dt && (!worst || s.ratio[m] < worst->ratio[m])) worst = &s;
      if (worst)
        std::printf("worst %s ratio (%s): %.2fx (%s)\n", m == 0 ? "staged" : "whole-loss", dtype_name(dt),
                    worst->ratio[m], worst->workload.c_str());
    }
  for (at::ScalarType dt : dtypes) {
    const Summary* worst = nullptr;
    for (const auto& s : summaries)
      if (s.dtype == dt && (!worst || s.ratio[1] / s.ratio[0] > worst->ratio[1] / worst->ratio[0])) worst = &s;
    if (worst)
      std::printf("staged's largest lag behind whole-loss (%s): %.0f %% (%s)\n", dtype_name(dt),
                  100 * (worst->ratio[1] / worst->ratio[0] - 1), worst->workload.c_str());
  }
  std::printf("check against libtorch (first rounds, and with the kernels built): %s\n", all_ok ? "passed" : "FAILED");
  return all_ok ? 0 : 1;
}
