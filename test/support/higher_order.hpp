#pragma once
// The higher-order workloads of bench/workloads.md (issue 32): the Burgers PINN with and
// without its boundary term, a KdV residual (third input derivative), a 2-D Poisson PINN
// (a Laplacian from one grad call per column), energy/force
// matching (SiLU, softplus), WGAN-GP critics (leaky ReLU, widths 128 and 512), a
// Hessian-vector product of an MLP classifier's loss, and a MAML inner step
// differentiated through. Each builds its tensors from the specification's deterministic
// formula and runs its training step (loss and gradients in the weights) in four modes:
//
//   Staged     the network compiled with k derivatives (`CompileOptions::derivatives`);
//              the loss's inner grads (create_graph) and the final grad run its stages
//   WholeLoss  the whole loss, inner grads included, compiled with one derivative; the
//              final grad runs its stage 1
//   Eager      the same code on stagejit's eager autograd
//   Libtorch   the same code on torch::autograd (the oracle)
//
// Used by bench/higher_order.cpp and test/closure/higher_order_workloads_test.cpp; the
// Python twin is bench/peers/workloads.py. Not part of the library.
//
// Reading of the specification where it leaves a choice (bench/workloads.md):
// - every tensor a workload lists takes a number t, also those not from the formula
//   (hvp's labels y; maml's y_s and y_q), so hvp's v_i are t = n_w + 2 + i and maml's x_q
//   is t = n_w + 2;
// - a bias has shape [fan_out];
// - the small sizes shrink the widths only where the table says so (burgers, kdv,
//   poisson, poisson128, forces_silu, critic*, hvp); burgers_residual, forces_softplus and maml keep theirs;
// - burgers_residual lists only X (t = n_w);
// - the critic's x_hat = e * real + (1 - e) * fake is formed once when the tensors are
//   built (ATen, in the dtype) and is a leaf requiring grad in every mode; the penalty's
//   norm has no epsilon.
#include <stagejit/stagejit.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace stagejit::testing::higher_order {

enum class Mode { Staged, WholeLoss, Eager, Libtorch };
inline constexpr Mode kModes[] = {Mode::Staged, Mode::WholeLoss, Mode::Eager, Mode::Libtorch};

inline const char* mode_name(Mode m) {
  switch (m) {
    case Mode::Staged: return "staged";
    case Mode::WholeLoss: return "whole-loss";
    case Mode::Eager: return "stagejit eager";
    case Mode::Libtorch: return "libtorch eager";
  }
  return "?";
}

/// A step's loss (as double; for hvp the sum of the HVP's entries) and its gradients in
/// the weights (for hvp the HVP), in the workload's dtype.
struct Result {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

/// max over the loss and every gradient of max |x - ref| / max |ref| (a zero reference
/// divides by 1e-30).
inline double max_rel_diff(const Result& r, const Result& ref) {
  double d = std::abs(r.loss - ref.loss) / std::max(std::abs(ref.loss), 1e-30);
  if (r.grads.size() != ref.grads.size()) return INFINITY;
  for (std::size_t i = 0; i < r.grads.size(); ++i) {
    const at::Tensor a = r.grads[i].to(at::kDouble), b = ref.grads[i].to(at::kDouble);
    if (!a.defined() || a.sizes() != b.sizes()) return INFINITY;
    d = std::max(d, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>());
  }
  return d;
}

// ------------------------------------------------------------------ the values

/// Tensor number `t` of a workload: value[k] = scale * sin(0.731 k + 1.37 t + 0.1), in
/// double, then cast to `dtype`.
inline at::Tensor formula(std::vector<int64_t> shape, double scale, int64_t t, at::ScalarType dtype) {
  at::Tensor v = at::empty(shape, at::kDouble);
  double* p = v.data_ptr<double>();
  for (int64_t k = 0; k < v.numel(); ++k) p[k] = scale * std::sin(0.731 * double(k) + 1.37 * double(t) + 0.1);
  return v.to(dtype);
}

/// W1, b1, W2, b2, ... for `layers` (W [in, out] scale 1/sqrt(in); b [out] scale 0.1),
/// tensor numbers 0, 1, 2, ...
inline std::vector<at::Tensor> mlp_weights(const std::vector<int64_t>& layers, at::ScalarType dtype) {
  std::vector<at::Tensor> w;
  for (std::size_t l = 0; l + 1 < layers.size(); ++l) {
    const int64_t t = int64_t(w.size());
    w.push_back(formula({layers[l], layers[l + 1]}, 1 / std::sqrt(double(layers[l])), t, dtype));
    w.push_back(formula({layers[l + 1]}, 0.1, t + 1, dtype));
  }
  return w;
}

/// in, `hidden` layers of `width`, out.
inline std::vector<int64_t> mlp_layers(int64_t in, int64_t width, int hidden, int64_t out) {
  std::vector<int64_t> l{in};
  for (int i = 0; i < hidden; ++i) l.push_back(width);
  l.push_back(out);
  return l;
}

// ------------------------------------------------------------------ generic pieces

enum class Activation { Tanh, Silu, Softplus, LeakyRelu };

/// act(h W + b) for every hidden layer (mm(h, W) + b), a linear output layer. Generic over
/// stagejit::Variable and torch::Tensor (ADL finds stagejit's ops or ATen's).
template <class V>
V mlp(const V& x, const std::vector<V>& w, Activation act) {
  V h = x;
  const std::size_t layers = w.size() / 2;
  for (std::size_t l = 0; l < layers; ++l) {
    h = mm(h, w[2 * l]) + w[2 * l + 1];
    if (l + 1 == layers) break;
    switch (act) {
      case Activation::Tanh: h = tanh(h); break;
      case Activation::Silu: h = silu(h); break;
      case Activation::Softplus: h = softplus(h); break;
      case Activation::LeakyRelu: h = leaky_relu(h, 0.2); break;
    }
  }
  return h;
}

/// d(sum y)/dx with a graph (create_graph). The ones are the op `ones_like`, not a tensor
/// made from `y.data()`, so that a trace may run on meta tensors.
inline Variable sum_grad(const Variable& y, const Variable& x) {
  return grad({y}, {x}, {stagejit::ones_like(y)}, /*create_graph=*/true)[0];
}
inline torch::Tensor sum_grad(const torch::Tensor& y, const torch::Tensor& x) {
  return torch::autograd::grad({y}, {x}, {torch::ones_like(y)}, /*retain_graph=*/true, /*create_graph=*/true)[0];
}
/// d(scalar)/d(xs) with a graph.
inline std::vector<Variable> grads_with_graph(const Variable& y, const std::vector<Variable>& xs) {
  return grad({y}, xs, {}, /*create_graph=*/true);
}
inline std::vector<torch::Tensor> grads_with_graph(const torch::Tensor& y, const std::vector<torch::Tensor>& xs) {
  return torch::autograd::grad({y}, xs, {}, /*retain_graph=*/true, /*create_graph=*/true);
}
/// Sum over dim 1, kept ([N, k] -> [N, 1]).
inline Variable row_sum(const Variable& a) { return sum(a, std::vector<int64_t>{1}, true); }
inline torch::Tensor row_sum(const torch::Tensor& a) { return a.sum({1}, true); }
/// Mean cross entropy of logits [N, C] against int64 labels [N].
inline Variable xent(const Variable& logits, const Variable& y) { return cross_entropy(logits, y); }
inline torch::Tensor xent(const torch::Tensor& logits, const torch::Tensor& y) {
  return at::cross_entropy_loss(logits, y);
}

// ------------------------------------------------------------------ the workload

/// One workload at one dtype and size: its tensors, its compiled functions (created
/// once, reused by every step) and its step in the four modes. Not movable (the compiled
/// loss refers to it).
class Workload {
 public:
  virtual ~Workload() = default;
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  const std::string& name() const { return name_; }
  at::ScalarType dtype() const { return dtype_; }
  /// The derivatives the staged mode compiles the network with.
  int derivatives() const { return derivatives_; }
  /// "2-20x8-1 tanh, N 10000 + 100" and so on.
  virtual std::string describe() const = 0;
  const std::vector<at::Tensor>& weights() const { return weights_; }
  const std::vector<at::Tensor>& data() const { return data_; }

  /// The loss and its gradients in the weights in mode `m`.
  Result step(Mode m) {
    if (m == Mode::Libtorch) {
      std::vector<torch::Tensor> w, d;
      for (const auto& t : weights_) w.push_back(t.detach().requires_grad_(true));
      for (std::size_t i = 0; i < data_.size(); ++i)
        d.push_back(data_grad_[i] ? data_[i].detach().requires_grad_(true) : data_[i]);
      auto net = [this](const torch::Tensor& x, const std::vector<torch::Tensor>& p) {
        return mlp<torch::Tensor>(x, p, act_);
      };
      const torch::Tensor loss = loss_torch(net, w, d);
      const auto g = torch::autograd::grad({loss}, w);
      return finish(loss.detach(), {g.begin(), g.end()});
    }
    variable_list w, d;
    for (const auto& t : weights_) w.emplace_back(t, true);
    for (std::size_t i = 0; i < data_.size(); ++i) d.emplace_back(data_[i], bool(data_grad_[i]));
    Variable loss;
    if (m == Mode::WholeLoss) {
      variable_list in = w;
      in.insert(in.end(), d.begin(), d.end());
      last_loss_inputs_ = spec_of(in);
      loss = loss_(in)[0];
    } else {
      const bool staged = m == Mode::Staged;
      bool first_call = true;
      auto net = [this, staged, &first_call](const Variable& x, const variable_list& p) {
        if (!staged) return mlp<Variable>(x, p, act_);
        variable_list in{x};
        in.insert(in.end(), p.begin(), p.end());
        // The call of the most rows (the collocation points, not the boundary's).
        if (first_call || last_net_inputs_.empty() || x.data().size(0) >= last_net_inputs_[0].data().size(0))
          last_net_inputs_ = spec_of(in);
        first_call = false;
        return net_(in)[0];
      };
      loss = loss_sj(net, w, d);
    }
    std::vector<at::Tensor> g;
    for (const auto& v : grad({loss}, w)) g.push_back(v.data());
    return finish(loss.data(), std::move(g));
  }

  /// The staged mode's compiled network and the whole-loss mode's compiled loss.
  CompiledFunction& compiled_net() { return net_; }
  CompiledFunction& compiled_loss() { return loss_; }
  /// Leaves with the data and requires_grad of the inputs of the last staged step's call
  /// of the compiled net with the most rows (the last of those), and of the last
  /// whole-loss step's compiled loss (empty before such a step), holding no step's graph:
  /// `graph_for` takes them.
  const variable_list& last_net_inputs() const { return last_net_inputs_; }
  const variable_list& last_loss_inputs() const { return last_loss_inputs_; }

 protected:
  using SjNet = std::function<Variable(const Variable&, const variable_list&)>;
  using TorchNet = std::function<torch::Tensor(const torch::Tensor&, const std::vector<torch::Tensor>&)>;

  Workload(std::string name, at::ScalarType dtype, int derivatives, Activation act, std::vector<int64_t> layers)
      : name_(std::move(name)), dtype_(dtype), derivatives_(derivatives), act_(act), layers_(std::move(layers)),
        weights_(mlp_weights(layers_, dtype)),
        net_(compile(
            [act](const variable_list& in) {
              return variable_list{mlp<Variable>(in[0], variable_list(in.begin() + 1, in.end()), act)};
            },
            CompileOptions{.derivatives = derivatives})),
        loss_(compile(
            [this](const variable_list& in) {
              const auto nw = std::ptrdiff_t(weights_.size());
              const variable_list w(in.begin(), in.begin() + nw), d(in.begin() + nw, in.end());
              return variable_list{loss_sj([this](const Variable& x, const variable_list& p) {
                                             return mlp<Variable>(x, p, act_);
                                           },
                                           w, d)};
            },
            CompileOptions{.derivatives = 1})) {}

  /// Appends a data tensor (requiring grad in the step when `input_grad`).
  void add_data(at::Tensor t, bool input_grad = false) {
    data_.push_back(std::move(t));
    data_grad_.push_back(input_grad);
  }
  /// Appends the next listed tensor: `sizes` from the formula at scale 1, in the
  /// workload's dtype (requiring grad in the step when `input_grad`).
  void add_listed(std::vector<int64_t> sizes, bool input_grad = false) {
    add_data(formula(sizes, 1, next_t(), dtype_), input_grad);
    count_listed();
  }
  /// The tensor number of the next listed tensor.
  int64_t next_t() const { return int64_t(weights_.size() + listed_); }
  void count_listed(int64_t n = 1) { listed_ += std::size_t(n); }
  /// The data of the PDE workloads, each listed: X [n, 2] (grad), then with `boundary`
  /// X_b [n_b, 2] and g_b [n_b, 1].
  void add_pde_data(at::ScalarType dtype, int64_t n, int64_t n_b, bool boundary) {
    add_data(formula({n, 2}, 1, next_t(), dtype), true);
    count_listed();
    if (boundary) {
      add_data(formula({n_b, 2}, 1, next_t(), dtype));
      count_listed();
      add_data(formula({n_b, 1}, 1, next_t(), dtype));
      count_listed();
    }
  }

  std::string layers_string() const {
    std::string s;
    for (std::size_t i = 0; i < layers_.size(); ++i) s += (i ? "-" : "") + std::to_string(layers_[i]);
    static const char* names[] = {"tanh", "SiLU", "softplus", "leaky ReLU 0.2"};
    return s + " " + names[int(act_)];
  }

  virtual Variable loss_sj(const SjNet& net, const variable_list& w, const variable_list& d) const = 0;
  virtual torch::Tensor loss_torch(const TorchNet& net, const std::vector<torch::Tensor>& w,
                                   const std::vector<torch::Tensor>& d) const = 0;
  /// hvp reports the sum of the HVP's entries as its loss.
  virtual bool loss_is_grad_sum() const { return false; }

 private:
  static variable_list spec_of(const variable_list& in) {
    variable_list r;
    for (const auto& v : in) r.emplace_back(v.data(), v.requires_grad());
    return r;
  }
  Result finish(const at::Tensor& loss, std::vector<at::Tensor> grads) const {
    Result r{0, std::move(grads)};
    if (loss_is_grad_sum())
      for (const auto& g : r.grads) r.loss += g.to(at::kDouble).sum().item<double>();
    else
      r.loss = loss.to(at::kDouble).item<double>();
    return r;
  }

  std::string name_;
  at::ScalarType dtype_;
  int derivatives_;
  Activation act_;
  std::vector<int64_t> layers_;
  std::vector<at::Tensor> weights_;
  std::vector<at::Tensor> data_;
  std::vector<char> data_grad_;
  std::size_t listed_ = 0;
  CompiledFunction net_, loss_;
  variable_list last_net_inputs_, last_loss_inputs_;
};

/// Forwards the two virtual losses to `Derived::loss<V>(net, w, d)`.
template <class Derived>
class WorkloadOf : public Workload {
 protected:
  using Workload::Workload;
  Variable loss_sj(const SjNet& net, const variable_list& w, const variable_list& d) const override {
    return static_cast<const Derived*>(this)->template loss<Variable>(net, w, d);
  }
  torch::Tensor loss_torch(const TorchNet& net, const std::vector<torch::Tensor>& w,
                           const std::vector<torch::Tensor>& d) const override {
    return static_cast<const Derived*>(this)->template loss<torch::Tensor>(net, w, d);
  }
};

inline constexpr double kBurgersNu = 0.01 / 3.14159265358979323846;

/// u = net(x) of a PDE workload and its derivatives u_t, u_x (columns 0 and 1 of x), u_xx.
template <class V>
struct PdeTerms {
  V u, u_t, u_x, u_xx;
};
template <class V, class Net>
PdeTerms<V> pde_terms(const Net& net, const std::vector<V>& w, const V& x) {
  const V u = net(x, w);
  const V du = sum_grad(u, x);
  const V u_t = narrow(du, 1, 0, 1);
  const V u_x = narrow(du, 1, 1, 1);
  const V u_xx = narrow(sum_grad(u_x, x), 1, 1, 1);
  return {u, u_t, u_x, u_xx};
}

/// burgers, burgers_residual: f = u_t + u u_x - nu u_xx; mean(f^2) [+ mean((u_b - g_b)^2)].
/// Data: X [N, 2] (grad), X_b [N_b, 2], g_b [N_b, 1] (X only without the boundary term).
class Burgers : public WorkloadOf<Burgers> {
 public:
  Burgers(at::ScalarType dtype, bool small, bool boundary)
      : WorkloadOf(boundary ? "burgers" : "burgers_residual", dtype, 3, Activation::Tanh,
                   mlp_layers(2, small && boundary ? 8 : 20, 8, 1)),
        boundary_(boundary), n_(small ? 64 : 10000), n_b_(small ? 8 : 100) {
    add_pde_data(dtype, n_, n_b_, boundary_);
  }
  std::string describe() const override {
    return layers_string() + ", N " + std::to_string(n_) + (boundary_ ? " + " + std::to_string(n_b_) : "");
  }
  template <class V, class Net>
  V loss(const Net& net, const std::vector<V>& w, const std::vector<V>& d) const {
    const V& x = d[0];
    const auto [u, u_t, u_x, u_xx] = pde_terms(net, w, x);
    const V f = u_t + u * u_x - u_xx * kBurgersNu;
    V l = mean(f * f);
    if (boundary_) {
      const V e = net(d[1], w) - d[2];
      l = l + mean(e * e);
    }
    return l;
  }

 private:
  bool boundary_;
  int64_t n_, n_b_;
};

/// kdv: f = u_t + 6 u u_x + u_xxx; mean(f^2) + mean((u_b - g_b)^2). Data as burgers.
class Kdv : public WorkloadOf<Kdv> {
 public:
  Kdv(at::ScalarType dtype, bool small)
      : WorkloadOf("kdv", dtype, 4, Activation::Tanh, mlp_layers(2, small ? 8 : 32, 4, 1)),
        n_(small ? 64 : 4000), n_b_(small ? 8 : 100) {
    add_pde_data(dtype, n_, n_b_, true);
  }
  std::string describe() const override {
    return layers_string() + ", N " + std::to_string(n_) + " + " + std::to_string(n_b_);
  }
  template <class V, class Net>
  V loss(const Net& net, const std::vector<V>& w, const std::vector<V>& d) const {
    const V& x = d[0];
    const auto [u, u_t, u_x, u_xx] = pde_terms(net, w, x);
    const V u_xxx = narrow(sum_grad(u_xx, x), 1, 1, 1);
    const V f = u_t + 6.0 * u * u_x + u_xxx;
    const V e = net(d[1], w) - d[2];
    return mean(f * f) + mean(e * e);
  }

 private:
  int64_t n_, n_b_;
};

/// poisson, poisson128: the 2-D Poisson PINN, -(u_xx + u_yy) = s, with the Laplacian from
/// one grad call per input column (two calls of the net's second stage on one first-stage
/// result, as users write it); mean((u_xx + u_yy + s)^2) + mean((u_b - g_b)^2).
/// poisson128 is the same PINN with layers wider than 64 (128; 80 at the small sizes).
/// Data: X [N, 2] (grad), s [N, 1], X_b [N_b, 2], g_b [N_b, 1].
class Poisson : public WorkloadOf<Poisson> {
 public:
  Poisson(at::ScalarType dtype, bool small, bool wide = false)
      : WorkloadOf(wide ? "poisson128" : "poisson", dtype, 3, Activation::Tanh,
                   mlp_layers(2, wide ? (small ? 80 : 128) : (small ? 8 : 50), 3, 1)),
        n_(small ? 64 : (wide ? 2000 : 4000)), n_b_(small ? 8 : (wide ? 200 : 400)) {
    add_listed({n_, 2}, true);
    add_listed({n_, 1});
    add_listed({n_b_, 2});
    add_listed({n_b_, 1});
  }
  std::string describe() const override {
    return layers_string() + ", N " + std::to_string(n_) + " + " + std::to_string(n_b_);
  }
  template <class V, class Net>
  V loss(const Net& net, const std::vector<V>& w, const std::vector<V>& d) const {
    const V& x = d[0];
    const V u = net(x, w);
    const V du = sum_grad(u, x);
    const V u_xx = narrow(sum_grad(narrow(du, 1, 0, 1), x), 1, 0, 1);
    const V u_yy = narrow(sum_grad(narrow(du, 1, 1, 1), x), 1, 1, 1);
    const V r = u_xx + u_yy + d[1];
    const V e = net(d[2], w) - d[3];
    return mean(r * r) + mean(e * e);
  }

 private:
  int64_t n_, n_b_;
};

/// forces_silu, forces_softplus: E = net(x), F = -dE/dx; mean((E - E_ref)^2) + mean((F -
/// F_ref)^2). Data: x [N, 12] (grad), E_ref [N, 1], F_ref [N, 12].
class Forces : public WorkloadOf<Forces> {
 public:
  Forces(at::ScalarType dtype, bool small, bool softplus_act)
      : WorkloadOf(softplus_act ? "forces_softplus" : "forces_silu", dtype, 2,
                   softplus_act ? Activation::Softplus : Activation::Silu,
                   mlp_layers(12, small && !softplus_act ? 16 : 64, 2, 1)),
        n_(small ? 32 : 2000) {
    add_listed({n_, 12}, true);
    add_listed({n_, 1});
    add_listed({n_, 12});
  }
  std::string describe() const override { return layers_string() + ", N " + std::to_string(n_); }
  template <class V, class Net>
  V loss(const Net& net, const std::vector<V>& w, const std::vector<V>& d) const {
    const V e = net(d[0], w);
    const V f = -sum_grad(e, d[0]);
    const V de = e - d[1];
    const V df = f - d[2];
    return mean(de * de) + mean(df * df);
  }

 private:
  int64_t n_;
};

/// critic128, critic512: WGAN-GP, mean(D(fake)) - mean(D(real)) + 10 mean((|grad_x
/// D(x_hat)| - 1)^2). Data: real [N, 32], fake [N, 32], e [N, 1] = 0.5 + 0.5 formula, then
/// x_hat (derived, requires grad; not a listed tensor).
class Critic : public WorkloadOf<Critic> {
 public:
  Critic(at::ScalarType dtype, bool small, int64_t width)
      : WorkloadOf("critic" + std::to_string(width), dtype, 2, Activation::LeakyRelu,
                   mlp_layers(32, small ? 16 : width, 2, 1)),
        n_(small ? 32 : 2000) {
    const at::Tensor real = formula({n_, 32}, 1, next_t(), dtype);
    count_listed();
    const at::Tensor fake = formula({n_, 32}, 1, next_t(), dtype);
    count_listed();
    const at::Tensor e = (0.5 + 0.5 * formula({n_, 1}, 1, next_t(), at::kDouble)).to(dtype);
    count_listed();
    add_data(real);
    add_data(fake);
    add_data(e);
    add_data((e * real + (1 - e) * fake).contiguous(), true);
  }
  std::string describe() const override { return layers_string() + ", N " + std::to_string(n_); }
  template <class V, class Net>
  V loss(const Net& net, const std::vector<V>& w, const std::vector<V>& d) const {
    const V d_fake = net(d[1], w);
    const V d_real = net(d[0], w);
    const V d_hat = net(d[3], w);
    const V g = sum_grad(d_hat, d[3]);
    const V gap = sqrt(row_sum(g * g)) - 1.0;
    return mean(d_fake) - mean(d_real) + 10.0 * mean(gap * gap);
  }

 private:
  int64_t n_;
};

/// hvp: H v for L = cross_entropy(net(x), y), grad(dot(grad(L, p, create_graph), v), p).
/// Data: x [N, 64], y [N] (k mod 10), v_1..v_n (the weights' shapes, scale 1).
class Hvp : public WorkloadOf<Hvp> {
 public:
  Hvp(at::ScalarType dtype, bool small)
      : WorkloadOf("hvp", dtype, 2, Activation::Tanh, mlp_layers(64, small ? 16 : 256, 2, 10)),
        n_(small ? 16 : 512) {
    add_data(formula({n_, 64}, 1, next_t(), dtype));
    count_listed();
    add_data(at::arange(n_, at::kLong).remainder(10));
    count_listed();
    for (const auto& w : weights()) {
      add_data(formula(w.sizes().vec(), 1, next_t(), dtype));
      count_listed();
    }
  }
  std::string describe() const override { return layers_string() + ", N " + std::to_string(n_); }
  template <class V, class Net>
  V loss(const Net& net, const std::vector<V>& w, const std::vector<V>& d) const {
    const V l = xent(net(d[0], w), d[1]);
    const std::vector<V> g = grads_with_graph(l, w);
    V dot = sum(g[0] * d[2]);
    for (std::size_t i = 1; i < g.size(); ++i) dot = dot + sum(g[i] * d[2 + i]);
    return dot;
  }
  bool loss_is_grad_sum() const override { return true; }

 private:
  int64_t n_;
};

/// maml: p' = p - 0.01 grad(L_s(p), p, create_graph), loss L_q(p') (MSE). Data: x_s [N, 1]
/// (scale 3), y_s = sin(x_s), x_q [N, 1] (scale 3), y_q = sin(x_q).
class Maml : public WorkloadOf<Maml> {
 public:
  Maml(at::ScalarType dtype, bool small)
      : WorkloadOf("maml", dtype, 2, Activation::Tanh, mlp_layers(1, 40, 2, 1)), n_(small ? 32 : 1000) {
    for (int i = 0; i < 2; ++i) {
      const at::Tensor x = formula({n_, 1}, 3, next_t(), at::kDouble);
      count_listed(2);  // x, then y = sin(x)
      add_data(x.to(dtype));
      add_data(x.sin().to(dtype));
    }
  }
  std::string describe() const override {
    return layers_string() + ", N " + std::to_string(n_) + " + " + std::to_string(n_);
  }
  template <class V, class Net>
  V loss(const Net& net, const std::vector<V>& w, const std::vector<V>& d) const {
    const V es = net(d[0], w) - d[1];
    const std::vector<V> g = grads_with_graph(mean(es * es), w);
    std::vector<V> p;
    for (std::size_t i = 0; i < w.size(); ++i) p.push_back(w[i] - 0.01 * g[i]);
    const V eq = net(d[2], p) - d[3];
    return mean(eq * eq);
  }

 private:
  int64_t n_;
};

inline std::vector<std::string> workload_names() {
  return {"burgers", "burgers_residual", "kdv", "poisson", "poisson128", "forces_silu", "forces_softplus",
          "critic128", "critic512", "hvp", "maml"};
}

/// The workload `name` (one of workload_names()) at `dtype` (float or double), at the
/// bench's default sizes or the tests' small ones. std::invalid_argument for another name.
inline std::unique_ptr<Workload> make_workload(const std::string& name, at::ScalarType dtype, bool small) {
  if (name == "burgers") return std::make_unique<Burgers>(dtype, small, true);
  if (name == "burgers_residual") return std::make_unique<Burgers>(dtype, small, false);
  if (name == "kdv") return std::make_unique<Kdv>(dtype, small);
  if (name == "poisson") return std::make_unique<Poisson>(dtype, small);
  if (name == "poisson128") return std::make_unique<Poisson>(dtype, small, true);
  if (name == "forces_silu") return std::make_unique<Forces>(dtype, small, false);
  if (name == "forces_softplus") return std::make_unique<Forces>(dtype, small, true);
  if (name == "critic128") return std::make_unique<Critic>(dtype, small, 128);
  if (name == "critic512") return std::make_unique<Critic>(dtype, small, 512);
  if (name == "hvp") return std::make_unique<Hvp>(dtype, small);
  if (name == "maml") return std::make_unique<Maml>(dtype, small);
  throw std::invalid_argument("unknown workload '" + name + "'");
}

}  // namespace stagejit::testing::higher_order
