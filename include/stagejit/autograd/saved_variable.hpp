#pragma once
/// \file
/// `SavedVariable`: a Variable kept by a backward function for its formula. An output
/// saved by its own grad_fn keeps only the tensor and a weak reference to the Variable, so
/// the grad_fn does not own itself (no reference cycle); `unpack(owner)` rebuilds it with
/// edge (owner, output_nr). Follows libtorch's SavedVariable, including its check that a
/// saved tensor was not modified in place before the backward uses it: the tensor's
/// version counter (`at::Tensor::_version()`, bumped by every in-place ATen op on it or
/// a view of it) is recorded when saved and compared on unpack.

#include <stagejit/autograd/variable.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace stagejit {

class SavedVariable {
 public:
  SavedVariable() = default;
  /// Saves `v`; `is_output` says `v` is an output of the function that saves it.
  SavedVariable(const Variable& v, bool is_output);
  /// The saved Variable. For saved outputs: the original Variable while it is alive,
  /// else a new Variable sharing the tensor with gradient edge (owner, output_nr).
  /// Throws `Error` when the tensor was modified in place since it was saved (its version
  /// moved), naming `owner`'s function, the saved variable (`role` and `index`: "input 1";
  /// `role` null: "input" or "output" as saved) and both versions, as libtorch does.
  Variable unpack(const std::shared_ptr<Function>& owner, std::size_t index = 0,
                  const char* role = nullptr) const;
  bool defined() const noexcept { return data_.defined(); }
  /// Drops the saved tensor (after a backward with keep_graph = false).
  void reset() noexcept;

 private:
  at::Tensor data_;
  std::shared_ptr<detail::VariableImpl> input_;   // saved input: the Variable itself
  std::weak_ptr<detail::VariableImpl> output_;    // saved output: weak
  uint32_t output_nr_ = 0;
  uint32_t saved_version_ = 0;
  bool is_output_ = false;
  bool requires_grad_ = false;
  bool tracks_version_ = false;  // inference tensors have no version counter
};

}  // namespace stagejit
