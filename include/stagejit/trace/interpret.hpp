#pragma once
/// \file
/// The reference interpreter: evaluates a traced multi-stage graph node by node, in the
/// graph's topological order, eagerly through stagejit's op table (ATen calls with
/// stagejit autograd bookkeeping), keeping the values of earlier stages. Handles are the
/// opaque backward Functions made when a HostOp runs; an `Eval` node applies the
/// Function its Handle input holds. It is the simple oracle that the closure compiler
/// and the fuser are checked against; it is not fast.

#include <stagejit/core/config.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/trace/host_op_payload.hpp>

#include <memory>
#include <unordered_map>
#include <variant>
#include <vector>

namespace stagejit {

/// Evaluates every stage of `graph` and returns all graph outputs, stage 0 first.
///
/// `inputs` gives one Variable per graph input (all stages, in `graph.inputs()` order);
/// their requires_grad flags matter as they did when traced (they decide which opaque
/// backwards exist and which gradients an `Eval` returns): pass the traced flags, e.g.
/// `Trace::flags(s).inputs`. Tensor values must have the traced dtypes; shapes may
/// differ where the graph does not bake them in.
///
/// Throws `CompileError` naming the node for: a graph input count mismatch, a HostOp
/// without the tracer's payload (parsed text cannot be run), an Eval whose Handle holds
/// no Function, an Eval returning another number of gradients than the node has outputs,
/// FusionGroup / Transpose / Reshape / Gemm kinds it does not interpret; op errors
/// (`ShapeError`, `Error`) propagate.
STAGEJIT_FUNC variable_list interpret(const ir::Graph& graph, const variable_list& inputs);

}  // namespace stagejit
