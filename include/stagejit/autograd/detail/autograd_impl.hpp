#pragma once
/// \file
/// Internal: the helpers of autograd's function bodies that more than one `-inl.hpp`
/// file of autograd/ uses (core/config.hpp). Bodies: `shape_str` in
/// autograd/variable-inl.hpp, `apply_host_backward` in autograd/host_function-inl.hpp,
/// `apply_eval` in autograd/eval-inl.hpp.

#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/variable.hpp>

#include <ATen/core/TensorBody.h>

#include <string>

namespace stagejit::detail::autograd_impl {

/// `s` printed as ATen prints sizes (`[2, 3]`), for messages.
std::string shape_str(at::IntArrayRef s);

/// The apply of a `HostBackward` Function (a host function's backward).
variable_list apply_host_backward(Function& self, HostBackward& hb, variable_list& grads);
/// The apply of an `Eval` Function (eval::wrap).
variable_list apply_eval(Function& self, Eval& ev, variable_list& grads);

}  // namespace stagejit::detail::autograd_impl
