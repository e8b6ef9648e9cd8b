// CUDA fusion backend: the kernel cache (NVRTC compiles to PTX, kept on disk), kernel
// loading and launch, device buffers; over the driver API and NVRTC of src/cuda_driver.cpp.
#include "cuda_driver.hpp"

#include <stagejit/core/error.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/fusion/detail/build_once.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <c10/util/hash.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <future>
#include <mutex>
#include <unordered_map>

#ifdef STAGEJIT_FUSION_CUDA
#include <cuda.h>
#endif
#ifdef STAGEJIT_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace stagejit::fusion {

#ifdef STAGEJIT_FUSION_CUDA

using namespace cuda_driver;

namespace {

static_assert(sizeof(TensorArg) == sizeof(void*) + 2 * kMaxDims * sizeof(long long), "TensorArg layout");
struct ArgPack {
  TensorArg t[kMaxCudaArgs];
};

}  // namespace

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
      ::stagejit::detail::throw_error<FusionError>("fusion: loading the PTX of kernel `", src.entry, "` on cuda:", device,
                                       " failed: ", text ? text : "unknown error", "\n", error_log);
    }
    const CUresult f = d.get_function(&impl->function, impl->module, src.entry.c_str());
    if (f != CUDA_SUCCESS) {
      d.module_unload(impl->module);
      ::stagejit::detail::throw_error<FusionError>("fusion: the module of kernel `", src.entry, "` has no entry point `",
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

using cuda_driver::no_cuda;

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
