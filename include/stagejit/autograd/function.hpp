#pragma once
/// \file
/// `Function`: a node of the backward graph (and of compiled closures). Its behaviour is a
/// closed set of kinds held in a `std::variant` (docs/design.md, "Types dispatched through
/// variants"); `next_functions` are its outgoing edges. Eager kinds: AccumulateGrad,
/// OpBackward, HostBackward, Eval (+ EvalOutput), Error. Closure kinds (filled by the
/// closure compiler; docs/seed-system.md §3.2): Replicate, InputPlaceholder, PrevStageInput,
/// EvalPlaceholder, Output, EmitNull, OpCall, AtenCall, HostCall, WrapConstant,
/// ConstantFactory, FusedKernel and ClosureFunction (type-erased closure).

#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/saved_variable.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ops/op_def.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace stagejit {

class HostContext;

/// Adds incoming gradients into a leaf's `grad()` (thread-safe).
struct AccumulateGrad { std::shared_ptr<detail::VariableImpl> variable; };
/// One table op's backward formula with its saved variables.
struct OpBackward {
  const OpDef* op = nullptr;
  Attributes attrs;
  std::vector<SavedVariable> saved_inputs;   ///< indexed like the op's inputs
  std::vector<SavedVariable> saved_outputs;  ///< empty unless op->saves_outputs
  std::vector<InputMeta> input_meta;
  bool released = false;
};
/// The backward of a HostFunction: calls the user's `backward(ctx, grads)`.
struct HostBackward {
  std::string name;
  std::shared_ptr<HostContext> ctx;
  std::function<variable_list(HostContext*, variable_list)> backward;
  std::vector<InputMeta> input_meta;  ///< one per tensor input
  bool traceable = false;  ///< its ops are traced one by one (not an opaque unit)
  /// One letter per forward argument, `t` tensor or `s` scalar: `backward` may return one
  /// gradient per tensor input or, as libtorch's `Function<T>` and the seed do, one per
  /// forward argument with the scalar slots undefined.
  std::string calling_convention;
};
/// Throws `stagejit::Error(message)` when applied (e.g. "compiled only for 1 derivatives").
struct ErrorFunction { std::string message; };
/// A placeholder at the boundary of an Eval's subgraph, standing for `next_edge`. Its
/// input is captured by the Eval's pre-callback; it has no next_functions.
struct EvalOutput { Edge next_edge; };
/// Runs a detached autograd subgraph as one Function (docs/seed-system.md §2.3): `roots` are the
/// subgraph's output-side edges, `placeholders` the EvalOutput functions in the order of
/// this Function's next_functions. See `autograd/eval.hpp`.
struct Eval {
  std::vector<Edge> roots;
  std::vector<std::shared_ptr<Function>> placeholders;
};

// Closure kinds (docs/seed-system.md §3.2). They are filled by the closure compiler.
/// Returns its one input once per next_function.
struct Replicate {};
/// Identity; root of a stage input.
struct InputPlaceholder {};
/// Like Replicate; root feeding a value captured at an earlier stage.
struct PrevStageInput {};
/// Identity; an Eval node whose work a RunHandle post-callback does.
struct EvalPlaceholder {};
/// The stage's Return: must be stopped by a CaptureOutputs pre-callback (throws otherwise).
struct Output {};
/// Returns one undefined Variable.
struct EmitNull {};
/// Runs one table op on its inputs (an IR `Op` node). A nullary op (`zeros`) is
/// triggered by the ConstantFactory like a constant: it takes that one undefined input
/// and calls the op without inputs.
struct OpCall {
  const OpDef* op = nullptr;
  Attributes attrs;
};
/// Runs an ATen computation that is not a table op (IR Transpose / Reshape / Gemm nodes:
/// their meaning is in ir/node_semantics.hpp). `name` is the node kind's name.
struct AtenCall {
  std::string_view name;
  std::function<variable_list(const variable_list&)> fn;
};
/// Calls a host function (HostOp node) as a unit.
struct HostCall { std::string name; std::function<variable_list(const variable_list&)> call; };
/// Needs one undefined input; returns a fresh non-grad Variable holding a clone of `value`.
struct WrapConstant { at::Tensor value; };
/// Needs one undefined input; returns one undefined Variable per next_function.
struct ConstantFactory {};
/// Runs a fused kernel.
struct FusedKernel { std::string name; std::function<variable_list(const variable_list&)> run; };
/// Interface of a type-erased closure (the closure compiler's stage closures).
class ClosureImpl {
 public:
  virtual ~ClosureImpl() = default;
  virtual variable_list apply(variable_list inputs) = 0;
  /// Applied as a Function: `needed[i]` says whether output i is needed by the running
  /// backward (engine::should_compute_output). By default every output is computed.
  virtual variable_list apply(variable_list inputs, const std::vector<char>& needed) {
    (void)needed;
    return apply(std::move(inputs));
  }
  /// As above; `early` (empty unless the engine applies this closure) delivers an output
  /// before `apply` returns (Note [Early outputs] in autograd/engine.hpp). By default
  /// nothing is delivered early.
  virtual variable_list apply(variable_list inputs, const std::vector<char>& needed,
                              const OutputSink& early) {
    (void)early;
    return apply(std::move(inputs), needed);
  }
  virtual std::string_view name() const = 0;
  /// True when the closure's own tensors come from `memory::HostCachingAllocator`
  /// (`CompileOptions::cache_host_memory`): the engine then also sums the gradients
  /// several producers send to one of its inputs from that cache, as the closure's own
  /// work would (the sums belong to it; from glibc, an 800 KiB sum per call is a fresh
  /// mapping faulted in page by page).
  virtual bool caches_host_memory() const { return false; }
  /// Note [Joint backward] (closure/autograd_closure.hpp): the Functions whose calls this
  /// closure can run together with its own as one unit of a backward, in its order, its
  /// own Function among them, null where one is gone. Empty (the default): none. The
  /// engine joins those a graph task reaches (none reaching another) into one Function
  /// whose inputs and next_functions are the members', and calls `apply_joint`.
  virtual std::vector<std::shared_ptr<Function>> joint_members() const { return {}; }
  /// Note [Joint siblings] (passes/joint_siblings.hpp): how many *siblings* the joint
  /// unit can take besides `joint_members()`: Functions of other closures with the same
  /// `joint_sibling_key()`, whose `joint_members()` has as many entries and themselves
  /// last. 0 (the default): none.
  virtual std::size_t joint_sibling_capacity() const { return 0; }
  /// Note [Joint siblings]: closures whose keys are equal (and not null) are siblings.
  virtual const void* joint_sibling_key() const { return nullptr; }
  /// Runs the members of `joint_members()`, then the siblings the engine joined, together:
  /// `members` those Functions (null where one is gone), `inputs[m]` the incoming
  /// gradients of member m (empty: not part of the backward), `needed[m]` which of its
  /// outputs the backward needs. Returns each member's outputs (sized as its
  /// next_functions), or nullopt when it cannot (the engine then applies the members one
  /// by one).
  virtual std::optional<std::vector<variable_list>> apply_joint(std::vector<variable_list> inputs,
                                                                const std::vector<std::vector<char>>& needed,
                                                                const std::vector<std::shared_ptr<Function>>& members) {
    (void)inputs;
    (void)needed;
    (void)members;
    return std::nullopt;
  }
};
struct ClosureFunction { std::shared_ptr<ClosureImpl> impl; };

using FunctionKind =
    std::variant<AccumulateGrad, OpBackward, HostBackward, ErrorFunction, Eval, EvalOutput,
                 Replicate, InputPlaceholder, PrevStageInput, EvalPlaceholder, Output,
                 EmitNull, OpCall, AtenCall, HostCall, WrapConstant, ConstantFactory,
                 FusedKernel, ClosureFunction>;

/// A node of the backward graph. Apply it with `apply` (the engine does).
struct Function : std::enable_shared_from_this<Function> {
  FunctionKind kind;
  std::vector<Edge> next_functions;
  uint32_t num_inputs = 0;
  uint64_t sequence_nr;
  /// Where it comes from, for messages: the IR node it runs, as `--print` shows it, with
  /// the line and column it was read from (set by the closure compiler for graphs read
  /// from text; empty otherwise). The engine names it when the Function throws.
  std::string origin;

  Function(FunctionKind k, std::vector<Edge> next, uint32_t inputs)
      : kind(std::move(k)), next_functions(std::move(next)), num_inputs(inputs),
        sequence_nr(next_sequence_nr()) {}
  /// Hands the Functions it owns (next_functions, and those an Eval or EvalOutput
  /// holds) to `detail::release_function`, so a chain of any length is freed
  /// without recursion (Note [Iterative release] in autograd/function-inl.hpp).
  ~Function();
  Function(const Function&) = delete;
  Function& operator=(const Function&) = delete;

  /// A readable name: "MulBackward", "AccumulateGrad", "Eval", the host function's name.
  std::string name() const;
  /// Runs this Function on its input gradients; returns one output per next_function.
  /// Throws what the kind throws (`Error` subclasses for user errors).
  variable_list apply(variable_list inputs);
  /// Drops saved variables (after a backward with keep_graph = false).
  void release_variables();
  template <class K>
  bool is() const noexcept { return std::holds_alternative<K>(kind); }

  static uint64_t next_sequence_nr() noexcept {
    static std::atomic<uint64_t> counter{0};
    return counter.fetch_add(1, std::memory_order_relaxed);
  }
};

namespace detail {
/// Drops `fn` (left null). When this frees the Function, the Functions it owns are freed
/// one after the other from a worklist instead of from inside its destructor, as
/// libtorch's `deleteNode` (torch/csrc/autograd/function.cpp) does: a chain of 10^6
/// Functions is freed with a bounded stack (Note [Iterative release]).
void release_function(std::shared_ptr<Function>& fn) noexcept;
}  // namespace detail

/// Makes a Function of kind `k`.
inline std::shared_ptr<Function> make_function(FunctionKind k, std::vector<Edge> next,
                                               uint32_t num_inputs) {
  return std::make_shared<Function>(std::move(k), std::move(next), num_inputs);
}

}  // namespace stagejit
