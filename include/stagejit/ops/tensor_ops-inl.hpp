#pragma once
/// \file
/// Bodies of ops/tensor_ops.hpp: the table entries (forward through ATen, backward formulas in
/// stagejit ops following libtorch 1.13's derivatives.yaml) and the free functions.
/// Included at the end of ops/ops-inl.hpp.
#include <stagejit/ops/ops-inl.hpp>

namespace stagejit {
namespace detail::ops_impl {

template <class Def>
void define_tensor_ops(Def& def) {
  (void)def;
}

}  // namespace detail::ops_impl
}  // namespace stagejit
