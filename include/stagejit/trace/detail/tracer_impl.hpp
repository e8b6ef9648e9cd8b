#pragma once
// Implementation of trace() (see trace/trace.hpp). Internal. The bodies of the members
// below, of `detail::trace_stages` and of `trace()` are in detail/tracer_impl-inl.hpp.

#include <stagejit/core/config.hpp>
#include <stagejit/trace/trace.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/trace/host_op_payload.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/passes/zeros.hpp>
#include <stagejit/ops/ops.hpp>

#include <algorithm>

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
  STAGEJIT_FUNC ir::Value* add_input(const Variable& v, std::size_t stage);

  /// Note [Cross-stage gradients]: while on, an op of the current stage reading a value
  /// of an earlier stage that requires grad gets, for that input, the gradient edge of a
  /// boundary leaf of its own (one per value and reading stage) instead of the value's
  /// grad_fn, so the next stage's backward stops there and returns the value's gradient.
  void set_cutting(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    cutting_ = on;
  }

  /// A boundary leaf: `value` (of an earlier stage) as read by the ops of `stage`.
  struct Boundary {
    ir::Value* value;
    Variable leaf;
    std::size_t stage;
  };
  std::vector<Boundary> boundaries() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return boundaries_;
  }

  /// Values made by ops of `stage` that require grad, with their Variables, in the order
  /// they were made.
  std::vector<std::pair<Variable, ir::Value*>> intermediates(std::size_t stage) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stage < intermediates_.size() ? intermediates_[stage]
                                         : std::vector<std::pair<Variable, ir::Value*>>{};
  }

  STAGEJIT_FUNC Edge gradient_edge_of(const Variable& v) override;

  /// Registers `v` as an output of `stage`. An undefined `v` becomes an Undefined node;
  /// a Variable the trace never saw is a TraceError when `require_traced`.
  STAGEJIT_FUNC void add_output(const Variable& v, std::size_t stage, std::size_t index, bool require_traced);

  STAGEJIT_FUNC void record_op(const OpSchema& op, const Attributes& attrs, const variable_list& inputs,
                               const variable_list& outputs) override;

  STAGEJIT_FUNC void record_host_op(std::string_view name, std::string_view calling_convention,
                                    const std::vector<Scalar>& scalars, const variable_list& inputs,
                                    const variable_list& outputs, const std::shared_ptr<Function>& backward,
                                    const HostCallable& call) override;

  STAGEJIT_FUNC void record_eval(const Function& fn, const variable_list& grad_inputs,
                                 const variable_list& grad_outputs,
                                 const std::shared_ptr<Function>& backward_of_outputs) override;

 private:
  static ir::Type type_of(const Variable& v) {
    if (!v.defined()) return ir::UnknownType{};
    return ir::TensorType::of(v.data());
  }

  void bind(const Variable& v, ir::Value* value) {
    values_[v.impl_id()] = value;
    keep_alive_.push_back(v);
  }
  // `v`, made by a node of the current stage.
  STAGEJIT_FUNC void bind_made(const Variable& v, ir::Value* value);
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
  STAGEJIT_FUNC ir::Value* constant_for(const Variable& v);

  STAGEJIT_FUNC std::vector<ir::Value*> values_for(const variable_list& vars);

  struct PairHash {
    std::size_t operator()(const std::pair<const void*, std::size_t>& p) const noexcept {
      return std::hash<const void*>{}(p.first) * 31 + p.second;
    }
  };

  std::shared_ptr<ir::Graph> graph_;
  mutable std::mutex mutex_;
  bool cutting_ = false;
  std::vector<Boundary> boundaries_;
  std::unordered_map<std::pair<const void*, std::size_t>, std::size_t, PairHash> boundary_index_;
  std::vector<std::vector<std::pair<Variable, ir::Value*>>> intermediates_;
  std::unordered_map<const void*, ir::Value*> values_;
  std::unordered_map<const Function*, ir::Value*> handles_;
  variable_list keep_alive_;
  std::vector<std::shared_ptr<Function>> keep_alive_functions_;
};

}  // namespace stagejit::detail

namespace stagejit {

namespace detail {

/// Thrown inside a cutting trace when a cross-stage gradient has nowhere to go (an
/// earlier-stage value read later without a gradient input of its own); `trace` then
/// traces again without cutting (Note [Cross-stage gradients]).
struct CrossStageFallback {};

// Note [Cross-stage gradients], the pruning step. While tracing, stage s < k got a
// gradient input for every value of stage s-1 that requires grad (it cannot know yet which
// of them later stages read). Those no later stage feeds are symbolic zeros: propagated
// through their stage and removed, with the outputs that are gradients of them (those
// would flow into inputs nobody has), with the inputs of the next stage that are
// gradients of those outputs, and so on. Everything is by Value here; indices are
// rebuilt by the caller.
struct CrossStagePrune {
  ir::Graph& g;
  std::size_t k;
  // Per stage s >= 1: the graph input each regular input stands for the gradient of
  // (the stage s-1 output), by output index of stage s-1 (null: that output did not require
  // grad, no input).
  std::vector<std::vector<ir::Value*>> input_of_output;
  // Per stage: the extra inputs (gradient inputs of stage s-1 values).
  std::vector<std::vector<ir::Value*>> extras;
  // Per stage s >= 1: the graph input each regular output (the first `old` outputs) is the
  // gradient of.
  std::vector<std::vector<ir::Value*>> gradient_of;
  // Per stage: the extra input each boundary output feeds.
  std::vector<std::vector<ir::Value*>> feeds;

  // Runs the pruning. Returns, per stage, which outputs to erase, and the inputs to erase.
  STAGEJIT_FUNC std::pair<std::vector<std::vector<char>>, std::vector<ir::Value*>> run();
};

}  // namespace detail

}  // namespace stagejit
