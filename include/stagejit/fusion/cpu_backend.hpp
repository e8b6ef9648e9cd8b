#pragma once
/// \file
/// CPU fusion backend: compiles a generated kernel (`KernelSource`, launch ABI of
/// kernel_spec.hpp) with the system C++ compiler into a shared object, caches it on disk
/// and in the process, loads it with dlopen and runs it as a parallel loop over elements.
///
/// Disk cache: `$STAGEJIT_FUSION_CACHE_DIR`, else `$XDG_CACHE_HOME/stagejit`, else
/// `~/.cache/stagejit`. An entry `<hash>.so` (hash = SHA-1 of prelude + source + entry +
/// the key's device and dtypes + compiler command + flags + the compiler's `--version`;
/// rank and contiguity are run-time arguments of a CPU kernel, so they are not part of
/// it) comes with `<hash>.sum` (its checksum). The shared object exports the kernel as
/// `sjk_<hash>` (its entry point renamed), so an entry is bound to its key: a `.so`
/// installed under another entry's name lacks that symbol and is rebuilt, never run.
/// Kernels are compiled several per compiler run (`prefetch`): one translation unit
/// includes the prelude from `prelude-<hash>.hpp` (precompiled once per folder into a
/// `.gch`) and holds each kernel in a namespace of its own; the entries of one run are
/// hard links to its shared object. Entries are installed by writing temporaries and
/// renaming them, under an advisory file lock per hash, taken in hash order, so that
/// processes sharing the cache compile an entry once and never see half an entry. An
/// entry whose checksum, dlopen or dlsym fails is rebuilt. A compile that fails keeps
/// its source `<unit>.cpp` and log `<unit>.log` for the error message. A precompiled
/// prelude the compiler refuses is rebuilt once per process, then dropped (the prelude
/// is compiled inline).
///
/// Flags: `-O2`, not `-O3`: on the PINN's 30 kernels -O3 costs 3x the compile time
/// (11.2 s against 3.7 s of compiler CPU time) for no measurable run-time difference
/// (bench/fusion.md).
///
/// Generated code is written against the prelude (`cpu_prelude()`), which includes
/// ATen's header-only `at::vec::Vectorized<T>` (SLEEF underneath for transcendental
/// functions; the shared object links `libsleef`, not libtorch) and provides
/// `sjk::elementwise<T, sjk::types<In...>, sjk::types<Out...>>(begin, end, rank, args, body)`:
/// it walks `[begin, end)` row by row and calls `body(const sjk::Vec<T>* in, sjk::Vec<T>* out)`
/// on whole vectors (a contiguous fast path with plain loads when every row is dense and
/// the storage type is `T`; gathers for strided rows, a broadcast for stride 0, partial
/// vectors for the tail). Example kernel computing `tanh(a*b+c)*sigmoid(a)` in float:
///
///     extern "C" void k(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args) {
///       sjk::elementwise<float, sjk::types<float, float, float>, sjk::types<float>>(
///           begin, end, rank, args, [](const sjk::Vec<float>* in, sjk::Vec<float>* out) {
///             out[0] = (in[0] * in[1] + in[2]).tanh() * sjk::sigmoid(in[0]);
///           });
///     }

#include <stagejit/core/error.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>

#include <cstdint>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace stagejit::fusion {

/// The text prepended to every CPU kernel source (see the file comment).
const std::string& cpu_prelude();

/// The disk cache folder chosen by the environment (see the file comment); not created.
std::filesystem::path default_cache_dir();

/// How the CPU backend compiles. `from_environment()` reads `$STAGEJIT_CXX` (a command,
/// split at spaces, default `c++`) and the cache folder variables.
struct CpuBackendOptions {
  std::vector<std::string> compiler;         ///< command and leading arguments
  std::vector<std::string> flags;            ///< `-std=c++17 -O2 -march=native -fPIC -shared ...`
  std::vector<std::string> link_flags;       ///< libraries after the source (`-lsleef`)
  std::filesystem::path cache_dir;           ///< disk cache folder, created on first use
  /// Most compiler runs at once (`prefetch`); 0: one per hardware thread.
  /// `$STAGEJIT_FUSION_JOBS` sets it (FusionError for text that is not 0..1024).
  int jobs = 0;

  static CpuBackendOptions from_environment();
};

/// A loaded CPU kernel. Keeps its shared object open for its lifetime. Thread-safe.
class CpuKernel {
 public:
  /// The entry point of the launch ABI.
  using EntryFn = void (*)(int64_t begin, int64_t end, int32_t rank, const TensorArg* args);

  CpuKernel(void* handle, EntryFn fn, std::string entry, std::filesystem::path library, KernelKey key);
  ~CpuKernel();
  CpuKernel(const CpuKernel&) = delete;
  CpuKernel& operator=(const CpuKernel&) = delete;

  EntryFn entry_fn() const noexcept { return fn_; }
  const std::string& entry() const noexcept { return entry_; }
  const std::filesystem::path& library_path() const noexcept { return library_; }
  const KernelKey& key() const noexcept { return key_; }

  /// Runs the kernel over all `args.numel` elements with `at::parallel_for` (ranges of at
  /// least `grain` elements). Throws `FusionError` when the argument count differs from
  /// the key's inputs + outputs.
  void run(const PackedArgs& args, int64_t grain = 32768) const;

 private:
  void* handle_;
  EntryFn fn_;
  std::string entry_;
  std::filesystem::path library_;
  KernelKey key_;
};

/// Counters of a `CpuBackend` (for tests and diagnostics).
struct CpuBackendStats {
  int64_t compiles = 0;         ///< compiler runs (successful or not; one run builds several kernels)
  int64_t kernels_compiled = 0; ///< kernels built by those runs
  int64_t disk_hits = 0;        ///< kernels loaded from the disk cache without compiling
  int64_t memory_hits = 0;      ///< requests served by the in-process cache
  int64_t corrupt_entries = 0;  ///< disk entries found corrupt and rebuilt
  int64_t prelude_builds = 0;   ///< precompiled preludes built (once per cache folder and flags)
  double compile_wall_seconds = 0;  ///< summed wall time of the compiler runs (they overlap when parallel)
  double compile_cpu_seconds = 0;   ///< summed CPU time (user + system) of the compiler runs
  double load_seconds = 0;          ///< checksum, dlopen and dlsym of loaded entries
};

/// Compiles, caches and loads CPU kernels. Thread-safe: concurrent `get` calls for one
/// source compile it once (the others wait for that compile); a failed compile is
/// remembered and rethrown for that source.
class CpuBackend {
 public:
  explicit CpuBackend(CpuBackendOptions options = CpuBackendOptions::from_environment());
  ~CpuBackend();
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  /// The loaded kernel for `source` (prelude prepended), compiling it if no valid disk
  /// entry exists. Throws `FusionError` with the compiler's log and the path of the
  /// source file when compilation fails, or naming the entry point when the shared
  /// object lacks it, or when the compiler cannot be run or the cache is not writable.
  std::shared_ptr<const CpuKernel> get(const KernelSource& source);

  /// `get` without waiting: the kernel's future, ready at once for a kernel built or
  /// loaded before; otherwise its build (disk cache or compiler) runs on a background
  /// thread. The future rethrows what `get` would throw. Throws `FusionError` at once
  /// for a source `get` refuses before building (no entry point, not a CPU kernel).
  std::shared_future<std::shared_ptr<const CpuKernel>> get_async(const KernelSource& source);

  /// Starts building, in the background, every kernel of `sources` that this backend has
  /// not built or loaded yet: loads those in the disk cache, and compiles the rest in up
  /// to `options().jobs` concurrent compiler runs, several kernels per run. A later `get`
  /// of one of them waits for its build instead of starting another. Sources that `get`
  /// would refuse are skipped here (`get` reports them). Does not throw for build
  /// failures (`get` rethrows them); may throw `std::system_error` when no thread can
  /// be started.
  void prefetch(const std::vector<KernelSource>& sources);

  /// Waits until every background build (`prefetch`, `get_async`) has finished.
  void wait_for_prefetches();

  /// Creates the cache folder and builds the precompiled prelude if it is missing, so
  /// that later `get` calls compile faster (call it early, e.g. from a background
  /// thread). Throws `FusionError` when the folder cannot be created.
  void prepare();

  /// The cache hash of `source` under this backend's compiler and flags (40 hex digits).
  std::string hash_of(const KernelSource& source) const;

  /// The text of a cache entry's `<hash>.sum` for a shared object whose bytes are `bytes`:
  /// its size and a 64-bit hash of its content (not a cryptographic digest: it detects a
  /// damaged file; a library swapped for another kernel's fails the entry-symbol check).
  static std::string checksum(const std::string& bytes);

  CpuBackendStats stats() const;
  const CpuBackendOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The process-wide backend, configured from the environment at first use.
CpuBackend& default_cpu_backend();

}  // namespace stagejit::fusion
