#pragma once
/// \file
/// Bodies of autograd/variable.hpp: `Variable` (and `detail::shape_str` of
/// autograd/detail/autograd_impl.hpp).
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/autograd/detail/autograd_impl.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad.hpp>
#include <stagejit/core/error.hpp>

#include <algorithm>
#include <sstream>

namespace stagejit {

// ------------------------------------------------------------------ Variable
namespace detail::autograd_impl {

STAGEJIT_FUNC std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}
STAGEJIT_FUNC const at::Tensor& undefined_tensor() {
  static const at::Tensor t;
  return t;
}
STAGEJIT_FUNC const std::shared_ptr<Function>& null_function() {
  static const std::shared_ptr<Function> f;
  return f;
}
STAGEJIT_FUNC at::Tensor strip(at::Tensor data) {
  if (data.defined() && data.requires_grad()) return data.detach();
  return data;
}
}  // namespace detail::autograd_impl

STAGEJIT_FUNC Variable::Variable(at::Tensor data, bool requires_grad) {
  if (!data.defined()) {
    STAGEJIT_CHECK(!requires_grad, "Variable: an undefined tensor cannot require grad");
    return;
  }
  impl_ = std::make_shared<detail::VariableImpl>();
  impl_->data = detail::autograd_impl::strip(std::move(data));
  if (requires_grad) set_requires_grad(true);
}

STAGEJIT_FUNC Variable::Variable(at::Tensor data, Edge edge) {
  if (!data.defined()) return;
  impl_ = std::make_shared<detail::VariableImpl>();
  impl_->data = detail::autograd_impl::strip(std::move(data));
  impl_->grad_fn = std::move(edge.function);
  impl_->output_nr = edge.input_nr;
}

STAGEJIT_FUNC const at::Tensor& Variable::data() const noexcept {
  return impl_ ? impl_->data : detail::autograd_impl::undefined_tensor();
}

STAGEJIT_FUNC const std::shared_ptr<Function>& Variable::grad_fn() const noexcept {
  return impl_ ? impl_->grad_fn : detail::autograd_impl::null_function();
}

STAGEJIT_FUNC void Variable::set_requires_grad(bool requires_grad) {
  STAGEJIT_CHECK(impl_, "set_requires_grad on an undefined Variable");
  STAGEJIT_CHECK(is_leaf(), "set_requires_grad: only leaves can be marked (this Variable has "
                 "grad_fn '", impl_->grad_fn->name(), "')");
  STAGEJIT_CHECK(!requires_grad || at::isFloatingType(impl_->data.scalar_type()) ||
                     at::isComplexType(impl_->data.scalar_type()),
                 "only floating point Variables can require grad (got dtype ",
                 impl_->data.scalar_type(), ")");
  impl_->requires_grad = requires_grad;
}

STAGEJIT_FUNC Edge Variable::gradient_edge() const {
  if (!impl_) return {};
  if (impl_->grad_fn) return Edge{impl_->grad_fn, impl_->output_nr};
  if (!impl_->requires_grad) return {};
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto acc = impl_->grad_accumulator.lock();
  if (!acc) {
    acc = make_function(AccumulateGrad{impl_}, {}, 1);
    impl_->grad_accumulator = acc;
  }
  return Edge{acc, 0};
}

STAGEJIT_FUNC void Variable::set_gradient_edge(Edge edge) const {
  STAGEJIT_CHECK(impl_, "set_gradient_edge on an undefined Variable");
  impl_->grad_fn = std::move(edge.function);
  impl_->output_nr = edge.input_nr;
}

STAGEJIT_FUNC Variable Variable::grad() const {
  if (!impl_) return {};
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return Variable::from_impl(impl_->grad);
}

STAGEJIT_FUNC void Variable::set_grad(const Variable& grad) const {
  STAGEJIT_CHECK(impl_, "set_grad on an undefined Variable");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->grad = grad.impl();
}

STAGEJIT_FUNC uint64_t Variable::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const {
  STAGEJIT_CHECK(impl_, "register_post_accumulate_grad_hook on an undefined Variable");
  STAGEJIT_CHECK(is_leaf(), "register_post_accumulate_grad_hook: only leaves accumulate "
                 "gradients (this Variable has grad_fn '", impl_->grad_fn->name(), "')");
  STAGEJIT_CHECK(impl_->requires_grad, "register_post_accumulate_grad_hook: the leaf does not "
                 "require grad (no gradient is ever accumulated into it)");
  STAGEJIT_CHECK(hook, "register_post_accumulate_grad_hook: empty hook");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const uint64_t handle = impl_->next_hook_handle++;
  impl_->post_accumulate_hooks.emplace_back(
      handle, std::make_shared<const PostAccumulateGradHook>(std::move(hook)));
  return handle;
}

STAGEJIT_FUNC bool Variable::remove_post_accumulate_grad_hook(uint64_t handle) const {
  if (!impl_) return false;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& hooks = impl_->post_accumulate_hooks;
  auto it = std::find_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.first == handle; });
  if (it == hooks.end()) return false;
  hooks.erase(it);
  return true;
}

STAGEJIT_FUNC void Variable::backward(const Variable& grad_output, bool create_graph) const {
  stagejit::backward({*this}, {grad_output}, create_graph);
}

STAGEJIT_FUNC detail::VariableImpl::~VariableImpl() { release_function(grad_fn); }

}  // namespace stagejit
