#pragma once
/// \file
/// Callback policies the engine runs before (pre) or after (post) a Function, per
/// execution (docs/seed-system.md §4). The set is closed: every policy the library needs
/// is a member of `CallbackPolicy`, run by one exhaustive visitor (`run_callback`), and
/// `GenericCallback` is the one type-erased escape hatch, for users only (no library code
/// uses it). A pre callback returning false stops that Function: it is not applied and
/// emits one undefined output per next_function.
///
/// The tables (`ExecuteCallbacks`) are built once (a compiled stage builds them with its
/// closure) and shared by every call; what one call captures goes into that call's own
/// `CallState`, passed to `execute` beside the tables. So a call copies nothing and one
/// table serves several threads at once.

#include <stagejit/autograd/variable.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

namespace stagejit {

/// Receives output `output` of a Function before that Function returns (Note [Early
/// outputs] in autograd/engine.hpp).
using OutputSink = std::function<void(std::size_t output, Variable value)>;

/// Per-call state the policies read and write (owned by the caller of `execute`).
/// Policies lock `mutex`; slots grow on demand.
struct CallState {
  std::mutex mutex;
  variable_list values;                               ///< value slots (CaptureInput/CaptureOutput)
  std::vector<std::shared_ptr<Function>> handles;     ///< Handle slots (CaptureHandle/RunHandle)
  variable_list outputs;                              ///< CaptureOutputs
  /// EmitOutput: where a stage output goes as soon as it is computed (empty: nowhere;
  /// it is only collected by CaptureOutputs). Called without `mutex` held.
  OutputSink early_outputs;
};

/// pre: stores input `input` into `CallState::values[slot]`; stops the Function when
/// `stop` (an Eval's boundary placeholder), else continues.
struct CaptureInput {
  std::size_t input = 0;
  std::size_t slot = 0;
  bool stop = false;
};
/// post: stores output `output` into `CallState::values[slot]` (a value a later stage
/// reads); continues.
struct CaptureOutput { std::size_t output = 0; std::size_t slot = 0; };
/// post: stores into `CallState::handles[slot]` the grad_fn of the first defined output
/// that has one (the opaque backward a host function made), or null; continues.
struct CaptureHandle { std::size_t slot = 0; };
/// post: replaces the outputs by the Handle in `CallState::handles[in_slot]` applied to
/// the inputs, in grad mode when `makes_handle` (the inputs then require grad, as when
/// traced), and when `out_slot >= 0` captures the grad_fn of the result as the next
/// Handle there. One policy, so running a Handle always precedes capturing the next (the
/// seed relied on multimap order: docs/seed-system.md §6.4). Throws `Error` naming `where` when the
/// slot holds no Handle or the Handle returns another number than `expected` outputs.
struct RunHandle {
  std::size_t in_slot = 0;
  std::ptrdiff_t out_slot = -1;
  bool makes_handle = false;
  std::size_t expected = 0;
  std::string where;
};
/// pre: stores all inputs into `CallState::outputs`; stops the function (a stage's Output).
struct CaptureOutputs {};
/// post: passes output `output` (stage output `stage_output`, which only this output
/// feeds) to `CallState::early_outputs` when that is set, so the stage's caller can
/// deliver it before the stage ends (Note [Early outputs] in autograd/engine.hpp); it
/// still reaches the Output as well. Continues.
struct EmitOutput { std::size_t output = 0; std::size_t stage_output = 0; };
/// Anything else (user code only). `outputs` is null for pre callbacks. Returns false to stop.
struct GenericCallback {
  std::function<bool(Function& fn, variable_list& inputs, variable_list* outputs,
                     CallState* state)> fn;
};

using CallbackPolicy =
    std::variant<CaptureInput, CaptureOutput, CaptureHandle, RunHandle, CaptureOutputs,
                 EmitOutput, GenericCallback>;

/// The callback tables of an execution, keyed by Function. Built once, read-only while
/// `execute` runs (any number of executions may share one).
struct ExecuteCallbacks {
  std::unordered_multimap<const Function*, CallbackPolicy> pre;
  std::unordered_multimap<const Function*, CallbackPolicy> post;
  bool empty() const noexcept { return pre.empty() && post.empty(); }
};

/// Runs one policy. `outputs` null for pre callbacks; `state` the call's state (null when
/// the caller gave none: every policy but GenericCallback then throws `Error`). Returns
/// false to stop the function.
bool run_callback(const CallbackPolicy& policy, Function& fn, variable_list& inputs,
                  variable_list* outputs, CallState* state);

}  // namespace stagejit
