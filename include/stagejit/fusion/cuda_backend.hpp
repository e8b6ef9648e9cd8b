#pragma once
/// \file
/// CUDA fusion backend: NVRTC compiles a generated kernel (`KernelSource`, CUDA launch
/// ABI of kernel_spec.hpp) to PTX; the CUDA driver API loads and launches it. Both
/// libraries are opened with dlopen at first use (`libnvrtc.so*`, from the loader path,
/// `$STAGEJIT_NVRTC_LIBRARY` or the toolkit's lib64; `libcuda.so.1`), so nothing links
/// CUDA and a machine without CUDA or without a GPU runs everything else: the
/// `*_available()` functions report false and the other functions throw `FusionError`.
/// Built with CUDA support when the `cuda` Meson feature finds a toolkit.
///
/// Generated code is written against the prelude (`cuda_prelude()`), which declares
/// `stagejit_TensorArg` (as `TensorArg`), `stagejit_Args<N> { stagejit_TensorArg t[N]; }` (the
/// launch's N tensors, N <= `kMaxCudaArgs`), `stagejit_ArgPack` (= `stagejit_Args<24>`),
/// `sj_offset(arg, rank, i)` (element offset of linear index `i`), `sj_load<T>(arg, rank, i)`,
/// `sj_store<T>(arg, rank, i, v)` and the loop `SJ_GRID_STRIDE_LOOP(i, begin, end)`.
/// Example (`tanh(a*b+c)*sigmoid(a)` in float):
///
///     extern "C" __global__ void k(long long begin, long long end, int rank, stagejit_ArgPack p) {
///       SJ_GRID_STRIDE_LOOP(i, begin, end) {
///         float a = sj_load<float>(p.t[0], rank, i), b = sj_load<float>(p.t[1], rank, i),
///               c = sj_load<float>(p.t[2], rank, i);
///         sj_store<float>(p.t[3], rank, i, tanhf(a * b + c) * (1.0f / (1.0f + expf(-a))));
///       }
///     }
/// The 2017 fusion compiler (docs/seed-system.md §5.2) is the model: NVRTC to PTX, driver-API launch.

#include <stagejit/core/error.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace stagejit::fusion {

/// The text prepended to every CUDA kernel source (see the file comment).
const std::string& cuda_prelude();

/// True when stagejit was built with the CUDA toolkit and libnvrtc can be loaded.
bool nvrtc_available() noexcept;

/// NVRTC's version as `major.minor`, or an empty string when it is not available.
std::string nvrtc_version();

/// Virtual architectures NVRTC accepts (e.g. 75 for `compute_75`), ascending; empty when
/// NVRTC is not available.
std::vector<int> nvrtc_supported_archs();

/// Compiles complete CUDA C++ `source` (nothing is prepended) to PTX for the virtual
/// architecture `arch` (`"compute_80"`; empty: the lowest NVRTC supports), C++17,
/// without contracting multiply-adds (`--fmad=false`, fused results round like ATen's
/// op-by-op kernels). `name` is
/// the file name NVRTC shows in its log. Throws `FusionError` carrying the NVRTC log
/// and the source when compilation fails, or when NVRTC is not available.
std::string compile_to_ptx(const std::string& source, const std::string& arch = "",
                           const std::string& name = "stagejit_kernel.cu");

/// True when libcuda can be loaded, `cuInit` succeeds and at least one GPU is present.
bool cuda_driver_available() noexcept;

/// Number of CUDA devices (0 without a driver or GPU).
int cuda_device_count() noexcept;

/// What the driver reports about one GPU (for benchmarks and reports).
struct CudaDeviceInfo {
  std::string name;
  int compute_capability = 0;     ///< e.g. 90 for sm_90
  int multiprocessors = 0;
  int memory_clock_khz = 0;       ///< peak memory clock (0 when the driver does not say)
  int memory_bus_width_bits = 0;  ///< global memory bus width (0 when the driver does not say)
  /// Peak DRAM bandwidth, 2 (double data rate) x clock x bus width, in GB/s (1e9
  /// bytes/s); 0 when clock or width is unknown.
  double peak_bandwidth_gbs() const noexcept {
    return 2.0 * memory_clock_khz * 1e3 * (memory_bus_width_bits / 8.0) / 1e9;
  }
};

/// The driver's description of CUDA device `device`. Throws `FusionError` without a
/// driver or for a device that does not exist.
CudaDeviceInfo cuda_device_info(int device = 0);

/// A kernel loaded into one device's primary context. Thread-safe.
class CudaKernel {
 public:
  struct Impl;
  explicit CudaKernel(std::unique_ptr<Impl> impl);
  ~CudaKernel();
  CudaKernel(const CudaKernel&) = delete;
  CudaKernel& operator=(const CudaKernel&) = delete;

  const std::string& entry() const noexcept;
  const std::string& ptx() const noexcept;
  int device() const noexcept;

  /// Launches the kernel over `[0, numel)` of an iteration shape of `rank` dimensions,
  /// with `args` (inputs then outputs, device pointers; at most `kMaxCudaArgs`), on
  /// `stream` (a `CUstream`; null: the legacy default stream). Asynchronous. Throws
  /// `FusionError` with the driver's error text on failure.
  void launch(int64_t numel, int32_t rank, const std::vector<TensorArg>& args, void* stream = nullptr) const;

  /// Launches with packed tensors (`pack_tensor_args` of CUDA tensors of this device).
  void launch(const PackedArgs& args, void* stream = nullptr) const;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Compiles (NVRTC, for the device's architecture) and loads CUDA kernels, once per
/// source and device (`build_once`, as `CpuBackend`); thread-safe. PTX is cached on disk
/// beside the CPU kernels (`default_cache_dir()`, `cuda-<hash>.ptx`, the hash covering
/// prelude, source, entry point, architecture and NVRTC version), so a later process
/// loads it without compiling. Throws `FusionError` when CUDA is
/// not available, compilation fails (with the NVRTC log) or loading fails.
class CudaBackend {
 public:
  CudaBackend();
  ~CudaBackend();
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  /// The kernel for `source` (prelude prepended) on device `source.key.device_index`
  /// (0 when negative).
  std::shared_ptr<const CudaKernel> get(const KernelSource& source);

  /// Number of NVRTC compilations so far (disk cache hits not counted).
  int64_t compiles() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The process-wide CUDA backend.
CudaBackend& default_cuda_backend();

/// The current CUDA stream of `device` as a `CUstream` (libtorch's
/// `c10::cuda::getCurrentCUDAStream(device)`), where fused kernels on CUDA tensors are
/// launched; null (the legacy default stream) when stagejit was built against a libtorch
/// without CUDA (there are no CUDA tensors then).
void* current_cuda_stream(int device);

/// Device memory of one GPU (`cuMemAlloc`), freed on destruction; for tests and for
/// callers without a CUDA-enabled libtorch. Throws `FusionError` on driver errors.
class CudaBuffer {
 public:
  CudaBuffer(std::size_t bytes, int device = 0);
  ~CudaBuffer();
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  void* data() const noexcept { return ptr_; }
  std::size_t bytes() const noexcept { return bytes_; }
  /// Synchronous copies of `bytes()` bytes.
  void copy_from_host(const void* src);
  void copy_to_host(void* dst) const;

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = 0;
};

/// Waits for all work on `device` (`cuCtxSynchronize`); throws `FusionError` on a
/// launch or kernel failure.
void cuda_synchronize(int device = 0);

}  // namespace stagejit::fusion
