#pragma once
/// \file
/// `SavedVariable`: a Variable kept by a backward function for its formula. An output
/// saved by its own grad_fn keeps only the tensor and a weak reference to the Variable, so
/// the grad_fn does not own itself (no reference cycle); `unpack(owner)` rebuilds it with
/// edge (owner, output_nr). Follows libtorch's SavedVariable.

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/autograd/variable.hpp>

#include <memory>

namespace stagejit {

class SavedVariable {
 public:
  SavedVariable() = default;
  /// Saves `v`; `is_output` says `v` is an output of the function that saves it.
  SavedVariable(const Variable& v, bool is_output);
  /// The saved Variable. For saved outputs: the original Variable while it is alive,
  /// else a new Variable sharing the tensor with gradient edge (owner, output_nr).
  Variable unpack(const std::shared_ptr<Function>& owner) const;
  bool defined() const noexcept { return data_.defined(); }
  /// Drops the saved tensor (after a backward with keep_graph = false).
  void reset() noexcept;

 private:
  at::Tensor data_;
  std::shared_ptr<detail::VariableImpl> input_;   // saved input: the Variable itself
  std::weak_ptr<detail::VariableImpl> output_;    // saved output: weak
  uint32_t output_nr_ = 0;
  bool is_output_ = false;
  bool requires_grad_ = false;
};

}  // namespace stagejit
#include <stagejit/core/detail/bodies_end.hpp>
