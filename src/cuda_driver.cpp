// The CUDA driver API and NVRTC, both opened with dlopen at first use (src/cuda_driver.hpp):
// their function-pointer tables, error checks, and the NVRTC and device queries of
// fusion/cuda_backend.hpp. Built without the CUDA toolkit they report "not available" or
// throw FusionError.
#include "cuda_driver.hpp"

#include <stagejit/core/error.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <algorithm>
#include <string>
#include <vector>

#ifdef STAGEJIT_FUSION_CUDA
#include <dlfcn.h>

#include <cstdlib>
#endif

namespace stagejit::fusion {

#ifdef STAGEJIT_FUSION_CUDA

namespace cuda_driver {

namespace {

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

}  // namespace

// ------------------------------------------------------------------- NVRTC table

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
  ::stagejit::detail::throw_error<FusionError>("fusion: ", what, " failed: ", text ? text : "unknown CUDA error", " (", int(r),
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

}  // namespace cuda_driver

using namespace cuda_driver;

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
    ::stagejit::detail::throw_error<FusionError>("fusion: NVRTC could not compile ", name, " for ", use_arch, ": ",
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

#else  // built without the CUDA toolkit

namespace cuda_driver {
[[noreturn]] void no_cuda() {
  ::stagejit::detail::throw_error<FusionError>("fusion: stagejit was built without CUDA support (the `cuda` Meson feature found "
                                   "no toolkit)");
}
}  // namespace cuda_driver

using cuda_driver::no_cuda;


bool nvrtc_available() noexcept { return false; }
std::string nvrtc_version() { return ""; }
std::vector<int> nvrtc_supported_archs() { return {}; }
std::string compile_to_ptx(const std::string&, const std::string&, const std::string&) { no_cuda(); }
bool cuda_driver_available() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
CudaDeviceInfo cuda_device_info(int) { no_cuda(); }

#endif

}  // namespace stagejit::fusion
