#pragma once
/// \file
/// `grad()` and `backward()` (docs/api.md "Gradients"), with the meaning of libtorch's
/// `torch::autograd::grad` / `backward` (retain_graph is always true here).

#include <stagejit/autograd/variable.hpp>

namespace stagejit {

/// Gradients of `outputs` (weighted by `grad_outputs`; implicit ones for one-element
/// outputs) with respect to `inputs`. With `create_graph` the results carry a graph and can
/// be differentiated again. An input used in several slots gets the same gradient in each.
/// Throws `Error`: an output or input that does not require grad, a non-scalar output with
/// no grad_output ("grad can be implicitly created only for scalar outputs"), a
/// grad_output of another shape (`ShapeError`), an unused input unless `allow_unused`
/// (then undefined), a tensor a backward saved that was modified in place after the
/// forward (its version counter moved, as libtorch checks). A grad_output of another
/// dtype than its output is accepted and cast where the gradient meets a function, as in
/// libtorch (compiled stages cast it to the traced dtype).
variable_list grad(const variable_list& outputs, const variable_list& inputs,
                   const variable_list& grad_outputs = {}, bool create_graph = false,
                   bool allow_unused = false);

/// Accumulates the gradients of `outputs` into every leaf's `grad()`. Same errors as grad.
void backward(const variable_list& outputs, const variable_list& grad_outputs = {},
              bool create_graph = false);

}  // namespace stagejit
