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

#include <stagejit/core/detail/bodies_begin.hpp>
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
inline at::ScalarType storage_type(const std::vector<at::Tensor>& inputs, DeviceKind dialect) {
  std::vector<at::Tensor> numeric;
  for (const auto& t : inputs)
    if (t.scalar_type() != at::kBool) numeric.push_back(t);
  if (numeric.empty()) throw FusionError("fusion: a group needs at least one floating-point input");
  at::ScalarType t = numeric[0].scalar_type();
  for (size_t i = 1; i < numeric.size(); ++i) t = at::promote_types(t, numeric[i].scalar_type());
  const bool ok = t == at::kFloat || t == at::kDouble || (dialect == DeviceKind::CUDA && is_reduced_float(t));
  if (!ok)
    throw FusionError(std::string("fusion: compute type ") + c10::toString(t) +
                      (dialect == DeviceKind::CUDA ? " is not float, double, half or bfloat16 (CUDA dialect)"
                                                   : " is not float or double (CPU dialect)"));
  for (const auto& x : numeric)
    if (x.scalar_type() != t)
      throw FusionError(std::string("fusion: inputs of dtypes ") + c10::toString(x.scalar_type()) + " and " +
                        c10::toString(t) + " are mixed; the group runs op by op");
  return t;
}

}  // namespace detail

/// The compute dtype of a group run on `inputs` in `dialect` (file comment): ATen's
/// promotion of the non-bool inputs, float for half and bfloat16 (CUDA only). Throws
/// FusionError when there is no non-bool input, when the promoted type is not one the
/// dialect computes in, or when a non-bool input has another dtype.
inline at::ScalarType compute_type(const std::vector<at::Tensor>& inputs, DeviceKind dialect = DeviceKind::CPU) {
  const at::ScalarType t = detail::storage_type(inputs, dialect);
  return detail::is_reduced_float(t) ? at::kFloat : t;
}

/// The iteration shape of a group run on `inputs`: their broadcast (NumPy rules).
/// Throws ShapeError when they do not broadcast.
inline std::vector<int64_t> broadcast_shape(const std::vector<at::Tensor>& inputs) {
  std::vector<int64_t> shape;
  try {
    for (const auto& t : inputs) shape = at::infer_size(shape, t.sizes());
  } catch (const c10::Error& e) {
    throw ShapeError(std::string("fusion: group inputs do not broadcast: ") + e.what_without_backtrace());
  }
  return shape;
}

namespace detail {

/// The C++ storage type of a kernel argument of dtype `t` in `dialect` (`sj_half` and
/// `sj_bfloat16` are the CUDA prelude's 16-bit storage types).
inline const char* storage_name(at::ScalarType t, DeviceKind dialect = DeviceKind::CPU) {
  switch (t) {
    case at::kFloat: return "float";
    case at::kDouble: return "double";
    case at::kBool: return "bool";
    case at::kHalf:
      if (dialect == DeviceKind::CUDA) return "sj_half";
      break;
    case at::kBFloat16:
      if (dialect == DeviceKind::CUDA) return "sj_bfloat16";
      break;
    default: break;
  }
  throw FusionError(std::string("fusion: dtype ") + c10::toString(t) + " cannot be a kernel argument (" +
                    to_string(dialect) + " dialect)");
}

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
inline KernelBody kernel_body(const ir::Graph& g, const std::vector<at::Tensor>& inputs, DeviceKind dialect,
                              bool with_text) {
  STAGEJIT_CHECK_AS(FusionError, inputs.size() == g.inputs().size(), "fusion: the group has ", g.inputs().size(),
                    " inputs but was given ", inputs.size(), " tensors");
  const bool cuda = dialect == DeviceKind::CUDA;
  KernelBody body;
  std::unordered_map<const ir::Value*, std::string> var;
  std::unordered_map<const ir::Value*, bool> is_bool;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const ir::Value* v = g.inputs()[i];
    var[v] = "x" + std::to_string(i);
    is_bool[v] = inputs[i].scalar_type() == at::kBool;
  }
  size_t k = 0;
  for (const ir::Node* n : g.nodes()) {
    std::vector<std::string> operands;
    std::vector<bool> operand_bool;
    for (const ir::Value* v : n->inputs()) {
      STAGEJIT_CHECK_AS(FusionError, var.count(v), "fusion: node #", n->id(), " reads a value defined later");
      operands.push_back(var.at(v));
      operand_bool.push_back(is_bool.at(v));
    }
    STAGEJIT_CHECK_AS(FusionError, n->outputs().size() == 1, "fusion: node #", n->id(), " (", n->describe(),
                      ") has ", n->outputs().size(), " outputs; fused nodes have one");
    bool result_bool = false;
    const std::string expr = op_expression(*n, operands, operand_bool, result_bool, cuda);
    const std::string name = "t" + std::to_string(k++);
    if (with_text) body.statements += std::string(cuda ? "    const T " : "        const V ") + name + " = " + expr + ";\n";
    var[n->output()] = name;
    is_bool[n->output()] = result_bool;
  }
  for (const ir::Value* v : g.outputs()) {
    body.output_vars.push_back(var.at(v));
    body.output_bool.push_back(is_bool.at(v));
  }
  return body;
}

/// The dialect of a group whose inputs are all on `device` (CPU or CUDA); FusionError
/// for another device type.
inline DeviceKind dialect_of(const at::Device& device) {
  if (device.is_cpu()) return DeviceKind::CPU;
  if (device.is_cuda()) return DeviceKind::CUDA;
  throw FusionError(std::string("fusion: no fused kernels on device ") + device.str() + " (CPU and CUDA only)");
}

}  // namespace detail

/// The dtypes of the outputs of `subgraph` run on `inputs` in `dialect`: bool for
/// boolean results, else the storage type of the inputs (ATen's promotion; half stays
/// half on CUDA). Same errors as `generate`.
inline std::vector<at::ScalarType> output_dtypes(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                                 DeviceKind dialect = DeviceKind::CPU) {
  const at::ScalarType t = detail::storage_type(inputs, dialect);
  std::vector<at::ScalarType> out;
  for (bool b : detail::kernel_body(subgraph, inputs, dialect, false).output_bool) out.push_back(b ? at::kBool : t);
  return out;
}

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
inline KernelSource generate(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs, DeviceKind dialect,
                             int32_t device_index = -1) {
  const bool cuda = dialect == DeviceKind::CUDA;
  const at::ScalarType storage = detail::storage_type(inputs, dialect);
  const at::ScalarType t = compute_type(inputs, dialect);
  const std::string tn = detail::storage_name(t, dialect);
  const detail::KernelBody body = detail::kernel_body(subgraph, inputs, dialect, true);
  STAGEJIT_CHECK_AS(FusionError, !body.output_bool.empty(), "fusion: a group without outputs has nothing to compute");
  if (cuda)
    STAGEJIT_CHECK_AS(FusionError, inputs.size() + body.output_bool.size() <= static_cast<size_t>(kMaxCudaArgs),
                      "fusion: the group has ", inputs.size(), " inputs and ", body.output_bool.size(),
                      " outputs; a CUDA kernel takes at most ", kMaxCudaArgs, " tensors");
  const auto shape = broadcast_shape(inputs);
  KernelSource ks;
  ks.entry = "stagejit_fused";
  ks.key.device = dialect;
  ks.key.device_index = cuda ? device_index : -1;
  std::string in_types, out_types, loads, stores;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& x = inputs[i];
    ks.key.inputs.push_back(TensorDesc{x.scalar_type(), x.dim(), x.is_contiguous()});
    const std::string sn = detail::storage_name(x.scalar_type(), dialect);
    in_types += (in_types.empty() ? "" : ", ") + sn;
    loads += "    const T x" + std::to_string(i) + " = sj_load_as<T, " + sn + ">(p.t[" + std::to_string(i) +
             "], rank, i);\n";
  }
  for (size_t o = 0; o < body.output_bool.size(); ++o) {
    const at::ScalarType ot = body.output_bool[o] ? at::kBool : storage;
    ks.key.outputs.push_back(TensorDesc{ot, static_cast<int64_t>(shape.size()), true});
    const std::string sn = detail::storage_name(ot, dialect);
    out_types += (out_types.empty() ? "" : ", ") + sn;
    stores += "    sj_store_as<T, " + sn + ">(p.t[" + std::to_string(inputs.size() + o) + "], rank, i, " +
              body.output_vars[o] + ");\n";
  }
  if (cuda) {
    ks.source = std::string(detail::cuda_kernel_helpers) + "extern \"C\" __global__ void " + ks.entry +
                "(long long begin, long long end, int rank, stagejit_Args<" +
                std::to_string(inputs.size() + body.output_bool.size()) + "> p) {\n"
                "  typedef " + tn + " T;\n"
                "  SJ_GRID_STRIDE_LOOP(i, begin, end) {\n" + loads + body.statements + stores + "  }\n}\n";
    return ks;
  }
  std::string outs;
  for (size_t o = 0; o < body.output_vars.size(); ++o)
    outs += "        out[" + std::to_string(o) + "] = " + body.output_vars[o] + ";\n";
  std::string ins;
  for (size_t i = 0; i < inputs.size(); ++i)
    ins += "        const V x" + std::to_string(i) + " = in[" + std::to_string(i) + "];\n";
  ks.source = std::string(detail::kernel_helpers) + "extern \"C\" void " + ks.entry +
              "(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args) {\n"
              "  using T = " + tn + ";\n"
              "  using V = sjk::Vec<T>;\n"
              "  sjk::elementwise<T, sjk::types<" + in_types + ">, sjk::types<" + out_types + ">>(\n"
              "      begin, end, rank, args, [](const V* in, V* out) {\n" + ins + body.statements + outs + "      });\n}\n";
  return ks;
}

/// `generate` in the dialect of the inputs' device (CPU tensors: CPU; CUDA tensors:
/// CUDA on their device). Throws FusionError when the inputs are on different devices
/// or on another device type, and what `generate` throws.
inline KernelSource generate(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) {
  at::Device device = inputs.empty() ? at::Device(at::kCPU) : inputs[0].device();
  for (size_t i = 1; i < inputs.size(); ++i)
    STAGEJIT_CHECK_AS(FusionError, inputs[i].device() == device, "fusion: group input ", i, " is on ",
                      inputs[i].device(), " but input 0 is on ", device, "; a fused kernel runs on one device");
  const DeviceKind dialect = detail::dialect_of(device);
  return generate(subgraph, inputs, dialect, dialect == DeviceKind::CUDA ? device.index() : -1);
}

/// Converts an op's IR attributes to the op table's core `Attributes` (numbers,
/// strings, lists; ir/attributes.hpp). Throws FusionError naming the op for tensor
/// or graph attributes.
inline Attributes to_core_attributes(const ir::Op& op) {
  try {
    return stagejit::detail::to_core_attributes(op.attributes);
  } catch (const CompileError& e) {
    throw FusionError("fusion: op '" + std::string(op.name()) + "': " + e.what());
  }
}

namespace detail {

/// Throws `Error` for the first undefined tensor in `inputs` (one per input of the group
/// `subgraph`), as the op reading it would outside a group: "fusion_group_3: op 'mul':
/// input 1 is undefined (group input 0)". `group_name` empty: "a fusion group".
inline void check_defined_inputs(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                 const std::string& group_name) {
  for (size_t i = 0; i < inputs.size() && i < subgraph.inputs().size(); ++i) {
    if (inputs[i].defined()) continue;
    const std::string group = group_name.empty() ? std::string("a fusion group") : group_name;
    const ir::Value* v = subgraph.inputs()[i];
    for (const ir::Node* n : subgraph.nodes()) {
      const auto* op = n->get_if<ir::Op>();
      for (size_t k = 0; op && k < n->inputs().size(); ++k)
        if (n->inputs()[k] == v)
          ::stagejit::detail::throw_error<Error>(group, ": op '", op->name(), "': input ", k,
                                                 " is undefined (group input ", i, ")");
    }
    ::stagejit::detail::throw_error<Error>(group, ": input ", i, " is undefined");
  }
}

}  // namespace detail

/// Runs `subgraph`'s nodes one by one (`semantics::run_pure`: ATen eager): the fallback
/// of `run_fused` and the oracle of its tests. Besides ops, the other kinds a group's
/// subgraph may hold (ir/lint.hpp) run too: Constant, Undefined, Transpose, Reshape, Gemm
/// as `run_pure` runs them, a nested FusionGroup by running its subgraph the same way.
/// Throws `Error` naming the op and input for an undefined input (as `ops::apply` does),
/// what `run_forward` throws, and FusionError for a HostOp or Eval (they need the
/// closure's context) or an attribute a table op cannot take.
inline std::vector<at::Tensor> run_unfused(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) {
  STAGEJIT_CHECK_AS(FusionError, inputs.size() == subgraph.inputs().size(), "fusion: the group has ",
                    subgraph.inputs().size(), " inputs but was given ", inputs.size(), " tensors");
  std::unordered_map<const ir::Value*, at::Tensor> env;
  for (size_t i = 0; i < inputs.size(); ++i) env[subgraph.inputs()[i]] = inputs[i];
  for (const ir::Node* n : subgraph.nodes()) {
    const auto* op = n->get_if<ir::Op>();
    const auto* group = n->get_if<ir::FusionGroup>();
    std::vector<at::Tensor> args;
    for (const ir::Value* v : n->inputs()) {
      args.push_back(env.at(v));
      if (op)
        STAGEJIT_CHECK(args.back().defined(), "op '", op->name(), "': input ", args.size() - 1, " is undefined");
    }
    std::vector<at::Tensor> outs;
    try {
      outs = group && group->subgraph ? run_unfused(*group->subgraph, args) : semantics::run_pure(*n, args);
    } catch (const CompileError& e) {  // attributes a table op cannot take; HostOp, Eval
      throw FusionError(std::string("fusion: ") + e.what());
    }
    STAGEJIT_CHECK_AS(FusionError, outs.size() == n->outputs().size(), "fusion: node #", n->id(), " (",
                      n->describe(), ") returned ", outs.size(), " tensors for ", n->outputs().size(), " outputs");
    for (size_t i = 0; i < outs.size(); ++i) env[n->output(i)] = outs[i];
  }
  std::vector<at::Tensor> out;
  for (const ir::Value* v : subgraph.outputs()) out.push_back(env.at(v));
  return out;
}

/// Whether a compiled function's fusion groups wait for their CPU kernel on the calls
/// made while it is being compiled. By default (false) they don't: such a call runs the
/// group's nodes one by one through ATen (the same results up to rounding, no warning)
/// and the kernel takes over on the first call after its build finished, so a first call
/// never waits for the compiler. `$STAGEJIT_FUSION_WAIT=1` (read once) or
/// `set_wait_for_kernels(true)` make every call wait: deterministic kernel use, for tests
/// and for timing. `run_fused` always waits.
inline bool waits_for_kernels() noexcept {
  int f = detail::wait_for_kernels_flag().load();
  if (f < 0) {
    const char* e = std::getenv("STAGEJIT_FUSION_WAIT");
    f = (e && std::string(e) == "1") ? 1 : 0;
    int expected = -1;
    detail::wait_for_kernels_flag().compare_exchange_strong(expected, f);
    f = detail::wait_for_kernels_flag().load();
  }
  return f == 1;
}

/// Sets `waits_for_kernels()`; returns the previous value.
inline bool set_wait_for_kernels(bool wait) noexcept {
  const bool before = waits_for_kernels();
  detail::wait_for_kernels_flag() = wait ? 1 : 0;
  return before;
}

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
inline bool outputs_have_shape(const ir::Graph& g, const std::vector<at::Tensor>& inputs,
                               const std::vector<int64_t>& shape) {
  std::unordered_map<const ir::Value*, std::vector<int64_t>> sizes;
  for (size_t i = 0; i < inputs.size(); ++i) sizes[g.inputs()[i]] = inputs[i].sizes().vec();
  for (const ir::Node* n : g.nodes()) {
    std::vector<int64_t> s;
    for (const ir::Value* v : n->inputs()) s = at::infer_size(s, sizes.at(v));
    for (const ir::Value* o : n->outputs()) sizes[o] = s;
  }
  for (const ir::Value* v : g.outputs())
    if (sizes.at(v) != shape) return false;
  return true;
}

/// Groups already warned about (by subgraph text), and reasons already given, so each
/// group warns once per process and a cause shared by every group (no compiler, an
/// unwritable cache) is said once.
struct FallbackWarnings {
  std::mutex mutex;
  std::set<std::string> warned;
  std::set<std::string> reasons;
};

inline FallbackWarnings& fallback_warnings() {
  static FallbackWarnings w;
  return w;
}

inline void warn_fallback(const std::string& group, const std::string& text, const std::string& reason) {
  auto& w = fallback_warnings();
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    if (!w.warned.insert(text).second) return;
    if (!w.reasons.insert(reason).second) return;
  }
  std::cerr << "stagejit: warning: " << (group.empty() ? std::string("a fusion group") : group)
            << " runs op by op (no fused kernel): " << reason << "\n";
}

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
inline at::Device group_device(const std::vector<at::Tensor>& inputs, const std::string& group_name) {
  const at::Device device = inputs.empty() ? at::Device(at::kCPU) : inputs[0].device();
  for (size_t i = 1; i < inputs.size(); ++i)
    if (inputs[i].device() != device)
      ::stagejit::detail::throw_error<FusionError>(
          group_name.empty() ? std::string("a fusion group") : group_name, ": inputs on more than one device (input 0 on ",
          device, ", input ", i, " on ", inputs[i].device(), "); a fused kernel runs on one device");
  return device;
}

/// Plans a run of `subgraph` (printed as `text`) on `inputs` (see `run_fused`): routes
/// by the inputs' device to the CPU or CUDA dialect and backend. Kernels are built once
/// per source by the backends' own caches (`build_once`, failures remembered); a
/// `FusedGroup` memoises the whole plan per input signature.
inline GroupPlan plan_group(const ir::Graph& subgraph, const std::string& text, const std::vector<at::Tensor>& inputs,
                            const Backends& backends, const std::string& group_name = "", bool may_defer = false) {
  (void)text;
  GroupPlan plan;
  for (const auto& x : inputs)
    if (!x.defined()) {
      plan.fallback = "fused kernels run on defined tensors only";
      return plan;
    }
  try {
    plan.device = group_device(inputs, group_name);
    const DeviceKind dialect = dialect_of(plan.device);
    plan.shape = broadcast_shape(inputs);
    if (!outputs_have_shape(subgraph, inputs, plan.shape)) {
      plan.fallback = "its outputs do not all have the broadcast shape of its inputs";
      return plan;
    }
    const auto t0 = std::chrono::steady_clock::now();
    KernelSource source =
        generate(subgraph, inputs, dialect, dialect == DeviceKind::CUDA ? plan.device.index() : -1);
    codegen_microseconds() +=
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    for (const TensorDesc& d : source.key.outputs) plan.output_dtypes.push_back(d.dtype);
    if (GroupObserver observer = group_observer_slot().load()) observer(subgraph, inputs);
    if (at::IntArrayRef(plan.shape).size() == 0 || c10::multiply_integers(plan.shape) > 0) {
      if (dialect == DeviceKind::CUDA)
        plan.cuda_kernel = (backends.cuda ? *backends.cuda : default_cuda_backend()).get(source);
      else if (may_defer && !waits_for_kernels()) {
        auto future = (backends.cpu ? *backends.cpu : default_cpu_backend()).get_async(source);
        if (future.wait_for(std::chrono::seconds(0)) == std::future_status::ready)
          plan.kernel = future.get();
        else
          plan.pending = std::move(future);
      } else {
        plan.kernel = (backends.cpu ? *backends.cpu : default_cpu_backend()).get(source);
      }
    }
  } catch (const FusionError& e) {
    const at::Device device = plan.device;
    plan = GroupPlan{};
    plan.device = device;
    plan.fallback = e.what();
  }
  return plan;
}

/// Runs a planned group: allocates the outputs on the plan's device (on the CPU from
/// `HostCachingAllocator` inside a `HostCacheScope`, as compiled stages run with
/// `cache_host_memory`; see `install_host_cache`) and runs the kernel (CUDA: launched on
/// the current stream of the tensors' device); or, for a fallback plan or arguments the
/// launch cannot take, warns once and runs the nodes one by one (the reason goes to
/// `*fallback_reason` when given).
inline std::vector<at::Tensor> run_planned(const GroupPlan& plan, const ir::Graph& subgraph,
                                           const std::string& text, const std::vector<at::Tensor>& inputs,
                                           const std::string& group_name,
                                           std::string* fallback_reason = nullptr) {
  if (!plan.fallback.empty()) {
    warn_fallback(group_name, text, plan.fallback);
    return run_unfused(subgraph, inputs);
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(plan.output_dtypes.size());
  // at::empty: inside a HostCacheScope (and with install_host_cache() done) c10's CPU
  // allocator serves it from the cache, and the storage keeps that routing allocator, so
  // a later resize outside any scope does not touch the cache.
  for (at::ScalarType dt : plan.output_dtypes)
    outputs.push_back(at::empty(plan.shape, at::TensorOptions().dtype(dt).device(plan.device)));
  if (plan.kernel || plan.cuda_kernel) {
    std::vector<at::Tensor> ins(inputs.begin(), inputs.end());
    PackedArgs args;
    try {
      args = pack_tensor_args(plan.shape, ins, outputs);
    } catch (const FusionError& e) {  // e.g. more dimensions than the launch ABI holds
      if (fallback_reason) *fallback_reason = e.what();
      warn_fallback(group_name, text, e.what());
      return run_unfused(subgraph, inputs);
    }
    if (plan.kernel)
      plan.kernel->run(args);
    else
      plan.cuda_kernel->launch(args, current_cuda_stream(plan.device.index()));
  }
  return outputs;
}

}  // namespace detail

/// Runs a FusionGroup subgraph on `inputs` (one tensor per subgraph input, broadcastable
/// to one shape, all on one device): allocates the outputs (the broadcast shape,
/// contiguous, on the inputs' device; on the CPU from `HostCachingAllocator` inside a
/// `HostCacheScope` once `install_host_cache()` has run, else from ATen's allocator;
/// dtypes from `output_dtypes`), and runs the kernel generated in the device's dialect:
/// CPU tensors through the CPU backend, CUDA tensors through the CUDA backend (NVRTC for
/// the device's architecture, launched on the current stream). Kernels are built once per
/// source by each backend. When no kernel can be used (anything `generate` refuses,
/// inputs on more than one device, or FusionError from the backend such as a missing
/// compiler, NVRTC or GPU), runs the nodes one by one with `run_unfused` instead and
/// prints a one-time warning per group on stderr naming the group and the reason. Throws
/// ShapeError when the inputs do not broadcast, `Error` naming the group, op and input
/// for an undefined input (as the op would outside a group), and what `run_unfused`
/// throws. For repeated calls of one group use `FusedGroup`, which memoises all of this
/// per input signature.
inline std::vector<at::Tensor> run_fused(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                         const RunFusedOptions& options = {}) {
  STAGEJIT_CHECK_AS(FusionError, inputs.size() == subgraph.inputs().size(), "fusion: the group has ",
                    subgraph.inputs().size(), " inputs but was given ", inputs.size(), " tensors");
  detail::check_defined_inputs(subgraph, inputs, options.group_name);
  const std::string text = ir::to_string(subgraph);
  detail::GroupPlan plan =
      detail::plan_group(subgraph, text, inputs, {options.backend, options.cuda_backend}, options.group_name);
  if (options.fallback_reason) *options.fallback_reason = plan.fallback;
  return detail::run_planned(plan, subgraph, text, inputs, options.group_name, options.fallback_reason);
}

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
inline void predict_kernel(const ir::Graph& subgraph, CpuBackend* backend) {
  KernelBatch* batch = current_kernel_batch();
  if (!batch) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> inputs;
  for (const ir::Value* v : subgraph.inputs()) {
    const ir::TensorType* t = v->tensor_type();
    if (!t || !t->device.is_cpu() || t->sizes.size() != t->strides.size()) return;
    inputs.push_back(at::empty_strided(t->sizes, t->strides, at::TensorOptions().dtype(t->dtype).device(at::kMeta)));
  }
  try {
    batch->sources.emplace_back(backend, generate(subgraph, inputs, DeviceKind::CPU));
  } catch (const Error&) {
  } catch (const c10::Error&) {
  }
  codegen_microseconds() +=
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

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
  void flush() noexcept {
    std::vector<std::pair<CpuBackend*, std::vector<KernelSource>>> by_backend;
    for (auto& [backend, source] : batch_.sources) {
      auto it = std::find_if(by_backend.begin(), by_backend.end(), [&b = backend](const auto& e) { return e.first == b; });
      if (it == by_backend.end()) it = by_backend.insert(by_backend.end(), {backend, {}});
      it->second.push_back(std::move(source));
    }
    batch_.sources.clear();
    for (auto& [backend, sources] : by_backend) {
      try {
        (backend ? *backend : default_cpu_backend()).prefetch(sources);
      } catch (const std::exception&) {
        // Prefetching is an optimisation: each group still builds its kernel on first use.
      }
    }
  }

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
             CudaBackend* cuda_backend = nullptr)
      : subgraph_(std::move(subgraph)), name_(std::move(name)), backends_{backend, cuda_backend} {
    STAGEJIT_CHECK_AS(FusionError, subgraph_, "fusion: FusedGroup ", name_, " without a subgraph");
    text_ = ir::to_string(*subgraph_);
    detail::predict_kernel(*subgraph_, backend);
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const {
    STAGEJIT_CHECK_AS(FusionError, inputs.size() == subgraph_->inputs().size(), "fusion: ", name_,
                      " has ", subgraph_->inputs().size(), " inputs but was given ", inputs.size(),
                      " tensors");
    detail::check_defined_inputs(*subgraph_, inputs, name_);
    Signature sig;
    sig.reserve(inputs.size() * 5);
    for (const auto& x : inputs) {
      if (!x.defined()) {
        sig.push_back(-1);
        continue;
      }
      sig.push_back(static_cast<int64_t>(x.scalar_type()) | (x.is_contiguous() ? 256 : 0));
      sig.push_back(static_cast<int64_t>(x.device().type()) * 1024 + x.device().index());
      sig.push_back(x.dim());
      for (int64_t d : x.sizes()) sig.push_back(d);
    }
    std::shared_ptr<const detail::GroupPlan> plan;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [s, p] : plans_)
        if (s == sig) {
          plan = p;
          break;
        }
    }
    if (!plan) {
      plan = std::make_shared<const detail::GroupPlan>(
          detail::plan_group(*subgraph_, text_, inputs, backends_, name_, /*may_defer=*/true));
      std::lock_guard<std::mutex> lock(mutex_);
      bool present = false;  // another thread may have planned this signature meanwhile
      for (const auto& entry : plans_) present = present || entry.first == sig;
      if (!present) {
        if (plans_.size() >= kMaxPlans) plans_.erase(plans_.begin());
        plans_.emplace_back(sig, plan);
      }
    }
    if (plan->pending.valid()) {
      // The kernel is being compiled (waits_for_kernels): op by op until it is ready,
      // then the plan with the kernel (or with the build's error as fallback) replaces
      // this one.
      if (plan->pending.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
        return run_unfused(*subgraph_, inputs);
      auto done = std::make_shared<detail::GroupPlan>(*plan);
      done->pending = {};
      try {
        done->kernel = plan->pending.get();
      } catch (const FusionError& e) {
        done->kernel = nullptr;
        done->fallback = e.what();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& entry : plans_)
        if (entry.first == sig) entry.second = done;
      plan = std::move(done);
    }
    return detail::run_planned(*plan, *subgraph_, text_, inputs, name_);
  }

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
#include <stagejit/core/detail/bodies_end.hpp>
