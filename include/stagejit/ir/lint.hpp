#pragma once
/// \file
/// `ir::lint`: checks every IR invariant (docs/seed-system.md §1.6 restated for Values, plus the stage
/// and Handle rules of the multi-stage IR). Each rule has a name, used in the message:
///
/// - `use-list`: every input edge has exactly one matching Use on its value and every
///   Use matches an input slot; inputs belong to this graph.
/// - `stage`: a node's stage is >= the stage of each input.
/// - `stage-order`: node stages never decrease along the node list.
/// - `handle`: a Handle is only the last output of a HostOp or Eval, and only the last
///   input of an Eval; an Eval's last input is a Handle; graph inputs and outputs are
///   never Handles.
/// - `def-before-use`: every input is a graph input or an output of an earlier node.
/// - `unique-names`: debug names are unique in the graph.
/// - `output-groups`: one output group per stage, counts sum to the outputs, and an
///   output of group s has stage <= s; every node and input stage has a group.
/// - `arity`: Param, Constant and Undefined have no inputs and one output; Transpose and
///   Reshape have 1 input, Gemm 3; each of these has one output.
/// - `unknown-op`: every `Op` is one of the op table's (ops/op_schema.hpp); parsed text may
///   call any name, but such an op cannot run. `LintOptions::allow_unknown_ops` keeps them
///   (`stagejit-run --allow-unknown-ops`), and then nothing more is checked of them.
/// - `op-arity`: a table op has as many inputs as its schema accepts (`min_inputs` to
///   `max_inputs`; a binary op's scalar form, one input, needs its scalar attribute, e.g.
///   `other`) and as many outputs as it computes: `chunk` 1 to `chunks` (fewer when the
///   dimension is short), `split` one per listed size (1 or more for an int size),
///   `dropout` 1 or 2 (result, mask), `max_pool2d_with_indices` 2, `native_batch_norm` /
///   `native_layer_norm` / `native_group_norm` 3, every other op 1.
/// - `op-attribute`: `chunk` has an integer `chunks` >= 1; `split` an integer or integer
///   list `split_size`, no size negative.
/// - `declared-type`: for an elementwise op whose inputs all have declared tensor types,
///   every output declared as a tensor type has the broadcast sizes of the inputs, and,
///   when the op is differentiable (not `to`) and its inputs share one floating dtype,
///   that dtype. Other ops' types need the op run: `stagejit-run --stage` checks every
///   computed value against its declared type.
/// - `calling-convention`: a HostOp's convention has only `t`/`s`, as many `t` as
///   tensor inputs and as many `s` as scalars.
/// - `fusion-group`: the subgraph exists, lints, is single-stage, and its input and
///   output counts match the node's.
/// - `structure`: the graph's inputs are Param outputs in stage order and nodes in the
///   list are not Param/Return.
///
/// Throws `LintError` (an `IrError`) naming the node, the rule, and what was expected.
///
/// This header declares `lint`; the checks (`detail::Linter`) are in ir/lint-inl.hpp
/// (core/config.hpp), compiled once with the other function bodies.

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>
#include <unordered_set>

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/detail/names.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/ops/op_schema.hpp>

namespace stagejit::ir {

/// An IR invariant violation found by `lint`: `rule()` is the rule's name, `location()`
/// the source position of the offending node when it was parsed (else unknown).
class LintError : public IrError {
 public:
  LintError(std::string rule, SourceLocation loc, const std::string& message)
      : IrError(message), rule_(std::move(rule)), location_(loc) {}
  const std::string& rule() const noexcept { return rule_; }
  const SourceLocation& location() const noexcept { return location_; }

 private:
  std::string rule_;
  SourceLocation location_;
};

/// What `lint` accepts beyond the invariants every graph must keep.
struct LintOptions {
  /// Keep ops the op table does not know (rule `unknown-op`): text may name any op, but
  /// such a graph cannot run.
  bool allow_unknown_ops = false;
};

/// Checks every invariant listed in the file comment; throws LintError (an IrError)
/// naming the node and the rule at the first violation.
STAGEJIT_FUNC void lint(const Graph& graph, LintOptions options = {});

}  // namespace stagejit::ir
