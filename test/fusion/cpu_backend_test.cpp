// CPU fusion backend: hand-written kernels compiled, cached, loaded and run, compared
// with libtorch eager; the disk cache, corruption, compile errors and concurrency.
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/testing/doctest.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include "../child.hpp"
#include "check_close.hpp"

#include "kernels.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace fs = std::filesystem;
using namespace stagejit::fusion;
using namespace stagejit::fusion::testing;

namespace {

using stagejit::testing::check_close;

/// Removes a folder at exit.
struct TempDirHolder {
  fs::path path;
  ~TempDirHolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

fs::path fresh_temp_path() {
  static std::atomic<int> n{0};
  return fs::temp_directory_path() / ("stagejit-fusion-test-" + std::to_string(::getpid()) + "-" + std::to_string(++n));
}

CpuBackendOptions options_in(const fs::path& dir) {
  CpuBackendOptions o = CpuBackendOptions::from_environment();
  o.cache_dir = dir;
  return o;
}

/// A fresh cache folder removed at the end of the test. Unless `with_prelude` is false
/// it starts with the precompiled prelude (built once per test process), which every
/// fresh folder would otherwise rebuild (several seconds).
struct TempDir {
  fs::path path;
  explicit TempDir(bool with_prelude = true) {
    path = fresh_temp_path();
    fs::remove_all(path);
    fs::create_directories(path);
    if (!with_prelude) return;
    static const fs::path seed = [] {
      static TempDirHolder holder{fresh_temp_path()};
      CpuBackend(options_in(holder.path)).prepare();
      return holder.path;
    }();
    for (const auto& e : fs::directory_iterator(seed))
      if (e.path().filename().string().rfind("prelude-", 0) == 0) fs::copy_file(e.path(), path / e.path().filename());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

KernelSource tanh_sigmoid(at::ScalarType dtype) {
  const std::string t = dtype == at::kFloat ? "float" : "double";
  const std::string entry = "tanh_sigmoid_" + t;
  return KernelSource{cpu_tanh_sigmoid_source(t, entry), entry, tanh_sigmoid_key(dtype)};
}

/// Runs `kernel` on (a, b, c) broadcast to their common shape into a fresh output.
at::Tensor run3(const CpuKernel& kernel, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  const auto shape = at::infer_size(at::infer_size(a.sizes(), b.sizes()), c.sizes());
  at::Tensor out = at::empty(shape, a.options());
  kernel.run(pack_tensor_args(shape, {a, b, c}, {out}));
  return out;
}


/// Runs this test executable as the "fusion-cache" child (test/child.hpp) in a new process with the cache in
/// `dir`; returns what the child wrote: "<compiles> <disk_hits> <ok>".
std::string run_child(const fs::path& dir) {
  const fs::path out = dir / "child-report.txt";
  fs::remove(out);
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (kv.rfind("STAGEJIT_FUSION_CACHE_DIR=", 0) != 0 && kv.rfind("STAGEJIT_FUSION_CHILD_REPORT=", 0) != 0 &&
        kv.rfind(std::string(stagejit::testing::child_env) + "=", 0) != 0)
      env_strings.push_back(kv);
  }
  env_strings.push_back("STAGEJIT_FUSION_CACHE_DIR=" + dir.string());
  env_strings.push_back("STAGEJIT_FUSION_CHILD_REPORT=" + out.string());
  env_strings.push_back(std::string(stagejit::testing::child_env) + "=fusion-cache");
  std::vector<char*> envp = stagejit::testing::env_pointers(env_strings);
  std::vector<std::string> args = {exe};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()) == 0);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

namespace {
// The child of the cross-process cache test (a subprocess entry, not a test case):
// loads the tanh/sigmoid kernel through the default backend and writes
// "<compiles> <disk_hits> <ok>" to STAGEJIT_FUSION_CHILD_REPORT.
int fusion_cache_child() {
  const char* report = std::getenv("STAGEJIT_FUSION_CHILD_REPORT");
  if (!report) return 2;
  auto kernel = default_cpu_backend().get(tanh_sigmoid(at::kFloat));
  at::Tensor a = at::randn({333}), b = at::randn({333}), c = at::randn({333});
  const at::Tensor got = run3(*kernel, a, b, c), want = eager_tanh_sigmoid(a, b, c);
  const bool ok = at::allclose(got, want, 1e-6, 1e-6);
  const auto st = default_cpu_backend().stats();
  std::ofstream(report) << st.compiles << ' ' << st.disk_hits << ' ' << ok;
  return 0;
}
const stagejit::testing::RegisterChild register_fusion_cache_child("fusion-cache", &fusion_cache_child);
}  // namespace

TEST_SUITE("fusion") {
  TEST_CASE("KernelKey describes dtype, rank and contiguity of each tensor") {
    at::Tensor a = at::zeros({3, 4}), b = at::zeros({4, 3}, at::kDouble).t(), o = at::zeros({3, 4});
    KernelKey key = KernelKey::of({a, b}, {o});
    CHECK((key.device == DeviceKind::CPU));
    REQUIRE(key.inputs.size() == 2);
    CHECK((key.inputs[1] == TensorDesc{at::kDouble, 2, false}));
    CHECK(key.to_string() == "cpu;in=Float/2/c,Double/2/n;out=Float/2/c");
    CHECK(!(key == KernelKey::of({a, a}, {o})));
  }

  TEST_CASE("pack_tensor_args broadcasts with stride 0 and merges contiguous dimensions") {
    at::Tensor a = at::zeros({16, 1}), b = at::zeros({4}), o = at::empty({16, 4});
    PackedArgs p = pack_tensor_args({16, 4}, {a, b}, {o});
    REQUIRE(p.rank == 2);
    CHECK(p.numel == 64);
    CHECK(p.args[0].strides[0] == 1);
    CHECK(p.args[0].strides[1] == 0);
    CHECK(p.args[1].strides[0] == 0);
    CHECK(p.args[1].strides[1] == 1);
    CHECK(p.args[2].strides[0] == 4);

    at::Tensor x = at::zeros({2, 3, 5}), y = at::empty({2, 3, 5});
    PackedArgs q = pack_tensor_args({2, 3, 5}, {x}, {y});
    CHECK(q.rank == 1);
    CHECK(q.shape == std::vector<int64_t>{30});

    // Tensors sharing a permuted dense layout merge into one row: the iteration follows
    // the first output's memory order (its unit stride innermost).
    at::Tensor ta = at::zeros({8, 6}).t(), tb = at::zeros({8, 6}).t(), to = at::empty({8, 6}).t();
    PackedArgs tp = pack_tensor_args({6, 8}, {ta, tb}, {to});
    CHECK(tp.rank == 1);
    CHECK(tp.shape == std::vector<int64_t>{48});
    PackedArgs mp = pack_tensor_args({6, 8}, {at::zeros({6, 8})}, {to});
    REQUIRE(mp.rank == 2);
    CHECK(mp.shape == std::vector<int64_t>{8, 6});
    CHECK(mp.args[1].strides[1] == 1);
    CHECK(mp.args[1].strides[0] == 6);
    CHECK(mp.args[0].strides[1] == 8);
    CHECK(mp.args[0].strides[0] == 1);

    PackedArgs z = pack_tensor_args({}, {at::zeros({})}, {at::empty({})});
    CHECK(z.rank == 1);
    CHECK(z.numel == 1);

    CHECK_THROWS_AS(pack_tensor_args({16, 4}, {at::zeros({3})}, {o}), stagejit::ShapeError);
    CHECK_THROWS_AS(pack_tensor_args({16, 4}, {a}, {at::empty({4, 16})}), stagejit::ShapeError);
    CHECK_THROWS_AS(pack_tensor_args({16, 4}, {a}, {at::empty({4}).expand({16, 4})}), stagejit::FusionError);
    CHECK_THROWS_AS(pack_tensor_args({16, 4}, {at::Tensor()}, {o}), stagejit::FusionError);
  }

  TEST_CASE("CPU kernel tanh(a*b+c)*sigmoid(a) matches ATen in float and double") {
    TempDir dir;
    CpuBackend backend(options_in(dir.path));
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      const std::string dtype_name = c10::toString(dtype);
      CAPTURE(dtype_name);
      auto kernel = backend.get(tanh_sigmoid(dtype));
      const auto opt = at::TensorOptions().dtype(dtype);
      auto gen = [&](at::IntArrayRef s) { return at::randn(s, opt) * 3; };

      {
      INFO("contiguous, odd length (vector tail)");
        at::Tensor a = gen({1003}), b = gen({1003}), c = gen({1003});
        check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
      }
      {
      INFO("large enough for several threads");
        at::Tensor a = gen({300001}), b = gen({300001}), c = gen({300001});
        check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
      }
      {
      INFO("broadcast [16,1] x [4] x []");
        at::Tensor a = gen({16, 1}), b = gen({4}), c = gen({});
        at::Tensor got = run3(*kernel, a, b, c);
        CHECK((got.sizes() == at::IntArrayRef{16, 4}));
        check_close(got, eager_tanh_sigmoid(a, b, c));
      }
      {
      INFO("transposed input");
        at::Tensor a = gen({37, 21}).t(), b = gen({21, 37}), c = gen({21, 37});
        REQUIRE(!a.is_contiguous());
        check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
      }
      {
      INFO("expanded (stride 0) and sliced inputs");
        at::Tensor a = gen({1, 40}).expand({33, 40}), b = gen({33, 80}).slice(1, 0, 80, 2), c = gen({33, 40});
        check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
      }
      {
      INFO("non-contiguous output");
        at::Tensor a = gen({9, 13}), b = gen({9, 13}), c = gen({13});
        at::Tensor out = at::empty({13, 9}, opt).t();
        kernel->run(pack_tensor_args({9, 13}, {a, b, c}, {out}));
        check_close(out, eager_tanh_sigmoid(a, b, c));
      }
      {
      INFO("every tensor transposed (one merged row in memory order), and a row broadcast beside them");
        at::Tensor a = gen({37, 21}).t(), b = gen({37, 21}).t(), c = gen({37, 21}).t();
        at::Tensor out = at::empty({37, 21}, opt).t();
        PackedArgs p = pack_tensor_args({21, 37}, {a, b, c}, {out});
        CHECK(p.rank == 1);
        kernel->run(p);
        check_close(out, eager_tanh_sigmoid(a, b, c));
        at::Tensor row = gen({37});
        at::Tensor out2 = at::empty({37, 21}, opt).t();
        kernel->run(pack_tensor_args({21, 37}, {a, row, c}, {out2}));
        check_close(out2, eager_tanh_sigmoid(a, row, c));
      }
      {
      INFO("ranges starting mid-row, as parallel_for may split them");
      at::Tensor a = gen({5, 7, 9}).permute({2, 0, 1}), b = gen({9, 1, 7}), c = gen({7});
      const std::vector<int64_t> shape{9, 5, 7};
      at::Tensor out = at::empty(shape, opt);
      PackedArgs p = pack_tensor_args(shape, {a, b, c}, {out});
      REQUIRE(p.rank == 3);
      for (int64_t begin = 0, step = 1; begin < p.numel; begin += step, step = step * 3 % 17 + 1)
        kernel->entry_fn()(begin, std::min(p.numel, begin + step), p.rank, p.args.data());
      check_close(out, eager_tanh_sigmoid(a, b, c));
    }
    {
      INFO("special values: NaN, infinities, large magnitudes");
      const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
      at::Tensor a = at::tensor({nan, inf, -inf, 50.0, -50.0, 1e4, -100.0, 0.0, -0.0, 1.5}, opt);
      at::Tensor b = at::tensor({1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, nan}, opt);
      at::Tensor c = at::tensor({0.0, -inf, inf, 0.0, 2.0, 0.0, 0.0, inf, 0.0, 0.0}, opt);
      check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
    }
    {
      INFO("0-dim");
        at::Tensor a = gen({}), b = gen({}), c = gen({});
        check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
      }
      {
      INFO("empty");
        at::Tensor a = gen({0, 3}), b = gen({3}), c = gen({0, 3});
        at::Tensor got = run3(*kernel, a, b, c);
        CHECK((got.sizes() == at::IntArrayRef{0, 3}));
      }
    }
    CHECK(backend.stats().compiles == 2);
  }

  TEST_CASE("CPU kernel with mixed storage types: float and double inputs, double and bool outputs") {
    TempDir dir;
    CpuBackend backend(options_in(dir.path));
    KernelKey key;
    key.inputs = {TensorDesc{at::kDouble, 2, true}, TensorDesc{at::kFloat, 1, true}};
    key.outputs = {TensorDesc{at::kDouble, 2, true}, TensorDesc{at::kBool, 2, true}};
    const std::string src = R"(
extern "C" void mixed(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args) {
  sjk::elementwise<double, sjk::types<double, float>, sjk::types<double, bool>>(
      begin, end, rank, args, [](const sjk::Vec<double>* in, sjk::Vec<double>* out) {
        out[0] = in[0] * in[1];
        out[1] = in[0].gt(in[1]);
      });
}
)";
    auto kernel = backend.get(KernelSource{src, "mixed", key});
    at::Tensor a = at::randn({7, 11}, at::kDouble), b = at::randn({11});
    at::Tensor prod = at::empty({7, 11}, at::kDouble), gt = at::empty({7, 11}, at::kBool);
    kernel->run(pack_tensor_args({7, 11}, {a, b}, {prod, gt}));
    check_close(prod, a * b.to(at::kDouble));
    CHECK(at::equal(gt, at::gt(a, b.to(at::kDouble))));

    // A call whose dtypes differ from the key is refused, not misread.
    at::Tensor wrong = at::empty({7, 11}, at::kFloat);
    CHECK_THROWS_AS(kernel->run(pack_tensor_args({7, 11}, {a, b}, {wrong, gt})), stagejit::FusionError);
    CHECK_THROWS_AS(kernel->run(pack_tensor_args({7, 11}, {a}, {prod, gt})), stagejit::FusionError);
  }

  TEST_CASE("the disk cache serves a second backend without compiling") {
    TempDir dir;
    const KernelSource src = tanh_sigmoid(at::kFloat);
    {
      CpuBackend first(options_in(dir.path));
      first.get(src);
      first.get(src);
      CHECK(first.stats().compiles == 1);
      CHECK(first.stats().memory_hits == 1);
    }
    CpuBackend second(options_in(dir.path));
    CHECK(fs::exists(dir.path / (second.hash_of(src) + ".so")));
    auto kernel = second.get(src);
    CHECK(second.stats().compiles == 0);
    CHECK(second.stats().disk_hits == 1);
    at::Tensor a = at::randn({100}), b = at::randn({100}), c = at::randn({100});
    check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
  }

  TEST_CASE("the disk cache is reused by a second process") {
    TempDir dir;
    CHECK(run_child(dir.path) == "1 0 1");  // first process compiles
    CHECK(run_child(dir.path) == "0 1 1");  // second process loads from disk
  }

  TEST_CASE("a corrupt or truncated cache entry is detected and rebuilt") {
    TempDir dir;
    const KernelSource src = tanh_sigmoid(at::kFloat);
    std::string hash;
    {
      CpuBackend first(options_in(dir.path));
      first.get(src);
      hash = first.hash_of(src);
    }
    const fs::path so = dir.path / (hash + ".so"), sum = dir.path / (hash + ".sum");
    auto check_rebuilds = [&] {
      CpuBackend again(options_in(dir.path));
      auto kernel = again.get(src);
      CHECK(again.stats().corrupt_entries == 1);
      CHECK(again.stats().compiles == 1);
      at::Tensor a = at::randn({50}), b = at::randn({50}), c = at::randn({50});
      check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
    };
    {
      INFO("truncated shared object");
      fs::resize_file(so, fs::file_size(so) / 2);
      check_rebuilds();
    }
    {
      INFO("garbage with a matching checksum (dlopen fails)");
      { std::ofstream(so, std::ios::trunc) << "not an ELF file"; }
      { std::ofstream(sum, std::ios::trunc) << CpuBackend::checksum("not an ELF file"); }
      check_rebuilds();
    }
    {
      INFO("missing checksum");
      fs::remove(sum);
      check_rebuilds();
    }
  }

  TEST_CASE("a damaged precompiled prelude does not break kernel builds") {
    TempDir dir(false);
    {
      CpuBackend first(options_in(dir.path));
      first.get(tanh_sigmoid(at::kFloat));
      CHECK(first.stats().prelude_builds == 1);
    }
    int damaged = 0;
    for (const auto& e : fs::directory_iterator(dir.path)) {
      if (e.path().extension() == ".gch") {
        fs::resize_file(e.path(), fs::file_size(e.path()) / 3);
        ++damaged;
      }
    }
    REQUIRE(damaged == 1);
    CpuBackend again(options_in(dir.path));
    auto kernel = again.get(tanh_sigmoid(at::kDouble));  // a new kernel, compiled against the damaged .gch
    at::Tensor a = at::randn({77}, at::kDouble), b = at::randn({77}, at::kDouble), c = at::randn({77}, at::kDouble);
    check_close(run3(*kernel, a, b, c), eager_tanh_sigmoid(a, b, c));
  }

  TEST_CASE("a compile error raises FusionError with the compiler log and the source path") {
    TempDir dir;
    CpuBackend backend(options_in(dir.path));
    KernelSource bad{"extern \"C\" void broken(int64_t, int64_t, int32_t, const stagejit_TensorArg*) { undeclared_name; }\n",
                     "broken", tanh_sigmoid_key(at::kFloat)};
    std::string what;
    try {
      backend.get(bad);
    } catch (const stagejit::FusionError& e) {
      what = e.what();
    }
    CHECK(what.find("undeclared_name") != std::string::npos);
    CHECK(what.find("error") != std::string::npos);
    const fs::path cpp = dir.path / (backend.hash_of(bad) + ".cpp");
    CHECK(what.find(cpp.string()) != std::string::npos);
    CHECK(fs::exists(cpp));
    // The failure is remembered: asking again does not recompile.
    CHECK_THROWS_AS(backend.get(bad), stagejit::FusionError);
    CHECK(backend.stats().compiles == 1);
  }

  TEST_CASE("a missing entry point or compiler raises FusionError") {
    TempDir dir;
    CpuBackend backend(options_in(dir.path));
    KernelSource src = tanh_sigmoid(at::kFloat);
    src.entry = "no_such_entry";
    CHECK_THROWS_WITH_AS(backend.get(src), doctest::Contains("no_such_entry"), stagejit::FusionError);

    CpuBackendOptions o = options_in(dir.path);
    o.compiler = {"/nonexistent/stagejit-cxx"};
    CpuBackend nocc(o);
    CHECK_THROWS_WITH_AS(nocc.get(tanh_sigmoid(at::kFloat)), doctest::Contains("STAGEJIT_CXX"), stagejit::FusionError);
  }

  TEST_CASE("concurrent requests for one kernel compile it once") {
    TempDir dir;
    const KernelSource src = tanh_sigmoid(at::kDouble);
    SUBCASE("one backend, eight threads") {
      CpuBackend backend(options_in(dir.path));
      std::vector<std::shared_ptr<const CpuKernel>> got(8);
      std::vector<std::thread> threads;
      for (int i = 0; i < 8; ++i) threads.emplace_back([&, i] { got[i] = backend.get(src); });
      for (auto& t : threads) t.join();
      CHECK(backend.stats().compiles == 1);
      CHECK(backend.stats().memory_hits == 7);
      for (const auto& k : got) CHECK(k.get() == got[0].get());
    }
    SUBCASE("two backends sharing a cache folder (file lock)") {
      CpuBackend one(options_in(dir.path)), two(options_in(dir.path));
      std::thread t1([&] { one.get(src); }), t2([&] { two.get(src); });
      t1.join();
      t2.join();
      CHECK(one.stats().compiles + two.stats().compiles == 1);
      CHECK(one.stats().disk_hits + two.stats().disk_hits == 1);
    }
  }

  TEST_CASE("default cache folder follows the environment") {
    const char* old = std::getenv("STAGEJIT_FUSION_CACHE_DIR");
    const std::string saved = old ? old : "";
    ::setenv("STAGEJIT_FUSION_CACHE_DIR", "/tmp/stagejit-override", 1);
    CHECK((default_cache_dir() == fs::path("/tmp/stagejit-override")));
    ::unsetenv("STAGEJIT_FUSION_CACHE_DIR");
    if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) CHECK((default_cache_dir() == fs::path(x) / "stagejit"));
    if (old) ::setenv("STAGEJIT_FUSION_CACHE_DIR", saved.c_str(), 1);
  }

  TEST_CASE("NVRTC compiles the CUDA version of the kernel to PTX" * doctest::skip(!nvrtc_available())) {
    MESSAGE("NVRTC " << nvrtc_version());
    for (const std::string t : {"float", "double"}) {
      const std::string entry = "tanh_sigmoid_" + t;
      const std::string ptx = compile_to_ptx(cuda_prelude() + cuda_tanh_sigmoid_source(t, entry));
      CHECK(ptx.find(".entry " + entry) != std::string::npos);
    }
    const std::string bad = cuda_prelude() + "extern \"C\" __global__ void k() { undeclared_name; }";
    CHECK_THROWS_WITH_AS(compile_to_ptx(bad), doctest::Contains("undeclared_name"), stagejit::FusionError);
  }

  // With a GPU present the gpu suite covers the launches.
  TEST_CASE("without a GPU the CUDA driver reports unavailable and launches throw" *
            doctest::skip(cuda_driver_available())) {
    CHECK(cuda_device_count() == 0);
    CHECK_THROWS_AS(CudaBuffer(16), stagejit::FusionError);
    KernelSource src{cuda_tanh_sigmoid_source("float", "k"), "k", tanh_sigmoid_key(at::kFloat, DeviceKind::CUDA)};
    CHECK_THROWS_AS(CudaBackend().get(src), stagejit::FusionError);
  }
}
