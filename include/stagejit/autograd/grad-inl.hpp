#pragma once
/// \file
/// Bodies of autograd/grad.hpp: `grad()` and `backward()`.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/grad.hpp>
#include <stagejit/autograd/detail/autograd_impl.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>

namespace stagejit {

// ------------------------------------------------------------------ grad(), backward()
namespace detail::autograd_impl {

STAGEJIT_FUNC void make_roots(const variable_list& outputs, const variable_list& grad_outputs,
                std::vector<Edge>& roots, variable_list& grads) {
  STAGEJIT_CHECK(!outputs.empty(), "grad/backward: no outputs given");
  STAGEJIT_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(),
                 "grad/backward: got ", grad_outputs.size(), " grad_outputs for ",
                 outputs.size(), " outputs");
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const Variable& out = outputs[i];
    STAGEJIT_CHECK(out.defined(), "grad/backward: output ", i, " is undefined");
    STAGEJIT_CHECK(out.requires_grad(), "grad/backward: element ", i,
                   " of outputs does not require grad and has no grad_fn");
    Variable g = grad_outputs.empty() ? Variable() : grad_outputs[i];
    if (g.defined()) {
      STAGEJIT_CHECK_AS(ShapeError, g.sizes() == out.sizes(), "grad/backward: grad_output ", i,
                        " has shape ", shape_str(g.sizes()), " but output ", i, " has shape ",
                        shape_str(out.sizes()));
      // As libtorch's validate_outputs: a gradient lives on its output's device.
      STAGEJIT_CHECK(g.data().device() == out.data().device(), "grad/backward: grad_output ", i,
                     " is on device ", g.data().device(), " but output ", i, " is on ",
                     out.data().device());
    } else {
      STAGEJIT_CHECK(out.numel() == 1, "grad can be implicitly created only for scalar outputs "
                     "(output ", i, " has shape ", shape_str(out.sizes()),
                     "; pass a grad_output)");
      g = Variable(at::ones_like(out.data(), at::MemoryFormat::Preserve));
    }
    roots.push_back(out.gradient_edge());
    grads.push_back(std::move(g));
  }
}

}  // namespace detail::autograd_impl

STAGEJIT_FUNC variable_list grad(const variable_list& outputs, const variable_list& inputs,
                   const variable_list& grad_outputs, bool create_graph, bool allow_unused) {
  std::vector<Edge> roots;
  variable_list grads;
  detail::autograd_impl::make_roots(outputs, grad_outputs, roots, grads);
  STAGEJIT_CHECK(!inputs.empty(), "grad: no inputs given");
  ExecuteOptions opts;
  opts.create_graph = create_graph;
  opts.keep_graph = true;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    STAGEJIT_CHECK(inputs[i].defined(), "grad: input ", i, " is undefined");
    STAGEJIT_CHECK(inputs[i].requires_grad(), "grad: element ", i,
                   " of inputs does not require grad");
    opts.capture.push_back(inputs[i].gradient_edge());
  }
  variable_list res = execute(roots, grads, opts);
  for (std::size_t i = 0; i < res.size(); ++i) {
    STAGEJIT_CHECK(res[i].defined() || allow_unused, "grad: element ", i,
                   " of inputs was not used in the graph (pass allow_unused = true to get an "
                   "undefined gradient instead)");
  }
  return res;
}

STAGEJIT_FUNC void backward(const variable_list& outputs, const variable_list& grad_outputs,
              bool create_graph) {
  std::vector<Edge> roots;
  variable_list grads;
  detail::autograd_impl::make_roots(outputs, grad_outputs, roots, grads);
  ExecuteOptions opts;
  opts.create_graph = create_graph;
  execute(roots, grads, opts);
}

}  // namespace stagejit
