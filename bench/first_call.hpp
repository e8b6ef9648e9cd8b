#pragma once
// --first-call of bench/pinn and bench/higher_order: where a compiled function's first
// call spends its time, in a fresh kernel cache. Not part of the library.
#include <stagejit/compiler.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <string>
#include <vector>

namespace stagejit::bench {

/// Points `$STAGEJIT_FUSION_CACHE_DIR` at a new empty folder under $TMPDIR (or /tmp),
/// so that every kernel is compiled. Call before the first compiled call of the process
/// (the default backend reads the variable once). Returns the folder; empty on failure.
/// The folder is removed when the process exits normally (after the backend's compiler
/// runs are waited for).
inline std::string use_fresh_kernel_cache() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/stagejit-first-call-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) return {};
  ::setenv("STAGEJIT_FUSION_CACHE_DIR", buf.data(), 1);
  static std::string folder;
  folder = buf.data();
  // Constructed now (it reads the variable), so it is destroyed after the handler runs.
  (void)fusion::default_cpu_backend();
  std::atexit([] {
    fusion::default_cpu_backend().wait_for_prefetches();
    std::error_code ec;
    std::filesystem::remove_all(folder, ec);
  });
  return folder;
}

/// The kernel cache of a `--first-call` run: a fresh folder (`use_fresh_kernel_cache`),
/// or with `warm` the default one. Returns the line to print about it; empty (after an
/// error on stderr) when no fresh folder could be made.
inline std::string first_call_cache(bool warm) {
  if (warm) return "kernel cache: the default folder (--warm-cache)";
  const std::string fresh = use_fresh_kernel_cache();
  if (fresh.empty()) {
    std::fprintf(stderr, "error: --first-call: cannot create a temporary kernel cache folder\n");
    return {};
  }
  return "kernel cache: " + fresh + " (fresh)";
}

/// The options of a bench with `--first-call`: `--first-call MODE` (`staged` or
/// `compile-loss`; `help` says what the bench measures) into `first_call`, and the
/// `--warm-cache` flag (first_call_cache's `warm`) into `warm_cache`.
inline void add_first_call_options(CLI::App& app, std::string& first_call, bool& warm_cache, const std::string& help) {
  app.add_option("--first-call", first_call, help)->check(CLI::IsMember({"staged", "compile-loss"}));
  app.add_flag("--warm-cache", warm_cache,
               "With --first-call: use the default kernel cache folder (warm once a run has filled it) instead "
               "of a fresh one");
}

/// Prints the breakdown of a first call that took `first_ms`, for the compiled
/// functions whose statistics are `stats` (summed), with the default CPU backend's
/// counters: trace, passes, closure building, source generation, compiler runs (count,
/// kernels, summed wall and CPU seconds), loading.
inline void print_first_call(const char* label, double first_ms, const std::vector<CompiledFunction::Stats>& stats) {
  double trace = 0, passes = 0, build = 0;
  for (const auto& s : stats) {
    trace += s.trace_seconds;
    passes += s.passes_seconds;
    build += s.build_seconds;
  }
  const fusion::CpuBackendStats b = fusion::default_cpu_backend().stats();
  const double codegen = 1e-6 * double(fusion::detail::codegen_microseconds().load());
  std::printf("first call of %s: %.0f ms\n", label, first_ms);
  std::printf("  trace %.0f ms, passes %.0f ms, closures %.0f ms (kernel source generation, all calls: %.0f ms)\n",
              1e3 * trace, 1e3 * passes, 1e3 * build, 1e3 * codegen);
  std::printf("  compiler runs %lld for %lld kernels (%lld from the disk cache), %.2f s wall summed over runs, "
              "%.2f s CPU; %lld prelude builds; load %.0f ms\n",
              (long long)b.compiles, (long long)b.kernels_compiled, (long long)b.disk_hits, b.compile_wall_seconds,
              b.compile_cpu_seconds, (long long)b.prelude_builds, 1e3 * b.load_seconds);
}

}  // namespace stagejit::bench
