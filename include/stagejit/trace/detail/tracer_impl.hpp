#pragma once
// Implementation of trace() (see trace/trace.hpp). Internal.

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/trace/trace.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/trace/host_op_payload.hpp>

#include <mutex>
#include <string>
#include <unordered_map>

namespace stagejit::detail {

/// The TraceHook that records into one graph. Maps every Variable it has seen (by
/// `impl_id()`) to its IR value, and every opaque backward Function to the Handle that
/// stands for it. Keeps the Variables it mapped alive until the trace ends, so an
/// address is never reused for another Variable while the map holds it.
class TracingState final : public TraceHook {
 public:
  TracingState() : graph_(std::make_shared<ir::Graph>()) {}

  const std::shared_ptr<ir::Graph>& graph() const { return graph_; }

  void begin_stage(std::size_t s) {
    std::lock_guard<std::mutex> lock(mutex_);
    graph_->set_current_stage(s);
  }

  /// Adds a graph input of `stage` for `v` (defined).
  void add_input(const Variable& v, std::size_t stage) {
    std::lock_guard<std::mutex> lock(mutex_);
    ir::Value* p = graph_->add_input(ir::TensorType::of(v.data()), stage);
    bind(v, p);
  }

  /// Registers `v` as an output of `stage`. An undefined `v` becomes an Undefined node;
  /// a Variable the trace never saw is a TraceError when `require_traced`.
  void add_output(const Variable& v, std::size_t stage, std::size_t index, bool require_traced) {
    std::lock_guard<std::mutex> lock(mutex_);
    ir::Value* value = nullptr;
    if (!v.defined()) {
      value = graph_->append_undefined();
    } else if (auto it = values_.find(v.impl_id()); it != values_.end()) {
      value = it->second;
    } else {
      STAGEJIT_CHECK_AS(TraceError, !require_traced, "output ", index, " of stage ", stage,
                        " of the traced function has no observable data dependence on its "
                        "inputs (it was not computed by a stagejit op); return a value "
                        "computed from the inputs, or pass the tensor in as an input");
      value = constant_for(v);
    }
    graph_->register_output(value, stage);
  }

  void record_op(const OpSchema& op, const Attributes& attrs, const variable_list& inputs,
                 const variable_list& outputs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<ir::Value*> in = values_for(inputs);
    std::vector<ir::Type> types;
    types.reserve(outputs.size());
    for (const auto& o : outputs) types.push_back(type_of(o));
    ir::Node* n = graph_->create_and_append(ir::Op::with(op.id, attrs), in, types);
    for (std::size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i].defined()) bind(outputs[i], n->output(i));
  }

  void record_host_op(std::string_view name, std::string_view calling_convention,
                      const std::vector<Scalar>& scalars, const variable_list& inputs,
                      const variable_list& outputs, const std::shared_ptr<Function>& backward,
                      const HostCallable& call) override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<ir::Value*> in = values_for(inputs);
    // Sized up front: no regrowth (ir::Type copies on regrowth, its move not being noexcept,
    // and that path trips a GCC 12 maybe-uninitialized false positive).
    std::vector<ir::Type> types(outputs.size() + (backward ? 1 : 0));
    for (std::size_t i = 0; i < outputs.size(); ++i) types[i] = type_of(outputs[i]);
    if (backward) types.back() = ir::HandleType{};
    auto payload = std::make_shared<HostOpPayload>();
    payload->call = call;
    for (const auto& v : inputs) payload->input_requires_grad.push_back(v.requires_grad());
    ir::HostOp kind{std::string(name), std::string(calling_convention), scalars, payload};
    ir::Node* n = graph_->create_and_append(std::move(kind), in, types);
    for (std::size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i].defined()) bind(outputs[i], n->output(i));
    if (backward) bind_handle(backward, n->outputs().back());
  }

  void record_eval(const Function& fn, const variable_list& grad_inputs,
                   const variable_list& grad_outputs,
                   const std::shared_ptr<Function>& backward_of_outputs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto h = handles_.find(&fn);
    STAGEJIT_CHECK_AS(TraceError, h != handles_.end(), "opaque backward '", fn.name(),
                      "' ran at stage ", graph_->current_stage(),
                      " but the trace holds no Handle for it (its forward ran outside the "
                      "trace, or an earlier stage was not traced)");
    std::vector<ir::Value*> in = values_for(grad_inputs);
    in.push_back(h->second);
    std::vector<ir::Type> types(grad_outputs.size() + (backward_of_outputs ? 1 : 0));
    for (std::size_t i = 0; i < grad_outputs.size(); ++i) types[i] = type_of(grad_outputs[i]);
    if (backward_of_outputs) types.back() = ir::HandleType{};
    ir::Node* n = graph_->create_and_append(ir::Eval{}, in, types);
    for (std::size_t i = 0; i < grad_outputs.size(); ++i)
      if (grad_outputs[i].defined()) bind(grad_outputs[i], n->output(i));
    if (backward_of_outputs) bind_handle(backward_of_outputs, n->outputs().back());
  }

 private:
  static ir::Type type_of(const Variable& v) {
    if (!v.defined()) return ir::UnknownType{};
    return ir::TensorType::of(v.data());
  }

  void bind(const Variable& v, ir::Value* value) {
    values_[v.impl_id()] = value;
    keep_alive_.push_back(v);
  }
  void bind_handle(const std::shared_ptr<Function>& fn, ir::Value* value) {
    handles_[fn.get()] = value;
    keep_alive_functions_.push_back(fn);
  }

  // A tensor met for the first time: a Constant holding a clone (made now, so later
  // mutation of the original does not leak into the graph), shared by later uses.
  // A Variable the trace did not see being made: a constant of the graph (cloned, so later
  // changes to it change nothing). One that requires grad is refused, as libtorch's tracer
  // refuses to insert a tensor that requires grad as a constant: frozen, its gradient
  // would silently be lost (a captured parameter, or the raw ATen result of a traceable
  // host function's forward).
  ir::Value* constant_for(const Variable& v) {
    STAGEJIT_CHECK_AS(TraceError, !v.requires_grad(), "trace: a Variable that requires grad (a ",
                      v.scalar_type(), " tensor of shape ", v.sizes(),
                      ") is used but is neither an input of the traced function nor computed from one "
                      "by a stagejit op; frozen as a constant its gradient would be lost: pass it in as an "
                      "input, or detach() it");
    ir::Value* c = graph_->append_constant(v.data().clone());
    bind(v, c);
    return c;
  }

  std::vector<ir::Value*> values_for(const variable_list& vars) {
    std::vector<ir::Value*> out;
    out.reserve(vars.size());
    for (const auto& v : vars) {
      if (!v.defined()) {
        out.push_back(graph_->append_undefined());
      } else if (auto it = values_.find(v.impl_id()); it != values_.end()) {
        out.push_back(it->second);
      } else {
        out.push_back(constant_for(v));
      }
    }
    return out;
  }

  std::shared_ptr<ir::Graph> graph_;
  std::mutex mutex_;
  std::unordered_map<const void*, ir::Value*> values_;
  std::unordered_map<const Function*, ir::Value*> handles_;
  variable_list keep_alive_;
  std::vector<std::shared_ptr<Function>> keep_alive_functions_;
};

}  // namespace stagejit::detail

namespace stagejit {

inline Trace trace(const traced_fn& fn, const variable_list& inputs, TraceOptions options) {
  STAGEJIT_CHECK(options.derivatives >= 0, "trace: derivatives must be >= 0, got ",
                 options.derivatives);
  const std::size_t k = static_cast<std::size_t>(options.derivatives);
  detail::TracingState state;
  Trace t;
  t.graph_ = state.graph();

  AutoGradMode grad_on(true);
  TraceHookGuard hook(&state);

  // ---- stage 0: fresh leaves sharing the inputs' tensors become the stage-0 Params.
  variable_list leaves;
  leaves.reserve(inputs.size());
  StageFlags flags0;
  std::vector<std::size_t> leaf_input_index;  // graph-input index of each defined leaf
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Variable& in = inputs[i];
    flags0.inputs.push_back(VariableFlags::of(in));
    STAGEJIT_CHECK_AS(TraceError, in.defined(), "trace: input ", i,
                      " is undefined; every traced input must hold a tensor");
    Variable leaf(in.data(), in.requires_grad());
    state.add_input(leaf, 0);
    leaves.push_back(leaf);
  }
  state.begin_stage(0);
  variable_list outs = fn(leaves);
  STAGEJIT_CHECK_AS(TraceError, !outs.empty(), "trace: the traced function returned no outputs");
  for (std::size_t i = 0; i < outs.size(); ++i) {
    state.add_output(outs[i], 0, i, /*require_traced=*/true);
    flags0.outputs.push_back(VariableFlags::of(outs[i]));
  }
  t.stage_inputs_.push_back(leaves);
  t.stage_outputs_.push_back(outs);
  t.flags_.push_back(std::move(flags0));
  t.output_edges_.emplace_back();
  t.gradient_of_.emplace_back();

  // Every graph input so far (in graph-input order) and its Variable.
  variable_list all_inputs = leaves;

  // ---- stages 1..k: the backward of the previous stage, recorded.
  for (std::size_t s = 1; s <= k; ++s) {
    StageFlags flags;
    variable_list roots_vars, grad_outputs;
    for (const auto& o : t.stage_outputs_.back()) {
      if (!o.defined() || !o.requires_grad()) continue;
      Variable g(at::ones_like(o.data()), /*requires_grad=*/s < k);
      roots_vars.push_back(o);
      grad_outputs.push_back(g);
      flags.inputs.push_back(VariableFlags::of(g));
    }
    state.begin_stage(s);
    for (const auto& g : grad_outputs) state.add_input(g, s);

    std::vector<Edge> capture;
    std::vector<std::size_t> gradient_of;
    for (std::size_t i = 0; i < all_inputs.size(); ++i) {
      if (!all_inputs[i].requires_grad()) continue;
      capture.push_back(all_inputs[i].gradient_edge());
      gradient_of.push_back(i);
    }
    variable_list grads(capture.size());
    if (!roots_vars.empty() && !capture.empty()) {
      std::vector<Edge> roots;
      for (const auto& o : roots_vars) roots.push_back(o.gradient_edge());
      ExecuteOptions opts;
      opts.create_graph = s < k;
      opts.keep_graph = true;
      opts.single_threaded = true;
      opts.capture = capture;
      grads = execute(roots, grad_outputs, opts);
    }
    for (std::size_t i = 0; i < grads.size(); ++i) {
      state.add_output(grads[i], s, i, /*require_traced=*/false);
      flags.outputs.push_back(VariableFlags::of(grads[i]));
    }
    t.stage_inputs_.push_back(grad_outputs);
    t.stage_outputs_.push_back(grads);
    t.flags_.push_back(std::move(flags));
    t.output_edges_.push_back(std::move(capture));
    t.gradient_of_.push_back(std::move(gradient_of));
    for (const auto& g : grad_outputs) all_inputs.push_back(g);
  }
  return t;
}

}  // namespace stagejit
#include <stagejit/core/detail/bodies_end.hpp>
