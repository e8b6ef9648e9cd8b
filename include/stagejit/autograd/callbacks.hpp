#pragma once
/// \file
/// Callback policies the engine runs before (pre) or after (post) a Function, per
/// execution. A closed variant; the generic policy type-erases anything else. A pre
/// callback returning false stops that Function: it is not applied and emits one undefined
/// output per next_function. Follows the seed's engine callbacks (SPEC.md section 4).

#include <stagejit/autograd/variable.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <variant>
#include <vector>

namespace stagejit {

/// Per-call state the policies read and write (owned by the caller of `execute`).
/// Policies lock `mutex`; slots grow on demand.
struct CallState {
  std::mutex mutex;
  variable_list values;                               ///< CaptureValue slots
  std::vector<std::shared_ptr<Function>> handles;     ///< CaptureHandle slots
  variable_list outputs;                              ///< CaptureOutputs
};

/// pre: stores input `input` into `CallState::values[slot]`; continues.
struct CaptureValue { std::size_t input = 0; std::size_t slot = 0; };
/// post: stores the grad_fn of output `output` into `CallState::handles[slot]`; continues.
struct CaptureHandle { std::size_t output = 0; std::size_t slot = 0; };
/// post: replaces the outputs by `CallState::handles[slot]` applied to the inputs.
/// Throws `Error` when the slot holds no handle.
struct RunHandle { std::size_t slot = 0; };
/// pre: stores all inputs into `CallState::outputs`; stops the function.
struct CaptureOutputs {};
/// Anything else. `outputs` is null for pre callbacks. Returns false to stop.
struct GenericCallback {
  std::function<bool(Function& fn, variable_list& inputs, variable_list* outputs,
                     CallState* state)> fn;
};

using CallbackPolicy =
    std::variant<CaptureValue, CaptureHandle, RunHandle, CaptureOutputs, GenericCallback>;

/// The callbacks of one execution, keyed by Function.
struct ExecuteCallbacks {
  std::unordered_multimap<const Function*, CallbackPolicy> pre;
  std::unordered_multimap<const Function*, CallbackPolicy> post;
  CallState* state = nullptr;
  bool empty() const noexcept { return pre.empty() && post.empty(); }
};

/// Runs one policy. `outputs` null for pre callbacks. Returns false to stop the function.
bool run_callback(const CallbackPolicy& policy, Function& fn, variable_list& inputs,
                  variable_list* outputs, CallState* state);

}  // namespace stagejit
