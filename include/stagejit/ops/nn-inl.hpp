#pragma once
/// \file
/// Bodies of ops/nn.hpp: the table entries (forward through ATen, backward formulas in
/// stagejit ops following libtorch 1.13's derivatives.yaml) and the free functions.
/// Its entries join the table in build_table (ops/op_table-inl.hpp).
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ops/detail/ops_impl.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ops/nn.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>

#include <ATen/ATen.h>

#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace stagejit {
namespace detail::ops_impl {

// ------------------------------------------------------------------ live buffers
// The running statistics of batch_norm: plain tensors an op reads and updates in place,
// named in the op's attributes by an id of this registry (ops/nn.hpp, file comment). A
// slot holds the tensor weakly (a registry entry never keeps a model's buffer alive); an
// id is (generation << 32 | slot), so a slot reused after its tensor died never answers
// for an id of the old tensor.
struct LiveBuffers {
  struct Slot {
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> ref;
    const c10::TensorImpl* impl = nullptr;
    uint32_t generation = 0;
  };
  std::mutex mutex;
  std::vector<Slot> slots;
  std::unordered_map<const c10::TensorImpl*, std::size_t> slot_of;
  std::vector<std::size_t> free_slots;
  std::size_t sweep_at = 16;
};

STAGEJIT_FUNC LiveBuffers& live_buffers() {
  static LiveBuffers* b = new LiveBuffers;  // never destroyed: compiled closures may outlive statics
  return *b;
}

STAGEJIT_FUNC int64_t live_buffer_id(const at::Tensor& t) {
  LiveBuffers& b = live_buffers();
  std::lock_guard<std::mutex> lock(b.mutex);
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto id_of = [&](std::size_t s) {
    return static_cast<int64_t>((static_cast<uint64_t>(b.slots[s].generation) << 32) | s);
  };
  if (auto it = b.slot_of.find(impl); it != b.slot_of.end()) {
    auto alive = b.slots[it->second].ref->lock();
    if (alive && alive.get() == impl) return id_of(it->second);
  }
  if (b.free_slots.empty() && b.slots.size() >= b.sweep_at) {
    std::size_t live = 0;
    for (std::size_t s = 0; s < b.slots.size(); ++s) {
      if (b.slots[s].ref && !b.slots[s].ref->expired()) {
        ++live;
        continue;
      }
      if (auto it = b.slot_of.find(b.slots[s].impl); it != b.slot_of.end() && it->second == s)
        b.slot_of.erase(it);
      b.slots[s].ref.reset();
      b.free_slots.push_back(s);
    }
    b.sweep_at = std::max<std::size_t>(16, 2 * live);
  }
  std::size_t s;
  if (!b.free_slots.empty()) {
    s = b.free_slots.back();
    b.free_slots.pop_back();
    ++b.slots[s].generation;
  } else {
    s = b.slots.size();
    b.slots.emplace_back();
  }
  b.slots[s].ref.emplace(t.getIntrusivePtr());
  b.slots[s].impl = impl;
  b.slot_of[impl] = s;
  return id_of(s);
}

STAGEJIT_FUNC at::Tensor live_buffer(int64_t id, std::string_view what) {
  LiveBuffers& b = live_buffers();
  std::lock_guard<std::mutex> lock(b.mutex);
  const auto s = static_cast<std::size_t>(static_cast<uint64_t>(id) & 0xffffffffU);
  const auto generation = static_cast<uint32_t>(static_cast<uint64_t>(id) >> 32);
  if (s < b.slots.size() && b.slots[s].generation == generation && b.slots[s].ref) {
    auto alive = b.slots[s].ref->lock();
    if (alive) return at::Tensor(std::move(alive));
  }
  throw Error(detail::str_cat("the ", what, " tensor (live buffer ", id,
                              ") no longer exists: it was freed after the op was traced"));
}

// ------------------------------------------------------------------ helpers
// An int-list argument of a `spatial`-d op: one value stands for all dimensions.
STAGEJIT_FUNC std::vector<int64_t> spatial_list(std::string_view op, std::string_view name,
                                                std::vector<int64_t> v, std::size_t spatial) {
  if (v.size() == 1 && spatial > 1) v.assign(spatial, v[0]);
  STAGEJIT_CHECK_AS(ShapeError, v.size() == spatial, op, ": ", name, " must have ", spatial,
                    " values (or one), got ", v.size());
  return v;
}

STAGEJIT_FUNC Variable convolution_op(const Variable& input, const Variable& weight, const Variable& bias,
                                      std::vector<int64_t> stride, std::vector<int64_t> padding,
                                      std::vector<int64_t> dilation, bool transposed,
                                      std::vector<int64_t> output_padding, int64_t groups) {
  static const OpDef& d = ops::def(OpId::convolution);
  variable_list in{input, weight};
  if (bias.defined()) in.push_back(bias);
  return ops::apply(d, in,
                    {{"stride", std::move(stride)}, {"padding", std::move(padding)},
                     {"dilation", std::move(dilation)}, {"transposed", transposed},
                     {"output_padding", std::move(output_padding)}, {"groups", groups}})[0];
}

// One gradient of a (non-transposed) convolution from ATen's convolution_backward, the
// kernels libtorch's own backward runs: `convolution_weight_backward` of (input,
// grad_output), `size` the weight's, or `convolution_input_backward` of (grad_output,
// weight), `size` the input's (a transposed convolution gives the input gradient too,
// but on CPU through a far slower im2col kernel).
STAGEJIT_FUNC Variable conv_grad(OpId id, const Variable& a, const Variable& b, std::vector<int64_t> size,
                                 std::vector<int64_t> stride, std::vector<int64_t> padding,
                                 std::vector<int64_t> dilation, int64_t groups) {
  const bool weight = id == OpId::convolution_weight_backward;
  return ops::apply(ops::def(id), {a, b},
                    {{weight ? "weight_size" : "input_size", std::move(size)}, {"stride", std::move(stride)},
                     {"padding", std::move(padding)}, {"dilation", std::move(dilation)},
                     {"groups", groups}})[0];
}
// The forward of convolution_input_backward (`input_grad`, inputs grad_output and weight)
// and convolution_weight_backward (inputs input and grad_output): one output of ATen's
// convolution_backward. ATen reads only the sizes, dtype and layout of the operand the
// op does not take, made here from the attribute `input_size` / `weight_size`.
STAGEJIT_FUNC at::Tensor aten_conv_grad(const Tensors& in, const Attributes& a, bool input_grad) {
  const auto stride = attr_ints(a, "stride");
  const at::Tensor& grad_output = input_grad ? in[0] : in[1];
  const at::Tensor stand_in =
      input_grad ? at::empty(attr_ints(a, "input_size"),
                             grad_output.options().memory_format(grad_output.suggest_memory_format()))
                 : at::zeros(attr_ints(a, "weight_size"), grad_output.options());
  auto grads = at::convolution_backward(grad_output, input_grad ? stand_in : in[0], input_grad ? in[1] : stand_in,
                                        c10::nullopt, stride, attr_ints(a, "padding"), attr_ints(a, "dilation"),
                                        false, std::vector<int64_t>(stride.size(), 0), attr_int(a, "groups", 1),
                                        {input_grad, !input_grad, false});
  return input_grad ? std::get<0>(grads) : std::get<1>(grads);
}

// The backward of those two ops (their inputs (grad_output, weight) or (input,
// grad_output)): a convolution for one input and the other gradient for the other.
STAGEJIT_FUNC variable_list conv_grad_backward(const BackwardArgs& a, bool input_grad) {
  variable_list r(2);
  const Variable& gg = G(a);
  if (!gg.defined()) return r;
  auto stride = attr_ints(a.attrs, "stride"), padding = attr_ints(a.attrs, "padding"),
       dilation = attr_ints(a.attrs, "dilation");
  const int64_t groups = attr_int(a.attrs, "groups", 1);
  const std::vector<int64_t> no_padding(stride.size(), 0);
  if (input_grad) {  // dx(g, w)
    const Variable &g = In(a, 0), &w = In(a, 1);
    if (a.needs(0)) r[0] = convolution_op(gg, w, {}, stride, padding, dilation, false, no_padding, groups);
    if (a.needs(1)) r[1] = conv_grad(OpId::convolution_weight_backward, gg, g,
                                     meta_sizes(a, 1), stride, padding, dilation, groups);
  } else {  // dw(x, g)
    const Variable &x = In(a, 0), &g = In(a, 1);
    if (a.needs(0)) r[0] = conv_grad(OpId::convolution_input_backward, g, gg,
                                     meta_sizes(a, 0), stride, padding, dilation, groups);
    if (a.needs(1)) r[1] = convolution_op(x, gg, {}, stride, padding, dilation, false, no_padding, groups);
  }
  return r;
}

STAGEJIT_FUNC Variable gather_op(const Variable& input, int64_t dim, const Variable& index) {
  static const OpDef& d = ops::def(OpId::gather);
  return ops::apply(d, {input, index}, {{"dim", dim}})[0];
}

STAGEJIT_FUNC Variable scatter_add_op(const Variable& input, int64_t dim, const Variable& index,
                                      const Variable& src) {
  static const OpDef& d = ops::def(OpId::scatter_add);
  return ops::apply(d, {input, index, src}, {{"dim", dim}})[0];
}

// Every dimension of a rank-`rank` tensor but `keep`.
STAGEJIT_FUNC std::vector<int64_t> dims_except(int64_t rank, int64_t keep) {
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < rank; ++i)
    if (i != keep) dims.push_back(i);
  return dims;
}

// Sum over `dims`, none when `dims` is empty (ATen's sum over an empty list sums all).
STAGEJIT_FUNC Variable sum_over(const Variable& v, const std::vector<int64_t>& dims) {
  return dims.empty() ? v : sum(v, dims);
}

// The weight and bias inputs of a normalisation op (undefined when absent).
STAGEJIT_FUNC std::pair<at::Tensor, at::Tensor> norm_affine(const Tensors& in, const Attributes& a) {
  const bool hw = attr_bool(a, "has_weight", false), hb = attr_bool(a, "has_bias", false);
  STAGEJIT_CHECK(in.size() == 1 + static_cast<std::size_t>(hw) + static_cast<std::size_t>(hb),
                 "expected ", 1 + hw + hb, " inputs (has_weight ", hw, ", has_bias ", hb, "), got ", in.size());
  return {hw ? in[1] : at::Tensor(), hb ? in[hw ? 2 : 1] : at::Tensor()};
}

STAGEJIT_FUNC Attributes norm_flags(const Variable& weight, const Variable& bias) {
  return {{"has_weight", weight.defined()}, {"has_bias", bias.defined()}};
}

STAGEJIT_FUNC variable_list with_affine(const Variable& input, const Variable& weight, const Variable& bias) {
  variable_list in{input};
  if (weight.defined()) in.push_back(weight);
  if (bias.defined()) in.push_back(bias);
  return in;
}

// Gradient with respect to x of the normalisation (x - mean) * invstd over `dims` (`m`
// elements each), mean and invstd (biased variance) themselves functions of x: `gxhat` is
// the gradient of the normalised x (the result's gradient times the weight), `gmean` and
// `ginvstd` those of the saved statistics (they reach here at higher orders, where the
// backward used them); each undefined when zero, all broadcastable to `xc` = x - mean.
STAGEJIT_FUNC Variable normalization_input_grad(const Variable& xc, const Variable& invstd,
                                                const Variable& gxhat, const Variable& gmean,
                                                const Variable& ginvstd, const std::vector<int64_t>& dims,
                                                double m) {
  Variable gx;
  if (gxhat.defined()) {
    Variable xhat = mul(xc, invstd);
    Variable centred = sub(sub(gxhat, mean(gxhat, dims, true)), mul(xhat, mean(mul(gxhat, xhat), dims, true)));
    gx = mul(centred, invstd);
  }
  if (gmean.defined()) {
    Variable term = div(gmean, m);
    gx = gx.defined() ? add(gx, term) : expand(term, vec(xc.sizes()));
  }
  if (ginvstd.defined()) {
    // d invstd / dx = -invstd^3 (x - mean) / m
    Variable term = div(mul(mul(ginvstd, pow(invstd, 3.0)), xc), m);
    gx = gx.defined() ? sub(gx, term) : neg(term);
  }
  return gx;
}

STAGEJIT_FUNC double product(at::IntArrayRef sizes, std::size_t from = 0, std::size_t to = SIZE_MAX) {
  double n = 1;
  for (std::size_t i = from; i < std::min(to, sizes.size()); ++i) n *= static_cast<double>(sizes[i]);
  return n;
}

// ------------------------------------------------------------------ table entries
template <class Def>
void define_nn_ops(Def& def) {
  // ---- convolution: input [N, C, *], weight [C_out, C_in / g, k...] (transposed:
  // [C_in, C_out / g, k...]), optional bias [C_out].
  def(OpId::convolution,
      [](const Tensors& in, const Attributes& a) {
        c10::optional<at::Tensor> bias;
        if (in.size() == 3) bias = in[2];
        return one(at::convolution(in[0], in[1], bias, attr_ints(a, "stride"), attr_ints(a, "padding"),
                                   attr_ints(a, "dilation"), attr_bool(a, "transposed", false),
                                   attr_ints(a, "output_padding"), attr_int(a, "groups", 1)));
      },
      [](const BackwardArgs& a) -> variable_list {
        variable_list r(a.input_meta.size());
        const Variable& g = G(a);
        if (!g.defined()) return r;
        auto stride = attr_ints(a.attrs, "stride"), padding = attr_ints(a.attrs, "padding"),
             dilation = attr_ints(a.attrs, "dilation");
        const int64_t groups = attr_int(a.attrs, "groups", 1);
        const Variable &x = In(a, 0), &w = In(a, 1);
        if (!attr_bool(a.attrs, "transposed", false)) {
          // y = conv(x, w): dx = conv_transpose(g, w) in value, from ATen's input-gradient
          // kernel; dw = the weight gradient of (x, g).
          if (a.needs(0)) r[0] = conv_grad(OpId::convolution_input_backward, g, w,
                                           meta_sizes(a, 0), stride, padding, dilation, groups);
          if (a.needs(1)) r[1] = conv_grad(OpId::convolution_weight_backward, x, g,
                                           meta_sizes(a, 1), stride, padding, dilation, groups);
        } else {
          // y = conv_transpose(x, w), the adjoint of conv(., w): dx = conv(g, w), and dw
          // the weight gradient of conv(g, w) at grad_output x. An output_padding of at
          // least the stride (allowed below the dilation) makes conv(g, w) longer than x
          // by output_padding / stride: the extra positions lie outside x, so dx drops
          // them and dw sees x padded with zeros there.
          const auto& xs = a.input_meta[0].sizes;
          const auto output_padding = attr_ints(a.attrs, "output_padding");
          if (a.needs(0)) {
            Variable gx = convolution_op(g, w, {}, stride, padding, dilation, false,
                                         std::vector<int64_t>(stride.size(), 0), groups);
            for (std::size_t i = 0; i < stride.size(); ++i)
              if (output_padding[i] >= stride[i]) gx = narrow(gx, static_cast<int64_t>(i + 2), 0, xs[i + 2]);
            r[0] = gx;
          }
          if (a.needs(1)) {
            Variable xp = x;
            for (std::size_t i = 0; i < stride.size(); ++i) {
              if (output_padding[i] < stride[i]) continue;
              auto extra = vec(xp.sizes());
              extra[i + 2] = output_padding[i] / stride[i];
              xp = cat({xp, zeros_of(extra, a.input_meta[0].options)}, static_cast<int64_t>(i + 2));
            }
            r[1] = conv_grad(OpId::convolution_weight_backward, g, xp,
                             meta_sizes(a, 1), stride, padding, dilation, groups);
          }
        }
        if (r.size() == 3 && a.needs(2)) r[2] = sum(g, dims_except(g.dim(), 1));
        return r;
      });
  // The weight gradient of y = conv(x, w) for grad_output g, and the input gradient: both
  // bilinear, <gg, dw(x, g)> = <g, conv(x, gg)> and <gg, dx(g, w)> = <conv(gg, w), g>, so
  // the backward of each is a convolution and the other gradient (conv_grad_backward).
  def(OpId::convolution_weight_backward,
      [](const Tensors& in, const Attributes& a) { return one(aten_conv_grad(in, a, /*input_grad=*/false)); },
      [](const BackwardArgs& a) { return conv_grad_backward(a, /*input_grad=*/false); });
  def(OpId::convolution_input_backward,
      [](const Tensors& in, const Attributes& a) { return one(aten_conv_grad(in, a, /*input_grad=*/true)); },
      [](const BackwardArgs& a) { return conv_grad_backward(a, /*input_grad=*/true); });

  // ---- pooling over the last two dimensions of [N, C, H, W] or [C, H, W]
  def(OpId::max_pool2d_with_indices,
      [](const Tensors& in, const Attributes& a) -> Tensors {
        // On CPU, ATen's kernel for a contiguous [N, C, H, W] input walks one window at a
        // time; its channels-last kernel vectorises over C. For C >= 8 the op runs that one
        // on a channels-last copy and returns ATen's layout: the same values and indices
        // (indices are flat over H*W per channel in both), 3x faster with the copies for a
        // 2x2 pool of [32, 32, 28, 28] floats (libtorch 1.13, one thread).
        const at::Tensor& x = in[0];
        const bool via_channels_last = x.device().is_cpu() && x.dim() == 4 && x.size(1) >= 8 &&
                                       x.is_contiguous() && !x.is_contiguous(at::MemoryFormat::ChannelsLast);
        auto [values, indices] = at::max_pool2d_with_indices(
            via_channels_last ? x.contiguous(at::MemoryFormat::ChannelsLast) : x, attr_ints(a, "kernel_size"),
            attr_ints(a, "stride"), attr_ints(a, "padding"), attr_ints(a, "dilation"), attr_bool(a, "ceil_mode", false));
        if (via_channels_last) return {values.contiguous(), indices.contiguous()};
        return {values, indices};
      },
      [](const BackwardArgs& a) -> variable_list {
        // The gradient goes to the positions the indices name, accumulated where windows
        // share a maximum (ATen's kernel); its own backward gathers by the same indices.
        if (!G(a).defined() || !a.needs(0)) return {Variable()};
        static const OpDef& d = ops::def(OpId::max_pool2d_with_indices_backward);
        Attributes attrs{{"input_size", meta_sizes(a, 0)}};
        attrs.insert(attrs.end(), a.attrs.begin(), a.attrs.end());
        return {ops::apply(d, {G(a), Out(a, 1)}, attrs)[0]};
      });
  def(OpId::max_pool2d_with_indices_backward,
      [](const Tensors& in, const Attributes& a) {
        at::Tensor self = at::empty(attr_ints(a, "input_size"), in[0].options());
        return one(at::max_pool2d_with_indices_backward(in[0], self, attr_ints(a, "kernel_size"),
                                                        attr_ints(a, "stride"), attr_ints(a, "padding"),
                                                        attr_ints(a, "dilation"), attr_bool(a, "ceil_mode", false),
                                                        in[1]));
      },
      [](const BackwardArgs& a) -> variable_list {
        // Linear in grad_output: each input position's gradient, read back at the
        // indices (flat over H * W), is the gradient of the pooled value.
        const Variable& gg = G(a);
        if (!gg.defined() || !a.needs(0)) return {Variable(), Variable()};
        const auto gsizes = meta_sizes(a, 0);
        auto sizes = vec(gg.sizes());
        std::vector<int64_t> flat(sizes.begin(), sizes.end() - 2), gflat(gsizes.begin(), gsizes.end() - 2);
        flat.push_back(-1);
        gflat.push_back(-1);
        return {reshape(gather_op(reshape(gg, flat), -1, reshape(In(a, 1), gflat)), gsizes), Variable()};
      });
  def(OpId::avg_pool2d,
      [](const Tensors& in, const Attributes& a) {
        return one(at::avg_pool2d(in[0], attr_ints(a, "kernel_size"), attr_ints(a, "stride"), attr_ints(a, "padding"),
                                  attr_bool(a, "ceil_mode", false), attr_bool(a, "count_include_pad", true)));
      },
      [](const BackwardArgs& a) -> variable_list {
        if (!G(a).defined() || !a.needs(0)) return {Variable()};
        static const OpDef& d = ops::def(OpId::avg_pool2d_backward);
        Attributes attrs{{"input_size", meta_sizes(a, 0)}};
        attrs.insert(attrs.end(), a.attrs.begin(), a.attrs.end());
        return {ops::apply(d, {G(a)}, attrs)[0]};
      });
  def(OpId::avg_pool2d_backward,
      [](const Tensors& in, const Attributes& a) {
        at::Tensor self = at::empty(attr_ints(a, "input_size"), in[0].options());
        return one(at::avg_pool2d_backward(in[0], self, attr_ints(a, "kernel_size"), attr_ints(a, "stride"),
                                           attr_ints(a, "padding"), attr_bool(a, "ceil_mode", false),
                                           attr_bool(a, "count_include_pad", true), c10::nullopt));
      },
      [](const BackwardArgs& a) -> variable_list {
        // Linear in grad_output: its backward is the pool again.
        if (!G(a).defined()) return {Variable()};
        static const OpDef& d = ops::def(OpId::avg_pool2d);
        Attributes attrs;
        for (const auto& kv : a.attrs)
          if (kv.first != "input_size") attrs.push_back(kv);
        return {ops::apply(d, {G(a)}, attrs)[0]};
      });
  def(OpId::adaptive_avg_pool2d,
      [](const Tensors& in, const Attributes& a) {
        return one(at::adaptive_avg_pool2d(in[0], attr_ints(a, "output_size")));
      },
      [](const BackwardArgs& a) -> variable_list {
        if (!G(a).defined() || !a.needs(0)) return {Variable()};
        static const OpDef& d = ops::def(OpId::adaptive_avg_pool2d_backward);
        return {ops::apply(d, {G(a)}, {{"input_size", meta_sizes(a, 0)}})[0]};
      });
  def(OpId::adaptive_avg_pool2d_backward,
      [](const Tensors& in, const Attributes& a) {
        at::Tensor self = at::empty(attr_ints(a, "input_size"), in[0].options());
        return one(at::_adaptive_avg_pool2d_backward(in[0], self));
      },
      [](const BackwardArgs& a) -> variable_list {
        if (!G(a).defined()) return {Variable()};
        static const OpDef& d = ops::def(OpId::adaptive_avg_pool2d);
        auto gsizes = meta_sizes(a, 0);
        return {ops::apply(d, {G(a)}, {{"output_size", std::vector<int64_t>(gsizes.end() - 2, gsizes.end())}})[0]};
      });

  // ---- normalisation: result, mean, invstd; the backward takes all three gradients.
  def(OpId::native_batch_norm,
      [](const Tensors& in, const Attributes& a) -> Tensors {
        auto [weight, bias] = norm_affine(in, a);
        at::Tensor rm, rv;
        if (find_attr(a, "running_mean")) rm = live_buffer(attr_int(a, "running_mean"), "running_mean");
        if (find_attr(a, "running_var")) rv = live_buffer(attr_int(a, "running_var"), "running_var");
        const double momentum = attr_double(a, "momentum", 0.1), eps = attr_double(a, "eps", 1e-5);
        if (attr_bool(a, "training", true)) {
          // Tracing is not a call: the closure built from the trace updates the
          // statistics when it runs (ops/nn.hpp).
          if (current_trace_hook()) rm = rv = at::Tensor();
          auto [y, mean, invstd] = at::native_batch_norm(in[0], weight, bias, rm, rv, true, momentum, eps);
          return {y, mean, invstd};
        }
        STAGEJIT_CHECK(rm.defined() && rv.defined(),
                       "batch_norm in evaluation mode needs running_mean and running_var");
        at::Tensor y = std::get<0>(at::native_batch_norm(in[0], weight, bias, rm, rv, false, momentum, eps));
        return {y, rm.clone(), at::rsqrt(rv + eps)};
      },
      [](const BackwardArgs& a) -> variable_list {
        const bool hw = attr_bool(a.attrs, "has_weight", false), hb = attr_bool(a.attrs, "has_bias", false);
        variable_list r(a.input_meta.size());
        const auto sizes = meta_sizes(a, 0);
        const int64_t rank = static_cast<int64_t>(sizes.size());
        std::vector<int64_t> per_channel(sizes.size(), 1);
        per_channel[1] = sizes[1];
        const auto dims = dims_except(rank, 1);
        Variable mean_c = reshape(Out(a, 1), per_channel), invstd_c = reshape(Out(a, 2), per_channel);
        const Variable& gy = G(a, 0);
        Variable gxhat = gy.defined() && hw ? mul(gy, reshape(In(a, 1), per_channel)) : gy;
        Variable xc = sub(In(a, 0), mean_c);
        if (a.needs(0)) {
          if (attr_bool(a.attrs, "training", true)) {
            Variable gm = G(a, 1).defined() ? reshape(G(a, 1), per_channel) : Variable();
            Variable gi = G(a, 2).defined() ? reshape(G(a, 2), per_channel) : Variable();
            r[0] = normalization_input_grad(xc, invstd_c, gxhat, gm, gi, dims, product(sizes) / static_cast<double>(sizes[1]));
          } else if (gxhat.defined()) {
            r[0] = mul(gxhat, invstd_c);  // the running statistics are constants
          }
        }
        if (gy.defined() && hw && a.needs(1)) r[1] = sum(mul(gy, mul(xc, invstd_c)), dims);
        if (gy.defined() && hb && a.needs(hw ? 2 : 1)) r[hw ? 2 : 1] = sum(gy, dims);
        return r;
      });
  def(OpId::native_layer_norm,
      [](const Tensors& in, const Attributes& a) -> Tensors {
        auto [weight, bias] = norm_affine(in, a);
        auto [y, mean, rstd] = at::native_layer_norm(in[0], attr_ints(a, "normalized_shape"), weight, bias,
                                                      attr_double(a, "eps", 1e-5));
        return {y, mean, rstd};
      },
      [](const BackwardArgs& a) -> variable_list {
        const bool hw = attr_bool(a.attrs, "has_weight", false), hb = attr_bool(a.attrs, "has_bias", false);
        variable_list r(a.input_meta.size());
        const auto sizes = meta_sizes(a, 0);
        const auto k = attr_ints(a.attrs, "normalized_shape").size();
        const std::size_t axis = sizes.size() - k;
        std::vector<int64_t> stat(sizes.begin(), sizes.begin() + static_cast<std::ptrdiff_t>(axis)), dims, outer;
        stat.resize(sizes.size(), 1);
        for (std::size_t i = 0; i < sizes.size(); ++i) (i < axis ? outer : dims).push_back(static_cast<int64_t>(i));
        Variable mean_s = reshape(Out(a, 1), stat), rstd_s = reshape(Out(a, 2), stat);
        const Variable& gy = G(a, 0);
        Variable gxhat = gy.defined() && hw ? mul(gy, In(a, 1)) : gy;
        Variable xc = sub(In(a, 0), mean_s);
        if (a.needs(0))
          r[0] = normalization_input_grad(xc, rstd_s, gxhat, G(a, 1).defined() ? reshape(G(a, 1), stat) : Variable(),
                                          G(a, 2).defined() ? reshape(G(a, 2), stat) : Variable(), dims,
                                          product(sizes, axis));
        if (gy.defined() && hw && a.needs(1)) r[1] = sum_over(mul(gy, mul(xc, rstd_s)), outer);
        if (gy.defined() && hb && a.needs(hw ? 2 : 1)) r[hw ? 2 : 1] = sum_over(gy, outer);
        return r;
      });
  def(OpId::native_group_norm,
      [](const Tensors& in, const Attributes& a) -> Tensors {
        auto [weight, bias] = norm_affine(in, a);
        const at::Tensor& x = in[0];
        STAGEJIT_CHECK_AS(ShapeError, x.dim() >= 2, "group_norm: expected an input of at least 2 dimensions [N, C, *], got sizes ", x.sizes());
        const int64_t n = x.size(0), c = x.size(1);
        const int64_t hxw = c10::multiply_integers(x.sizes().slice(2));
        const int64_t groups = attr_int(a, "num_groups");
        // As ATen's group_norm: the input in its suggested memory format, made dense.
        auto [y, mean, rstd] = at::native_group_norm(x.contiguous(x.suggest_memory_format()), weight, bias, n, c, hxw,
                                                      groups, attr_double(a, "eps", 1e-5));
        return {y, mean, rstd};
      },
      [](const BackwardArgs& a) -> variable_list {
        const bool hw = attr_bool(a.attrs, "has_weight", false), hb = attr_bool(a.attrs, "has_bias", false);
        variable_list r(a.input_meta.size());
        const auto sizes = meta_sizes(a, 0);
        const int64_t rank = static_cast<int64_t>(sizes.size());
        const int64_t n = sizes[0], groups = attr_int(a.attrs, "num_groups");
        const std::vector<int64_t> grouped{n, groups, -1}, stat{n, groups, 1};
        std::vector<int64_t> per_channel(sizes.size(), 1);
        per_channel[1] = sizes[1];
        const auto dims = dims_except(rank, 1);
        Variable mean_s = reshape(Out(a, 1), stat), rstd_s = reshape(Out(a, 2), stat);
        const Variable& gy = G(a, 0);
        Variable xc = sub(reshape(In(a, 0), grouped), mean_s);
        if (a.needs(0)) {
          Variable gxhat = gy.defined() ? reshape(hw ? mul(gy, reshape(In(a, 1), per_channel)) : gy, grouped) : Variable();
          Variable gx = normalization_input_grad(xc, rstd_s, gxhat, G(a, 1).defined() ? reshape(G(a, 1), stat) : Variable(),
                                                 G(a, 2).defined() ? reshape(G(a, 2), stat) : Variable(), {2},
                                                 product(sizes, 1) / static_cast<double>(groups));
          if (gx.defined()) r[0] = reshape(gx, sizes);
        }
        if (gy.defined() && hw && a.needs(1)) r[1] = sum(mul(gy, reshape(mul(xc, rstd_s), sizes)), dims);
        if (gy.defined() && hb && a.needs(hw ? 2 : 1)) r[hw ? 2 : 1] = sum(gy, dims);
        return r;
      });

  // ---- gather / scatter_add
  def(OpId::gather,
      [](const Tensors& in, const Attributes& a) { return one(at::gather(in[0], attr_int(a, "dim"), in[1])); },
      [](const BackwardArgs& a) -> variable_list {
        if (!G(a).defined() || !a.needs(0)) return {Variable(), Variable()};
        Variable z = zeros_of(meta_sizes(a, 0), a.input_meta[0].options);
        return {scatter_add_op(z, attr_int(a.attrs, "dim"), In(a, 1), G(a)), Variable()};
      });
  def(OpId::scatter_add,
      [](const Tensors& in, const Attributes& a) {
        return one(at::scatter_add(in[0], attr_int(a, "dim"), in[1], in[2]));
      },
      [](const BackwardArgs& a) -> variable_list {
        const Variable& g = G(a);
        if (!g.defined()) return {Variable(), Variable(), Variable()};
        return {a.needs(0) ? g : Variable(), Variable(),
                a.needs(2) ? gather_op(g, attr_int(a.attrs, "dim"), In(a, 1)) : Variable()};
      });
}

// A convolution over `spatial` dimensions, batched or not, with its arguments checked.
STAGEJIT_FUNC Variable conv_nd(std::string_view name, std::size_t spatial, const Variable& input,
                               const Variable& weight, const Variable& bias, std::vector<int64_t> stride,
                               std::vector<int64_t> padding, std::vector<int64_t> dilation, bool transposed,
                               std::vector<int64_t> output_padding, int64_t groups) {
  const auto rank = static_cast<int64_t>(spatial);
  STAGEJIT_CHECK(input.defined() && weight.defined(), name, ": input and weight must be defined");
  STAGEJIT_CHECK_AS(ShapeError, weight.dim() == rank + 2, name, ": weight must be ", rank + 2, "-d ([",
                    transposed ? "C_in, C_out / groups" : "C_out, C_in / groups", ", kernel...]), got sizes ",
                    weight.sizes());
  STAGEJIT_CHECK_AS(ShapeError, input.dim() == rank + 1 || input.dim() == rank + 2, name, ": input must be ",
                    rank + 1, "-d (unbatched) or ", rank + 2, "-d ([N, C, ...]), got sizes ", input.sizes());
  STAGEJIT_CHECK_AS(ShapeError, groups > 0, name, ": groups must be positive, got ", groups);
  stride = spatial_list(name, "stride", std::move(stride), spatial);
  padding = spatial_list(name, "padding", std::move(padding), spatial);
  dilation = spatial_list(name, "dilation", std::move(dilation), spatial);
  output_padding = spatial_list(name, "output_padding", std::move(output_padding), spatial);
  for (std::size_t i = 0; i < spatial; ++i) {
    STAGEJIT_CHECK_AS(ShapeError, padding[i] >= 0, name, ": negative padding ", padding[i], " is not supported");
    STAGEJIT_CHECK_AS(ShapeError, stride[i] > 0 && dilation[i] > 0, name,
                      ": stride and dilation must be positive, got stride ", stride[i], ", dilation ", dilation[i]);
    STAGEJIT_CHECK_AS(ShapeError, output_padding[i] >= 0, name, ": negative output_padding ", output_padding[i]);
  }
  const bool batched = input.dim() == rank + 2;
  Variable y = convolution_op(batched ? input : unsqueeze(input, 0), weight, bias, std::move(stride),
                              std::move(padding), std::move(dilation), transposed, std::move(output_padding), groups);
  return batched ? y : squeeze(y, 0);
}

STAGEJIT_FUNC Attributes pool_attrs(std::string_view name, const Variable& input, std::vector<int64_t> kernel_size,
                                    std::vector<int64_t> stride, std::vector<int64_t> padding) {
  STAGEJIT_CHECK(input.defined(), name, ": input must be defined");
  STAGEJIT_CHECK_AS(ShapeError, input.dim() == 3 || input.dim() == 4, name,
                    ": input must be 3-d [C, H, W] or 4-d [N, C, H, W], got sizes ", input.sizes());
  kernel_size = spatial_list(name, "kernel_size", std::move(kernel_size), 2);
  stride = stride.empty() ? kernel_size : spatial_list(name, "stride", std::move(stride), 2);
  padding = spatial_list(name, "padding", std::move(padding), 2);
  for (int i = 0; i < 2; ++i) {
    STAGEJIT_CHECK_AS(ShapeError, kernel_size[i] > 0 && stride[i] > 0, name,
                      ": kernel_size and stride must be positive, got ", kernel_size[i], " and ", stride[i]);
    STAGEJIT_CHECK_AS(ShapeError, padding[i] >= 0 && padding[i] <= kernel_size[i] / 2, name, ": padding ",
                      padding[i], " must be between 0 and half the kernel size ", kernel_size[i]);
  }
  return {{"kernel_size", std::move(kernel_size)}, {"stride", std::move(stride)}, {"padding", std::move(padding)}};
}

}  // namespace detail::ops_impl

// ------------------------------------------------------------------ free functions
STAGEJIT_FUNC Variable conv1d(const Variable& input, const Variable& weight, const Variable& bias,
                              std::vector<int64_t> stride, std::vector<int64_t> padding,
                              std::vector<int64_t> dilation, int64_t groups) {
  return detail::ops_impl::conv_nd("conv1d", 1, input, weight, bias, std::move(stride), std::move(padding), std::move(dilation),
                 false, {0}, groups);
}
STAGEJIT_FUNC Variable conv2d(const Variable& input, const Variable& weight, const Variable& bias,
                              std::vector<int64_t> stride, std::vector<int64_t> padding,
                              std::vector<int64_t> dilation, int64_t groups) {
  return detail::ops_impl::conv_nd("conv2d", 2, input, weight, bias, std::move(stride), std::move(padding), std::move(dilation),
                 false, {0}, groups);
}
STAGEJIT_FUNC Variable conv_transpose2d(const Variable& input, const Variable& weight, const Variable& bias,
                                        std::vector<int64_t> stride, std::vector<int64_t> padding,
                                        std::vector<int64_t> output_padding, int64_t groups,
                                        std::vector<int64_t> dilation) {
  return detail::ops_impl::conv_nd("conv_transpose2d", 2, input, weight, bias, std::move(stride), std::move(padding),
                 std::move(dilation), true, std::move(output_padding), groups);
}
STAGEJIT_FUNC Variable max_pool2d(const Variable& input, std::vector<int64_t> kernel_size,
                                  std::vector<int64_t> stride, std::vector<int64_t> padding,
                                  std::vector<int64_t> dilation, bool ceil_mode) {
  SJ_OP(max_pool2d_with_indices);
  Attributes attrs = detail::ops_impl::pool_attrs("max_pool2d", input, std::move(kernel_size), std::move(stride), std::move(padding));
  dilation = detail::ops_impl::spatial_list("max_pool2d", "dilation", std::move(dilation), 2);
  STAGEJIT_CHECK_AS(ShapeError, dilation[0] > 0 && dilation[1] > 0, "max_pool2d: dilation must be positive, got ",
                    dilation[0], " and ", dilation[1]);
  attrs.emplace_back("dilation", std::move(dilation));
  attrs.emplace_back("ceil_mode", ceil_mode);
  return ops::apply(d, {input}, attrs)[0];
}
STAGEJIT_FUNC Variable avg_pool2d(const Variable& input, std::vector<int64_t> kernel_size,
                                  std::vector<int64_t> stride, std::vector<int64_t> padding) {
  SJ_OP(avg_pool2d);
  return detail::ops_impl::run1(d, {input}, detail::ops_impl::pool_attrs("avg_pool2d", input, std::move(kernel_size), std::move(stride), std::move(padding)));
}
STAGEJIT_FUNC Variable adaptive_avg_pool2d(const Variable& input, std::vector<int64_t> output_size) {
  SJ_OP(adaptive_avg_pool2d);
  output_size = detail::ops_impl::spatial_list("adaptive_avg_pool2d", "output_size", std::move(output_size), 2);
  return detail::ops_impl::run1(d, {input}, {{"output_size", std::move(output_size)}});
}
STAGEJIT_FUNC Variable batch_norm(const Variable& input, const Variable& weight, const Variable& bias,
                                  at::Tensor running_mean, at::Tensor running_var, bool training,
                                  double momentum, double eps) {
  SJ_OP(native_batch_norm);
  STAGEJIT_CHECK(input.defined(), "batch_norm: input must be defined");
  STAGEJIT_CHECK_AS(ShapeError, input.dim() >= 2, "batch_norm: expected an input of at least 2 dimensions [N, C, *], got sizes ",
                    input.sizes());
  const int64_t c = input.sizes()[1];
  auto check_c = [&](bool defined, at::IntArrayRef sizes, std::string_view what) {
    STAGEJIT_CHECK_AS(ShapeError, !defined || (sizes.size() == 1 && sizes[0] == c), "batch_norm: ", what,
                      " must have sizes [", c, "] (the input's channels), got ", sizes);
  };
  check_c(weight.defined(), weight.defined() ? weight.sizes() : at::IntArrayRef{}, "weight");
  check_c(bias.defined(), bias.defined() ? bias.sizes() : at::IntArrayRef{}, "bias");
  check_c(running_mean.defined(), running_mean.defined() ? running_mean.sizes() : at::IntArrayRef{}, "running_mean");
  check_c(running_var.defined(), running_var.defined() ? running_var.sizes() : at::IntArrayRef{}, "running_var");
  STAGEJIT_CHECK(training || (running_mean.defined() && running_var.defined()),
                 "batch_norm: evaluation mode (training = false) needs running_mean and running_var");
  Attributes attrs{{"training", training}, {"momentum", momentum}, {"eps", eps}};
  for (auto& kv : detail::ops_impl::norm_flags(weight, bias)) attrs.push_back(std::move(kv));
  if (running_mean.defined()) attrs.emplace_back("running_mean", detail::ops_impl::live_buffer_id(running_mean));
  if (running_var.defined()) attrs.emplace_back("running_var", detail::ops_impl::live_buffer_id(running_var));
  return ops::apply(d, detail::ops_impl::with_affine(input, weight, bias), attrs)[0];
}
STAGEJIT_FUNC Variable layer_norm(const Variable& input, std::vector<int64_t> normalized_shape,
                                  const Variable& weight, const Variable& bias, double eps) {
  SJ_OP(native_layer_norm);
  STAGEJIT_CHECK(input.defined(), "layer_norm: input must be defined");
  Attributes attrs{{"normalized_shape", std::move(normalized_shape)}, {"eps", eps}};
  for (auto& kv : detail::ops_impl::norm_flags(weight, bias)) attrs.push_back(std::move(kv));
  return ops::apply(d, detail::ops_impl::with_affine(input, weight, bias), attrs)[0];
}
STAGEJIT_FUNC Variable group_norm(const Variable& input, int64_t num_groups, const Variable& weight,
                                  const Variable& bias, double eps) {
  SJ_OP(native_group_norm);
  STAGEJIT_CHECK(input.defined(), "group_norm: input must be defined");
  STAGEJIT_CHECK_AS(ShapeError, input.dim() >= 2, "group_norm: expected an input of at least 2 dimensions [N, C, *], got sizes ",
                    input.sizes());
  STAGEJIT_CHECK_AS(ShapeError, num_groups > 0 && input.sizes()[1] % num_groups == 0, "group_norm: ",
                    input.sizes()[1], " channels cannot be split into ", num_groups, " groups");
  Attributes attrs{{"num_groups", num_groups}, {"eps", eps}};
  for (auto& kv : detail::ops_impl::norm_flags(weight, bias)) attrs.push_back(std::move(kv));
  return ops::apply(d, detail::ops_impl::with_affine(input, weight, bias), attrs)[0];
}
STAGEJIT_FUNC Variable gather(const Variable& input, int64_t dim, const Variable& index) {
  return detail::ops_impl::gather_op(input, dim, index);
}
STAGEJIT_FUNC Variable scatter_add(const Variable& input, int64_t dim, const Variable& index, const Variable& src) {
  return detail::ops_impl::scatter_add_op(input, dim, index, src);
}

}  // namespace stagejit
