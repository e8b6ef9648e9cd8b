#pragma once
// Test support: compare stagejit derivatives with libtorch's autograd on the same inputs.
#include <stagejit/stagejit.hpp>
#include <torch/torch.h>
#include <stagejit/testing/doctest.hpp>

#include <functional>
#include <string>
#include <vector>

namespace sj = stagejit;

namespace oracle {

/// Sets the engine's thread count for a scope and restores it at scope exit.
struct ThreadCount {
  int saved = sj::engine::num_threads();
  explicit ThreadCount(int n) { sj::engine::set_num_threads(n); }
  ~ThreadCount() { sj::engine::set_num_threads(saved); }
};

using SjFn = std::function<sj::variable_list(const sj::variable_list&)>;
using TorchFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Max abs difference with NaN == NaN and equal infinities treated as equal; -1 when the
/// shapes differ or NaN patterns differ.
inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return -1;
  if (a.numel() == 0) return 0;
  at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  if (!at::equal(x.isnan(), y.isnan())) return -1;
  at::Tensor same = (x == y).logical_or(x.isnan());
  at::Tensor d = at::where(same, at::zeros_like(x), (x - y).abs());
  return d.max().item<double>();
}

inline at::Tensor value_or_zeros(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : at::zeros_like(like);
}

/// Checks forward values (equal, or within `forward_tol` when libtorch computes them
/// another way, e.g. from primitive ops) and derivatives up to `order` (1..3).
inline void check(const std::string& name, const std::vector<at::Tensor>& inputs,
                  const std::vector<bool>& differentiable, const SjFn& sj_fn,
                  const TorchFn& torch_fn, int order, double tol = 1e-10,
                  double forward_tol = 0.0) {
  CAPTURE(name);
  sj::variable_list xs;
  std::vector<torch::Tensor> xt;
  sj::variable_list xs_diff;
  std::vector<torch::Tensor> xt_diff;
  std::vector<at::Tensor> like;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    bool d = differentiable[i];
    xs.emplace_back(inputs[i], d);
    xt.push_back(d ? inputs[i].detach().requires_grad_(true) : inputs[i]);
    if (d) {
      xs_diff.push_back(xs.back());
      xt_diff.push_back(xt.back());
      like.push_back(inputs[i]);
    }
  }
  sj::variable_list ys = sj_fn(xs);
  std::vector<torch::Tensor> yt = torch_fn(xt);
  REQUIRE(ys.size() == yt.size());
  for (std::size_t i = 0; i < ys.size(); ++i) {
    INFO("forward output ", i);
    const double d = max_diff(ys[i].data(), yt[i].detach());
    CHECK(d >= 0);
    CHECK(d <= forward_tol);
  }
  // Level 1 with explicit random grad_outputs; higher levels differentiate a random
  // weighted sum of the previous level's gradients.
  sj::variable_list gs_prev;
  std::vector<torch::Tensor> gt_prev;
  for (int level = 1; level <= order; ++level) {
    CAPTURE(level);
    sj::variable_list sj_out, sj_go;
    std::vector<torch::Tensor> t_out, t_go;
    if (level == 1) {
      for (std::size_t i = 0; i < ys.size(); ++i) {
        if (!yt[i].requires_grad() && !ys[i].requires_grad()) continue;
        at::Tensor w = at::randn(ys[i].sizes(), at::kDouble);
        if (ys[i].requires_grad()) { sj_out.push_back(ys[i]); sj_go.emplace_back(w); }
        if (yt[i].requires_grad()) { t_out.push_back(yt[i]); t_go.push_back(w); }
      }
    } else {
      sj::Variable ls;
      torch::Tensor lt;
      for (std::size_t i = 0; i < gs_prev.size(); ++i) {
        at::Tensor v = at::randn(like[i].sizes(), at::kDouble);
        if (gs_prev[i].defined() && gs_prev[i].requires_grad()) {
          sj::Variable term = sj::sum(sj::mul(gs_prev[i], sj::Variable(v)));
          ls = ls.defined() ? sj::add(ls, term) : term;
        }
        if (gt_prev[i].defined() && gt_prev[i].requires_grad()) {
          torch::Tensor term = (gt_prev[i] * v).sum();
          lt = lt.defined() ? lt + term : term;
        }
      }
      if (ls.defined()) { sj_out.push_back(ls); }
      if (lt.defined()) { t_out.push_back(lt); }
    }
    sj::variable_list gs(xs_diff.size());
    std::vector<torch::Tensor> gt(xt_diff.size());
    if (!sj_out.empty()) gs = sj::grad(sj_out, xs_diff, sj_go, true, true);
    if (!t_out.empty())
      gt = torch::autograd::grad(t_out, xt_diff, t_go, true, true, true);
    for (std::size_t i = 0; i < gs.size(); ++i) {
      INFO("derivative of order ", level, " w.r.t. differentiable input ", i);
      at::Tensor a = value_or_zeros(gs[i].data(), like[i]);
      at::Tensor b = value_or_zeros(gt[i].defined() ? gt[i].detach() : at::Tensor(), like[i]);
      double d = max_diff(a, b);
      CHECK(d >= 0);
      CHECK(d <= tol);
      if (!(d >= 0 && d <= tol)) {
        MESSAGE("stagejit: ", a, "\nlibtorch: ", b);
      }
    }
    gs_prev = gs;
    gt_prev = gt;
  }
}

}  // namespace oracle
