// Kernels compiled together (the first-call issue): several kernels per compiler run,
// runs in parallel, identical kernels once, processes sharing one empty cache, a missing
// compiler, and a compiled function's first call not waiting for its kernels. Also the
// cache entries bound to their keys and the precompiled prelude repaired once (the
// reliability issue, items 5, 6 and 9a).
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>
#include "../child.hpp"
#include "check_close.hpp"
#include "kernels.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace fs = std::filesystem;
namespace sj = stagejit;
namespace ir = stagejit::ir;
using namespace stagejit::fusion;
using namespace stagejit::fusion::testing;
using stagejit::testing::check_close;

namespace {

/// A fresh, empty folder under the system temp folder, removed at the end of the test.
struct EmptyDir {
  fs::path path;
  EmptyDir() {
    static std::atomic<int> n{0};
    path = fs::temp_directory_path() / ("stagejit-batch-test-" + std::to_string(::getpid()) + "-" + std::to_string(++n));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~EmptyDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

CpuBackendOptions options_in(const fs::path& dir, int jobs = 2) {
  CpuBackendOptions o = CpuBackendOptions::from_environment();
  o.cache_dir = dir;
  o.jobs = jobs;
  return o;
}

/// `n` distinct kernels (tanh(a*b+c)*sigmoid(a) under n entry names: distinct sources).
std::vector<KernelSource> distinct_kernels(int n, at::ScalarType dtype = at::kFloat) {
  const std::string t = dtype == at::kFloat ? "float" : "double";
  std::vector<KernelSource> out;
  for (int i = 0; i < n; ++i) {
    const std::string entry = "batch_kernel_" + t + "_" + std::to_string(i);
    out.push_back(KernelSource{cpu_tanh_sigmoid_source(t, entry), entry, tanh_sigmoid_key(dtype)});
  }
  return out;
}

bool kernel_matches_eager(const CpuKernel& kernel, at::ScalarType dtype) {
  at::Tensor a = at::randn({131}, dtype), b = at::randn({131}, dtype), c = at::randn({131}, dtype);
  at::Tensor out = at::empty({131}, dtype);
  kernel.run(pack_tensor_args({131}, {a, b, c}, {out}));
  const double tol = dtype == at::kFloat ? 1e-6 : 1e-12;
  return at::allclose(out, eager_tanh_sigmoid(a, b, c), tol, tol);
}

struct ChildResult {
  int status = -1;
  std::string report;  // what the child wrote to $STAGEJIT_BATCH_REPORT
  std::string stderr_text;
};

/// Starts this executable as the child entry `entry` with `env` added (replacing
/// variables of the same name); `report`/`err`: files for its report and stderr.
pid_t spawn_child(const std::string& entry, const std::map<std::string, std::string>& env, const fs::path& report,
                  const fs::path& err) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : env) vars[k] = v;
  vars[stagejit::testing::child_env] = entry;
  vars["STAGEJIT_BATCH_REPORT"] = report.string();
  std::vector<std::string> strings;
  for (const auto& [k, v] : vars) strings.push_back(k + "=" + v);
  std::vector<char*> envp = stagejit::testing::env_pointers(strings);
  std::string arg0 = exe;
  char* argv[] = {arg0.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE(rc == 0);
  return pid;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ChildResult wait_child(pid_t pid, const fs::path& report, const fs::path& err) {
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  ChildResult r;
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.report = slurp(report);
  r.stderr_text = slurp(err);
  return r;
}

void write_report(const std::string& text) {
  if (const char* p = std::getenv("STAGEJIT_BATCH_REPORT")) std::ofstream(p) << text;
}

// Child: prefetches 6 kernels through the default backend, checks each against eager,
// reports "<kernels compiled> <disk hits> <ok>".
int batch_fill_child() {
  auto& backend = default_cpu_backend();
  const auto sources = distinct_kernels(6);
  backend.prefetch(sources);
  bool ok = true;
  for (const auto& s : sources) ok = ok && kernel_matches_eager(*backend.get(s), at::kFloat);
  const auto st = backend.stats();
  write_report(std::to_string(st.kernels_compiled) + " " + std::to_string(st.disk_hits) + " " + (ok ? "1" : "0"));
  return 0;
}
const stagejit::testing::RegisterChild register_batch_fill("batch-fill", &batch_fill_child);

/// A function with elementwise chains in stage 0 and stage 1 (derivatives = 1).
sj::variable_list chains(const sj::variable_list& in) {
  sj::Variable h = sj::tanh(in[0] * in[1] + in[1]);
  sj::Variable y = sj::sigmoid(h * h) * in[0];
  return {sj::sum(y)};
}

/// Forward and gradients of `chains` compiled (`f`) and eager, on fixed inputs: the
/// largest absolute difference.
double compiled_vs_eager(sj::CompiledFunction& f, int64_t n) {
  at::manual_seed(3);
  const at::Tensor a = at::randn({n, 3}, at::kDouble), b = at::randn({n, 3}, at::kDouble);
  auto run = [&](bool compiled) {
    sj::Variable x(a, true), w(b, true);
    sj::variable_list out = compiled ? f({x, w}) : chains({x, w});
    auto g = sj::grad({out[0]}, {x, w});
    return std::vector<at::Tensor>{out[0].data(), g[0].data(), g[1].data()};
  };
  const auto c = run(true), e = run(false);
  double worst = 0;
  for (std::size_t i = 0; i < c.size(); ++i) worst = std::max(worst, (c[i] - e[i]).abs().max().item<double>());
  return worst;
}

// Child: with no usable compiler ($STAGEJIT_CXX as set by the parent), a compiled
// function still gives eager's numbers; reports the difference.
int no_compiler_child() {
  auto f = sj::compile(&chains, {.derivatives = 1});
  double worst = 0;
  for (int call = 0; call < 2; ++call) worst = std::max(worst, compiled_vs_eager(f, 64));
  write_report(worst <= 1e-12 ? "ok" : "differs " + std::to_string(worst));
  return 0;
}
const stagejit::testing::RegisterChild register_no_compiler("batch-no-compiler", &no_compiler_child);

// Child: fusion groups not waiting for their kernels (STAGEJIT_FUSION_WAIT=0), in an
// empty cache: the first call runs op by op while the kernels compile, later calls run
// the kernels; every call gives eager's numbers. Reports "<diff first> <diff later>
// <kernels compiled>".
int deferred_child() {
  sj::fusion::set_wait_for_kernels(false);
  auto f = sj::compile(&chains, {.derivatives = 1});
  const double first = compiled_vs_eager(f, 64);
  default_cpu_backend().wait_for_prefetches();
  double later = 0;
  for (int call = 0; call < 2; ++call) later = std::max(later, compiled_vs_eager(f, 64));
  std::ostringstream os;
  os << first << ' ' << later << ' ' << default_cpu_backend().stats().kernels_compiled;
  write_report(os.str());
  return 0;
}
const stagejit::testing::RegisterChild register_deferred("batch-deferred", &deferred_child);

}  // namespace

TEST_SUITE("fusion") {
  TEST_CASE("n kernels need fewer than n compiler runs: prefetch batches them into parallel runs") {
    EmptyDir dir;
    CpuBackend backend(options_in(dir.path, 2));
    const auto sources = distinct_kernels(6, at::kDouble);
    backend.prefetch(sources);
    backend.wait_for_prefetches();
    const auto st = backend.stats();
    CHECK(st.kernels_compiled == 6);
    CHECK(st.compiles < 6);
    CHECK(st.compiles == 2);  // two jobs: one run each
    for (const auto& s : sources) CHECK(kernel_matches_eager(*backend.get(s), at::kDouble));
    CHECK(backend.stats().memory_hits == 6);  // prefetched: no further build
    CHECK(backend.stats().compiles == 2);

    // A second backend on the same folder loads all six from disk, in one pass.
    CpuBackend again(options_in(dir.path, 2));
    again.prefetch(sources);
    again.wait_for_prefetches();
    CHECK(again.stats().compiles == 0);
    CHECK(again.stats().disk_hits == 6);
    for (const auto& s : sources) CHECK(kernel_matches_eager(*again.get(s), at::kDouble));
  }

  TEST_CASE("a failing kernel in a batch is reported for itself; the others of its run still build") {
    EmptyDir dir;
    CpuBackend backend(options_in(dir.path, 1));
    auto sources = distinct_kernels(3);
    KernelSource bad{"extern \"C\" void batch_broken(int64_t, int64_t, int32_t, const stagejit_TensorArg*) { "
                     "undeclared_in_batch; }\n",
                     "batch_broken", tanh_sigmoid_key(at::kFloat)};
    sources.push_back(bad);
    backend.prefetch(sources);
    backend.wait_for_prefetches();
    CHECK_THROWS_WITH_AS(backend.get(bad), doctest::Contains("undeclared_in_batch"), sj::FusionError);
    for (std::size_t i = 0; i < 3; ++i) CHECK(kernel_matches_eager(*backend.get(sources[i]), at::kFloat));
    CHECK(backend.stats().kernels_compiled == 3);
  }

  TEST_CASE("a structurally identical kernel in two stages is compiled once") {
    // Stage 0 and stage 1 each hold mul -> tanh -> mul, with other value names, shapes
    // and ranks: one kernel source, one build.
    const std::string text = R"(graph(%a : Double(6, 4),
      %b : Double(6, 4),
      -------- stage 1 --------
      %g : Double(24)) {
  %p : Double(6, 4) = mul(%a, %b);
  %q : Double(6, 4) = tanh(%p);
  %r : Double(6, 4) = mul(%q, %a);
  %s : Double(24) = reshape[shape=[24]](%r);
  ---------------- stage 1 ----------------
  %u : Double(24) = mul(%g, %s);
  %v : Double(24) = tanh(%u);
  %w : Double(24) = mul(%v, %g);
  return (%r | %w);
}
)";
    auto g = ir::parse(text);
    REQUIRE(stagejit::passes::fuse(*g) == 2);
    std::vector<std::shared_ptr<const ir::Graph>> subgraphs;
    for (ir::Node* n : g->nodes())
      if (auto* fg = n->get_if<ir::FusionGroup>()) subgraphs.push_back(fg->subgraph);
    REQUIRE(subgraphs.size() == 2);
    CHECK(ir::to_string(*subgraphs[0]) != ir::to_string(*subgraphs[1]));  // other shapes

    EmptyDir dir;
    CpuBackend backend(options_in(dir.path, 2));
    std::vector<std::shared_ptr<const FusedGroup>> groups;
    {
      KernelBatchScope scope;
      for (std::size_t i = 0; i < subgraphs.size(); ++i)
        groups.push_back(std::make_shared<const FusedGroup>(subgraphs[i], "group " + std::to_string(i), &backend));
      CHECK(scope.size() == 2);  // both predicted...
    }
    backend.wait_for_prefetches();
    CHECK(backend.stats().kernels_compiled == 1);  // ...one built
    CHECK(backend.stats().compiles == 1);

    const at::Tensor a = at::randn({6, 4}, at::kDouble), b = at::randn({6, 4}, at::kDouble);
    const at::Tensor gg = at::randn({24}, at::kDouble), s = at::randn({24}, at::kDouble);
    check_close(groups[0]->run({a, b})[0], at::tanh(a * b) * a);
    check_close(groups[1]->run({gg, s})[0], at::tanh(gg * s) * gg);
    CHECK(backend.stats().kernels_compiled == 1);
  }

  TEST_CASE("two processes fill one empty cache folder at the same time, both correct") {
    EmptyDir dir;
    const std::map<std::string, std::string> env = {{"STAGEJIT_FUSION_CACHE_DIR", dir.path.string()}};
    const fs::path r1 = dir.path / "r1", r2 = dir.path / "r2", e1 = dir.path / "e1", e2 = dir.path / "e2";
    const pid_t p1 = spawn_child("batch-fill", env, r1, e1);
    const pid_t p2 = spawn_child("batch-fill", env, r2, e2);
    const ChildResult c1 = wait_child(p1, r1, e1), c2 = wait_child(p2, r2, e2);
    CHECK(c1.status == 0);
    CHECK(c2.status == 0);
    int k1 = -1, h1 = -1, ok1 = 0, k2 = -1, h2 = -1, ok2 = 0;
    std::istringstream(c1.report) >> k1 >> h1 >> ok1;
    std::istringstream(c2.report) >> k2 >> h2 >> ok2;
    CHECK(ok1 == 1);
    CHECK(ok2 == 1);
    CHECK(k1 + k2 == 6);  // each kernel compiled by one of them (per-kernel locks)
    CHECK(k1 + h1 == 6);
    CHECK(k2 + h2 == 6);
    for (const auto& e : fs::directory_iterator(dir.path))  // no temporaries left behind
      CHECK(e.path().string().find(".tmp.") == std::string::npos);
  }

  TEST_CASE("no compiler: a compiled function still gives eager's numbers, with one warning naming the cause") {
    EmptyDir dir;
    for (const std::string cxx : {"/nonexistent/stagejit-cxx", "   "}) {
      CAPTURE(cxx);
      const std::map<std::string, std::string> env = {{"STAGEJIT_FUSION_CACHE_DIR", dir.path.string()},
                                                      {"STAGEJIT_CXX", cxx}};
      const fs::path r = dir.path / "r", e = dir.path / "e";
      const ChildResult c = wait_child(spawn_child("batch-no-compiler", env, r, e), r, e);
      CHECK(c.status == 0);
      CHECK(c.report == "ok");
      std::size_t warnings = 0;
      for (std::size_t at = c.stderr_text.find("stagejit: warning:"); at != std::string::npos;
           at = c.stderr_text.find("stagejit: warning:", at + 1))
        ++warnings;
      CHECK(warnings == 1);
      CHECK(c.stderr_text.find("STAGEJIT_CXX") != std::string::npos);
      if (cxx.front() == '/') CHECK(c.stderr_text.find(cxx) != std::string::npos);
      CHECK(c.stderr_text.find("-std=c++17") == std::string::npos);  // never a flag as the compiler
    }
  }

  TEST_CASE("a first call does not wait for the compiler: op by op first, the kernels later, eager's numbers throughout") {
    EmptyDir dir;
    const std::map<std::string, std::string> env = {{"STAGEJIT_FUSION_CACHE_DIR", dir.path.string()},
                                                    {"STAGEJIT_FUSION_WAIT", "0"}};
    const fs::path r = dir.path / "r", e = dir.path / "e";
    const ChildResult c = wait_child(spawn_child("batch-deferred", env, r, e), r, e);
    CHECK(c.status == 0);
    double first = 1, later = 1;
    int kernels = 0;
    std::istringstream(c.report) >> first >> later >> kernels;
    CHECK(first <= 1e-12);
    CHECK(later <= 1e-12);
    CHECK(kernels >= 2);  // stage 0's and stage 1's groups
    CHECK(c.stderr_text.find("runs op by op") == std::string::npos);  // deferral is silent
  }

  TEST_CASE("cache entries are bound to their keys: swapped .so/.sum pairs are rebuilt, never run") {
    EmptyDir dir;
    const auto sources = distinct_kernels(2, at::kDouble);
    std::string h0, h1;
    {
      CpuBackend first(options_in(dir.path, 1));
      for (const auto& s : sources) first.get(s);  // one run each: two separate shared objects
      h0 = first.hash_of(sources[0]);
      h1 = first.hash_of(sources[1]);
    }
    auto swap_files = [&](const std::string& ext) {
      const fs::path a = dir.path / (h0 + ext), b = dir.path / (h1 + ext), t = dir.path / "swap";
      fs::rename(a, t);
      fs::rename(b, a);
      fs::rename(t, b);
    };
    swap_files(".so");
    swap_files(".sum");
    CpuBackend again(options_in(dir.path, 1));
    for (const auto& s : sources) CHECK(kernel_matches_eager(*again.get(s), at::kDouble));
    CHECK(again.stats().corrupt_entries == 2);
    CHECK(again.stats().kernels_compiled == 2);
  }

  TEST_CASE("a damaged precompiled prelude is rebuilt once, then kernels build against it") {
    EmptyDir dir;
    const auto sources = distinct_kernels(3, at::kDouble);
    {
      CpuBackend first(options_in(dir.path, 1));
      first.get(sources[0]);
      CHECK(first.stats().prelude_builds == 1);  // built after the kernel, for later runs
    }
    fs::path gch;
    for (const auto& e : fs::directory_iterator(dir.path))
      if (e.path().extension() == ".gch") gch = e.path();
    REQUIRE(!gch.empty());
    fs::resize_file(gch, fs::file_size(gch) / 3);
    {
      CpuBackend again(options_in(dir.path, 1));
      CHECK(kernel_matches_eager(*again.get(sources[1]), at::kDouble));
      CHECK(again.stats().prelude_builds == 1);  // rebuilt once
      CHECK(again.stats().compiles == 2);        // the refused run and its retry
    }
    CpuBackend third(options_in(dir.path, 1));  // a later process finds a good one
    CHECK(kernel_matches_eager(*third.get(sources[2]), at::kDouble));
    CHECK(third.stats().prelude_builds == 0);
    CHECK(third.stats().compiles == 1);
  }

  TEST_CASE("$STAGEJIT_CXX blank or $STAGEJIT_FUSION_JOBS malformed: errors naming the variable") {
    EmptyDir dir;
    CpuBackendOptions o = options_in(dir.path);
    o.compiler = {};
    CpuBackend blank(o);
    CHECK_THROWS_WITH_AS(blank.get(distinct_kernels(1)[0]), doctest::Contains("STAGEJIT_CXX"), sj::FusionError);
    ::setenv("STAGEJIT_FUSION_JOBS", "two", 1);
    CHECK_THROWS_WITH_AS(CpuBackendOptions::from_environment(), doctest::Contains("STAGEJIT_FUSION_JOBS"),
                         sj::FusionError);
    ::unsetenv("STAGEJIT_FUSION_JOBS");
  }

  TEST_CASE("a float tensor times a 0-dim double (or int) compiles without a warning, as eager promotes") {
    struct Case {
      at::ScalarType x, s;
    };
    for (const Case c : {Case{at::kFloat, at::kDouble}, Case{at::kDouble, at::kFloat}, Case{at::kFloat, at::kLong}}) {
      const std::string dtypes = std::string(c10::toString(c.x)) + " * " + c10::toString(c.s);
      CAPTURE(dtypes);
      auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
        return {sj::tanh(in[0] * in[1] + in[0])};
      });
      const at::Tensor x = at::randn({16}, at::kDouble).to(c.x);
      const at::Tensor s = at::scalar_tensor(3, at::TensorOptions().dtype(c.s));
      std::ostringstream captured;
      std::streambuf* old = std::cerr.rdbuf(captured.rdbuf());
      sj::variable_list got;
      try {
        got = f({sj::Variable(x), sj::Variable(s)});
      } catch (...) {
        std::cerr.rdbuf(old);
        throw;
      }
      std::cerr.rdbuf(old);
      const at::Tensor want = at::tanh(x * s + x);
      CHECK((got[0].data().scalar_type() == want.scalar_type()));
      CHECK(at::allclose(got[0].data(), want, 1e-6, 1e-6));
      CHECK(captured.str().find("runs op by op") == std::string::npos);
    }
  }
}
