#pragma once
/// \file
/// The multi-stage tracer (docs/seed-system.md §2; docs/api.md "Tracing").
///
/// `trace(fn, inputs, {.derivatives = k})` runs `fn` once on fresh leaf Variables that
/// share the inputs' tensors and records every op into one `ir::Graph` at stage 0 (the
/// inputs become stage-0 Params). Then, for s = 1..k, it runs the backward of stage s-1:
/// one new stage-s Param per stage s-1 output that requires grad (its grad output, filled
/// with ones, requiring grad when s < k), and gradients of every earlier-stage input that
/// requires grad, in graph-input order, computed with `create_graph = (s < k)`. Every op
/// the backward formulas run is recorded at stage s; ops of stage s refer directly to
/// values of earlier stages (cross-stage edges). The gradients are stage s's outputs
/// (undefined gradients become `Undefined` nodes).
///
/// Values that enter the trace without being inputs (tensors made inside `fn`) become
/// `Constant` nodes holding a clone taken when first seen. A non-traceable host function
/// becomes one `HostOp` node whose last output is a Handle; when its backward runs at the
/// next stage the tracer records an `Eval` node consuming that Handle, itself with a
/// Handle output when its own backward is opaque and a further stage is traced.
///
/// Note [Cross-stage gradients] (`TraceOptions::cross_stage_gradients`, k >= 2)
/// Without it stage s+1 differentiates stage s back to the graph inputs: the values of
/// earlier stages that stage s reads (the forward's activations, saved for the backward)
/// are differentiated again through the ops that made them, inside stage s+1. A backward
/// through stages 1..k (the loss of a physics-informed network, whose gradient in the
/// weights runs stages 3, 2 and 1) then differentiates the forward k times where
/// libtorch's one graph sums the incoming gradients at each activation and differentiates
/// it once. With it, as libtorch's saved variables are gradient edges:
/// - while tracing stage s (1 <= s < k), an op reading a value v of an earlier stage j
///   that requires grad gets a *boundary leaf* of (v, s) as the gradient edge of that
///   input; stage s+1 captures the boundary leaves, so it stops there and returns v's
///   gradient as an extra output (`Trace::feeds`);
/// - stage j+1 (1 <= j+1 < k) has an extra gradient input for each value of stage j that
///   requires grad, flowing into the value as a grad output flows into an output; a
///   compiled call routes each cross-stage gradient to the extra input of the call of
///   stage j+1 of its chain, whose backward sums it with the rest;
/// - a value that is a graph input is not differentiated further anyway: its boundary
///   gradient is added to the stage's regular output for that input;
/// - the extra inputs no later stage feeds are symbolic zeros (`passes::propagate_zeros`)
///   and removed, with the regular outputs that are gradients of them and, in the next
///   stage, the inputs that are gradients of those outputs.
/// The stage outputs are then parts of the gradients, not the gradients: what autograd
/// returns through the compiled calls is the same, what `run_stages` returns per stage
/// is not. A value whose gradient has nowhere to go (an earlier-stage value read through
/// an opaque backward) makes `trace` trace again without cutting.
///
/// Tracing is thread-local: the hook is installed on the calling thread and the engine
/// carries it to the thread running each backward function (the backward stages run
/// single-threaded so the recorded order is deterministic). Ops run elsewhere are not
/// affected and pay one thread-local pointer check.

#include <stagejit/core/config.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <ostream>
#include <vector>

namespace stagejit {

/// How many backward stages `trace` records after the forward.
struct TraceOptions {
  int derivatives = 0;
  /// Note [Cross-stage gradients]: with two or more derivatives, a backward stage stops
  /// at the values of earlier stages it reads and returns their gradients, which flow
  /// into the stage that differentiates their producers. Off (the default, the seed's
  /// trace): each stage differentiates back through every earlier stage on its own, and
  /// its outputs are the whole gradients of the earlier inputs. `compile` passes
  /// `CompileOptions::cross_stage_gradients`: through autograd the results are the same.
  bool cross_stage_gradients = false;
  /// Note [Joint stage] (ir/graph.hpp), k >= 2, without cross-stage gradients: after
  /// stage k, record stage k + 1, the backward of the outputs of stages 0..k-1 together
  /// (one gradient input per input of stages 1..k, in that order; the outputs are the
  /// gradients stage k returns, `gradient_of(k + 1) == gradient_of(k)`). A compiled call
  /// of stage k runs it in place of the calls of stages 1..k of its chain that one
  /// backward reaches (closure/autograd_closure.hpp, Note [Joint backward]). Not recorded
  /// when the graph holds an opaque host function.
  bool joint_backward = false;
};

/// A stage input named by stage and position among that stage's inputs.
struct StageInputRef {
  std::size_t stage = 0;
  std::size_t index = 0;
  friend bool operator==(const StageInputRef&, const StageInputRef&) = default;
};

class Trace;
namespace detail {
STAGEJIT_FUNC Trace trace_stages(const traced_fn& fn, const variable_list& inputs, std::size_t k, bool cut,
                                 bool joint);
}

/// What the trace saw of one Variable (docs/seed-system.md §2.1 VariableFlags without `volatile`).
struct VariableFlags {
  bool defined = false;
  bool requires_grad = false;
  static VariableFlags of(const Variable& v) { return {v.defined(), v.requires_grad()}; }
  /// True when `v` has the same flags (the closure compiler's input check).
  bool matches(const Variable& v) const { return of(v) == *this; }
  friend bool operator==(const VariableFlags&, const VariableFlags&) = default;
  /// Prints `{defined, requires_grad}` as e.g. `defined+rg`, `defined`, `undefined`.
  friend std::ostream& operator<<(std::ostream& os, const VariableFlags& f) {
    return os << (f.defined ? "defined" : "undefined") << (f.requires_grad ? "+rg" : "");
  }
};

/// Per stage: flags of the stage's inputs (stage 0: the traced inputs; s >= 1: the grad
/// outputs fed to it) and of its outputs (docs/seed-system.md §2.5).
struct StageFlags {
  std::vector<VariableFlags> inputs;
  std::vector<VariableFlags> outputs;
};

/// The result of `trace`: the graph, the eager results of each stage and the per-stage
/// bookkeeping the closure compiler needs.
class Trace {
 public:
  /// The recorded multi-stage graph (lints).
  const std::shared_ptr<ir::Graph>& graph() const noexcept { return graph_; }
  /// The stage-0 outputs, computed eagerly while tracing. Throws Error after
  /// `drop_eager_results`.
  const variable_list& outputs() const { return stage_outputs(0); }
  /// The outputs of stage `s` (the gradients it returned while tracing). Throws Error
  /// after `drop_eager_results`.
  const variable_list& stage_outputs(std::size_t s) const {
    check_eager("stage_outputs");
    return stage_outputs_.at(s);
  }
  /// The inputs fed to stage `s` while tracing (stage 0: the traced leaves). Throws Error
  /// after `drop_eager_results`.
  const variable_list& stage_inputs(std::size_t s) const {
    check_eager("stage_inputs");
    return stage_inputs_.at(s);
  }
  /// Number of stages (derivatives + 1, and the joint stage when there is one).
  std::size_t num_stages() const noexcept { return flags_.size(); }
  /// The joint stage (`TraceOptions::joint_backward`, Note [Joint stage]), or 0.
  std::size_t joint_stage() const noexcept { return graph_ ? graph_->joint_stage() : 0; }
  /// Input and output flags of stage `s` (docs/seed-system.md §2.5).
  const StageFlags& flags(std::size_t s) const { return flags_.at(s); }
  /// For s >= 1: the autograd edges stage s's outputs flow into at trace time (the
  /// gradient edges of the earlier-stage inputs they are gradients of), aligned with the
  /// stage's outputs. Empty for stage 0 (docs/seed-system.md §2.5).
  /// Throws Error after `drop_eager_results`.
  const std::vector<Edge>& output_edges(std::size_t s) const {
    check_eager("output_edges");
    return output_edges_.at(s);
  }
  /// For s >= 1: the index in `graph()->inputs()` of the input each output of stage s is
  /// the gradient of.
  const std::vector<std::size_t>& gradient_of(std::size_t s) const { return gradient_of_.at(s); }
  /// For s >= 1: the outputs of stage s after the `gradient_of(s).size()` regular ones are
  /// gradients of earlier-stage values this stage's backward stopped at (Note
  /// [Cross-stage gradients]); each feeds the gradient input named here, of the stage that
  /// differentiates the value's producer. Empty without cross-stage gradients.
  const std::vector<StageInputRef>& feeds(std::size_t s) const { return feeds_.at(s); }

  /// Frees the eager results: the stage outputs and inputs and the output edges, i.e.
  /// the autograd graph the trace recorded with every tensor it saved (a few hundred
  /// bytes per traced op). Keeps the graph, the flags and `gradient_of`, all that the
  /// closure compiler reads: for a caller that keeps a Trace (or its graph) around.
  /// `compile()` does not call it before its passes: with glibc's malloc, freeing
  /// thousands of small autograd records just before the passes made malloc place the
  /// new IR in the holes they left, and `clone` and the fuser ran 2-4x slower on a
  /// 1 000-op chain (bench/closure.md).
  void drop_eager_results() noexcept {
    stage_outputs_ = {};
    stage_inputs_ = {};
    output_edges_ = {};
    eager_dropped_ = true;
  }
  /// True after `drop_eager_results`.
  bool eager_results_dropped() const noexcept { return eager_dropped_; }

 private:
  void check_eager(const char* what) const {
    STAGEJIT_CHECK(!eager_dropped_, "Trace::", what, ": the eager results were dropped "
                   "(drop_eager_results)");
  }
  friend Trace trace(const traced_fn&, const variable_list&, TraceOptions);
  friend Trace detail::trace_stages(const traced_fn&, const variable_list&, std::size_t, bool, bool);
  std::shared_ptr<ir::Graph> graph_;
  std::vector<variable_list> stage_outputs_;
  std::vector<variable_list> stage_inputs_;
  std::vector<StageFlags> flags_;
  std::vector<std::vector<Edge>> output_edges_;
  std::vector<std::vector<std::size_t>> gradient_of_;
  std::vector<std::vector<StageInputRef>> feeds_;
  bool eager_dropped_ = false;
};

/// Traces `fn` on `inputs` with `options.derivatives` backward stages (see the file
/// comment). Throws `TraceError` when an output of `fn` has no data dependence on the
/// traced values, when `fn` returns no outputs, when an opaque backward runs whose
/// forward was not traced, and `Error` when `options.derivatives` is negative. Errors
/// thrown by `fn` propagate unchanged; the thread's hook is restored in every case.
STAGEJIT_FUNC Trace trace(const traced_fn& fn, const variable_list& inputs, TraceOptions options = {});

}  // namespace stagejit

#include <stagejit/trace/detail/tracer_impl.hpp>
