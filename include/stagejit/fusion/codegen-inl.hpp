#pragma once
/// \file
/// Bodies of fusion/codegen.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
/// They hold the generator (`generate`, the kernel body), the planner and runner of a
/// group (`plan_group`, `run_planned`, `run_fused`, `run_unfused`, `FusedGroup::run`)
/// and the kernel prediction of `KernelBatchScope`.
#include <stagejit/core/config.hpp>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/memory/host_allocator.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/fusion/detail/codegen_ops.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/node_semantics.hpp>
#include <stagejit/ir/printer.hpp>
#include <stagejit/ops/op_def.hpp>

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
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

STAGEJIT_FUNC at::ScalarType storage_type(const std::vector<at::Tensor>& inputs, DeviceKind dialect) {
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

STAGEJIT_FUNC at::ScalarType compute_type(const std::vector<at::Tensor>& inputs, DeviceKind dialect) {
  const at::ScalarType t = detail::storage_type(inputs, dialect);
  return detail::is_reduced_float(t) ? at::kFloat : t;
}

STAGEJIT_FUNC std::vector<int64_t> broadcast_shape(const std::vector<at::Tensor>& inputs) {
  std::vector<int64_t> shape;
  try {
    for (const auto& t : inputs) shape = at::infer_size(shape, t.sizes());
  } catch (const c10::Error& e) {
    throw ShapeError(std::string("fusion: group inputs do not broadcast: ") + e.what_without_backtrace());
  }
  return shape;
}

namespace detail {

STAGEJIT_FUNC const char* storage_name(at::ScalarType t, DeviceKind dialect) {
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

STAGEJIT_FUNC KernelBody kernel_body(const ir::Graph& g, const std::vector<at::Tensor>& inputs, DeviceKind dialect,
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

STAGEJIT_FUNC DeviceKind dialect_of(const at::Device& device) {
  if (device.is_cpu()) return DeviceKind::CPU;
  if (device.is_cuda()) return DeviceKind::CUDA;
  throw FusionError(std::string("fusion: no fused kernels on device ") + device.str() + " (CPU and CUDA only)");
}

}  // namespace detail

STAGEJIT_FUNC std::vector<at::ScalarType> output_dtypes(const ir::Graph& subgraph,
                                                        const std::vector<at::Tensor>& inputs,
                                                        DeviceKind dialect) {
  const at::ScalarType t = detail::storage_type(inputs, dialect);
  std::vector<at::ScalarType> out;
  for (bool b : detail::kernel_body(subgraph, inputs, dialect, false).output_bool) out.push_back(b ? at::kBool : t);
  return out;
}

STAGEJIT_FUNC KernelSource generate(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                    DeviceKind dialect, int32_t device_index) {
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

STAGEJIT_FUNC KernelSource generate(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) {
  at::Device device = inputs.empty() ? at::Device(at::kCPU) : inputs[0].device();
  for (size_t i = 1; i < inputs.size(); ++i)
    STAGEJIT_CHECK_AS(FusionError, inputs[i].device() == device, "fusion: group input ", i, " is on ",
                      inputs[i].device(), " but input 0 is on ", device, "; a fused kernel runs on one device");
  const DeviceKind dialect = detail::dialect_of(device);
  return generate(subgraph, inputs, dialect, dialect == DeviceKind::CUDA ? device.index() : -1);
}

STAGEJIT_FUNC Attributes to_core_attributes(const ir::Op& op) {
  try {
    return stagejit::detail::to_core_attributes(op.attributes);
  } catch (const CompileError& e) {
    throw FusionError("fusion: op '" + std::string(op.name()) + "': " + e.what());
  }
}

namespace detail {

STAGEJIT_FUNC void check_defined_inputs(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
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

STAGEJIT_FUNC std::vector<at::Tensor> run_unfused(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) {
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

STAGEJIT_FUNC bool waits_for_kernels() noexcept {
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

STAGEJIT_FUNC bool set_wait_for_kernels(bool wait) noexcept {
  const bool before = waits_for_kernels();
  detail::wait_for_kernels_flag() = wait ? 1 : 0;
  return before;
}

namespace detail {

STAGEJIT_FUNC bool outputs_have_shape(const ir::Graph& g, const std::vector<at::Tensor>& inputs,
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

STAGEJIT_FUNC void warn_fallback(const std::string& group, const std::string& text, const std::string& reason) {
  auto& w = fallback_warnings();
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    if (!w.warned.insert(text).second) return;
    if (!w.reasons.insert(reason).second) return;
  }
  std::cerr << "stagejit: warning: " << (group.empty() ? std::string("a fusion group") : group)
            << " runs op by op (no fused kernel): " << reason << "\n";
}

STAGEJIT_FUNC at::Device group_device(const std::vector<at::Tensor>& inputs, const std::string& group_name) {
  const at::Device device = inputs.empty() ? at::Device(at::kCPU) : inputs[0].device();
  for (size_t i = 1; i < inputs.size(); ++i)
    if (inputs[i].device() != device)
      ::stagejit::detail::throw_error<FusionError>(
          group_name.empty() ? std::string("a fusion group") : group_name, ": inputs on more than one device (input 0 on ",
          device, ", input ", i, " on ", inputs[i].device(), "); a fused kernel runs on one device");
  return device;
}

STAGEJIT_FUNC GroupPlan plan_group(const ir::Graph& subgraph, const std::string& text,
                                   const std::vector<at::Tensor>& inputs, const Backends& backends,
                                   const std::string& group_name, bool may_defer) {
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

STAGEJIT_FUNC std::vector<at::Tensor> run_planned(const GroupPlan& plan, const ir::Graph& subgraph,
                                                  const std::string& text, const std::vector<at::Tensor>& inputs,
                                                  const std::string& group_name,
                                                  std::string* fallback_reason) {
  if (!plan.fallback.empty()) {
    warn_fallback(group_name, text, plan.fallback);
    return run_unfused(subgraph, inputs);
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(plan.output_dtypes.size());
  // at::empty: inside a HostCacheScope (and with install_host_cache() done) c10's CPU
  // allocator serves it from the cache, and the storage keeps that routing allocator, so
  // a later resize outside any scope does not touch the cache.
  // The outputs take the layout the full-size inputs share when it is a permuted dense one
  // (every full-size input transposed alike), as ATen's TensorIterator gives its outputs:
  // the kernel then runs as one contiguous row (`pack_tensor_args` iterates in the first
  // output's memory order) instead of reading every input element by element. A weight
  // gradient summed from transposed products, `add(t(a), t(b))`, is such a group.
  const at::Tensor* layout = nullptr;  // the first full-size input, when all share its strides
  for (const at::Tensor& t : inputs) {
    if (!t.defined() || t.sizes() != at::IntArrayRef(plan.shape)) continue;
    if (!layout) {
      layout = &t;
    } else if (layout->strides() != t.strides()) {
      layout = nullptr;
      break;
    }
  }
  const bool permuted = layout && !layout->is_contiguous() && layout->is_non_overlapping_and_dense();
  for (at::ScalarType dt : plan.output_dtypes) {
    const auto options = at::TensorOptions().dtype(dt).device(plan.device);
    outputs.push_back(permuted ? at::empty_strided(plan.shape, layout->strides(), options) : at::empty(plan.shape, options));
  }
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

STAGEJIT_FUNC std::vector<at::Tensor> run_fused(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs,
                                                const RunFusedOptions& options) {
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

STAGEJIT_FUNC void predict_kernel(const ir::Graph& subgraph, CpuBackend* backend) {
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

STAGEJIT_FUNC void KernelBatchScope::flush() noexcept {
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

STAGEJIT_FUNC FusedGroup::FusedGroup(std::shared_ptr<const ir::Graph> subgraph, std::string name, CpuBackend* backend,
                                     CudaBackend* cuda_backend)
    : subgraph_(std::move(subgraph)), name_(std::move(name)), backends_{backend, cuda_backend} {
  STAGEJIT_CHECK_AS(FusionError, subgraph_, "fusion: FusedGroup ", name_, " without a subgraph");
  text_ = ir::to_string(*subgraph_);
  detail::predict_kernel(*subgraph_, backend);
}

STAGEJIT_FUNC std::vector<at::Tensor> FusedGroup::run(const std::vector<at::Tensor>& inputs) const {
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

}  // namespace stagejit::fusion
