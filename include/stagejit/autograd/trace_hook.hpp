#pragma once
/// \file
/// The trace hook: the interface through which the tracer observes eager execution.
/// autograd only calls it; the tracer (trace/) implements it. The current hook is
/// thread-local, and the engine propagates the hook of the thread calling `execute` to
/// every thread running that graph task, so ops of backward formulas are reported too.

#include <stagejit/autograd/variable.hpp>
#include <stagejit/ops/op_schema.hpp>
#include <stagejit/core/scalar.hpp>

#include <functional>
#include <memory>
#include <string_view>
#include <vector>

namespace stagejit {

/// Runs a host function again on new tensor inputs, with the scalars of the call it was
/// made from (the IR interpreter and the closure compiler's HostCall use it).
using HostCallable = std::function<variable_list(const variable_list&)>;

/// Receives every op, host op and opaque backward run on threads where it is current.
class TraceHook {
 public:
  virtual ~TraceHook() = default;
  /// Every table op, whatever the grad mode, after it ran (also ops inside backward
  /// formulas). `attrs` are the op's attributes as recorded in the IR.
  virtual void record_op(const OpSchema& op, const Attributes& attrs,
                         const variable_list& inputs, const variable_list& outputs) = 0;
  /// A non-traceable HostFunction ran as a unit (its inner ops are not reported).
  /// `calling_convention` has one letter per argument: `t` tensor, `s` scalar. `call`
  /// re-runs the host function (same scalars) on new tensor inputs.
  virtual void record_host_op(std::string_view name, std::string_view calling_convention,
                              const std::vector<Scalar>& scalars, const variable_list& inputs,
                              const variable_list& outputs,
                              const std::shared_ptr<Function>& backward,
                              const HostCallable& call) = 0;
  /// An opaque backward (HostBackward or Eval) ran as a unit. `backward_of_outputs` is the
  /// Eval that is grad_fn of `grad_outputs` (create_graph), or null.
  virtual void record_eval(const Function& fn, const variable_list& grad_inputs,
                           const variable_list& grad_outputs,
                           const std::shared_ptr<Function>& backward_of_outputs) = 0;
  /// The gradient edge a table op run now gives its input `v` (`Variable::gradient_edge`
  /// unless the hook cuts it: the multi-stage tracer gives a value of an earlier stage,
  /// read by an op of a later one, an edge of its own, Note [Cross-stage gradients] in
  /// trace/trace.hpp).
  virtual Edge gradient_edge_of(const Variable& v) { return v.gradient_edge(); }
};

/// The hook current on this thread, or null (one pointer load per op when null).
TraceHook* current_trace_hook() noexcept;
/// Sets this thread's hook (prefer `TraceHookGuard`).
void set_current_trace_hook(TraceHook* hook) noexcept;

/// RAII: makes `hook` current on this thread (null suspends tracing) and restores the
/// previous hook on destruction.
class TraceHookGuard {
 public:
  explicit TraceHookGuard(TraceHook* hook) noexcept : prev_(current_trace_hook()) {
    set_current_trace_hook(hook);
  }
  ~TraceHookGuard() { set_current_trace_hook(prev_); }
  TraceHookGuard(const TraceHookGuard&) = delete;
  TraceHookGuard& operator=(const TraceHookGuard&) = delete;

 private:
  TraceHook* prev_;
};

namespace detail {
inline thread_local int meta_trace_depth = 0;
}  // namespace detail

/// RAII: open while `compile()` traces on meta tensors (`CompileOptions::trace_on_meta`)
/// on this thread. Host functions refuse to run inside it (their forward may read data a
/// meta tensor does not have), which sends `compile()` to a trace of the real tensors.
class MetaTraceScope {
 public:
  MetaTraceScope() noexcept { ++detail::meta_trace_depth; }
  ~MetaTraceScope() { --detail::meta_trace_depth; }
  MetaTraceScope(const MetaTraceScope&) = delete;
  MetaTraceScope& operator=(const MetaTraceScope&) = delete;
  /// True when a scope is open on this thread.
  static bool active() noexcept { return detail::meta_trace_depth > 0; }
};

}  // namespace stagejit
