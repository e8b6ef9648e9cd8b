#pragma once
/// \file
/// What the tracer keeps in a `HostOp` node's payload: the callable that runs the host
/// function again (the IR interpreter and the closure compiler's HostCall use it) and the
/// requires_grad flag each tensor input had when traced.

#include <stagejit/autograd/trace_hook.hpp>

#include <vector>

namespace stagejit {

struct HostOpPayload {
  /// Runs `T::apply` on new tensor inputs with the traced scalars.
  HostCallable call;
  std::vector<bool> input_requires_grad;
};

}  // namespace stagejit
