#pragma once
/// \file
/// `Overloaded`: a visitor made of lambdas, one per alternative, for `std::visit`. Every
/// visitor over a closed kind set (`ir::NodeKind`, `FunctionKind`, `CallbackPolicy`) is
/// written as such an overload set without a catch-all, so adding a kind is a compile
/// error at every visitor until it is handled.

#include <stagejit/core/detail/bodies_begin.hpp>
namespace stagejit {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

}  // namespace stagejit
#include <stagejit/core/detail/bodies_end.hpp>
