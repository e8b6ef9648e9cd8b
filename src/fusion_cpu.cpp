// CPU fusion backend: compile with the system C++ compiler, cache on disk, dlopen, run.
#include <stagejit/core/error.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/detail/build_once.hpp>

#include <ATen/Parallel.h>
#include <c10/util/hash.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <sstream>
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

/// Runs `argv` with stdout and stderr redirected to `log`; returns the exit status (or
/// 128 + signal). Throws FusionError when the program cannot be started.
int run_program(const std::vector<std::string>& argv, const fs::path& log) {
  STAGEJIT_CHECK_AS(FusionError, !argv.empty(), "fusion: empty compiler command (set $STAGEJIT_CXX)");
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
  while (::waitpid(pid, &status, 0) < 0) {
    STAGEJIT_CHECK_AS(FusionError, errno == EINTR, "fusion: waiting for the kernel compiler failed: ",
                      std::strerror(errno));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 255;
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
        detail::throw_error<FusionError>("fusion: cannot lock ", path.string(), ": ", std::strerror(err));
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

/// Whether a compiler log blames a precompiled header.
bool mentions_pch(std::string log) {
  std::transform(log.begin(), log.end(), log.begin(), [](unsigned char c) { return std::tolower(c); });
  return log.find(".gch") != std::string::npos || log.find("pch") != std::string::npos;
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
  o.flags = {"-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-w"};
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

struct CpuBackend::Impl {
  CpuBackendOptions options;
  std::once_flag identity_once;
  std::string identity;
  std::mutex mutex;
  std::unordered_map<std::string, std::shared_future<std::shared_ptr<const CpuKernel>>> kernels;
  std::atomic<int64_t> compiles{0}, disk_hits{0}, memory_hits{0}, corrupt{0}, prelude_builds{0};
  std::atomic<bool> pch_disabled{false};

  const std::string& compiler_identity() {
    std::call_once(identity_once, [&] {
      std::string version = "unavailable";
      try {
        fs::create_directories(options.cache_dir);
        const fs::path log = temp_name(options.cache_dir / "compiler-version");
        std::vector<std::string> argv = options.compiler;
        argv.push_back("--version");
        if (run_program(argv, log) == 0) version = read_file(log);
        std::error_code ec;
        fs::remove(log, ec);
      } catch (const std::exception&) {
        // The compile itself will report the problem.
      }
      identity = version + "\n" + cpu_flags_line();
    });
    return identity;
  }

  std::string hash_of(const KernelSource& src) {
    std::string text;
    text += cpu_prelude();
    text += '\x01' + src.source + '\x01' + src.entry + '\x01' + src.key.to_string();
    text += '\x01' + join(options.compiler) + '\x01' + join(options.flags) + '\x01' + join(options.link_flags);
    text += '\x01' + compiler_identity();
    return sha1_hex(text);
  }

  /// Loads a valid disk entry, or returns null (removing an entry found corrupt).
  std::shared_ptr<const CpuKernel> try_load(const KernelSource& src, const fs::path& so, const fs::path& sum,
                                            std::string* why) {
    std::error_code ec;
    if (!fs::exists(so, ec) && !fs::exists(sum, ec)) return nullptr;
    auto corrupt_entry = [&](const std::string& reason) -> std::shared_ptr<const CpuKernel> {
      if (why) *why = reason;
      ++corrupt;
      fs::remove(so, ec);
      fs::remove(sum, ec);
      return nullptr;
    };
    if (!fs::exists(so, ec) || !fs::exists(sum, ec)) return corrupt_entry("incomplete entry");
    if (sha1_hex(read_file(so)) != read_file(sum)) return corrupt_entry("checksum mismatch");
    void* handle = ::dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) return corrupt_entry(std::string("dlopen: ") + ::dlerror());
    void* sym = ::dlsym(handle, src.entry.c_str());
    if (!sym) {
      ::dlclose(handle);
      return corrupt_entry("no symbol `" + src.entry + "`");
    }
    return std::make_shared<const CpuKernel>(handle, reinterpret_cast<CpuKernel::EntryFn>(sym), src.entry, so,
                                             src.key);
  }

  /// The prelude as a header in the cache folder, with a precompiled `.gch` next to it
  /// when the compiler can build one (GCC then skips parsing ATen's vec headers: about
  /// 1.7 s less per kernel). GCC ignores a `.gch` built for other options; one that
  /// fails a compile is removed (load_or_build). The name hashes prelude, compiler, flags.
  fs::path prelude_header(const fs::path& dir) {
    const std::string h = sha1_hex(cpu_prelude() + '\x01' + join(options.compiler) + '\x01' + join(options.flags) +
                                   '\x01' + compiler_identity())
                              .substr(0, 16);
    const fs::path header = dir / ("prelude-" + h + ".hpp");
    const fs::path pch = fs::path(header.string() + ".gch");
    std::error_code ec;
    // Checked on every compile (a few KiB, next to a compile of seconds): a damaged
    // header would otherwise fail every kernel.
    if (read_file(header) == cpu_prelude() && (pch_disabled || fs::exists(pch, ec))) return header;
    FileLock lock(dir / ("prelude-" + h + ".lock"));
    if (read_file(header) != cpu_prelude()) {
      install_file(header, cpu_prelude());
      fs::remove(pch, ec);  // built from other text
    }
    if (!pch_disabled && !fs::exists(pch, ec)) {
      const fs::path tmp = temp_name(pch);
      const fs::path log = temp_name(dir / ("prelude-" + h + ".log"));
      std::vector<std::string> argv = options.compiler;
      for (const auto& f : options.flags)
        if (f != "-shared") argv.push_back(f);
      argv.insert(argv.end(), {"-x", "c++-header", header.string(), "-o", tmp.string()});
      ++prelude_builds;
      if (run_program(argv, log) == 0) {
        fs::rename(tmp, pch, ec);
      } else {
        pch_disabled = true;  // kernels include the plain header
      }
      fs::remove(tmp, ec);
      fs::remove(log, ec);
    }
    return header;
  }

  std::shared_ptr<const CpuKernel> load_or_build(const KernelSource& src, const std::string& hash) {
    const fs::path dir = options.cache_dir;
    std::error_code ec;
    fs::create_directories(dir, ec);
    STAGEJIT_CHECK_AS(FusionError, !ec, "fusion: cannot create the kernel cache folder ", dir.string(), ": ",
                      ec.message(), " (set $STAGEJIT_FUSION_CACHE_DIR)");
    const fs::path so = dir / (hash + ".so");
    const fs::path sum = dir / (hash + ".sum");
    const fs::path cpp = dir / (hash + ".cpp");
    FileLock lock(dir / (hash + ".lock"));

    if (auto k = try_load(src, so, sum, nullptr)) {
      ++disk_hits;
      return k;
    }

    const fs::path header = prelude_header(dir);
    install_file(cpp, "#include \"" + header.string() + "\"\n" + src.source + "\n");
    const fs::path so_tmp = temp_name(so);
    const fs::path log = dir / (hash + ".log");
    std::vector<std::string> argv = options.compiler;
    argv.insert(argv.end(), options.flags.begin(), options.flags.end());
    argv.insert(argv.end(), {"-o", so_tmp.string(), cpp.string()});
    argv.insert(argv.end(), options.link_flags.begin(), options.link_flags.end());
    ++compiles;
    int status = run_program(argv, log);
    const fs::path pch = fs::path(header.string() + ".gch");
    if (status != 0 && fs::exists(pch, ec) && mentions_pch(read_file(log))) {
      // A damaged precompiled prelude: retry with the prelude text inline, and stop
      // using precompiled preludes in this process.
      pch_disabled = true;
      fs::remove(pch, ec);
      const fs::path plain = dir / (hash + ".nopch.cpp");
      install_file(plain, cpu_prelude() + "\n" + src.source + "\n");
      std::vector<std::string> retry = argv;
      retry[retry.size() - 1 - options.link_flags.size()] = plain.string();
      ++compiles;
      const fs::path log2 = dir / (hash + ".nopch.log");
      if (run_program(retry, log2) == 0) status = 0;
      fs::remove(plain, ec);
      fs::remove(log2, ec);
    }
    if (status != 0) {
      fs::remove(so_tmp, ec);
      detail::throw_error<FusionError>("fusion: compiling kernel `", src.entry, "` (", src.key.to_string(),
                                       ") failed with exit status ", status, "\n  source: ", cpp.string(),
                                       " (after the prelude ", header.string(), ")\n  command: ", join(argv), "\n  compiler log (", log.string(), "):\n",
                                       read_file(log));
    }
    fs::remove(log, ec);
    install_file(sum, sha1_hex(read_file(so_tmp)));
    fs::rename(so_tmp, so, ec);
    STAGEJIT_CHECK_AS(FusionError, !ec, "fusion: cannot install ", so.string(), ": ", ec.message());
    std::string why;
    auto k = try_load(src, so, sum, &why);
    if (!k) {
      --corrupt;  // not a corrupt cache entry: the fresh build itself does not load
      detail::throw_error<FusionError>("fusion: kernel `", src.entry, "` compiled from ", cpp.string(),
                                       " cannot be loaded: ", why);
    }
    return k;
  }
};

CpuBackend::CpuBackend(CpuBackendOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
}

CpuBackend::~CpuBackend() = default;

const CpuBackendOptions& CpuBackend::options() const noexcept { return impl_->options; }

void CpuBackend::prepare() {
  std::error_code ec;
  fs::create_directories(impl_->options.cache_dir, ec);
  STAGEJIT_CHECK_AS(FusionError, !ec, "fusion: cannot create the kernel cache folder ",
                    impl_->options.cache_dir.string(), ": ", ec.message(), " (set $STAGEJIT_FUSION_CACHE_DIR)");
  impl_->prelude_header(impl_->options.cache_dir);
}

std::string CpuBackend::hash_of(const KernelSource& source) const { return impl_->hash_of(source); }

CpuBackendStats CpuBackend::stats() const {
  CpuBackendStats s;
  s.compiles = impl_->compiles;
  s.disk_hits = impl_->disk_hits;
  s.memory_hits = impl_->memory_hits;
  s.corrupt_entries = impl_->corrupt;
  s.prelude_builds = impl_->prelude_builds;
  return s;
}

std::shared_ptr<const CpuKernel> CpuBackend::get(const KernelSource& source) {
  STAGEJIT_CHECK_AS(FusionError, !source.entry.empty(), "fusion kernel source without an entry point name");
  STAGEJIT_CHECK_AS(FusionError, source.key.device == DeviceKind::CPU, "the CPU fusion backend was given a ",
                    to_string(source.key.device), " kernel `", source.entry, "`");
  const std::string hash = impl_->hash_of(source);
  bool hit = false;
  auto kernel = build_once(impl_->mutex, impl_->kernels, hash,
                                   [&] { return impl_->load_or_build(source, hash); }, &hit);
  if (hit) ++impl_->memory_hits;
  return kernel;
}

CpuBackend& default_cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace stagejit::fusion
