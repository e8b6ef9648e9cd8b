#pragma once
// The CUDA driver API and NVRTC, opened with dlopen at first use: their function-pointer
// tables and error checks, private to the shim (src/cuda_driver.cpp defines them;
// src/fusion_cuda.cpp, the CUDA backend, uses them). Built without the CUDA toolkit only
// `no_cuda()` is declared.
#include <stagejit/fusion/cuda_backend.hpp>

#include <string>

#ifdef STAGEJIT_FUSION_CUDA
#include <cuda.h>
#include <nvrtc.h>

#include <mutex>
#include <unordered_map>
#endif

namespace stagejit::fusion::cuda_driver {

#ifdef STAGEJIT_FUSION_CUDA

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

/// The NVRTC table, loaded at the first call (`ok` false and `why` set when it cannot be).
const Nvrtc& nvrtc();
/// `nvrtc()`, or a FusionError saying why NVRTC is not available.
const Nvrtc& require_nvrtc();

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

/// The driver table, loaded and initialised (cuInit) at the first call.
const Driver& driver();
/// `driver()`, or a FusionError saying why the driver is not available.
const Driver& require_driver();

/// Throws FusionError "fusion: <what> failed: <CUDA error string> (<code>)" unless `r` is CUDA_SUCCESS.
void check_cu(const Driver& d, CUresult r, const char* what);

void use_device(const Driver& d, int device);

/// Attribute `attr` of CUDA device `device`.
int device_attribute(const Driver& d, CUdevice_attribute attr, int device);

#else  // built without the CUDA toolkit

/// Throws FusionError: stagejit was built without CUDA support.
[[noreturn]] void no_cuda();

#endif

}  // namespace stagejit::fusion::cuda_driver
