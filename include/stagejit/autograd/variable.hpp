#pragma once
/// \file
/// `Variable`: an ATen tensor plus autograd metadata (requires_grad, the grad_fn edge,
/// the accumulated grad of a leaf). Variables share their metadata: copies of a Variable
/// are the same variable (`impl_id()` is equal). docs/api.md, "Variable"; the design follows
/// libtorch's `torch::autograd::Variable` (pre-1.0: a wrapper holding the grad_fn edge).

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace stagejit {

struct Function;
class Variable;
using variable_list = std::vector<Variable>;
/// A function traced by `trace` and compiled by `compile`.
using traced_fn = std::function<variable_list(const variable_list&)>;

/// An edge of the backward graph: gradient flows into input slot `input_nr` of `function`.
/// A null `function` means "no gradient needed here".
struct Edge {
  std::shared_ptr<Function> function;
  uint32_t input_nr = 0;
  /// Whether the edge points to a function.
  bool is_valid() const noexcept { return function != nullptr; }
  friend bool operator==(const Edge& a, const Edge& b) noexcept {
    return a.function == b.function && a.input_nr == b.input_nr;
  }
};

/// A hook run after a backward accumulated a gradient into a leaf (the leaf is passed;
/// its `grad()` holds the new sum). See `Variable::register_post_accumulate_grad_hook`.
using PostAccumulateGradHook = std::function<void(const Variable& leaf)>;

namespace detail {
/// The shared state of a Variable. Internal: use `Variable`.
struct VariableImpl : std::enable_shared_from_this<VariableImpl> {
  at::Tensor data;
  bool requires_grad = false;             ///< for leaves; non-leaves require grad via grad_fn
  std::shared_ptr<Function> grad_fn;      ///< null for leaves
  uint32_t output_nr = 0;                 ///< which output of grad_fn this is
  std::mutex mutex;                       ///< guards grad and grad_accumulator
  std::shared_ptr<VariableImpl> grad;     ///< accumulated gradient (leaves)
  std::weak_ptr<Function> grad_accumulator;
  /// Post-accumulate-grad hooks with their handles, in registration order (guarded by
  /// `mutex`).
  std::vector<std::pair<uint64_t, std::shared_ptr<const PostAccumulateGradHook>>> post_accumulate_hooks;
  uint64_t next_hook_handle = 1;
  /// Releases `grad_fn` through `detail::release_function` (no recursion along a chain).
  ~VariableImpl();
};
}  // namespace detail

/// A tensor that autograd tracks. Undefined when default-constructed.
/// The wrapped `at::Tensor` never requires grad in libtorch's sense (stagejit does its own
/// autograd); a tensor that does is detached on construction.
class Variable {
 public:
  /// An undefined Variable (`defined() == false`).
  Variable() = default;
  /// Wraps `data` (undefined data gives an undefined Variable); a leaf.
  /// Throws `Error` if `requires_grad` is set on a non-floating-point tensor.
  explicit Variable(at::Tensor data, bool requires_grad = false);
  /// A non-leaf: wraps `data` with gradient edge `edge` (requires grad iff edge is valid).
  Variable(at::Tensor data, Edge edge);

  /// The tensor (an undefined tensor for an undefined Variable).
  const at::Tensor& data() const noexcept;
  bool defined() const noexcept { return impl_ != nullptr; }
  /// True for a leaf marked requires_grad or for any result of a recorded op.
  bool requires_grad() const noexcept {
    return impl_ && (impl_->requires_grad || impl_->grad_fn != nullptr);
  }
  /// Marks a leaf as requiring grad. Throws `Error` on a non-leaf or a non-floating tensor.
  void set_requires_grad(bool requires_grad);
  /// True when the Variable has no grad_fn.
  bool is_leaf() const noexcept { return !impl_ || impl_->grad_fn == nullptr; }
  /// The function that computes this Variable's gradient contribution, or null (leaves).
  const std::shared_ptr<Function>& grad_fn() const noexcept;
  /// Which output of `grad_fn()` this Variable is.
  uint32_t output_nr() const noexcept { return impl_ ? impl_->output_nr : 0; }
  /// The edge gradients of this Variable flow into: (grad_fn, output_nr) for non-leaves,
  /// the leaf's AccumulateGrad (created on first use) for leaves requiring grad, else null.
  Edge gradient_edge() const;
  /// Rebases the gradient edge (used by `Eval::wrap` and the tracer). A valid edge makes
  /// the Variable a non-leaf. Throws `Error` on an undefined Variable.
  void set_gradient_edge(Edge edge) const;
  /// The accumulated gradient of a leaf (undefined until a backward reached it).
  Variable grad() const;
  /// Replaces the accumulated gradient (an undefined Variable clears it).
  void set_grad(const Variable& grad) const;
  /// Registers `hook` to run each time a backward has accumulated a gradient into this
  /// leaf's `grad()` (after the sum, on the engine thread that ran the leaf's
  /// AccumulateGrad, possibly while the rest of the backward, a compiled stage included,
  /// still runs: Note [Post-accumulate-grad hooks] in autograd/function-inl.hpp). Hooks run
  /// in registration order; an exception from one fails the backward like an error of the
  /// AccumulateGrad. Not run by `grad()` (which accumulates nothing). Follows libtorch's
  /// `Tensor::register_post_accumulate_grad_hook`. Returns a handle for
  /// `remove_post_accumulate_grad_hook`. Throws `Error` on an undefined Variable, a
  /// non-leaf, a leaf that does not require grad or an empty hook.
  uint64_t register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const;
  /// Removes the hook registered under `handle`; false when there is none (already removed).
  bool remove_post_accumulate_grad_hook(uint64_t handle) const;
  /// Same as `stagejit::backward({*this}, {grad_output}, create_graph)`.
  void backward(const Variable& grad_output = {}, bool create_graph = false) const;
  /// A new leaf sharing the tensor, without grad_fn and not requiring grad.
  Variable detach() const { return Variable(data()); }
  /// Stable identity of the shared metadata (equal for copies); null when undefined.
  const void* impl_id() const noexcept { return impl_.get(); }

  // Tensor conveniences.
  at::IntArrayRef sizes() const { return data().sizes(); }
  int64_t size(int64_t dim) const { return data().size(dim); }
  int64_t dim() const { return data().dim(); }
  int64_t numel() const { return data().numel(); }
  at::ScalarType scalar_type() const { return data().scalar_type(); }
  at::TensorOptions options() const { return data().options(); }

  /// Internal: the shared metadata.
  const std::shared_ptr<detail::VariableImpl>& impl() const noexcept { return impl_; }
  /// Internal: wraps existing metadata.
  static Variable from_impl(std::shared_ptr<detail::VariableImpl> impl) {
    Variable v;
    v.impl_ = std::move(impl);
    return v;
  }

 private:
  std::shared_ptr<detail::VariableImpl> impl_;
};

}  // namespace stagejit
