#pragma once
// Test support: every stage of a compiled function against libtorch's autograd.
//
// `check_compiled_stages(sj_fn, torch_fn, data, requires_grad, k, options)` compiles
// `sj_fn` with `{.derivatives = k, .fuse = options.fuse}` and calls it `options.calls`
// times (the first traces, the later ones run from the cache); after each call it runs the
// compiled backward stage by stage exactly as `libtorch_stages` (staged_oracle.hpp) does
// with libtorch - grad outputs of ones, create_graph while a further stage follows, the
// gradients of every earlier input that requires grad - and compares every stage's
// results within `options.tol` (max |difference|). A result one side leaves undefined
// must be all zeros on the other: libtorch and stagejit differ in which zero gradients
// they materialise (an input that does not influence an output, the zero derivative of
// an index or a mask). Used by the closure and models suites.
#include <stagejit/stagejit.hpp>
#include <stagejit/testing/doctest.hpp>

#include "staged_oracle.hpp"

#include <vector>

namespace stagejit::testing {

struct StageCheckOptions {
  double tol = 1e-10;
  bool fuse = true;  ///< CompileOptions::fuse
  int calls = 2;     ///< calls of the compiled function, each checked
};

inline void check_compiled_stages(const traced_fn& sj_fn, const TorchFn& torch_fn,
                                  const std::vector<at::Tensor>& data, const std::vector<bool>& requires_grad,
                                  int k, StageCheckOptions options = {}) {
  CAPTURE(k);
  CAPTURE(options.fuse);
  const StagedResult oracle = libtorch_stages(torch_fn, data, requires_grad, k);
  auto f = compile(sj_fn, {.derivatives = k, .fuse = options.fuse});
  for (int call = 0; call < options.calls; ++call) {
    CAPTURE(call);
    variable_list inputs;
    for (std::size_t i = 0; i < data.size(); ++i) inputs.emplace_back(data[i], requires_grad[i]);
    variable_list all_inputs = inputs;
    variable_list outs = f(inputs);
    REQUIRE(outs.size() == oracle.outputs[0].size());
    for (std::size_t i = 0; i < outs.size(); ++i)
      CHECK(max_abs_diff(outs[i].data(), oracle.outputs[0][i]) <= options.tol);
    for (int s = 1; s <= k; ++s) {
      CAPTURE(s);
      variable_list roots, grads_in;
      for (auto& o : outs)
        if (o.defined() && o.requires_grad()) {
          roots.push_back(o);
          grads_in.emplace_back(at::ones_like(o.data()), s < k);
        }
      variable_list wrt;
      for (auto& v : all_inputs)
        if (v.requires_grad()) wrt.push_back(v);
      variable_list res = grad(roots, wrt, grads_in, /*create_graph=*/s < k, /*allow_unused=*/true);
      const auto& expected = oracle.outputs[s];
      REQUIRE(res.size() == expected.size());
      for (std::size_t i = 0; i < res.size(); ++i) {
        CAPTURE(i);
        if (!expected[i].defined()) {
          if (res[i].defined()) CHECK(res[i].data().abs().max().item<double>() == 0.0);
        } else if (!res[i].defined()) {
          CHECK(expected[i].abs().max().item<double>() == 0.0);
        } else {
          CHECK(max_abs_diff(res[i].data(), expected[i]) <= options.tol);
        }
      }
      for (auto& g : grads_in) all_inputs.push_back(g);
      outs = res;
    }
  }
  CHECK(f.stats().misses == 1);
  CHECK(f.stats().hits == static_cast<std::size_t>(options.calls - 1));
}

}  // namespace stagejit::testing
