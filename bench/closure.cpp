// bench/closure: what the closure compiler costs and buys.
//
// 1. LSTM cell (batch 64, input 512, hidden 512, float; test/support/models.hpp)
//    forward + backward (gradients of all six inputs for grad outputs of ones):
//    stagejit compile() with fusion off and on (and on with inter_op_parallel, and on
//    without the host memory cache), stagejit eager (the engine's pool runs independent
//    branches), libtorch eager, and libtorch eager inside a memory::HostCacheScope (what
//    the allocator alone would give libtorch); median times (ms) and speed-ups over
//    libtorch eager, results checked against libtorch. A last row times the step's six
//    matrix products alone (ATen `mm_out` into preallocated outputs, the same shapes):
//    an estimate of the floor under any variant that computes these products, so
//    libtorch / floor bounds the speed-up a compiler of this step could show here.
// 2. Trace + compile time of generated graphs of about 100, 1 000 and 10 000 forward
//    nodes (a chain of elementwise ops with fan-out on [8] doubles, one backward stage),
//    split into trace, passes (DCE + CSE), fuser and closure build, best of three rounds;
//    per-node cost should stay flat (linear growth). For scale, the last column runs the
//    same chain forward + backward through libtorch's own autograd (`libtorch f+b`):
//    how the machine's caches and allocator treat a graph of that many nodes; the last
//    column divides our total by it (flat when our growth is the machine's).
// 3. (glibc only; last, since it changes the process's malloc settings) part 1 again on
//    a level field: `mallopt` keeps freed blocks in the heap (blocks up to 32 MiB from
//    the heap instead of mmap, the heap top never trimmed), so no variant pays page
//    faults in steady state.
// Options: --reps R (default 30), --threads T (ATen intra-op threads; default ATen's),
// --part all|lstm|compile|level (default all). With $STAGEJIT_BENCH_PRINT_GRAPH set, prints
// the LSTM cell's compiled graphs.
#include <stagejit/compiler.hpp>
#include <torch/torch.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "../test/support/models.hpp"
#include "bench_util.hpp"

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <string>

namespace sj = stagejit;
using sj::bench::max_rel_diff;
using sj::bench::median_ms;
using sj::bench::once_ms;
using sj::bench::row;

namespace {

void lstm(int reps, bool level_field) {
  const int64_t B = 64, I = 512, H = 512;
  at::manual_seed(0);
  std::vector<at::Tensor> data = {at::randn({B, I}), at::randn({B, H}), at::randn({B, H}),
                                  at::randn({4 * H, I}) * 0.05, at::randn({4 * H, H}) * 0.05,
                                  at::randn({4 * H}) * 0.05};
  const at::Tensor ones = at::ones({B, H});

  sj::variable_list in;
  for (auto& d : data) in.emplace_back(d, true);
  const sj::variable_list gouts = {sj::Variable(ones), sj::Variable(ones)};
  auto fn = [](const sj::variable_list& v) { return sj::testing::lstm_cell(v); };
  auto unfused = sj::compile(fn, {.derivatives = 1, .fuse = false});
  auto fused = sj::compile(fn, {.derivatives = 1, .fuse = true});
  auto fused_par = sj::compile(fn, {.derivatives = 1, .fuse = true, .inter_op_parallel = true});
  auto fused_nocache = sj::compile(fn, {.derivatives = 1, .fuse = true, .cache_host_memory = false});
  auto sj_step = [&](sj::CompiledFunction& f) { return sj::grad(f(in), in, gouts); };
  const double first_unfused = once_ms([&] { sj_step(unfused); });
  const double first_fused = once_ms([&] { sj_step(fused); });
  sj_step(fused_par);
  sj_step(fused_nocache);

  std::vector<torch::Tensor> leaves;
  for (auto& d : data) leaves.push_back(d.detach().requires_grad_(true));
  auto torch_step = [&] {
    auto out = sj::testing::lstm_cell(leaves);
    return torch::autograd::grad(out, leaves, {ones, ones});
  };

  const double t_torch = median_ms([&] { torch_step(); }, reps);
  const double t_torch_cached = median_ms([&] {
    sj::memory::HostCacheScope scope;
    torch_step();
  }, reps);
  const double t_eager = median_ms([&] { sj::grad(sj::testing::lstm_cell(in), in, gouts); }, reps);
  const double t_unfused = median_ms([&] { sj_step(unfused); }, reps);
  const double t_fused = median_ms([&] { sj_step(fused); }, reps);
  const double t_fused_par = median_ms([&] { sj_step(fused_par); }, reps);
  const double t_fused_nocache = median_ms([&] { sj_step(fused_nocache); }, reps);

  // The floor: the six products of the step (forward x W_ih^T, h W_hh^T; backward
  // dgates W_ih, dgates W_hh, dgates^T x, dgates^T h) into preallocated outputs.
  const at::Tensor dgates = at::randn({B, 4 * H});
  std::vector<at::Tensor> prod = {at::empty({B, 4 * H}), at::empty({B, 4 * H}), at::empty({B, I}),
                                  at::empty({B, H}), at::empty({4 * H, I}), at::empty({4 * H, H})};
  const double t_floor = median_ms([&] {
    at::mm_out(prod[0], data[0], data[3].t());
    at::mm_out(prod[1], data[1], data[4].t());
    at::mm_out(prod[2], dgates, data[3]);
    at::mm_out(prod[3], dgates, data[4]);
    at::mm_out(prod[4], dgates.t(), data[0]);
    at::mm_out(prod[5], dgates.t(), data[1]);
  }, reps);

  double diff = 0;
  auto want = torch_step();
  for (auto* f : {&unfused, &fused, &fused_par, &fused_nocache}) {
    auto got = sj_step(*f);
    for (std::size_t i = 0; i < got.size(); ++i) diff = std::max(diff, max_rel_diff(got[i].data(), want[i]));
  }
  int groups = 0;
  for (auto* node : fused.graph_for(in)->nodes()) groups += node->is<sj::ir::FusionGroup>();
  if (std::getenv("STAGEJIT_BENCH_PRINT_GRAPH"))
    std::printf("%s\n%s\n", sj::ir::to_string(*unfused.graph_for(in)).c_str(),
                sj::ir::to_string(*fused.graph_for(in)).c_str());

  std::printf("%sLSTM cell forward+backward, batch %lld, input %lld, hidden %lld, float; ATen threads %d, "
              "median of %d\n", level_field ? "\n[level field: freed memory stays in the heap] " : "",
              (long long)B, (long long)I, (long long)H, at::get_num_threads(), reps);
  std::printf("  first call (trace + compile): unfused %.0f ms, fused %.0f ms (%d fusion groups)\n",
              first_unfused, first_fused, groups);
  std::printf("                                            time        vs libtorch\n");
  row("libtorch eager", t_torch, t_torch);
  row("libtorch eager, HostCacheScope", t_torch_cached, t_torch);
  row("stagejit eager", t_eager, t_torch);
  row("stagejit compiled, fusion off", t_unfused, t_torch);
  row("stagejit compiled, fusion on", t_fused, t_torch);
  row("  ... and inter-op parallel", t_fused_par, t_torch);
  row("  ... without the host memory cache", t_fused_nocache, t_torch);
  row("six matrix products alone (floor)", t_floor, t_torch);
  std::printf("  max relative difference of the gradients to libtorch: %.2g\n", diff);
  std::printf("  target: fused >= 1.3x libtorch (%s); the largest speed-up the products allow: %.2fx\n",
              t_torch / t_fused >= 1.3 ? "met" : "NOT met", t_torch / t_floor);
}

// About `n` forward nodes: a chain where every fourth step also reuses an older value
// (fan-out), mixing unary and binary elementwise ops. T: sj::Variable or at::Tensor.
template <class T>
std::vector<T> chain(const std::vector<T>& in, int n) {
  T x = in[0], y = in[1], older = in[0];
  for (int i = 0; i < n; ++i) {
    switch (i % 4) {
      case 0: x = x * y; break;
      case 1: x = tanh(x); break;
      case 2: x = x + older; break;
      default: older = x; x = sigmoid(x) - 0.5; ++i; break;  // two nodes
    }
  }
  return {sum(x)};
}

void compile_scaling() {
  std::printf("\ntrace + compile time of generated graphs (forward + one backward stage, [8] doubles)\n");
  std::printf("  %8s %8s %10s %10s %10s %10s %10s %12s %14s %10s\n", "fwd ops", "nodes", "trace ms",
              "passes ms", "fuser ms", "closure ms", "total ms", "us per node", "libtorch f+b ms",
              "/ libtorch");
  for (int n : {100, 1000, 10000}) {
    sj::variable_list in = {sj::Variable(at::rand({8}, at::kDouble), true),
                            sj::Variable(at::rand({8}, at::kDouble), true)};
    auto fn = [n](const sj::variable_list& v) { return chain(v, n); };
    std::vector<at::Tensor> leaves = {in[0].data().detach().requires_grad_(true),
                                      in[1].data().detach().requires_grad_(true)};
    // Best of three rounds of each phase (the first round also pays first-touch page faults).
    double t_trace = 1e30, t_passes = 1e30, t_fuse = 1e30, t_closure = 1e30, t_torch = 1e30;
    std::size_t nodes = 0;
    for (int round = 0; round < 3; ++round) {
      sj::Trace tr;
      t_trace = std::min(t_trace, once_ms([&] { tr = sj::trace(fn, {in[0], in[1]}, {.derivatives = 1}); }));
      auto g = tr.graph();
      t_passes = std::min(t_passes, once_ms([&] {
        sj::passes::eliminate_dead_code(*g);
        sj::passes::eliminate_common_subexpressions(*g);
        sj::passes::eliminate_dead_code(*g);
      }));
      nodes = g->nodes().size();
      auto gf = g->clone();
      // The fuser pass alone (grouping); kernels are generated and compiled at run time.
      t_fuse = std::min(t_fuse, once_ms([&] { sj::passes::fuse(*gf); }));
      t_closure = std::min(t_closure, once_ms([&] { sj::closure::MultiStageClosure c(g, tr); }));
      t_torch = std::min(t_torch, once_ms([&] { torch::autograd::grad(chain(leaves, n), leaves); }));
    }
    const double total = t_trace + t_passes + t_fuse + t_closure;
    std::printf("  %8d %8zu %10.2f %10.2f %10.2f %10.2f %10.2f %12.2f %14.2f %10.2f\n", n, nodes,
                t_trace, t_passes, t_fuse, t_closure, total, total * 1e3 / double(nodes), t_torch,
                total / t_torch);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 30;
  std::string part = "all";
  auto usage = [&] {
    std::fprintf(stderr, "usage: %s [--reps R] [--threads T] [--part all|lstm|compile|level]\n", argv[0]);
    return 1;
  };
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) return usage();
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--part")) part = argv[i + 1];
    else if (!std::strcmp(argv[i], "--threads")) at::set_num_threads(std::atoi(argv[i + 1]));
    else return usage();
  }
  if (part != "all" && part != "lstm" && part != "compile" && part != "level") return usage();
  if (part == "all" || part == "lstm") lstm(reps, false);
  if (part == "all" || part == "compile") compile_scaling();
  if (part == "all" || part == "level") {
#if defined(__GLIBC__)
    // Blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) from the heap, and
    // the heap top never given back. The LSTM step's largest block is 4 MiB.
    if (mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 || mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1) {
      std::fprintf(stderr, "mallopt refused the level-field settings\n");
      return 1;
    }
    lstm(reps, true);
#else
    std::printf("\n(level-field part skipped: it sets glibc malloc options)\n");
#endif
  }
  return 0;
}
