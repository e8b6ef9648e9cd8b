#pragma once
/// \file
/// The contract between the fusion code generator and the fusion backends: what a
/// generated kernel is (`KernelSource`), what it is specialised on (`KernelKey`) and how
/// it is called (the launch ABI, `TensorArg`).
///
/// ## Launch ABI (elementwise kernels, CPU and CUDA)
///
/// A kernel computes every element of an *iteration shape* (the output shape; all
/// outputs of one kernel share it). Each input and output is described by a
/// `TensorArg`: its data pointer and, for each of the `rank` dimensions of the iteration
/// shape, a size and a stride in **elements** (not bytes), 64-bit. Inputs are broadcast
/// to the iteration shape beforehand: a broadcast or expanded dimension has stride 0.
/// Arguments are ordered inputs first, then outputs, in the order of the key.
/// Linear index `i` in `[0, numel)` names the element whose multi-index is `i` written
/// row-major in the iteration shape (last dimension fastest).
///
/// - CPU entry point (generated C++, compiled to a shared object):
///   `extern "C" void NAME(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args)`
///   computes the elements with linear index in `[begin, end)`. It is called from several
///   threads at once on disjoint ranges (`run_cpu_kernel`).
/// - CUDA entry point (generated CUDA C++, NVRTC):
///   `extern "C" __global__ void NAME(long long begin, long long end, int rank, stagejit_Args<N> pack)`
///   with `pack.t[k]` the k-th `TensorArg` of the N given (generated kernels: N = inputs +
///   outputs; `stagejit_ArgPack` is `stagejit_Args<24>` for hand-written ones); a
///   grid-stride loop covers `[begin, end)`.
///
/// The preludes (`cpu_prelude()`, `cuda_prelude()`) declare `stagejit_TensorArg` with the
/// same layout as `stagejit::fusion::TensorArg` and the loop helpers a generated body
/// uses; the backends prepend them to `KernelSource::source`.
/// Follows the TensorInfo/grid-stride design of the 2017 fusion compiler (docs/seed-system.md §5.2),
/// extended with 64-bit indices, broadcasting and CPU kernels.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace stagejit::fusion {

/// Most dimensions a kernel's iteration shape may have (after merging contiguous runs).
inline constexpr int kMaxDims = 8;
/// Most tensors (inputs + outputs) one CUDA launch may take. The pack is passed by value
/// as a kernel parameter of N x 136 bytes: above 29 tensors it exceeds the classic 4 KiB
/// and needs the 32 KiB parameters of CUDA 12.1+ on sm_70 or newer (an LSTM cell's
/// backward group holds 33); NVRTC refuses it otherwise (FusionError: the group runs
/// op by op).
inline constexpr int kMaxCudaArgs = 128;

/// One tensor as a kernel sees it: element pointer, sizes and element strides of the
/// first `rank` dimensions (the rest unused). Standard layout; generated code declares
/// the identical `stagejit_TensorArg`.
struct TensorArg {
  void* data = nullptr;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

/// Where a kernel runs.
enum class DeviceKind : int32_t { CPU = 0, CUDA = 1 };

/// Printed name of a device kind (`"cpu"`, `"cuda"`).
const char* to_string(DeviceKind kind) noexcept;

/// What a kernel is specialised on for one input or output tensor.
struct TensorDesc {
  at::ScalarType dtype = at::kFloat;
  int64_t rank = 0;         ///< dimensions of the tensor as given (before broadcasting)
  bool contiguous = true;   ///< `Tensor::is_contiguous()` of the tensor as given
  bool operator==(const TensorDesc&) const = default;
};

/// The specialisation key of a kernel: device, and a `TensorDesc` per input and output.
/// Two calls with equal keys may run the same kernel; the fuser looks kernels up by it.
struct KernelKey {
  DeviceKind device = DeviceKind::CPU;
  int32_t device_index = -1;  ///< CUDA ordinal; -1 on the CPU
  std::vector<TensorDesc> inputs;
  std::vector<TensorDesc> outputs;
  bool operator==(const KernelKey&) const = default;

  /// A stable text form, e.g. `cpu;in=f32/2/c,f32/1/n;out=f32/2/c`. Part of cache hashes.
  std::string to_string() const;

  /// The key of a call with these tensors (all on one device; `FusionError` otherwise).
  static KernelKey of(at::TensorList inputs, at::TensorList outputs);
};

/// A generated kernel, ready for a backend: the source text (without the prelude, which
/// the backend prepends), the name of its `extern "C"` entry point, and its key.
struct KernelSource {
  std::string source;  ///< C++ (CPU) or CUDA C++ (NVRTC) text following the launch ABI
  std::string entry;   ///< name of the entry point, a C identifier
  KernelKey key;       ///< the specialisation the source was generated for
};

}  // namespace stagejit::fusion
