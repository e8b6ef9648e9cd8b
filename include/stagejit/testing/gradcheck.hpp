#pragma once
/// \file
/// Finite-difference gradient checks for tests (public test helper, like
/// `torch.autograd.gradcheck` / `gradgradcheck`). Inputs must be double tensors; each
/// input requiring grad is perturbed element by element with central differences and the
/// numerical Jacobian is compared with the one `stagejit::grad` computes, row by row.

#include <stagejit/autograd/grad.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace stagejit::testing {

using checked_fn = std::function<variable_list(const variable_list&)>;

namespace detail {

inline std::vector<at::Tensor> flat_outputs(const checked_fn& fn, const variable_list& in) {
  std::vector<at::Tensor> out;
  for (const auto& v : fn(in))
    out.push_back(v.defined() ? v.data().contiguous().reshape({-1}).clone() : at::Tensor());
  return out;
}

}  // namespace detail

/// Checks the gradients of `fn` at `inputs` against central finite differences (step
/// `eps`). Returns true when every entry agrees within `atol + rtol * |numerical|`;
/// otherwise false with a description in `*report`. Throws `Error` for non-double inputs
/// requiring grad.
inline bool gradcheck(const checked_fn& fn, const variable_list& inputs, double eps = 1e-6,
                      double atol = 1e-5, double rtol = 1e-3, std::string* report = nullptr) {
  std::vector<std::size_t> diff;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    STAGEJIT_CHECK(inputs[i].scalar_type() == at::kDouble, "gradcheck: input ", i,
                   " must be a double tensor (got ", inputs[i].scalar_type(), ")");
    diff.push_back(i);
  }
  STAGEJIT_CHECK(!diff.empty(), "gradcheck: no input requires grad");
  variable_list outs = fn(inputs);
  // numerical[o][k] : Jacobian block d out_o / d input diff[k], shape [numel(out), numel(in)]
  std::vector<std::vector<at::Tensor>> numerical(outs.size());
  for (std::size_t k = 0; k < diff.size(); ++k) {
    const at::Tensor base = inputs[diff[k]].data().contiguous();
    const int64_t n = base.numel();
    for (std::size_t o = 0; o < outs.size(); ++o)
      numerical[o].push_back(at::zeros({outs[o].defined() ? outs[o].numel() : 0, n}, at::kDouble));
    for (int64_t j = 0; j < n; ++j) {
      auto eval_at = [&](double delta) {
        at::Tensor p = base.clone();
        p.view({-1})[j] += delta;
        variable_list in = inputs;
        in[diff[k]] = Variable(p, true);
        return detail::flat_outputs(fn, in);
      };
      auto plus = eval_at(eps), minus = eval_at(-eps);
      for (std::size_t o = 0; o < outs.size(); ++o)
        if (plus[o].defined())
          numerical[o][k].select(1, j).copy_((plus[o] - minus[o]).to(at::kDouble) / (2 * eps));
    }
  }
  std::ostringstream msg;
  bool ok = true;
  for (std::size_t o = 0; o < outs.size(); ++o) {
    if (!outs[o].defined() || !outs[o].requires_grad()) continue;
    const int64_t m = outs[o].numel();
    for (int64_t r = 0; r < m; ++r) {
      at::Tensor onehot = at::zeros({m}, outs[o].options());
      onehot[r] = 1;
      variable_list go(outs.size());
      for (std::size_t q = 0; q < outs.size(); ++q)
        if (outs[q].defined() && outs[q].requires_grad())
          go[q] = Variable(q == o ? onehot.reshape(outs[o].sizes())
                                  : at::zeros_like(outs[q].data()));
      variable_list req_out, req_go, req_in;
      for (std::size_t q = 0; q < outs.size(); ++q)
        if (go[q].defined()) {
          req_out.push_back(outs[q]);
          req_go.push_back(go[q]);
        }
      for (auto k : diff) req_in.push_back(inputs[k]);
      variable_list g = grad(req_out, req_in, req_go, false, true);
      for (std::size_t k = 0; k < diff.size(); ++k) {
        at::Tensor analytic = g[k].defined() ? g[k].data().contiguous().reshape({-1})
                                             : at::zeros({inputs[diff[k]].numel()}, at::kDouble);
        at::Tensor num = numerical[o][k][r];
        at::Tensor err = (analytic - num).abs() - (atol + rtol * num.abs());
        if (err.numel() > 0 && err.max().item<double>() > 0) {
          ok = false;
          msg << "output " << o << " element " << r << " w.r.t. input " << diff[k]
              << ": analytical " << analytic << " numerical " << num << "\n";
        }
      }
    }
  }
  if (report) *report = msg.str();
  return ok;
}

/// Checks second derivatives: gradcheck of (inputs, v) -> grad(fn(inputs), inputs, v,
/// create_graph) with random double grad_outputs `v` that require grad.
inline bool gradgradcheck(const checked_fn& fn, const variable_list& inputs, double eps = 1e-6,
                          double atol = 1e-5, double rtol = 1e-3, std::string* report = nullptr) {
  variable_list outs = fn(inputs);
  variable_list all = inputs;
  std::vector<std::size_t> out_idx;
  for (std::size_t o = 0; o < outs.size(); ++o) {
    if (!outs[o].defined() || !outs[o].requires_grad()) continue;
    out_idx.push_back(o);
    all.push_back(Variable(at::randn_like(outs[o].data()).to(at::kDouble), true));
  }
  const std::size_t n_in = inputs.size();
  checked_fn first = [&](const variable_list& in) {
    variable_list x(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(n_in));
    variable_list y = fn(x), ys, vs, xs;
    for (std::size_t k = 0; k < out_idx.size(); ++k) {
      ys.push_back(y[out_idx[k]]);
      vs.push_back(in[n_in + k]);
    }
    for (const auto& v : x)
      if (v.requires_grad()) xs.push_back(v);
    return grad(ys, xs, vs, true, true);
  };
  return gradcheck(first, all, eps, atol, rtol, report);
}

}  // namespace stagejit::testing
