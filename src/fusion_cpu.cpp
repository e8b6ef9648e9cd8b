// CPU fusion backend: compile with the system C++ compiler, cache on disk, dlopen, run.
#include <stagejit/core/error.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/detail/build_once.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <ATen/Parallel.h>
#include <c10/util/hash.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <mutex>
#include <sstream>
#include <string_view>
#include <cstdio>
#include <thread>
#include <unordered_map>

extern char** environ;

namespace stagejit::fusion {

namespace fs = std::filesystem;

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream is(s);
  std::vector<std::string> out;
  for (std::string w; is >> w;) out.push_back(w);
  return out;
}

std::string join(const std::vector<std::string>& ws) {
  std::string out;
  for (const auto& w : ws) {
    if (!out.empty()) out += ' ';
    out += w;
  }
  return out;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  STAGEJIT_CHECK_AS(FusionError, out.good(), "fusion: cannot write ", p.string(), ": ", std::strerror(errno));
}

std::string sha1_hex(const std::string& bytes) {
  // c10::sha1 leaves its state uninitialised for an empty string; never hash one.
  return c10::sha1(bytes.empty() ? std::string(1, '\0') : bytes).str();
}

/// The `.sum` of a cached shared object: its size and a 64-bit hash of its bytes
/// (libstdc++'s `std::hash` of a string, MurmurHash64A). It detects a truncated or damaged
/// file; a library swapped for another kernel's fails the symbol check instead. SHA-1 cost
/// about 1 ms per 100 KiB library on every load, a third of a warm first call's hashing.
std::string content_checksum(const std::string& bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "size %zu murmur64 %016zx", bytes.size(), std::hash<std::string_view>{}(bytes));
  return buf;
}

/// A name unique within the machine for a temporary next to `final_path`.
fs::path temp_name(const fs::path& final_path) {
  static std::atomic<uint64_t> counter{0};
  return fs::path(final_path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(++counter));
}

/// Writes `text` to a temporary and renames it over `path` (atomic for readers).
void install_file(const fs::path& path, const std::string& text) {
  const fs::path tmp = temp_name(path);
  write_file(tmp, text);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  STAGEJIT_CHECK_AS(FusionError, !ec, "fusion: cannot install ", path.string(), ": ", ec.message());
}

/// What a finished compiler run cost: its exit status (or 128 + signal), wall and CPU
/// seconds (the child's user + system time, from wait4).
struct RunResult {
  int status = 255;
  double wall_seconds = 0;
  double cpu_seconds = 0;
};

/// Runs `argv` with stdout and stderr redirected to `log`. Throws FusionError when the
/// program cannot be started, naming it and `$STAGEJIT_CXX`.
RunResult run_program(const std::vector<std::string>& argv, const fs::path& log) {
  STAGEJIT_CHECK_AS(FusionError, !argv.empty() && !argv[0].empty(),
                    "fusion: empty compiler command (set $STAGEJIT_CXX to a C++ compiler, or unset it for `c++`)");
  const auto t0 = std::chrono::steady_clock::now();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  STAGEJIT_CHECK_AS(FusionError, rc == 0, "fusion: cannot run the kernel compiler `", argv[0], "`: ", std::strerror(rc),
                    " (set $STAGEJIT_CXX to a C++ compiler)");
  int status = 0;
  struct rusage usage {};
  while (::wait4(pid, &status, 0, &usage) < 0) {
    STAGEJIT_CHECK_AS(FusionError, errno == EINTR, "fusion: waiting for the kernel compiler failed: ",
                      std::strerror(errno));
  }
  RunResult r;
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.cpu_seconds = double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                  1e-6 * double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
  if (WIFEXITED(status)) r.status = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) r.status = 128 + WTERMSIG(status);
  return r;
}

/// An exclusive advisory lock on a file, released on destruction.
class FileLock {
 public:
  explicit FileLock(const fs::path& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    STAGEJIT_CHECK_AS(FusionError, fd_ >= 0, "fusion: cannot open the cache lock ", path.string(), ": ",
                      std::strerror(errno));
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        const int err = errno;
        ::close(fd_);
        ::stagejit::detail::throw_error<FusionError>("fusion: cannot lock ", path.string(), ": ", std::strerror(err));
      }
    }
  }
  ~FileLock() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

/// Whether a compiler log blames a precompiled header (GCC: "one or more PCH files were
/// found, but they were invalid", "while reading precompiled header", "x.hpp.gch: ...").
bool mentions_pch(std::string log) {
  std::transform(log.begin(), log.end(), log.begin(), [](unsigned char c) { return std::tolower(c); });
  return log.find(".gch") != std::string::npos || log.find("pch") != std::string::npos ||
         log.find("precompiled header") != std::string::npos;
}

/// Whether `s` is a C identifier (an entry point name the kernel's symbol replaces).
bool is_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isalnum(c) || c == '_'; });
}

/// What a CPU kernel's code depends on besides its source: device and dtypes. Rank and
/// contiguity are run-time arguments of the generated loop (`sjk::elementwise`), so
/// calls that differ only in them share one kernel.
std::string canonical_key(const KernelKey& key) {
  std::string s = to_string(key.device);
  for (const auto& d : key.inputs) s += std::string(",i") + c10::toString(d.dtype);
  for (const auto& d : key.outputs) s += std::string(",o") + c10::toString(d.dtype);
  return s;
}

std::string cpu_flags_line() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("flags", 0) == 0) return line;
  return "unknown-cpu";
}

}  // namespace

fs::path default_cache_dir() {
  if (const char* d = std::getenv("STAGEJIT_FUSION_CACHE_DIR"); d && *d) return fs::path(d);
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return fs::path(x) / "stagejit";
  if (const char* h = std::getenv("HOME"); h && *h) return fs::path(h) / ".cache" / "stagejit";
  return fs::temp_directory_path() / ("stagejit-" + std::to_string(::getuid()));
}

CpuBackendOptions CpuBackendOptions::from_environment() {
  CpuBackendOptions o;
  o.compiler = split_words(env_or("STAGEJIT_CXX", "c++"));
  // -ffp-contract=off: no FMA contraction of a*b+c, so fused results round like ATen's
  // op-by-op kernels.
  o.flags = {"-std=c++17", "-O2", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-w"};
#ifdef STAGEJIT_TORCH_INCLUDE
  // The libtorch stagejit was built against (-Dlibtorch=PATH): its ATen headers.
  o.flags.push_back("-isystem");
  o.flags.push_back(STAGEJIT_TORCH_INCLUDE);
#endif
#ifdef STAGEJIT_FUSION_HAVE_SLEEF
  o.link_flags = {"-lsleef"};
#else
  // Without SLEEF, ATen's Vectorized falls back to its portable (scalar-library) version.
  o.flags.push_back("-DSTAGEJIT_NO_SLEEF=1");
#endif
  o.cache_dir = default_cache_dir();
  if (const char* j = std::getenv("STAGEJIT_FUSION_JOBS"); j && *j) {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(j, &end, 10);
    STAGEJIT_CHECK_AS(FusionError, errno == 0 && end && *end == '\0' && v >= 0 && v <= 1024,
                      "fusion: $STAGEJIT_FUSION_JOBS must be a number of concurrent compiler runs in [0, 1024] ",
                      "(0: one per core), got '", j, "'");
    o.jobs = int(v);
  }
  return o;
}

// ------------------------------------------------------------------------- CpuKernel

CpuKernel::CpuKernel(void* handle, EntryFn fn, std::string entry, fs::path library, KernelKey key)
    : handle_(handle), fn_(fn), entry_(std::move(entry)), library_(std::move(library)), key_(std::move(key)) {}

CpuKernel::~CpuKernel() {
  if (handle_) ::dlclose(handle_);
}

void CpuKernel::run(const PackedArgs& args, int64_t grain) const {
  const std::size_t want = key_.inputs.size() + key_.outputs.size();
  STAGEJIT_CHECK_AS(FusionError, args.args.size() == want, "fusion kernel `", entry_, "` takes ", key_.inputs.size(),
                    " inputs and ", key_.outputs.size(), " outputs but was given ", args.args.size(), " tensors");
  STAGEJIT_CHECK_AS(FusionError, args.device.is_cpu(), "fusion kernel `", entry_, "` is a CPU kernel but its tensors are on ",
                    args.device);
  STAGEJIT_CHECK_AS(FusionError, args.rank >= 1 && args.rank <= kMaxDims, "fusion kernel `", entry_,
                    "` called with rank ", args.rank);
  for (std::size_t k = 0; k < want; ++k) {
    const bool is_in = k < key_.inputs.size();
    const at::ScalarType expected = is_in ? key_.inputs[k].dtype : key_.outputs[k - key_.inputs.size()].dtype;
    STAGEJIT_CHECK_AS(FusionError, k >= args.dtypes.size() || args.dtypes[k] == expected, "fusion kernel `", entry_,
                      "` ", (is_in ? "input " : "output "), (is_in ? k : k - key_.inputs.size()), " must be ",
                      expected, " but is ", args.dtypes[k]);
  }
  if (args.numel == 0) return;
  const TensorArg* a = args.args.data();
  const int32_t rank = args.rank;
  EntryFn fn = fn_;
  at::parallel_for(0, args.numel, std::max<int64_t>(grain, 1),
                   [&](int64_t begin, int64_t end) { fn(begin, end, rank, a); });
}

// ------------------------------------------------------------------------- CpuBackend

namespace {

using KernelPtr = std::shared_ptr<const CpuKernel>;

/// One kernel a build is responsible for: its source, cache hash and the promise its
/// waiters hold the future of.
struct BuildItem {
  KernelSource source;
  std::string hash;
  std::promise<KernelPtr> promise;
  bool done = false;

  void set(KernelPtr k) {
    if (done) return;
    done = true;
    promise.set_value(std::move(k));
  }
  void fail(std::exception_ptr e) {
    if (done) return;
    done = true;
    promise.set_exception(std::move(e));
  }
};

/// The exported symbol of the kernel with cache hash `hash`: binds a shared object to the
/// entry it was built for (a `.so` installed under another entry's name has no such
/// symbol, so it is found corrupt and rebuilt instead of run).
std::string symbol_of(const std::string& hash) { return "sjk_" + hash; }

}  // namespace

struct CpuBackend::Impl {
  CpuBackendOptions options;
  std::string prelude;  // cpu_prelude(), copied: compile threads may outlive function statics
  std::once_flag identity_once;
  std::once_flag common_once;
  std::string common;  // common_digest()
  std::string identity;
  std::mutex mutex;
  std::unordered_map<std::string, std::shared_future<KernelPtr>> kernels;
  std::atomic<int64_t> compiles{0}, kernels_compiled{0}, disk_hits{0}, memory_hits{0}, corrupt{0}, prelude_builds{0};
  std::atomic<int64_t> compile_wall_us{0}, compile_cpu_us{0}, load_us{0};
  std::atomic<bool> pch_disabled{false};
  std::atomic<bool> pch_rebuilt{false};
  // The build queue: kernels claimed and not yet built wait here; up to `jobs()` worker
  // threads take batches from it (one compiler run each), so kernels asked for while
  // others compile join the next runs instead of starting more compilers than cores.
  std::mutex queue_mutex;
  std::condition_variable queue_idle;
  std::deque<std::unique_ptr<BuildItem>> queue;
  std::vector<std::thread> workers;
  std::size_t active_workers = 0;
  std::size_t busy_workers = 0;  // workers building a batch

  ~Impl() { join_all(); }

  std::size_t jobs() const {
    return options.jobs > 0 ? std::size_t(options.jobs) : std::max<std::size_t>(1, std::thread::hardware_concurrency());
  }

  /// Waits until the queue is empty and no worker runs, then joins the finished threads.
  void join_all() {
    std::vector<std::thread> done;
    {
      std::unique_lock<std::mutex> lock(queue_mutex);
      queue_idle.wait(lock, [&] { return queue.empty() && active_workers == 0; });
      done.swap(workers);
    }
    for (auto& t : done)
      if (t.joinable()) t.join();
  }

  /// Queues `items` and starts workers up to `jobs()`.
  void launch(std::vector<BuildItem> items) {
    std::lock_guard<std::mutex> lock(queue_mutex);
    for (auto& it : items) queue.push_back(std::make_unique<BuildItem>(std::move(it)));
    while (active_workers < jobs() && active_workers < queue.size()) {
      ++active_workers;
      try {
        workers.emplace_back([this] { work(); });
      } catch (...) {
        --active_workers;  // no thread: the queued items wait for a later launch or `get`
        if (active_workers == 0) {
          for (auto& it : queue) it->fail(std::current_exception());
          queue.clear();
        }
        throw;
      }
    }
  }

  /// A worker: takes a share of the queue (its length over the number of workers,
  /// rounded up), builds it with one compiler run, and goes on until the queue is empty.
  void work() {
    for (;;) {
      std::vector<std::unique_ptr<BuildItem>> batch;
      {
        std::lock_guard<std::mutex> lock(queue_mutex);
        if (queue.empty()) {
          --active_workers;
          if (active_workers == 0) {
            queue_idle.notify_all();
          }
          break;
        }
        const std::size_t idle = std::max<std::size_t>(1, active_workers - busy_workers);
        const std::size_t n = (queue.size() + idle - 1) / idle;
        ++busy_workers;
        for (std::size_t i = 0; i < n && !queue.empty(); ++i) {
          batch.push_back(std::move(queue.front()));
          queue.pop_front();
        }
      }
      std::vector<BuildItem*> items;
      for (auto& it : batch) items.push_back(it.get());
      build_items(items);
      {
        std::lock_guard<std::mutex> lock(queue_mutex);
        --busy_workers;
      }
      auto left = std::make_exception_ptr(FusionError("fusion: internal error: a kernel build ended without a result"));
      for (auto& it : batch) it->fail(left);
    }
  }

  /// The compiler command; FusionError naming `$STAGEJIT_CXX` when it is blank.
  const std::vector<std::string>& compiler() const {
    if (options.compiler.empty() || options.compiler[0].empty()) {
      const char* env = std::getenv("STAGEJIT_CXX");
      ::stagejit::detail::throw_error<FusionError>("fusion: no kernel compiler: ",
                                       env ? "$STAGEJIT_CXX is set to '" + std::string(env) + "', which names no command"
                                           : std::string("the backend's compiler command is empty"),
                                       " (set $STAGEJIT_CXX to a C++ compiler, or unset it for `c++`)");
    }
    return options.compiler;
  }

  const std::string& compiler_identity() {
    std::call_once(identity_once, [&] {
      std::string version = "unavailable";
      try {
        fs::create_directories(options.cache_dir);
        const fs::path log = temp_name(options.cache_dir / "compiler-version");
        std::vector<std::string> argv = compiler();
        argv.push_back("--version");
        if (run_program(argv, log).status == 0) version = read_file(log);
        std::error_code ec;
        fs::remove(log, ec);
      } catch (const std::exception&) {
        // The compile itself will report the problem.
      }
      identity = version + "\n" + cpu_flags_line();
    });
    return identity;
  }

  /// SHA-1 of what every kernel shares: prelude, compiler command, flags and identity,
  /// computed once (the prelude alone is 11 KB, hashed again for every kernel before).
  const std::string& common_digest() {
    std::call_once(common_once, [&] {
      common = sha1_hex(prelude + '\x01' + join(options.compiler) + '\x01' + join(options.flags) + '\x01' +
                        join(options.link_flags) + '\x01' + compiler_identity());
    });
    return common;
  }

  std::string hash_of(const KernelSource& src) {
    return sha1_hex(common_digest() + '\x01' + src.source + '\x01' + src.entry + '\x01' + canonical_key(src.key));
  }

  fs::path cache_dir() {
    const fs::path dir = options.cache_dir;
    std::error_code ec;
    fs::create_directories(dir, ec);
    STAGEJIT_CHECK_AS(FusionError, !ec, "fusion: cannot create the kernel cache folder ", dir.string(), ": ",
                      ec.message(), " (set $STAGEJIT_FUSION_CACHE_DIR)");
    return dir;
  }

  /// Loads a valid disk entry, or returns null (removing an entry found corrupt).
  KernelPtr try_load(const KernelSource& src, const std::string& hash, const fs::path& dir, std::string* why) {
    const fs::path so = dir / (hash + ".so");
    const fs::path sum = dir / (hash + ".sum");
    std::error_code ec;
    if (!fs::exists(so, ec) && !fs::exists(sum, ec)) return nullptr;
    auto corrupt_entry = [&](const std::string& reason) -> KernelPtr {
      if (why) *why = reason;
      ++corrupt;
      fs::remove(so, ec);
      fs::remove(sum, ec);
      return nullptr;
    };
    if (!fs::exists(so, ec) || !fs::exists(sum, ec)) return corrupt_entry("incomplete entry");
    const auto t0 = std::chrono::steady_clock::now();
    if (content_checksum(read_file(so)) != read_file(sum)) return corrupt_entry("checksum mismatch");
    void* handle = ::dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) return corrupt_entry(std::string("dlopen: ") + ::dlerror());
    const std::string symbol = symbol_of(hash);
    void* sym = ::dlsym(handle, symbol.c_str());
    if (!sym) {
      ::dlclose(handle);
      return corrupt_entry("no symbol `" + symbol + "` for the entry point `" + src.entry +
                           "` (the source defines no such entry point, or the library belongs to another kernel)");
    }
    load_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    return std::make_shared<const CpuKernel>(handle, reinterpret_cast<CpuKernel::EntryFn>(sym), src.entry, so,
                                             src.key);
  }

  /// The prelude as a header in the cache folder, with a precompiled `.gch` next to it
  /// when the compiler can build one (GCC then skips parsing ATen's vec headers: about
  /// 1.7 s less per compiler run). GCC ignores a `.gch` built for other options. The name
  /// hashes prelude, compiler, flags. `rebuild`: remove the `.gch` first and build it again.
  fs::path prelude_header(const fs::path& dir, bool rebuild = false, bool build_pch = true) {
    const std::string h = sha1_hex(prelude + '\x01' + join(options.compiler) + '\x01' + join(options.flags) +
                                   '\x01' + compiler_identity())
                              .substr(0, 16);
    const fs::path header = dir / ("prelude-" + h + ".hpp");
    const fs::path pch = fs::path(header.string() + ".gch");
    std::error_code ec;
    // Checked on every compile (a few KiB, next to a compile of seconds): a damaged
    // header would otherwise fail every kernel.
    if (!rebuild && read_file(header) == prelude && (pch_disabled || !build_pch || fs::exists(pch, ec)))
      return header;
    FileLock lock(dir / ("prelude-" + h + ".lock"));
    if (read_file(header) != prelude) {
      install_file(header, prelude);
      fs::remove(pch, ec);  // built from other text
    }
    if (rebuild) fs::remove(pch, ec);
    if (build_pch && !pch_disabled && !fs::exists(pch, ec)) {
      const fs::path tmp = temp_name(pch);
      const fs::path log = temp_name(dir / ("prelude-" + h + ".log"));
      std::vector<std::string> argv = compiler();
      for (const auto& f : options.flags)
        if (f != "-shared") argv.push_back(f);
      argv.insert(argv.end(), {"-x", "c++-header", header.string(), "-o", tmp.string()});
      ++prelude_builds;
      if (run_program(argv, log).status == 0) {
        fs::rename(tmp, pch, ec);
      } else {
        pch_disabled = true;  // kernels include the plain header
      }
      fs::remove(tmp, ec);
      fs::remove(log, ec);
    }
    return header;
  }

  /// The translation unit of `items`: the prelude (included, so its `.gch` is used, or
  /// inline), then each kernel's source in a namespace of its own with its entry point
  /// renamed to its symbol (`symbol_of`).
  std::string unit_text(const std::vector<BuildItem*>& items, const fs::path& header, bool inline_prelude) const {
    std::string text = inline_prelude ? prelude + "\n" : "#include \"" + header.string() + "\"\n";
    text += "#include <cstdint>\n#include <limits>\n";
    for (const BuildItem* it : items) {
      text += "// kernel " + it->hash + " (" + it->source.key.to_string() + ")\nnamespace sjk_unit_" + it->hash +
              " {\n#define " + it->source.entry + " " + symbol_of(it->hash) + "\n" + it->source.source + "\n#undef " +
              it->source.entry + "\n}  // namespace sjk_unit_" + it->hash + "\n";
    }
    return text;
  }

  /// One compiler run over `items` into the shared object `so_tmp`, retrying once with a
  /// rebuilt precompiled prelude and then with the prelude inline when the log blames the
  /// `.gch`. Returns the exit status; the log is left at `log`, the unit at `cpp`.
  int compile_unit(const fs::path& dir, const std::vector<BuildItem*>& items, const fs::path& cpp,
                   const fs::path& so_tmp, const fs::path& log) {
    std::vector<std::string> argv;
    auto run = [&](bool inline_prelude, bool rebuild_pch) {
      // A missing `.gch` is not waited for (building it takes longer than parsing the
      // prelude in a few runs): the run includes the prelude inline, and `build_items`
      // builds the `.gch` afterwards for later runs.
      const fs::path header = prelude_header(dir, rebuild_pch, /*build_pch=*/rebuild_pch);
      std::error_code ec2;
      const bool have_pch = !pch_disabled && fs::exists(header.string() + ".gch", ec2);
      install_file(cpp, unit_text(items, header, inline_prelude || !have_pch));
      argv = compiler();
      argv.insert(argv.end(), options.flags.begin(), options.flags.end());
      argv.insert(argv.end(), {"-o", so_tmp.string(), cpp.string()});
      argv.insert(argv.end(), options.link_flags.begin(), options.link_flags.end());
      ++compiles;
      const RunResult r = run_program(argv, log);
      compile_wall_us += int64_t(r.wall_seconds * 1e6);
      compile_cpu_us += int64_t(r.cpu_seconds * 1e6);
      return r.status;
    };
    int status = run(false, false);
    std::error_code ec;
    if (status != 0 && !pch_disabled && mentions_pch(read_file(log))) {
      // A damaged precompiled prelude: build it again, once per process; if the fresh one
      // fails too, stop using precompiled preludes in this process (prelude inline).
      if (!pch_rebuilt.exchange(true)) status = run(false, true);
      if (status != 0 && mentions_pch(read_file(log))) {
        pch_disabled = true;
        fs::remove(prelude_header(dir).string() + ".gch", ec);
        status = run(true, false);
      }
    }
    last_command = join(argv);
    return status;
  }
  thread_local static std::string last_command;

  /// Builds `items` (all of whose cache locks the caller holds) with one compiler run and
  /// installs an entry per kernel: `<hash>.so` (hard links to the one shared object) and
  /// `<hash>.sum`. When the run fails and there are several items, builds each alone so
  /// that the failure is reported for its own kernel. Fulfils every item.
  void compile_and_install(const fs::path& dir, std::vector<BuildItem*> items) {
    if (items.empty()) return;
    const std::string unit = items.size() == 1 ? items[0]->hash : "batch-" + sha1_hex([&] {
      std::string all;
      for (const BuildItem* it : items) all += it->hash;
      return all;
    }()).substr(0, 16);
    const fs::path cpp = dir / (unit + ".cpp");
    const fs::path log = dir / (unit + ".log");
    const fs::path so_tmp = temp_name(dir / (unit + ".so"));
    std::error_code ec;
    int status = 255;
    try {
      status = compile_unit(dir, items, cpp, so_tmp, log);
    } catch (...) {
      fs::remove(so_tmp, ec);
      for (BuildItem* it : items) it->fail(std::current_exception());
      return;
    }
    if (status != 0) {
      fs::remove(so_tmp, ec);
      if (items.size() > 1) {
        fs::remove(cpp, ec);
        fs::remove(log, ec);
        for (BuildItem* it : items) compile_and_install(dir, {it});
        return;
      }
      BuildItem* it = items[0];
      try {
        ::stagejit::detail::throw_error<FusionError>("fusion: compiling kernel `", it->source.entry, "` (", it->source.key.to_string(),
                                         ") failed with exit status ", status, "\n  source: ", cpp.string(),
                                         "\n  command: ", last_command, "\n  compiler log (", log.string(), "):\n",
                                         read_file(log));
      } catch (...) {
        it->fail(std::current_exception());
      }
      return;
    }
    kernels_compiled += int64_t(items.size());
    fs::remove(log, ec);
    fs::remove(cpp, ec);
    const std::string checksum = content_checksum(read_file(so_tmp));
    for (BuildItem* it : items) {
      try {
        const fs::path so = dir / (it->hash + ".so");
        const fs::path link = temp_name(so);
        fs::create_hard_link(so_tmp, link, ec);
        if (ec) fs::copy_file(so_tmp, link, ec);
        STAGEJIT_CHECK_AS(FusionError, !ec, "fusion: cannot install ", so.string(), ": ", ec.message());
        install_file(dir / (it->hash + ".sum"), checksum);
        fs::rename(link, so, ec);
        STAGEJIT_CHECK_AS(FusionError, !ec, "fusion: cannot install ", so.string(), ": ", ec.message());
        std::string why;
        auto k = try_load(it->source, it->hash, dir, &why);
        if (!k) {
          --corrupt;  // not a corrupt cache entry: the fresh build itself does not load
          ::stagejit::detail::throw_error<FusionError>("fusion: kernel `", it->source.entry, "` (", it->source.key.to_string(),
                                           ") was compiled but cannot be loaded: ", why);
        }
        it->set(std::move(k));
      } catch (...) {
        it->fail(std::current_exception());
      }
    }
    fs::remove(so_tmp, ec);
  }

  /// Serves `items` from the disk cache or builds them: under the cache locks of all of
  /// them (taken in hash order, so processes building overlapping sets cannot deadlock),
  /// loads the entries present and compiles the rest with one compiler run.
  void build_batch(const fs::path& dir, std::vector<BuildItem*> items) {
    std::sort(items.begin(), items.end(), [](const BuildItem* a, const BuildItem* b) { return a->hash < b->hash; });
    std::vector<std::unique_ptr<FileLock>> locks;
    std::vector<BuildItem*> missing;
    try {
      for (BuildItem* it : items) locks.push_back(std::make_unique<FileLock>(dir / (it->hash + ".lock")));
      for (BuildItem* it : items) {
        if (auto k = try_load(it->source, it->hash, dir, nullptr)) {
          ++disk_hits;
          it->set(std::move(k));
        } else {
          missing.push_back(it);
        }
      }
    } catch (...) {
      for (BuildItem* it : items) it->fail(std::current_exception());
      return;
    }
    compile_and_install(dir, missing);
  }

  /// Builds `items` with one compiler run (after the disk cache), then the precompiled
  /// prelude for later runs when it is missing. Fulfils every item.
  void build_items(const std::vector<BuildItem*>& items) {
    if (items.empty()) return;
    fs::path dir;
    try {
      dir = cache_dir();
      compiler();
    } catch (...) {
      for (BuildItem* it : items) it->fail(std::current_exception());
      return;
    }
    build_batch(dir, items);
    try {
      prelude_header(dir);
    } catch (const std::exception&) {
      // Kernels are built without it.
    }
  }

  /// Registers every source of `sources` not already known (in the process) and returns
  /// the build items this caller is responsible for; `futures` gets each source's future.
  std::vector<BuildItem> claim(const std::vector<KernelSource>& sources,
                               std::vector<std::shared_future<KernelPtr>>* futures) {
    std::vector<BuildItem> mine;
    std::vector<std::string> hashes;
    for (const auto& s : sources) hashes.push_back(hash_of(s));
    std::lock_guard<std::mutex> lock(mutex);
    for (std::size_t i = 0; i < sources.size(); ++i) {
      auto it = kernels.find(hashes[i]);
      if (it != kernels.end()) {
        if (futures) futures->push_back(it->second);
        continue;
      }
      BuildItem item;
      item.source = sources[i];
      item.hash = hashes[i];
      auto f = item.promise.get_future().share();
      kernels.emplace(hashes[i], f);
      if (futures) futures->push_back(f);
      mine.push_back(std::move(item));
    }
    return mine;
  }
};

thread_local std::string CpuBackend::Impl::last_command;

namespace {

void check_cpu_source(const KernelSource& source) {
  STAGEJIT_CHECK_AS(FusionError, !source.entry.empty(), "fusion kernel source without an entry point name");
  STAGEJIT_CHECK_AS(FusionError, is_identifier(source.entry), "fusion kernel entry point `", source.entry,
                    "` is not a C identifier");
  STAGEJIT_CHECK_AS(FusionError, source.key.device == DeviceKind::CPU, "the CPU fusion backend was given a ",
                    to_string(source.key.device), " kernel `", source.entry, "`");
}

}  // namespace

CpuBackend::CpuBackend(CpuBackendOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->prelude = cpu_prelude();
}

CpuBackend::~CpuBackend() = default;

const CpuBackendOptions& CpuBackend::options() const noexcept { return impl_->options; }

void CpuBackend::prepare() {
  const fs::path dir = impl_->cache_dir();
  impl_->prelude_header(dir);
}

std::string CpuBackend::hash_of(const KernelSource& source) const { return impl_->hash_of(source); }

std::string CpuBackend::checksum(const std::string& bytes) { return content_checksum(bytes); }

CpuBackendStats CpuBackend::stats() const {
  CpuBackendStats s;
  s.compiles = impl_->compiles;
  s.kernels_compiled = impl_->kernels_compiled;
  s.disk_hits = impl_->disk_hits;
  s.memory_hits = impl_->memory_hits;
  s.corrupt_entries = impl_->corrupt;
  s.prelude_builds = impl_->prelude_builds;
  s.compile_wall_seconds = 1e-6 * double(impl_->compile_wall_us.load());
  s.compile_cpu_seconds = 1e-6 * double(impl_->compile_cpu_us.load());
  s.load_seconds = 1e-6 * double(impl_->load_us.load());
  return s;
}

std::shared_ptr<const CpuKernel> CpuBackend::get(const KernelSource& source) {
  check_cpu_source(source);
  std::vector<std::shared_future<KernelPtr>> futures;
  std::vector<BuildItem> mine = impl_->claim({source}, &futures);
  if (mine.empty()) {
    ++impl_->memory_hits;
  } else {
    // Built here, on the caller's thread (no queue: the caller waits anyway).
    BuildItem* item = &mine[0];
    impl_->build_items({item});
    item->fail(std::make_exception_ptr(FusionError("fusion: internal error: a kernel build ended without a result")));
  }
  return futures.at(0).get();
}

std::shared_future<std::shared_ptr<const CpuKernel>> CpuBackend::get_async(const KernelSource& source) {
  check_cpu_source(source);
  std::vector<std::shared_future<KernelPtr>> futures;
  std::vector<BuildItem> mine = impl_->claim({source}, &futures);
  if (mine.empty()) {
    ++impl_->memory_hits;
    return futures.at(0);
  }
  impl_->launch(std::move(mine));
  return futures.at(0);
}

void CpuBackend::prefetch(const std::vector<KernelSource>& sources) {
  std::vector<KernelSource> valid;
  for (const auto& s : sources) {
    try {
      check_cpu_source(s);
      valid.push_back(s);
    } catch (const FusionError&) {
      // `get` reports it for the group that asks.
    }
  }
  std::vector<BuildItem> mine = impl_->claim(valid, nullptr);
  if (!mine.empty()) impl_->launch(std::move(mine));
}

void CpuBackend::wait_for_prefetches() { impl_->join_all(); }

CpuBackend& default_cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace stagejit::fusion
