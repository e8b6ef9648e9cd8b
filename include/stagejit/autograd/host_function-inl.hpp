#pragma once
/// \file
/// Bodies of autograd/host_function.hpp: `HostContext`, `detail::finish_host_call` and
/// the backward of a host function (`HostBackward`'s apply).
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/host_function.hpp>
#include <stagejit/autograd/detail/autograd_impl.hpp>
#include <stagejit/autograd/eval.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ops/ops.hpp>

#include <ATen/ExpandUtils.h>

namespace stagejit {

// ------------------------------------------------------------------ host functions
STAGEJIT_FUNC variable_list HostContext::get_saved_variables() const {
  if (!finalized_) return to_save_;
  auto owner = owner_.lock();
  variable_list out;
  out.reserve(saved_.size());
  for (std::size_t i = 0; i < saved_.size(); ++i) out.push_back(saved_[i].unpack(owner, i, "variable"));
  return out;
}

STAGEJIT_FUNC void HostContext::finalize(const variable_list& outputs, const std::shared_ptr<Function>& owner) {
  owner_ = owner;
  saved_.clear();
  for (const auto& v : to_save_) {
    bool is_output = false;
    for (const auto& o : outputs) is_output = is_output || (v.defined() && o.impl_id() == v.impl_id());
    saved_.emplace_back(v, is_output && owner != nullptr);
  }
  to_save_.clear();
  finalized_ = true;
}

namespace detail {

STAGEJIT_FUNC std::shared_ptr<Function> finish_host_call(
    const std::string& name, const std::shared_ptr<HostContext>& ctx,
    const variable_list& inputs, variable_list& outputs,
    std::function<variable_list(HostContext*, variable_list)> backward, bool traceable,
    const std::string& calling_convention, const std::vector<Scalar>& scalars,
    const HostCallable& call) {
  for (auto& o : outputs) {
    if (!o.defined()) continue;
    bool is_input = false;
    for (const auto& in : inputs) is_input = is_input || in.impl_id() == o.impl_id();
    if (is_input || o.requires_grad()) o = Variable(o.data());
  }
  bool needs = false;
  if (GradMode::is_enabled())
    for (const auto& in : inputs) needs = needs || in.requires_grad();
  std::shared_ptr<Function> fn;
  if (needs) {
    std::vector<Edge> edges;
    std::vector<InputMeta> metas;
    for (const auto& in : inputs) {
      edges.push_back(in.gradient_edge());
      metas.push_back(InputMeta{at::DimVector(in.sizes()), in.options()});
    }
    fn = make_function(HostBackward{name, ctx, std::move(backward), std::move(metas), traceable, calling_convention},
                       std::move(edges), static_cast<uint32_t>(outputs.size()));
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && at::isFloatingType(outputs[i].scalar_type()))
        outputs[i].set_gradient_edge(Edge{fn, static_cast<uint32_t>(i)});
    }
  }
  ctx->finalize(outputs, fn);
  if (!traceable)
    if (auto* hook = current_trace_hook())
      hook->record_host_op(name, calling_convention, scalars, inputs, outputs, fn, call);
  return fn;
}

}  // namespace detail

namespace detail::autograd_impl {

// A host backward's gradients, one per tensor input. It may return one per tensor input,
// or one per forward argument (libtorch's Function<T>, the seed's MulConstant:
// `{g * c, Variable()}`), whose non-tensor slots must be undefined. As libtorch's
// CppNode<T>::apply, gradients past the forward's arguments are dropped when they are all
// undefined (a defined one is an error).
STAGEJIT_FUNC variable_list per_tensor_input(const HostBackward& hb, variable_list results) {
  const std::string& conv = hb.calling_convention;
  if (results.size() > conv.size() && results.size() > hb.input_meta.size()) {
    bool all_undefined = true;
    for (std::size_t k = conv.size(); k < results.size(); ++k) all_undefined = all_undefined && !results[k].defined();
    if (all_undefined) results.resize(conv.size());
  }
  if (results.size() == hb.input_meta.size()) return results;
  STAGEJIT_CHECK(results.size() == conv.size(), "HostFunction '", hb.name, "': backward returned ",
                 results.size(), " gradients, expected ", hb.input_meta.size(),
                 " (one per tensor input) or ", conv.size(),
                 " (one per forward argument, undefined for the non-tensor ones; further undefined "
                 "ones are dropped)");
  variable_list tensors;
  tensors.reserve(hb.input_meta.size());
  for (std::size_t k = 0; k < conv.size(); ++k) {
    if (conv[k] == 't') {
      tensors.push_back(std::move(results[k]));
      continue;
    }
    STAGEJIT_CHECK(!results[k].defined(), "HostFunction '", hb.name, "': backward returned a defined gradient for argument ",
                   k, ", which is not a tensor (a scalar argument has no gradient: return an undefined Variable there)");
  }
  return tensors;
}

STAGEJIT_FUNC variable_list apply_host_backward(Function& self, HostBackward& hb, variable_list& grads) {
  TraceHook* hook = hb.traceable ? nullptr : current_trace_hook();
  variable_list grads_in = grads;
  variable_list results;
  {
    TraceHookGuard suspend(hb.traceable ? current_trace_hook() : nullptr);
    AtenAutogradKeys user_code;  // Note [Below libtorch's autograd keys]
    results = hb.backward(hb.ctx.get(), grads);
    results = per_tensor_input(hb, std::move(results));
    // As libtorch's validate_outputs (engine.cpp): a gradient of another shape that the
    // input's shape broadcasts to is summed back to the input's shape (`at::sum_to`, here
    // the differentiable `sum_to_size`: [2, 3] or [1, 3] for an input [3]), any other shape
    // is a ShapeError; the device must be the input's; another dtype is cast to the input's
    // (inside the suspended hook: part of the opaque backward).
    for (std::size_t i = 0; i < results.size(); ++i) {
      if (!results[i].defined()) continue;
      const InputMeta& meta = hb.input_meta[i];
      if (results[i].sizes() != at::IntArrayRef(meta.sizes)) {
        STAGEJIT_CHECK_AS(ShapeError, at::is_expandable_to(meta.sizes, results[i].sizes()),
                          "HostFunction '", hb.name, "': backward gradient ", i, " has shape ",
                          shape_str(results[i].sizes()), ", expected ", shape_str(meta.sizes),
                          " (the shape of input ", i, ") or a shape ", shape_str(meta.sizes),
                          " broadcasts to (summed back to it, as libtorch does)");
        results[i] = sum_to_size(results[i], std::vector<int64_t>(meta.sizes.begin(), meta.sizes.end()));
      }
      STAGEJIT_CHECK(results[i].data().device() == meta.options.device(), "HostFunction '",
                     hb.name, "': backward gradient ", i, " is on device ",
                     results[i].data().device(), ", expected ", meta.options.device(),
                     " (the device of input ", i, ")");
      if (!self.next_functions[i].is_valid()) {
        results[i] = Variable();
        continue;
      }
      const at::ScalarType dtype = meta.options.dtype().toScalarType();
      if (results[i].scalar_type() != dtype) results[i] = to(results[i], dtype);
    }
  }
  std::shared_ptr<Function> backward_of_outputs;
  bool any_rg = false;
  for (auto& r : results) any_rg = any_rg || r.requires_grad();
  if (GradMode::is_enabled() && any_rg && !hb.traceable) {
    variable_list boundary = grads_in;
    for (auto& s : hb.ctx->get_saved_variables()) boundary.push_back(s);
    backward_of_outputs = eval::wrap(boundary, results);
  }
  if (hook) hook->record_eval(self, grads_in, results, backward_of_outputs);
  return results;
}

}  // namespace detail::autograd_impl

}  // namespace stagejit
