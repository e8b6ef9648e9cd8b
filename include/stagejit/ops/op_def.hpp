#pragma once
/// \file
/// The differentiable op table: one `OpDef` per `OpId`, holding its schema
/// (ops/op_schema.hpp), the forward (calls ATen on tensors and attributes) and the
/// backward formula (written with stagejit ops, so it is differentiable again and traced
/// when a trace hook is current). The IR interpreter and the closure compiler run IR
/// `Op` nodes through `def(op.id())` + `run_forward` / `apply`.
/// Attribute names follow ATen (`alpha`, `other`, `dim`, `keepdim`, `exponent`, ...);
/// each entry documents its attributes in `attributes`.

#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ops/op_schema.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace stagejit {

/// Shape, dtype and options of one op input, kept by its backward (sum_to_size, casts).
struct InputMeta {
  at::DimVector sizes;
  at::TensorOptions options;
};

/// What a backward formula gets. `inputs`/`outputs` hold the saved Variables (undefined
/// where the op does not save them), `grads` one gradient per output (undefined = zero).
struct BackwardArgs {
  const Attributes& attrs;
  const variable_list& inputs;
  const variable_list& outputs;
  const variable_list& grads;
  const std::vector<InputMeta>& input_meta;
  uint64_t needs_mask;  ///< bit i: input i needs a gradient
  bool needs(std::size_t i) const noexcept { return i < 64 && ((needs_mask >> i) & 1U); }
};

/// One op of the table: its schema (ops/op_schema.hpp: what the IR, passes and fuser
/// know of it) and what running it takes (forward, backward formula).
struct OpDef : OpSchema {
  /// Forward on ATen tensors. ATen's errors become `ShapeError` / `DtypeError` / `Error`
  /// (via `run_forward`).
  std::vector<at::Tensor> (*forward)(const std::vector<at::Tensor>& inputs,
                                     const Attributes& attrs) = nullptr;
  /// Backward formula in stagejit ops: one gradient per input (undefined = zero / none).
  variable_list (*backward)(const BackwardArgs& args) = nullptr;
};

namespace ops {

/// The op `id` (not `OpId::unknown`). Cheap: an index into the table.
const OpDef& def(OpId id);
/// The runnable op of `schema` (an `ir::Op`'s); throws `Error` ("unknown op 'x'") for an
/// interned name the table lacks.
const OpDef& def(const OpSchema& schema);
/// The op named `name`, or null.
const OpDef* find(std::string_view name) noexcept;
/// The op named `name`; throws `Error` ("unknown op 'x'") when absent.
const OpDef& get(std::string_view name);
/// Every op of the table, in `OpId` order.
const std::vector<const OpDef*>& all();

/// Runs the forward of `op` on tensors (no autograd, no trace hook). Throws, naming the
/// op, the stagejit class of an ATen error (`ShapeError` for shapes, `DtypeError` for
/// dtypes or devices, else `Error`: core/error.hpp, "ATen errors") and `Error` for a
/// wrong number of inputs or a missing or mistyped attribute.
std::vector<at::Tensor> run_forward(const OpDef& op, const std::vector<at::Tensor>& inputs,
                                    const Attributes& attrs);

/// Runs `op` on Variables: forward, then (in grad mode, when an input requires grad and
/// the op is differentiable) an `OpBackward` grad_fn for the outputs, then reports the op
/// to the current trace hook. Same errors as `run_forward`.
variable_list apply(const OpDef& op, const variable_list& inputs, const Attributes& attrs = {});

}  // namespace ops
}  // namespace stagejit
