#pragma once
/// \file
/// The fusion code generator, one generator with two dialects (CPU and CUDA), and the
/// runner of a FusionGroup (docs/seed-system.md §5.2, restated for the launch ABI of
/// kernel_spec.hpp).
///
/// `generate` turns a FusionGroup subgraph (elementwise Op nodes, see
/// passes/graph_fuser.hpp) plus the tensors it will run on into one kernel: every output
/// element is computed from the input elements in the group's compute type `T`.
/// Expressions come from the op table's `fusion_template`, finalised or overridden for
/// ATen's exact semantics on that device (see detail/codegen_ops.hpp):
/// - CPU dialect: a C++ body over `sjk::Vec<T>` (ATen `Vectorized<T>`); float, double.
/// - CUDA dialect: a scalar body per thread in a grid-stride loop with 64-bit indices
///   (NVRTC); float, double, and half/bfloat16 loaded and computed in float, stored back
///   rounded to nearest even.
/// Both keep the same special-value rules: NaN-propagating maximum/minimum/clamp/relu,
/// tanh and sigmoid exact at large |x| (no fast-math forms), literals in the compute
/// type. Boolean results (comparisons, `logical_and`) are kept as 1/0 in `T` and stored
/// as `bool`.
///
/// Compute type: ATen's type promotion of the non-bool inputs (`at::result_type`), which
/// must be float or double (or half/bfloat16 on CUDA, computed in float); every non-bool
/// input must already have that dtype (a group whose op-by-op promotion could differ from
/// one promoted type is refused).
/// Limits (FusionError, so `run_fused` falls back to running the nodes one by one):
/// other dtypes, `to`, ops without a form in the dialect, inputs on more than one device
/// or on a device other than CPU and CUDA, and groups whose outputs do not all have the
/// iteration shape (the broadcast of all inputs).
///
/// This header declares; the bodies (the generator, the planner and the runners) are in
/// fusion/codegen-inl.hpp, compiled once (core/config.hpp).

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/fusion/detail/codegen_ops.hpp>
#include <stagejit/core/memory/host_allocator.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/printer.hpp>
#include <stagejit/ir/node_semantics.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ir/attributes.hpp>

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace stagejit::fusion {

namespace detail {

/// Summed time spent generating kernel sources (`plan_group` and `predict_kernel`), for
/// the first-call breakdown of bench/pinn and bench/higher_order.
inline std::atomic<int64_t>& codegen_microseconds() noexcept {
  static std::atomic<int64_t> us{0};
  return us;
}

inline std::atomic<int>& wait_for_kernels_flag() noexcept {
  static std::atomic<int> flag{-1};  // -1: not read from the environment yet
  return flag;
}

/// Whether `t` is a dtype a dialect computes in float while storing it narrower (CUDA).
inline bool is_reduced_float(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

/// The storage dtype of a group's non-bool values on `inputs` (ATen's promotion of the
/// non-bool inputs), checked for `dialect`: float or double on the CPU, also half and
/// bfloat16 on CUDA. Throws FusionError as `compute_type` documents.
STAGEJIT_FUNC at::ScalarType storage_type(const std::vector<at::Tensor>& inputs, DeviceKind dialect);

}  // namespace detail

/// The compute dtype of a group run on `inputs` in `dialect` (file comment): ATen's
/// promotion of the non-bool inputs, float for half and bfloat16 (CUDA only). Throws
/// FusionError when there is no non-bool input, when the promoted type is not one the
/// dialect computes in, or when a non-bool input has another dtype.
STAGEJIT_FUNC at::ScalarType compute_type(const std::vector<at::Tensor>& inputs, DeviceKind dialect = DeviceKind::CPU);

/// The iteration shape of a group run on `inputs`: their broadcast (NumPy rules).
/// Throws ShapeError when they do not broadcast.
STAGEJIT_FUNC std::vector<int64_t> broadcast_shape(const std::vector<at::Tensor>& inputs);

namespace detail {

/// The C++ storage type of a kernel argument of dtype `t` in `dialect` (`sj_half` and
/// `sj_bfloat16` are the CUDA prelude's 16-bit storage types).
STAGEJIT_FUNC const char* storage_name(at::ScalarType t, DeviceKind dialect = DeviceKind::CPU);

/// The statements of a kernel body: one per node (`const V tK = ...;` on the CPU, `const
/// T tK = ...;` on CUDA) reading the inputs as `x0, x1, ...`.
struct KernelBody {
  std::string statements;
  std::vector<std::string> output_vars;  ///< per subgraph output, the variable holding it
  std::vector<bool> output_bool;         ///< per subgraph output, whether it is boolean
};

/// Builds the body of `g` on `inputs` in `dialect`; only the statements' text depends on
/// `with_text` (false: types only). Throws FusionError for a node the dialect cannot
/// express, naming it.
STAGEJIT_FUNC KernelBody kernel_body(const ir::Graph& g, const std::vector<at::Tensor>& inputs, DeviceKind dialect,
                                     bool with_text);

/// The dialect of a group whose inputs are all on `device` (CPU or CUDA); FusionError
/// for another device type.
STAGEJIT_FUNC DeviceKind dialect_of(const at::Device& device);

}  // namespace detail

/// The dtypes of the outputs of `subgraph` run on `inputs` in `dialect`: bool for
/// boolean results, else the storage type of the inputs (ATen's promotion; half stays
/// half on CUDA). Same errors as `generate`.
STAGEJIT_FUNC std::vector<at::ScalarType> output_dtypes(const ir::Graph& subgraph,
                                                        const std::vector<at::Tensor>& inputs,
                                                        DeviceKind dialect = DeviceKind::CPU);

/// Generates the kernel computing `subgraph`'s outputs from `inputs` (tensors in the
/// order of the subgraph's inputs; only their dtypes, ranks and contiguity matter, so
/// meta tensors do) over their broadcast shape, in `dialect`:
/// - CPU: C++ over `sjk::Vec<T>` (cpu_backend.hpp's prelude), entry
///   `extern "C" void stagejit_fused(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg*)`;
///   float and double.
/// - CUDA: CUDA C++ for NVRTC (cuda_backend.hpp's prelude), entry
///   `extern "C" __global__ void stagejit_fused(long long begin, long long end, int rank, stagejit_Args<N> p)`
///   (N = inputs + outputs),
///   a grid-stride loop with 64-bit indices, each thread loading its elements
///   (`sj_load_as`, half and bfloat16 converted to float), computing the scalar body in
///   the compute type and storing (`sj_store_as`); float, double, half and bfloat16; at
///   most `kMaxCudaArgs` inputs + outputs. `key.device_index` is `device_index`.
/// The key has one `TensorDesc` per input (as given) and per output (the iteration
/// shape's rank, contiguous). Throws FusionError for what the file comment lists as
/// unsupported, and ShapeError when the inputs do not broadcast.
STAGEJIT_FUNC KernelSource generate(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                    DeviceKind dialect, int32_t device_index = -1);

/// `generate` in the dialect of the inputs' device (CPU tensors: CPU; CUDA tensors:
/// CUDA on their device). Throws FusionError when the inputs are on different devices
/// or on another device type, and what `generate` throws.
STAGEJIT_FUNC KernelSource generate(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs);

/// Converts an op's IR attributes to the op table's core `Attributes` (numbers,
/// strings, lists; ir/attributes.hpp). Throws FusionError naming the op for tensor
/// or graph attributes.
STAGEJIT_FUNC Attributes to_core_attributes(const ir::Op& op);

namespace detail {

/// Throws `Error` for the first undefined tensor in `inputs` (one per input of the group
/// `subgraph`), as the op reading it would outside a group: "fusion_group_3: op 'mul':
/// input 1 is undefined (group input 0)". `group_name` empty: "a fusion group".
STAGEJIT_FUNC void check_defined_inputs(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                        const std::string& group_name);

}  // namespace detail

/// Runs `subgraph`'s nodes one by one (`semantics::run_pure`: ATen eager): the fallback
/// of `run_fused` and the oracle of its tests. Besides ops, the other kinds a group's
/// subgraph may hold (ir/lint.hpp) run too: Constant, Undefined, Transpose, Reshape, Gemm
/// as `run_pure` runs them, a nested FusionGroup by running its subgraph the same way.
/// Throws `Error` naming the op and input for an undefined input (as `ops::apply` does),
/// what `run_forward` throws, and FusionError for a HostOp or Eval (they need the
/// closure's context) or an attribute a table op cannot take.
STAGEJIT_FUNC std::vector<at::Tensor> run_unfused(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs);

/// Whether a compiled function's fusion groups wait for their CPU kernel on the calls
/// made while it is being compiled. By default (false) they don't: such a call runs the
/// group's nodes one by one through ATen (the same results up to rounding, no warning)
/// and the kernel takes over on the first call after its build finished, so a first call
/// never waits for the compiler. `$STAGEJIT_FUSION_WAIT=1` (read once) or
/// `set_wait_for_kernels(true)` make every call wait: deterministic kernel use, for tests
/// and for timing. `run_fused` always waits.
STAGEJIT_FUNC bool waits_for_kernels() noexcept;

/// Sets `waits_for_kernels()`; returns the previous value.
STAGEJIT_FUNC bool set_wait_for_kernels(bool wait) noexcept;

/// Options of `run_fused`.
struct RunFusedOptions {
  /// The backend compiling CPU kernels; null: `default_cpu_backend()`.
  CpuBackend* backend = nullptr;
  /// The group's name in the fallback warning (e.g. "fusion_group_0 of stage 1").
  std::string group_name;
  /// When not null, set to "" when the kernel ran, else to why the nodes ran one by one.
  std::string* fallback_reason = nullptr;
  /// The backend compiling CUDA kernels; null: `default_cuda_backend()`.
  CudaBackend* cuda_backend = nullptr;
};

/// Called by the planner with every group it generated a kernel for, and the inputs of
/// that call (before the kernel is compiled or loaded). A diagnostics hook: stagejit's
/// test executable installs one that compiles every group of the suite in the CUDA
/// dialect with NVRTC (test/fusion/ptx_check.hpp). Called from the threads that run
/// groups; must be thread-safe and must not throw.
using GroupObserver = void (*)(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) noexcept;

namespace detail {

inline std::atomic<GroupObserver>& group_observer_slot() {
  static std::atomic<GroupObserver> slot{nullptr};
  return slot;
}

}  // namespace detail

/// Installs `observer` (null: none); returns the previous one.
inline GroupObserver set_group_observer(GroupObserver observer) noexcept {
  return detail::group_observer_slot().exchange(observer);
}

namespace detail {

/// Broadcast shape of every subgraph value, from the input sizes.
STAGEJIT_FUNC bool outputs_have_shape(const ir::Graph& g, const std::vector<at::Tensor>& inputs,
                                      const std::vector<int64_t>& shape);

STAGEJIT_FUNC void warn_fallback(const std::string& group, const std::string& text, const std::string& reason);

/// What running a group on inputs of one signature takes: the iteration shape, the
/// device, and either a kernel of that device's backend (none for empty outputs) with
/// the output dtypes, or why the nodes must run one by one.
struct GroupPlan {
  std::vector<int64_t> shape;
  at::Device device = at::kCPU;
  std::shared_ptr<const CpuKernel> kernel;
  /// The CPU kernel still being built (`plan_group` with `may_defer`): until it is
  /// ready the group runs op by op, silently.
  std::shared_future<std::shared_ptr<const CpuKernel>> pending;
  std::shared_ptr<const CudaKernel> cuda_kernel;
  std::vector<at::ScalarType> output_dtypes;
  std::string fallback;  ///< non-empty: run op by op for this reason
};

/// The backends a plan may use (null members: the process-wide defaults).
struct Backends {
  CpuBackend* cpu = nullptr;
  CudaBackend* cuda = nullptr;
};

/// The one device of `inputs` (all defined). Throws FusionError naming `group_name` and
/// the first input on another device than input 0.
STAGEJIT_FUNC at::Device group_device(const std::vector<at::Tensor>& inputs, const std::string& group_name);

/// Plans a run of `subgraph` (printed as `text`) on `inputs` (see `run_fused`): routes
/// by the inputs' device to the CPU or CUDA dialect and backend. Kernels are built once
/// per source by the backends' own caches (`build_once`, failures remembered); a
/// `FusedGroup` memoises the whole plan per input signature.
STAGEJIT_FUNC GroupPlan plan_group(const ir::Graph& subgraph, const std::string& text,
                                   const std::vector<at::Tensor>& inputs, const Backends& backends,
                                   const std::string& group_name = "", bool may_defer = false);

/// Runs a planned group: allocates the outputs on the plan's device (on the CPU from
/// `HostCachingAllocator` inside a `HostCacheScope`, as compiled stages run with
/// `cache_host_memory`; see `install_host_cache`) and runs the kernel (CUDA: launched on
/// the current stream of the tensors' device); or, for a fallback plan or arguments the
/// launch cannot take, warns once and runs the nodes one by one (the reason goes to
/// `*fallback_reason` when given).
STAGEJIT_FUNC std::vector<at::Tensor> run_planned(const GroupPlan& plan, const ir::Graph& subgraph,
                                                  const std::string& text, const std::vector<at::Tensor>& inputs,
                                                  const std::string& group_name,
                                                  std::string* fallback_reason = nullptr);

}  // namespace detail

/// Runs a FusionGroup subgraph on `inputs` (one tensor per subgraph input, broadcastable to
/// one shape, all on one device): allocates the outputs (the broadcast shape, contiguous,
/// or in the layout every full-size input shares when that is a permuted dense one such as
/// a transpose, as ATen's TensorIterator does; on the inputs' device; on the CPU from
/// `HostCachingAllocator` inside a `HostCacheScope` once `install_host_cache()` has run,
/// else from ATen's allocator; dtypes from `output_dtypes`), and runs the kernel generated
/// in the device's dialect: CPU tensors through the CPU backend, CUDA tensors through the
/// CUDA backend (NVRTC for the device's architecture, launched on the current stream).
/// Kernels are built once per source by each backend. When no kernel can be used (anything
/// `generate` refuses, inputs on more than one device, or FusionError from the backend such
/// as a missing compiler, NVRTC or GPU), runs the nodes one by one with `run_unfused`
/// instead and prints a one-time warning per group on stderr naming the group and the
/// reason. Throws ShapeError when the inputs do not broadcast, `Error` naming the group, op
/// and input for an undefined input (as the op would outside a group), and what
/// `run_unfused` throws. For repeated calls of one group use `FusedGroup`, which memoises
/// all of this per input signature.
STAGEJIT_FUNC std::vector<at::Tensor> run_fused(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                                const RunFusedOptions& options = {});

namespace detail {

/// The kernels predicted while a `KernelBatchScope` is open on a thread.
struct KernelBatch {
  std::vector<std::pair<CpuBackend*, KernelSource>> sources;  // null backend: the default one
};

inline KernelBatch*& current_kernel_batch() noexcept {
  thread_local KernelBatch* batch = nullptr;
  return batch;
}

/// Adds to the open batch the CPU kernel `subgraph` will need when its inputs have the
/// types the trace recorded (only their dtypes shape a CPU kernel's code: kernel_spec.hpp,
/// cpu_backend.hpp). Nothing when no batch is open, when an input's type is unknown or
/// not on the CPU, or when `generate` refuses the group (its first call reports that).
STAGEJIT_FUNC void predict_kernel(const ir::Graph& subgraph, CpuBackend* backend);

}  // namespace detail

/// While alive, every `FusedGroup` constructed on this thread predicts its CPU kernel
/// from the types its subgraph's inputs were traced with, and the outermost scope hands
/// them all to `CpuBackend::prefetch` when it ends: they are compiled together, several
/// per compiler run, in parallel runs, in the background, while the first call starts
/// (the first-call issue: one compiler run per kernel, serially, took 8-25 s). A group
/// whose inputs turn out to have other dtypes simply builds its own kernel on its first
/// call. The closure compiler opens one around building a compiled function's stages and
/// around each stage variant. Nested scopes join the outermost one. Not copyable.
class KernelBatchScope {
 public:
  KernelBatchScope() noexcept {
    if (!detail::current_kernel_batch()) {
      detail::current_kernel_batch() = &batch_;
      outermost_ = true;
    }
  }
  ~KernelBatchScope() {
    if (!outermost_) return;
    detail::current_kernel_batch() = nullptr;
    flush();
  }
  KernelBatchScope(const KernelBatchScope&) = delete;
  KernelBatchScope& operator=(const KernelBatchScope&) = delete;

  /// Sends the predicted kernels to their backends now (the destructor does otherwise).
  void flush() noexcept;

  /// How many kernels the scope has predicted and not yet sent.
  std::size_t size() const noexcept { return batch_.sources.size(); }

 private:
  detail::KernelBatch batch_;
  bool outermost_ = false;
};

/// One FusionGroup subgraph run call after call (the closure compiler's FusedKernel):
/// behaves as `run_fused`, but prints the group once and memoises the plan (device,
/// broadcast shape, kernel or fallback reason) per input signature (device, dtype, sizes
/// and contiguity of every input), so a repeated call does no code generation, printing
/// or hashing of source text. Thread-safe; the memo holds at most `kMaxPlans` signatures
/// (then the oldest is dropped). Throws what `run_fused` throws.
class FusedGroup {
 public:
  static constexpr std::size_t kMaxPlans = 16;

  /// `subgraph`: the group's subgraph (not null); `name`: its name in the fallback
  /// warning; `backend` / `cuda_backend`: null for `default_cpu_backend()` /
  /// `default_cuda_backend()`.
  FusedGroup(std::shared_ptr<const ir::Graph> subgraph, std::string name, CpuBackend* backend = nullptr,
             CudaBackend* cuda_backend = nullptr);

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const;

  const std::string& name() const noexcept { return name_; }

 private:
  using Signature = std::vector<int64_t>;
  std::shared_ptr<const ir::Graph> subgraph_;
  std::string name_;
  detail::Backends backends_;
  std::string text_;
  mutable std::mutex mutex_;
  mutable std::vector<std::pair<Signature, std::shared_ptr<const detail::GroupPlan>>> plans_;
};

}  // namespace stagejit::fusion
