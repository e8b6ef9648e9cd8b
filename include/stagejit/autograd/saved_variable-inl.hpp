#pragma once
/// \file
/// Bodies of autograd/saved_variable.hpp: `SavedVariable`.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/saved_variable.hpp>
#include <stagejit/autograd/detail/autograd_impl.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/core/error.hpp>

namespace stagejit {

// ------------------------------------------------------------------ SavedVariable
STAGEJIT_FUNC SavedVariable::SavedVariable(const Variable& v, bool is_output) {
  if (!v.defined()) return;
  data_ = v.data();
  tracks_version_ = !data_.is_inference();
  if (tracks_version_) saved_version_ = data_._version();
  is_output_ = is_output;
  requires_grad_ = v.requires_grad();
  if (is_output) {
    output_ = v.impl();
    output_nr_ = v.output_nr();
  } else {
    input_ = v.impl();
  }
}

STAGEJIT_FUNC Variable SavedVariable::unpack(const std::shared_ptr<Function>& owner, std::size_t index,
                                            const char* role) const {
  if (!data_.defined()) return {};
  if (tracks_version_ && data_._version() != saved_version_) {
    throw Error(detail::str_cat(
        "one of the variables needed for gradient computation has been modified by an "
        "inplace operation: saved ", role ? role : (is_output_ ? "output" : "input"), " ", index,
        " of ", owner ? owner->name() : std::string("a function"), ", a ", data_.scalar_type(),
        " tensor of shape ", detail::autograd_impl::shape_str(data_.sizes()),
        ", is at version ", data_._version(), "; expected version ", saved_version_,
        " instead (it was modified in place after the forward saved it)"));
  }
  if (!is_output_) return Variable::from_impl(input_);
  if (auto alive = output_.lock()) return Variable::from_impl(std::move(alive));
  if (!requires_grad_ || !owner) return Variable(data_);
  return Variable(data_, Edge{owner, output_nr_});
}

STAGEJIT_FUNC void SavedVariable::reset() noexcept {
  data_.reset();
  input_.reset();
  output_.reset();
}

}  // namespace stagejit
