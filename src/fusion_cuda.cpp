// CUDA fusion backend: NVRTC and the driver API, both opened with dlopen at first use.
#include <stagejit/core/error.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/fusion/detail/build_once.hpp>

#include <c10/util/hash.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <future>
#include <mutex>
#include <unordered_map>

#ifdef STAGEJIT_FUSION_CUDA
#include <cuda.h>
#include <nvrtc.h>
#endif
#ifdef STAGEJIT_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace stagejit::fusion {

static_assert(kMaxCudaArgs >= 24, "the CUDA prelude declares stagejit_ArgPack with 24 tensors");

const std::string& cuda_prelude() {
  static const std::string text = R"PRELUDE(// ---- stagejit CUDA kernel prelude ----
/// Same layout as stagejit::fusion::TensorArg: element pointer, sizes, element strides.
struct stagejit_TensorArg {
  void* data;
  long long sizes[8];
  long long strides[8];
};
/// The N tensors of a launch, passed by value (inputs then outputs); the launcher passes
/// a buffer of kMaxCudaArgs tensors, of which the kernel's parameter reads the first N.
template <int N>
struct stagejit_Args {
  stagejit_TensorArg t[N];
};
/// The pack of hand-written kernels: up to 24 tensors.
typedef stagejit_Args<24> stagejit_ArgPack;
/// Element offset of linear index i (row-major over the iteration shape) in t.
__device__ __forceinline__ long long sj_offset(const stagejit_TensorArg& t, int rank, long long i) {
  long long off = 0;
  for (int d = rank - 1; d > 0; --d) {
    const long long s = t.sizes[d];
    off += (i % s) * t.strides[d];
    i /= s;
  }
  return off + i * t.strides[0];
}
template <class T>
__device__ __forceinline__ T sj_load(const stagejit_TensorArg& t, int rank, long long i) {
  return static_cast<const T*>(t.data)[sj_offset(t, rank, i)];
}
template <class T>
__device__ __forceinline__ void sj_store(const stagejit_TensorArg& t, int rank, long long i, T v) {
  static_cast<T*>(t.data)[sj_offset(t, rank, i)] = v;
}
/// 16-bit storage types (IEEE half, bfloat16), converted to and from float by the
/// loads and stores below; computation happens in float.
struct sj_half { unsigned short bits; };
struct sj_bfloat16 { unsigned short bits; };
/// Conversion of a stored element of type S to the compute type T and back.
template <class T, class S>
struct sj_convert {
  static __device__ __forceinline__ T load(S s) { return static_cast<T>(s); }
  static __device__ __forceinline__ S store(T v) { return static_cast<S>(v); }
};
template <class T>
struct sj_convert<T, sj_half> {
  static __device__ __forceinline__ T load(sj_half s) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s.bits));
    return static_cast<T>(f);
  }
  static __device__ __forceinline__ sj_half store(T v) {
    sj_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(static_cast<float>(v)));
    return h;
  }
};
template <class T>
struct sj_convert<T, sj_bfloat16> {
  static __device__ __forceinline__ T load(sj_bfloat16 s) {
    return static_cast<T>(__uint_as_float(static_cast<unsigned>(s.bits) << 16));
  }
  static __device__ __forceinline__ sj_bfloat16 store(T v) {
    // c10::BFloat16's round to nearest even; NaN stays a (quiet) NaN.
    const float f = static_cast<float>(v);
    unsigned u = __float_as_uint(f);
    sj_bfloat16 b;
    if (f != f) {
      b.bits = 0x7fc0;
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      b.bits = static_cast<unsigned short>(u >> 16);
    }
    return b;
  }
};
template <class T>
struct sj_convert<T, bool> {
  static __device__ __forceinline__ T load(bool s) { return s ? T(1) : T(0); }
  static __device__ __forceinline__ bool store(T v) { return v != T(0); }
};
/// Element i of t (storage type S) in the compute type T, and back.
template <class T, class S>
__device__ __forceinline__ T sj_load_as(const stagejit_TensorArg& t, int rank, long long i) {
  return sj_convert<T, S>::load(sj_load<S>(t, rank, i));
}
template <class T, class S>
__device__ __forceinline__ void sj_store_as(const stagejit_TensorArg& t, int rank, long long i, T v) {
  sj_store<S>(t, rank, i, sj_convert<T, S>::store(v));
}
#define SJ_GRID_STRIDE_LOOP(i, begin, end)                                                \
  for (long long i = (begin) + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (end); \
       i += (long long)blockDim.x * gridDim.x)
// ---- end of prelude ----
)PRELUDE";
  return text;
}

#ifdef STAGEJIT_FUSION_CUDA

namespace {

static_assert(sizeof(TensorArg) == sizeof(void*) + 2 * kMaxDims * sizeof(long long), "TensorArg layout");
struct ArgPack {
  TensorArg t[kMaxCudaArgs];
};

void* open_first(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    if (n.empty()) continue;
    if (void* h = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
  }
  return nullptr;
}

template <class F>
F symbol(void* lib, const char* name) {
  return reinterpret_cast<F>(::dlsym(lib, name));
}

// ------------------------------------------------------------------- NVRTC table
struct Nvrtc {
  bool ok = false;
  std::string why;
  decltype(&::nvrtcVersion) version = nullptr;
  decltype(&::nvrtcGetErrorString) error_string = nullptr;
  decltype(&::nvrtcCreateProgram) create = nullptr;
  decltype(&::nvrtcDestroyProgram) destroy = nullptr;
  decltype(&::nvrtcCompileProgram) compile = nullptr;
  decltype(&::nvrtcGetProgramLogSize) log_size = nullptr;
  decltype(&::nvrtcGetProgramLog) log = nullptr;
  decltype(&::nvrtcGetPTXSize) ptx_size = nullptr;
  decltype(&::nvrtcGetPTX) ptx = nullptr;
  decltype(&::nvrtcGetNumSupportedArchs) num_archs = nullptr;
  decltype(&::nvrtcGetSupportedArchs) archs = nullptr;
};

const Nvrtc& nvrtc() {
  static const Nvrtc table = [] {
    Nvrtc t;
    const char* env = std::getenv("STAGEJIT_NVRTC_LIBRARY");
    const std::string root = STAGEJIT_CUDA_TOOLKIT;
    void* lib = open_first({env ? env : "", "libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2",
                            root + "/lib64/libnvrtc.so", root + "/lib64/libnvrtc.so.13", root + "/lib64/libnvrtc.so.12",
                            root + "/lib/x64/libnvrtc.so"});
    if (!lib) {
      t.why = "libnvrtc could not be loaded (set $STAGEJIT_NVRTC_LIBRARY or install the CUDA toolkit)";
      return t;
    }
    t.version = symbol<decltype(t.version)>(lib, "nvrtcVersion");
    t.error_string = symbol<decltype(t.error_string)>(lib, "nvrtcGetErrorString");
    t.create = symbol<decltype(t.create)>(lib, "nvrtcCreateProgram");
    t.destroy = symbol<decltype(t.destroy)>(lib, "nvrtcDestroyProgram");
    t.compile = symbol<decltype(t.compile)>(lib, "nvrtcCompileProgram");
    t.log_size = symbol<decltype(t.log_size)>(lib, "nvrtcGetProgramLogSize");
    t.log = symbol<decltype(t.log)>(lib, "nvrtcGetProgramLog");
    t.ptx_size = symbol<decltype(t.ptx_size)>(lib, "nvrtcGetPTXSize");
    t.ptx = symbol<decltype(t.ptx)>(lib, "nvrtcGetPTX");
    t.num_archs = symbol<decltype(t.num_archs)>(lib, "nvrtcGetNumSupportedArchs");
    t.archs = symbol<decltype(t.archs)>(lib, "nvrtcGetSupportedArchs");
    t.ok = t.version && t.error_string && t.create && t.destroy && t.compile && t.log_size && t.log && t.ptx_size &&
           t.ptx;
    if (!t.ok) t.why = "libnvrtc lacks an expected function";
    return t;
  }();
  return table;
}

const Nvrtc& require_nvrtc() {
  const Nvrtc& n = nvrtc();
  STAGEJIT_CHECK_AS(FusionError, n.ok, "fusion: NVRTC is not available: ", n.why);
  return n;
}

// ------------------------------------------------------------------- driver table
struct Driver {
  bool ok = false;
  std::string why;
  int devices = 0;
  decltype(&::cuGetErrorString) error_string = nullptr;
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDeviceGetCount) device_count = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetAttribute) attribute = nullptr;
  decltype(&::cuDeviceGetName) name = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) ctx_retain = nullptr;
  decltype(&::cuCtxSetCurrent) ctx_set_current = nullptr;
  decltype(&::cuCtxSynchronize) ctx_synchronize = nullptr;
  decltype(&::cuModuleLoadDataEx) module_load = nullptr;
  decltype(&::cuModuleUnload) module_unload = nullptr;
  decltype(&::cuModuleGetFunction) get_function = nullptr;
  decltype(&::cuLaunchKernel) launch = nullptr;
  decltype(&::cuMemAlloc) mem_alloc = nullptr;
  decltype(&::cuMemFree) mem_free = nullptr;
  decltype(&::cuMemcpyHtoD) htod = nullptr;
  decltype(&::cuMemcpyDtoH) dtoh = nullptr;
  // Primary contexts retained per device (never released: they live with the process).
  mutable std::mutex mutex;
  mutable std::unordered_map<int, CUcontext> contexts;
};

const Driver& driver() {
  static const Driver& table = *[] {
    auto* t = new Driver();  // leaked on purpose: modules may be unloaded during exit
    void* lib = open_first({"libcuda.so.1", "libcuda.so"});
    if (!lib) {
      t->why = "libcuda.so.1 could not be loaded (no NVIDIA driver)";
      return t;
    }
    t->error_string = symbol<decltype(t->error_string)>(lib, "cuGetErrorString");
    t->init = symbol<decltype(t->init)>(lib, "cuInit");
    t->device_count = symbol<decltype(t->device_count)>(lib, "cuDeviceGetCount");
    t->device_get = symbol<decltype(t->device_get)>(lib, "cuDeviceGet");
    t->attribute = symbol<decltype(t->attribute)>(lib, "cuDeviceGetAttribute");
    t->name = symbol<decltype(t->name)>(lib, "cuDeviceGetName");
    t->ctx_retain = symbol<decltype(t->ctx_retain)>(lib, "cuDevicePrimaryCtxRetain");
    t->ctx_set_current = symbol<decltype(t->ctx_set_current)>(lib, "cuCtxSetCurrent");
    t->ctx_synchronize = symbol<decltype(t->ctx_synchronize)>(lib, "cuCtxSynchronize");
    t->module_load = symbol<decltype(t->module_load)>(lib, "cuModuleLoadDataEx");
    t->module_unload = symbol<decltype(t->module_unload)>(lib, "cuModuleUnload");
    t->get_function = symbol<decltype(t->get_function)>(lib, "cuModuleGetFunction");
    t->launch = symbol<decltype(t->launch)>(lib, "cuLaunchKernel");
    t->mem_alloc = symbol<decltype(t->mem_alloc)>(lib, "cuMemAlloc_v2");
    t->mem_free = symbol<decltype(t->mem_free)>(lib, "cuMemFree_v2");
    t->htod = symbol<decltype(t->htod)>(lib, "cuMemcpyHtoD_v2");
    t->dtoh = symbol<decltype(t->dtoh)>(lib, "cuMemcpyDtoH_v2");
    const bool all = t->error_string && t->init && t->device_count && t->device_get && t->attribute &&
                     t->ctx_retain && t->ctx_set_current && t->ctx_synchronize && t->module_load &&
                     t->module_unload && t->get_function && t->launch && t->mem_alloc && t->mem_free && t->htod &&
                     t->dtoh;
    if (!all) {
      t->why = "libcuda lacks an expected function";
      return t;
    }
    if (t->init(0) != CUDA_SUCCESS) {
      t->why = "cuInit failed (no usable GPU)";
      return t;
    }
    if (t->device_count(&t->devices) != CUDA_SUCCESS || t->devices <= 0) {
      t->why = "no CUDA device";
      t->devices = 0;
      return t;
    }
    t->ok = true;
    return t;
  }();
  return table;
}

const Driver& require_driver() {
  const Driver& d = driver();
  STAGEJIT_CHECK_AS(FusionError, d.ok, "fusion: the CUDA driver is not available: ", d.why);
  return d;
}

void check_cu(const Driver& d, CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (d.error_string) d.error_string(r, &text);
  detail::throw_error<FusionError>("fusion: ", what, " failed: ", text ? text : "unknown CUDA error", " (", int(r),
                                   ")");
}

/// Makes the primary context of `device` current on this thread.
void use_device(const Driver& d, int device) {
  STAGEJIT_CHECK_AS(FusionError, device >= 0 && device < d.devices, "fusion: CUDA device ", device,
                    " does not exist (", d.devices, " devices)");
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    auto it = d.contexts.find(device);
    if (it == d.contexts.end()) {
      CUdevice dev = 0;
      check_cu(d, d.device_get(&dev, device), "cuDeviceGet");
      check_cu(d, d.ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
      d.contexts.emplace(device, ctx);
    } else {
      ctx = it->second;
    }
  }
  check_cu(d, d.ctx_set_current(ctx), "cuCtxSetCurrent");
}

int device_attribute(const Driver& d, CUdevice_attribute attr, int device) {
  CUdevice dev = 0;
  check_cu(d, d.device_get(&dev, device), "cuDeviceGet");
  int v = 0;
  check_cu(d, d.attribute(&v, attr, dev), "cuDeviceGetAttribute");
  return v;
}

}  // namespace

bool nvrtc_available() noexcept {
  try {
    return nvrtc().ok;
  } catch (...) {
    return false;
  }
}

std::string nvrtc_version() {
  const Nvrtc& n = nvrtc();
  if (!n.ok) return "";
  int major = 0, minor = 0;
  if (n.version(&major, &minor) != NVRTC_SUCCESS) return "";
  return std::to_string(major) + "." + std::to_string(minor);
}

std::vector<int> nvrtc_supported_archs() {
  const Nvrtc& n = nvrtc();
  std::vector<int> out;
  if (!n.ok || !n.num_archs || !n.archs) return out;
  int count = 0;
  if (n.num_archs(&count) != NVRTC_SUCCESS || count <= 0) return out;
  out.resize(count);
  if (n.archs(out.data()) != NVRTC_SUCCESS) return {};
  std::sort(out.begin(), out.end());
  return out;
}

std::string compile_to_ptx(const std::string& source, const std::string& arch, const std::string& name) {
  const Nvrtc& n = require_nvrtc();
  std::string use_arch = arch;
  if (use_arch.empty()) {
    const auto archs = nvrtc_supported_archs();
    use_arch = "compute_" + std::to_string(archs.empty() ? 75 : archs.front());
  }
  nvrtcProgram prog = nullptr;
  nvrtcResult r = n.create(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr);
  STAGEJIT_CHECK_AS(FusionError, r == NVRTC_SUCCESS, "fusion: nvrtcCreateProgram failed: ", n.error_string(r));
  struct Destroy {
    const Nvrtc& n;
    nvrtcProgram* p;
    ~Destroy() { n.destroy(p); }
  } destroy{n, &prog};
  const std::string arch_opt = "--gpu-architecture=" + use_arch;
  // --fmad=false: no contraction of a*b+c into one rounding, so fused results round like
  // ATen's op-by-op kernels (as the CPU backend's -ffp-contract=off).
  const char* opts[] = {arch_opt.c_str(), "--std=c++17", "--fmad=false"};
  r = n.compile(prog, 3, opts);
  std::size_t log_size = 0;
  std::string log;
  if (n.log_size(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    log.resize(log_size);
    n.log(prog, log.data());
    log.resize(log_size - 1);
  }
  if (r != NVRTC_SUCCESS) {
    detail::throw_error<FusionError>("fusion: NVRTC could not compile ", name, " for ", use_arch, ": ",
                                     n.error_string(r), "\n  NVRTC log:\n", log, "\n  source:\n", source);
  }
  std::size_t ptx_size = 0;
  r = n.ptx_size(prog, &ptx_size);
  STAGEJIT_CHECK_AS(FusionError, r == NVRTC_SUCCESS, "fusion: nvrtcGetPTXSize failed: ", n.error_string(r));
  std::string ptx(ptx_size, '\0');
  r = n.ptx(prog, ptx.data());
  STAGEJIT_CHECK_AS(FusionError, r == NVRTC_SUCCESS, "fusion: nvrtcGetPTX failed: ", n.error_string(r));
  if (!ptx.empty() && ptx.back() == '\0') ptx.pop_back();
  return ptx;
}

bool cuda_driver_available() noexcept {
  try {
    return driver().ok;
  } catch (...) {
    return false;
  }
}

int cuda_device_count() noexcept { return cuda_driver_available() ? driver().devices : 0; }

CudaDeviceInfo cuda_device_info(int device) {
  const Driver& d = require_driver();
  STAGEJIT_CHECK_AS(FusionError, device >= 0 && device < d.devices, "fusion: CUDA device ", device,
                    " does not exist (", d.devices, " devices)");
  CudaDeviceInfo info;
  CUdevice dev = 0;
  check_cu(d, d.device_get(&dev, device), "cuDeviceGet");
  if (d.name) {
    char name[256] = {};
    if (d.name(name, sizeof name - 1, dev) == CUDA_SUCCESS) info.name = name;
  }
  auto attr = [&](CUdevice_attribute a) {
    int v = 0;
    return d.attribute(&v, a, dev) == CUDA_SUCCESS ? v : 0;
  };
  info.compute_capability = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) * 10 +
                            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  info.multiprocessors = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info.memory_clock_khz = attr(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
  info.memory_bus_width_bits = attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
  return info;
}

// ------------------------------------------------------------------- CudaKernel

struct CudaKernel::Impl {
  std::string entry;
  std::string ptx;
  int device = 0;
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  int max_blocks = 1;  // enough resident blocks to fill the device
};

CudaKernel::CudaKernel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaKernel::~CudaKernel() {
  if (impl_ && impl_->module) {
    const Driver& d = driver();
    if (d.ok) {
      try {
        use_device(d, impl_->device);
        d.module_unload(impl_->module);
      } catch (...) {
        // Unloading during process exit may fail; nothing to do.
      }
    }
  }
}

const std::string& CudaKernel::entry() const noexcept { return impl_->entry; }
const std::string& CudaKernel::ptx() const noexcept { return impl_->ptx; }
int CudaKernel::device() const noexcept { return impl_->device; }

void CudaKernel::launch(int64_t numel, int32_t rank, const std::vector<TensorArg>& args, void* stream) const {
  const Driver& d = require_driver();
  STAGEJIT_CHECK_AS(FusionError, args.size() <= static_cast<std::size_t>(kMaxCudaArgs), "fusion: CUDA kernel `",
                    impl_->entry, "` given ", args.size(), " tensors; at most ", kMaxCudaArgs);
  STAGEJIT_CHECK_AS(FusionError, rank >= 1 && rank <= kMaxDims, "fusion: CUDA kernel `", impl_->entry,
                    "` launched with rank ", rank);
  if (numel <= 0) return;
  ArgPack pack{};
  std::copy(args.begin(), args.end(), pack.t);
  long long begin = 0, end = numel;
  int r = rank;
  void* params[] = {&begin, &end, &r, &pack};
  constexpr int kThreads = 256;
  const int64_t needed = (numel + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(needed, impl_->max_blocks));
  use_device(d, impl_->device);
  check_cu(d, d.launch(impl_->function, blocks, 1, 1, kThreads, 1, 1, 0, static_cast<CUstream>(stream), params, nullptr),
           "cuLaunchKernel");
}

void CudaKernel::launch(const PackedArgs& args, void* stream) const {
  STAGEJIT_CHECK_AS(FusionError, args.device.is_cuda() && args.device.index() == impl_->device, "fusion: CUDA kernel `",
                    impl_->entry, "` is loaded on cuda:", impl_->device, " but its tensors are on ", args.device);
  launch(args.numel, args.rank, args.args, stream);
}

// ------------------------------------------------------------------- CudaBackend

struct CudaBackend::Impl {
  std::mutex mutex;
  std::unordered_map<std::string, std::shared_future<std::shared_ptr<const CudaKernel>>> kernels;
  std::atomic<int64_t> compiles{0};

  /// The PTX of `src` for `arch`, from the disk cache (`default_cache_dir()`, files
  /// `cuda-<sha1 of prelude, source, entry, arch, NVRTC version>.ptx`, installed by
  /// rename) or compiled by NVRTC and stored there. An unreadable cache is skipped.
  std::string cached_ptx(const KernelSource& src, const std::string& arch) {
    const std::string prelude = cuda_prelude();
    const std::string hash =
        c10::sha1(prelude + '\x01' + src.source + '\x01' + src.entry + '\x01' + arch + '\x01' + nvrtc_version()).str();
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path dir = default_cache_dir();
    const fs::path file = dir / ("cuda-" + hash + ".ptx");
    {
      std::ifstream in(file, std::ios::binary);
      if (in) {
        std::string ptx((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        if (ptx.find(".entry " + src.entry + "(") != std::string::npos) return ptx;
      }
    }
    ++compiles;
    std::string ptx = compile_to_ptx(prelude + "\n" + src.source, arch, src.entry + ".cu");
    fs::create_directories(dir, ec);
    const fs::path tmp = dir / ("cuda-" + hash + ".ptx.tmp" + std::to_string(::getpid()));
    {
      std::ofstream out(tmp, std::ios::binary);
      out << ptx;
      if (!out) return ptx;
    }
    fs::rename(tmp, file, ec);
    if (ec) fs::remove(tmp, ec);
    return ptx;
  }

  std::shared_ptr<const CudaKernel> build(const KernelSource& src, int device) {
    const Driver& d = require_driver();
    use_device(d, device);
    const int major = device_attribute(d, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device);
    const int minor = device_attribute(d, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device);
    int arch = major * 10 + minor;
    const auto archs = nvrtc_supported_archs();
    if (!archs.empty()) {
      // The newest virtual architecture NVRTC knows that the device can run (PTX is
      // JIT-compiled forward by the driver).
      int best = 0;
      for (int a : archs)
        if (a <= arch) best = a;
      STAGEJIT_CHECK_AS(FusionError, best > 0, "fusion: NVRTC ", nvrtc_version(), " cannot target cuda:", device,
                        " (sm_", arch, "); its lowest architecture is compute_", archs.front());
      arch = best;
    }
    auto impl = std::make_unique<CudaKernel::Impl>();
    impl->entry = src.entry;
    impl->device = device;
    impl->ptx = cached_ptx(src, "compute_" + std::to_string(arch));
    char error_log[8192] = {};
    CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void* values[] = {error_log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(error_log) - 1))};
    const CUresult r = d.module_load(&impl->module, impl->ptx.c_str(), 2, opts, values);
    if (r != CUDA_SUCCESS) {
      const char* text = nullptr;
      d.error_string(r, &text);
      detail::throw_error<FusionError>("fusion: loading the PTX of kernel `", src.entry, "` on cuda:", device,
                                       " failed: ", text ? text : "unknown error", "\n", error_log);
    }
    const CUresult f = d.get_function(&impl->function, impl->module, src.entry.c_str());
    if (f != CUDA_SUCCESS) {
      d.module_unload(impl->module);
      detail::throw_error<FusionError>("fusion: the module of kernel `", src.entry, "` has no entry point `",
                                       src.entry, "` (declare it extern \"C\" __global__)");
    }
    const int sms = device_attribute(d, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device);
    const int threads_per_sm = device_attribute(d, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, device);
    impl->max_blocks = std::max(1, sms * std::max(1, threads_per_sm / 256));
    return std::make_shared<const CudaKernel>(std::move(impl));
  }
};

CudaBackend::CudaBackend() : impl_(std::make_unique<Impl>()) {}
CudaBackend::~CudaBackend() = default;
int64_t CudaBackend::compiles() const noexcept { return impl_->compiles; }

std::shared_ptr<const CudaKernel> CudaBackend::get(const KernelSource& source) {
  STAGEJIT_CHECK_AS(FusionError, source.key.device == DeviceKind::CUDA, "the CUDA fusion backend was given a ",
                    to_string(source.key.device), " kernel `", source.entry, "`");
  const int device = std::max(0, static_cast<int>(source.key.device_index));
  const std::string hash = c10::sha1(cuda_prelude() + '\x01' + source.source + '\x01' + source.entry + '\x01' +
                                     source.key.to_string() + '\x01' + std::to_string(device))
                               .str();
  return build_once(impl_->mutex, impl_->kernels, hash, [&] { return impl_->build(source, device); });
}

// ------------------------------------------------------------------- CudaBuffer

CudaBuffer::CudaBuffer(std::size_t bytes, int device) : bytes_(bytes), device_(device) {
  const Driver& d = require_driver();
  use_device(d, device);
  CUdeviceptr p = 0;
  check_cu(d, d.mem_alloc(&p, std::max<std::size_t>(bytes, 1)), "cuMemAlloc");
  ptr_ = reinterpret_cast<void*>(static_cast<uintptr_t>(p));
}

CudaBuffer::~CudaBuffer() {
  const Driver& d = driver();
  if (ptr_ && d.ok) {
    try {
      use_device(d, device_);
      d.mem_free(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr_)));
    } catch (...) {
    }
  }
}

void CudaBuffer::copy_from_host(const void* src) {
  const Driver& d = require_driver();
  use_device(d, device_);
  if (bytes_ == 0) return;
  check_cu(d, d.htod(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr_)), src, bytes_), "cuMemcpyHtoD");
}

void CudaBuffer::copy_to_host(void* dst) const {
  const Driver& d = require_driver();
  use_device(d, device_);
  if (bytes_ == 0) return;
  check_cu(d, d.dtoh(dst, static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr_)), bytes_), "cuMemcpyDtoH");
}

void cuda_synchronize(int device) {
  const Driver& d = require_driver();
  use_device(d, device);
  check_cu(d, d.ctx_synchronize(), "cuCtxSynchronize");
}

#else  // built without the CUDA toolkit

namespace {
[[noreturn]] void no_cuda() {
  detail::throw_error<FusionError>("fusion: stagejit was built without CUDA support (the `cuda` Meson feature found "
                                   "no toolkit)");
}
}  // namespace

bool nvrtc_available() noexcept { return false; }
std::string nvrtc_version() { return ""; }
std::vector<int> nvrtc_supported_archs() { return {}; }
std::string compile_to_ptx(const std::string&, const std::string&, const std::string&) { no_cuda(); }
bool cuda_driver_available() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
CudaDeviceInfo cuda_device_info(int) { no_cuda(); }

struct CudaKernel::Impl {
  std::string entry, ptx;
};
CudaKernel::CudaKernel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaKernel::~CudaKernel() = default;
const std::string& CudaKernel::entry() const noexcept { return impl_->entry; }
const std::string& CudaKernel::ptx() const noexcept { return impl_->ptx; }
int CudaKernel::device() const noexcept { return 0; }
void CudaKernel::launch(int64_t, int32_t, const std::vector<TensorArg>&, void*) const { no_cuda(); }
void CudaKernel::launch(const PackedArgs&, void*) const { no_cuda(); }

struct CudaBackend::Impl {};
CudaBackend::CudaBackend() : impl_(std::make_unique<Impl>()) {}
CudaBackend::~CudaBackend() = default;
int64_t CudaBackend::compiles() const noexcept { return 0; }
std::shared_ptr<const CudaKernel> CudaBackend::get(const KernelSource&) { no_cuda(); }

CudaBuffer::CudaBuffer(std::size_t, int) { no_cuda(); }
CudaBuffer::~CudaBuffer() = default;
void CudaBuffer::copy_from_host(const void*) { no_cuda(); }
void CudaBuffer::copy_to_host(void*) const { no_cuda(); }
void cuda_synchronize(int) { no_cuda(); }

#endif

CudaBackend& default_cuda_backend() {
  static CudaBackend backend;
  return backend;
}

void* current_cuda_stream(int device) {
#ifdef STAGEJIT_TORCH_CUDA
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
#else
  (void)device;
  return nullptr;
#endif
}

}  // namespace stagejit::fusion
