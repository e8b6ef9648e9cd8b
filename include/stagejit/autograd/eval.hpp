#pragma once
/// \file
/// Eval: replacing an autograd subgraph by one opaque Function (docs/seed-system.md §2.3, general
/// case). The backward of an Eval, run with create_graph, is again an Eval.

#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/variable.hpp>

#include <memory>

namespace stagejit::eval {

/// Replaces the backward subgraph between `inputs` (the boundary) and `outputs` by one
/// `Eval` Function. Relevant outputs (defined, requiring grad, not an input passed through)
/// get the Eval as grad_fn (output i of the relevant ones -> input slot i). The boundary is
/// the gradient edges of `inputs`, the outer edges of the EvalOutput placeholders of
/// `inherited` (an earlier Eval), and every leaf accumulator reached. The Eval's
/// next_functions are the boundary edges reached, in input order then inherited order;
/// applying it runs the subgraph on the engine and returns their gradients.
/// Returns null when no output is relevant.
std::shared_ptr<Function> wrap(const variable_list& inputs, const variable_list& outputs,
                               const std::shared_ptr<Function>& inherited = nullptr);

/// The Eval that is grad_fn of the first output requiring grad, or null.
std::shared_ptr<Function> backward_eval(const variable_list& outputs);

}  // namespace stagejit::eval
