#pragma once
/// \file
/// The fusion code generator for the CPU backend and the runner of a FusionGroup
/// (docs/seed-system.md §5.2, restated for the CPU launch ABI of kernel_spec.hpp).
///
/// `generate` turns a FusionGroup subgraph (elementwise Op nodes, see
/// passes/graph_fuser.hpp) plus the tensors it will run on into one C++ kernel body over
/// `sjk::Vec<T>` (ATen `Vectorized<T>`): every output element is computed from the input
/// elements in the group's compute type `T`. Expressions come from the op table's
/// `fusion_template`, finalised or overridden for ATen's exact CPU semantics (see
/// detail/codegen_ops.hpp). Boolean results (comparisons, `logical_and`) are kept as 1/0
/// in `T` and stored as `bool`.
///
/// Compute type: ATen's type promotion of the non-bool inputs (`at::result_type`), which
/// must be `float` or `double`; every non-bool input must already have that dtype (a group
/// whose op-by-op promotion could differ from one promoted type is refused).
/// Limits (FusionError, so `run_fused` falls back to running the nodes one by one):
/// other dtypes, `to`, ops without a Vectorized form, inputs on a non-CPU device, and
/// groups whose outputs do not all have the iteration shape (the broadcast of all inputs).

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/detail/codegen_ops.hpp>
#include <stagejit/core/memory/host_allocator.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/printer.hpp>
#include <stagejit/ops/node_semantics.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/trace/op_attributes.hpp>

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace stagejit::fusion {

/// The compute dtype of a group run on `inputs` (file comment). Throws FusionError when
/// there is no non-bool input, when the promoted type is not float/double, or when a
/// non-bool input has another dtype.
inline at::ScalarType compute_type(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> numeric;
  for (const auto& t : inputs)
    if (t.scalar_type() != at::kBool) numeric.push_back(t);
  if (numeric.empty()) throw FusionError("fusion: a group needs at least one float or double input");
  at::ScalarType t = numeric[0].scalar_type();
  for (size_t i = 1; i < numeric.size(); ++i) t = at::promote_types(t, numeric[i].scalar_type());
  if (t != at::kFloat && t != at::kDouble)
    throw FusionError(std::string("fusion: compute type ") + c10::toString(t) + " is not float or double");
  for (const auto& x : numeric)
    if (x.scalar_type() != t)
      throw FusionError(std::string("fusion: inputs of dtypes ") + c10::toString(x.scalar_type()) + " and " +
                        c10::toString(t) + " are mixed; the group runs op by op");
  return t;
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

inline const char* storage_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float";
    case at::kDouble: return "double";
    case at::kBool: return "bool";
    default: throw FusionError(std::string("fusion: dtype ") + c10::toString(t) + " cannot be a kernel argument");
  }
}

/// Per subgraph value: whether it is boolean. Fills `body` with the kernel lambda's
/// statements when `body` is not null.
inline std::vector<bool> output_bools(const ir::Graph& g, const std::vector<at::Tensor>& inputs, std::string* body) {
  STAGEJIT_CHECK_AS(FusionError, inputs.size() == g.inputs().size(), "fusion: the group has ", g.inputs().size(),
                    " inputs but was given ", inputs.size(), " tensors");
  std::unordered_map<const ir::Value*, std::string> var;
  std::unordered_map<const ir::Value*, bool> is_bool;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const ir::Value* v = g.inputs()[i];
    var[v] = "x" + std::to_string(i);
    is_bool[v] = inputs[i].scalar_type() == at::kBool;
    if (body) *body += "        const V x" + std::to_string(i) + " = in[" + std::to_string(i) + "];\n";
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
    const std::string expr = op_expression(*n, operands, operand_bool, result_bool);
    const std::string name = "t" + std::to_string(k++);
    if (body) *body += "        const V " + name + " = " + expr + ";\n";
    var[n->output()] = name;
    is_bool[n->output()] = result_bool;
  }
  std::vector<bool> out;
  for (size_t i = 0; i < g.outputs().size(); ++i) {
    const ir::Value* v = g.outputs()[i];
    if (body) *body += "        out[" + std::to_string(i) + "] = " + var.at(v) + ";\n";
    out.push_back(is_bool.at(v));
  }
  return out;
}

}  // namespace detail

/// The dtypes of the outputs of `subgraph` run on `inputs`: bool for boolean results,
/// else the compute type. Same errors as `generate`.
inline std::vector<at::ScalarType> output_dtypes(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) {
  const at::ScalarType t = compute_type(inputs);
  std::vector<at::ScalarType> out;
  for (bool b : detail::output_bools(subgraph, inputs, nullptr)) out.push_back(b ? at::kBool : t);
  return out;
}

/// Generates the CPU kernel computing `subgraph`'s outputs from `inputs` (tensors in the
/// order of the subgraph's inputs; only their dtypes, ranks and contiguity matter) over
/// their broadcast shape. The entry point is `stagejit_fused`; the key has one
/// `TensorDesc` per input (as given) and per output (the iteration shape's rank,
/// contiguous). Throws FusionError for what the file comment lists as unsupported, and
/// ShapeError when the inputs do not broadcast.
inline KernelSource generate(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) {
  const at::ScalarType t = compute_type(inputs);
  const std::string tn = detail::storage_name(t);
  std::string body;
  const std::vector<bool> bools = detail::output_bools(subgraph, inputs, &body);
  STAGEJIT_CHECK_AS(FusionError, !bools.empty(), "fusion: a group without outputs has nothing to compute");
  const auto shape = broadcast_shape(inputs);
  KernelSource ks;
  ks.entry = "stagejit_fused";
  ks.key.device = DeviceKind::CPU;
  std::string in_types, out_types;
  for (const auto& x : inputs) {
    ks.key.inputs.push_back(TensorDesc{x.scalar_type(), x.dim(), x.is_contiguous()});
    in_types += std::string(in_types.empty() ? "" : ", ") + detail::storage_name(x.scalar_type());
  }
  for (bool b : bools) {
    const at::ScalarType ot = b ? at::kBool : t;
    ks.key.outputs.push_back(TensorDesc{ot, static_cast<int64_t>(shape.size()), true});
    out_types += std::string(out_types.empty() ? "" : ", ") + detail::storage_name(ot);
  }
  ks.source = std::string(detail::kernel_helpers) + "extern \"C\" void " + ks.entry +
              "(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args) {\n"
              "  using T = " + tn + ";\n"
              "  using V = sjk::Vec<T>;\n"
              "  sjk::elementwise<T, sjk::types<" + in_types + ">, sjk::types<" + out_types + ">>(\n"
              "      begin, end, rank, args, [](const V* in, V* out) {\n" + body + "      });\n}\n";
  return ks;
}

/// Converts an op's IR attributes to the op table's core `Attributes` (numbers,
/// strings, lists; trace/op_attributes.hpp). Throws FusionError naming the op for tensor
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

/// Options of `run_fused`.
struct RunFusedOptions {
  /// The backend compiling kernels; null: `default_cpu_backend()`.
  CpuBackend* backend = nullptr;
  /// The group's name in the fallback warning (e.g. "fusion_group_0 of stage 1").
  std::string group_name;
  /// When not null, set to "" when the kernel ran, else to why the nodes ran one by one.
  std::string* fallback_reason = nullptr;
};

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

struct KernelCache {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<const CpuKernel>> kernels;
  std::map<std::string, std::string> failures;  // cache key -> FusionError message
  std::set<std::string> warned;
};

inline KernelCache& kernel_cache() {
  static KernelCache cache;
  return cache;
}

inline void warn_fallback(const std::string& group, const std::string& text, const std::string& reason) {
  auto& cache = kernel_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    if (!cache.warned.insert(text).second) return;
  }
  std::cerr << "stagejit: warning: " << (group.empty() ? std::string("a fusion group") : group)
            << " runs op by op (no fused kernel): " << reason << "\n";
}

}  // namespace detail

namespace detail {

/// What running a group on inputs of one signature takes: the iteration shape and either
/// a kernel (null for empty outputs) with the output dtypes, or why the nodes must run
/// one by one.
struct GroupPlan {
  std::vector<int64_t> shape;
  std::shared_ptr<const CpuKernel> kernel;
  std::vector<at::ScalarType> output_dtypes;
  std::string fallback;  ///< non-empty: run op by op for this reason
};

/// Plans a run of `subgraph` (printed as `text`) on `inputs` (see `run_fused`).
inline GroupPlan plan_group(const ir::Graph& subgraph, const std::string& text,
                            const std::vector<at::Tensor>& inputs, CpuBackend& backend) {
  GroupPlan plan;
  for (const auto& x : inputs)
    if (!x.defined() || !x.device().is_cpu()) {
      plan.fallback = "fused kernels run on defined CPU tensors only";
      return plan;
    }
  plan.shape = broadcast_shape(inputs);
  if (!outputs_have_shape(subgraph, inputs, plan.shape)) {
    plan.fallback = "its outputs do not all have the broadcast shape of its inputs";
    return plan;
  }
  try {
    KernelSource source = generate(subgraph, inputs);
    for (const TensorDesc& d : source.key.outputs) plan.output_dtypes.push_back(d.dtype);
    if (at::IntArrayRef(plan.shape).size() == 0 || c10::multiply_integers(plan.shape) > 0) {
      auto& cache = kernel_cache();
      const std::string key = std::to_string(reinterpret_cast<uintptr_t>(&backend)) + "\n" +
                              source.key.to_string() + "\n" + text;
      {
        std::lock_guard<std::mutex> lock(cache.mutex);
        if (auto it = cache.kernels.find(key); it != cache.kernels.end()) plan.kernel = it->second;
        else if (auto f = cache.failures.find(key); f != cache.failures.end()) throw FusionError(f->second);
      }
      if (!plan.kernel) {
        try {
          plan.kernel = backend.get(source);
        } catch (const FusionError& e) {
          std::lock_guard<std::mutex> lock(cache.mutex);
          cache.failures.emplace(key, e.what());
          throw;
        }
        std::lock_guard<std::mutex> lock(cache.mutex);
        cache.kernels.emplace(key, plan.kernel);
      }
    }
  } catch (const FusionError& e) {
    plan = GroupPlan{};
    plan.fallback = e.what();
  }
  return plan;
}

/// Runs a planned group: allocates the outputs (from `HostCachingAllocator` inside a
/// `HostCacheScope`, as compiled stages run with `cache_host_memory`; see
/// `install_host_cache`) and runs the kernel; or, for a fallback plan or arguments the
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
    outputs.push_back(at::empty(plan.shape, at::TensorOptions().dtype(dt)));
  if (plan.kernel) {
    std::vector<at::Tensor> ins(inputs.begin(), inputs.end());
    PackedArgs args;
    try {
      args = pack_tensor_args(plan.shape, ins, outputs);
    } catch (const FusionError& e) {  // e.g. more dimensions than the launch ABI holds
      if (fallback_reason) *fallback_reason = e.what();
      warn_fallback(group_name, text, e.what());
      return run_unfused(subgraph, inputs);
    }
    plan.kernel->run(args);
  }
  return outputs;
}

}  // namespace detail

/// Runs a FusionGroup subgraph on `inputs` (one tensor per subgraph input, broadcastable
/// to one shape): allocates the outputs (the broadcast shape, contiguous, from
/// `HostCachingAllocator` inside a `HostCacheScope` once `install_host_cache()` has run,
/// else from ATen's allocator; dtypes from `output_dtypes`), and runs the generated
/// kernel from the CPU backend (kernels cached in the process per backend, key and subgraph
/// text). When no kernel can be used (anything `generate` refuses, or FusionError from
/// the backend such as a missing compiler), runs the nodes one by one with `run_unfused`
/// instead and prints a one-time warning per group on stderr. Throws ShapeError when the
/// inputs do not broadcast, `Error` naming the group, op and input for an undefined input
/// (as the op would outside a group), and what `run_unfused` throws. For repeated calls
/// of one group use `FusedGroup`, which memoises all of this per input signature.
inline std::vector<at::Tensor> run_fused(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                         const RunFusedOptions& options = {}) {
  STAGEJIT_CHECK_AS(FusionError, inputs.size() == subgraph.inputs().size(), "fusion: the group has ",
                    subgraph.inputs().size(), " inputs but was given ", inputs.size(), " tensors");
  detail::check_defined_inputs(subgraph, inputs, options.group_name);
  const std::string text = ir::to_string(subgraph);
  CpuBackend& backend = options.backend ? *options.backend : default_cpu_backend();
  detail::GroupPlan plan = detail::plan_group(subgraph, text, inputs, backend);
  if (options.fallback_reason) *options.fallback_reason = plan.fallback;
  return detail::run_planned(plan, subgraph, text, inputs, options.group_name, options.fallback_reason);
}

/// One FusionGroup subgraph run call after call (the closure compiler's FusedKernel):
/// behaves as `run_fused`, but prints the group once and memoises the plan (broadcast
/// shape, kernel or fallback reason) per input signature (dtype, sizes and contiguity of
/// every input), so a repeated call does no code generation, printing or hashing of
/// source text. Thread-safe; the memo holds at most `kMaxPlans` signatures (then the
/// oldest is dropped). Throws what `run_fused` throws.
class FusedGroup {
 public:
  static constexpr std::size_t kMaxPlans = 16;

  /// `subgraph`: the group's subgraph (not null); `name`: its name in the fallback
  /// warning; `backend`: null for `default_cpu_backend()`.
  FusedGroup(std::shared_ptr<const ir::Graph> subgraph, std::string name, CpuBackend* backend = nullptr)
      : subgraph_(std::move(subgraph)), name_(std::move(name)), backend_(backend) {
    STAGEJIT_CHECK_AS(FusionError, subgraph_, "fusion: FusedGroup ", name_, " without a subgraph");
    text_ = ir::to_string(*subgraph_);
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const {
    STAGEJIT_CHECK_AS(FusionError, inputs.size() == subgraph_->inputs().size(), "fusion: ", name_,
                      " has ", subgraph_->inputs().size(), " inputs but was given ", inputs.size(),
                      " tensors");
    detail::check_defined_inputs(*subgraph_, inputs, name_);
    Signature sig;
    sig.reserve(inputs.size() * 4);
    for (const auto& x : inputs) {
      if (!x.defined()) {
        sig.push_back(-1);
        continue;
      }
      sig.push_back(static_cast<int64_t>(x.scalar_type()) | (x.is_contiguous() ? 256 : 0) |
                    (x.device().is_cpu() ? 0 : 512));
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
      CpuBackend& backend = backend_ ? *backend_ : default_cpu_backend();
      plan = std::make_shared<const detail::GroupPlan>(detail::plan_group(*subgraph_, text_, inputs, backend));
      std::lock_guard<std::mutex> lock(mutex_);
      bool present = false;  // another thread may have planned this signature meanwhile
      for (const auto& entry : plans_) present = present || entry.first == sig;
      if (!present) {
        if (plans_.size() >= kMaxPlans) plans_.erase(plans_.begin());
        plans_.emplace_back(std::move(sig), plan);
      }
    }
    return detail::run_planned(*plan, *subgraph_, text_, inputs, name_);
  }

  const std::string& name() const noexcept { return name_; }

 private:
  using Signature = std::vector<int64_t>;
  std::shared_ptr<const ir::Graph> subgraph_;
  std::string name_;
  CpuBackend* backend_;
  std::string text_;
  mutable std::mutex mutex_;
  mutable std::vector<std::pair<Signature, std::shared_ptr<const detail::GroupPlan>>> plans_;
};

}  // namespace stagejit::fusion
#include <stagejit/core/detail/bodies_end.hpp>
