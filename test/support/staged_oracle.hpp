#pragma once
// The independent oracle for multi-stage results: libtorch's own autograd.
//
// `libtorch_stages(fn, inputs, requires_grad, k)` computes, with torch::autograd::grad,
// exactly what a k-derivative stagejit trace of `fn` returns stage by stage (docs/api.md,
// Tracing): stage 0 = fn(inputs); stage s >= 1 takes a grad output of ones for every
// stage s-1 output that requires grad (those grad outputs require grad when s < k) and
// returns the gradients of every earlier-stage input that requires grad, in input order
// (stage-0 inputs first, then the grad outputs of stage 1, 2, ...). An input that does
// not influence a result yields an undefined tensor (allow_unused).

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace stagejit::testing {

using TorchFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// One entry per stage 0..k; each the list of that stage's outputs (undefined allowed).
struct StagedResult {
  std::vector<std::vector<torch::Tensor>> outputs;
  /// The grad outputs (all ones) fed to each stage s >= 1, outputs[0] is empty.
  std::vector<std::vector<torch::Tensor>> grad_outputs;
};

inline StagedResult libtorch_stages(const TorchFn& fn, const std::vector<torch::Tensor>& inputs,
                                    const std::vector<bool>& requires_grad, int k) {
  StagedResult r;
  std::vector<torch::Tensor> leaves;       // every graph input so far, in graph-input order
  std::vector<bool> leaf_requires_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto t = inputs[i].detach().clone();
    t.set_requires_grad(requires_grad.at(i));
    leaves.push_back(t);
    leaf_requires_grad.push_back(requires_grad.at(i));
  }
  r.outputs.push_back(fn(leaves));
  r.grad_outputs.emplace_back();
  for (int s = 1; s <= k; ++s) {
    std::vector<torch::Tensor> outs, grads_in;
    for (auto& o : r.outputs.back()) {
      if (o.defined() && o.requires_grad()) {
        outs.push_back(o);
        auto g = torch::ones_like(o);
        g.set_requires_grad(s < k);
        grads_in.push_back(g);
      }
    }
    std::vector<torch::Tensor> wrt;
    for (size_t i = 0; i < leaves.size(); ++i)
      if (leaf_requires_grad[i]) wrt.push_back(leaves[i]);
    std::vector<torch::Tensor> res;
    if (!outs.empty() && !wrt.empty()) {
      res = torch::autograd::grad(outs, wrt, grads_in, /*retain_graph=*/true,
                                  /*create_graph=*/s < k, /*allow_unused=*/true);
    } else {
      res.assign(wrt.size(), torch::Tensor());
    }
    r.outputs.push_back(res);
    r.grad_outputs.push_back(grads_in);
    for (auto& g : grads_in) {
      leaves.push_back(g);
      leaf_requires_grad.push_back(g.requires_grad());
    }
  }
  return r;
}

/// max |a - b| over all elements; both undefined -> 0; one undefined -> +inf.
inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() && !b.defined()) return 0.0;
  if (!a.defined() || !b.defined()) return std::numeric_limits<double>::infinity();
  if (a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  if (a.numel() == 0) return 0.0;
  return (a.detach().to(torch::kDouble) - b.detach().to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace stagejit::testing
