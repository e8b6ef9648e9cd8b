#pragma once
/// \file
/// `Overloaded`: a visitor made of lambdas, one per alternative, for `std::visit`. Every
/// visitor over a closed kind set (`ir::NodeKind`, `FunctionKind`, `CallbackPolicy`) is
/// written as such an overload set without a catch-all, so adding a kind is a compile
/// error at every visitor until it is handled.

namespace stagejit {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

}  // namespace stagejit
