#pragma once
/// \file
/// Bodies of passes/zeros.hpp (core/config.hpp): compiled once in src/compiled_bodies.cpp,
/// or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/passes/zeros.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/passes/dce.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace stagejit::passes {

namespace detail {

STAGEJIT_FUNC void ZeroPass::run() {
  for (ir::Node* n : g_.nodes()) {
    if (stage_ && n->stage() != *stage_) continue;
    bool any = false;
    for (ir::Value* in : n->inputs()) any = any || is_zero(in);
    if (!any) continue;
    pinned_mode_ = pinned_ && n->id() < pinned_->size() && (*pinned_)[n->id()];
    visit(n);
  }
}

STAGEJIT_FUNC ir::Value* ZeroPass::materialised(ir::Value* z, ir::Node* before) {
  if (inner_) throw NeedsMaterialising{};
  if (ir::Value* m = get_ptr(z->id())) return m;
  const ir::TensorType* t = z->tensor_type();
  STAGEJIT_CHECK_AS(CompileError, t, "propagate_zeros: value %", z->id(),
                    " is zero but has no tensor type to materialise");
  Attributes attrs{{"size", std::vector<int64_t>(t->sizes.begin(), t->sizes.end())},
                   {"dtype", static_cast<int64_t>(t->dtype)}};
  if (!t->device.is_cpu()) attrs.emplace_back("device", t->device.str());
  ir::Node* n = g_.create(ir::Op::with(OpId::zeros, attrs), {},
                          {ir::TensorType::contiguous(t->dtype, t->sizes, t->device)});
  n->set_stage(stage_ ? *stage_ : before->stage());
  n->insert_before(before);
  set_ptr(z->id(), n->output());
  return n->output();
}

STAGEJIT_FUNC void ZeroPass::visit(ir::Node* n) {
  if (auto* op = n->get_if<ir::Op>()) return visit_op(n, *op);
  if (n->is<ir::Transpose>() || n->is<ir::Reshape>()) return zero_outputs(n);
  if (auto* gemm = n->get_if<ir::Gemm>()) {
    const bool product_zero = is_zero(n->input(0)) || is_zero(n->input(1));
    // beta = 0: the product alone, C ignored (NaN and all), as ATen's addmm.
    if (product_zero && (is_zero(n->input(2)) || gemm->beta == 0)) return zero_outputs(n);
    if (product_zero) return forward_scaled(n, n->input(2), gemm->beta);
    return materialise_inputs(n);
  }
  if (auto* fg = n->get_if<ir::FusionGroup>(); fg && fg->subgraph) return visit_group(n, *fg);
  materialise_inputs(n);
}

STAGEJIT_FUNC void ZeroPass::visit_op(ir::Node* n, const ir::Op& op) {
  const std::size_t k = n->inputs().size();
  auto zero = [&](std::size_t i) { return i < k && is_zero(n->input(i)); };
  bool all_zero = true;
  for (std::size_t i = 0; i < k; ++i) all_zero = all_zero && zero(i);
  switch (op.id()) {
    // Linear in every input (or in the one input they have).
    case OpId::mul: case OpId::mm: case OpId::matmul: case OpId::neg: case OpId::sum:
    case OpId::expand: case OpId::reshape: case OpId::view: case OpId::t:
    case OpId::transpose: case OpId::unsqueeze: case OpId::squeeze: case OpId::sum_to_size:
    case OpId::narrow: case OpId::chunk: case OpId::to: case OpId::zeros_like:
    case OpId::select: case OpId::split: case OpId::cross:
      return zero_outputs(n);
    case OpId::div:
    case OpId::nll_loss_backward:
      return zero(0) ? zero_outputs(n) : materialise_inputs(n);
    case OpId::cat:
      return all_zero ? zero_outputs(n) : materialise_inputs(n);
    case OpId::where:
      // where(condition, a, b): the condition is never a zero gradient; a and b are.
      return zero(1) && zero(2) ? zero_outputs(n) : materialise_inputs(n);
    case OpId::masked_fill:
      return zero(0) && attr_double(op, "value", 1) == 0 ? zero_outputs(n) : materialise_inputs(n);
    case OpId::add: case OpId::sub: case OpId::rsub: {
      if (k != 2) break;
      if (all_zero) return zero_outputs(n);
      const double alpha = attr_double(op, "alpha", 1);
      // add: a + alpha b; sub: a - alpha b; rsub: b - alpha a.
      if (op.id() == OpId::add) return zero(0) ? forward_scaled(n, n->input(1), alpha) : forward_scaled(n, n->input(0), 1);
      if (op.id() == OpId::sub) return zero(0) ? forward_scaled(n, n->input(1), -alpha) : forward_scaled(n, n->input(0), 1);
      return zero(0) ? forward_scaled(n, n->input(1), 1) : forward_scaled(n, n->input(0), -alpha);
    }
    case OpId::addmm: {
      const bool product_zero = zero(1) || zero(2);
      const double beta = attr_double(op, "beta", 1);
      // beta = 0: the product alone, self ignored (NaN and all), as ATen's addmm.
      if (product_zero && (zero(0) || beta == 0)) return zero_outputs(n);
      if (product_zero) return forward_scaled(n, n->input(0), beta);
      break;
    }
    default:
      break;  // any other op (or one the table lacks) reads its zeros as tensors
  }
  materialise_inputs(n);
}

STAGEJIT_FUNC void ZeroPass::forward_scaled(ir::Node* n, ir::Value* v, double scale) {
  if (pinned_mode_) return materialise_inputs(n);  // its output must stay its own
  ir::Value* out = n->output();
  const ir::TensorType* to = out->tensor_type();
  const ir::TensorType* tv = v->tensor_type();
  if (!to || !tv || to->sizes != tv->sizes || to->dtype != tv->dtype || to->device != tv->device)
    return materialise_inputs(n);  // a broadcast or cast hides in the op: keep it
  ir::Value* result = v;
  if (scale != 1) {
    ir::Node* m = g_.create(ir::Op::with(OpId::mul, {{"other", scale}}), {v}, {out->type()});
    m->set_stage(n->stage());
    m->insert_before(n);
    result = m->output();
  }
  replace(out, result);
}

STAGEJIT_FUNC void ZeroPass::visit_group(ir::Node* n, const ir::FusionGroup& fg) {
  std::shared_ptr<ir::Graph> sub = fg.subgraph->clone();
  ZeroPass inner(*sub, std::nullopt, nullptr, {});
  for (std::size_t i = 0; i < n->inputs().size(); ++i)
    if (is_zero(n->input(i))) inner.mark(sub->inputs()[i]);
  inner.inner_ = true;
  try {
    inner.run();
  } catch (const NeedsMaterialising&) {
    return materialise_inputs(n);
  }
  // Each group output: still computed, zero, or one of the group's inputs.
  std::vector<ir::Value*> outer_of(n->outputs().size(), nullptr);  // replacement, or null
  std::vector<char> zero_out(n->outputs().size(), 0);
  for (std::size_t j = 0; j < sub->outputs().size(); ++j) {
    ir::Value* so = sub->outputs()[j];
    if (inner.is_zero(so)) {
      zero_out[j] = 1;
      continue;
    }
    if (so->node()->is<ir::Param>()) {
      std::size_t i = 0;
      while (sub->inputs()[i] != so) ++i;
      ir::Value* outer_in = n->input(i);
      const ir::TensorType* a = outer_in->tensor_type();
      const ir::TensorType* b = n->output(j)->tensor_type();
      if (!a || !b || a->sizes != b->sizes || a->dtype != b->dtype) return materialise_inputs(n);
      outer_of[j] = outer_in;
    }
  }
  if (pinned_mode_) {
    // Its outputs must stay its own values: none may become one of its inputs (the
    // specialised group's outputs replace them through `on_replace`). One that would
    // is copied by the kernel (x * 1 is exact for every float, inf and NaN included)
    // rather than running the group on materialised zeros, where a zero times an
    // infinite saved value would make the NaN an undefined gradient does not.
    for (std::size_t j = 0; j < outer_of.size(); ++j) {
      if (!outer_of[j]) continue;
      ir::Node* copy = sub->create(ir::Op::with(OpId::mul, {{"other", 1.0}}), {sub->outputs()[j]},
                                   {n->output(j)->type()});
      sub->append(copy);
      sub->return_node()->replace_input(j, copy->output());
      outer_of[j] = nullptr;
    }
  }
  for (std::size_t j = sub->outputs().size(); j-- > 0;)
    if (zero_out[j] || outer_of[j]) sub->erase_output(j);
  eliminate_dead_code(*sub);
  // The clone keeps the group's input order: input i of `sub` is input i of `n`.
  std::vector<ir::Value*> kept_outer;
  for (std::size_t i = 0; i < sub->inputs().size(); ++i)
    if (sub->inputs()[i]->has_uses()) kept_outer.push_back(n->input(i));
  for (std::size_t i = sub->inputs().size(); i-- > 0;)
    if (!sub->inputs()[i]->has_uses()) sub->erase_input(i);
  ir::Node* repl = nullptr;
  if (!sub->outputs().empty()) {
    std::vector<ir::Type> types;
    for (ir::Value* so : sub->outputs()) types.push_back(so->type());
    repl = g_.create(ir::FusionGroup{sub}, kept_outer, types);
    repl->set_stage(n->stage());
    repl->insert_before(n);
  }
  std::size_t next_out = 0;
  for (std::size_t j = 0; j < n->outputs().size(); ++j) {
    ir::Value* o = n->output(j);
    if (zero_out[j]) mark(o);
    else if (outer_of[j]) replace(o, outer_of[j]);
    else replace(o, repl->output(next_out++));
  }
}

}  // namespace detail

STAGEJIT_FUNC std::vector<ir::Value*> propagate_zeros(ir::Graph& graph, std::size_t stage,
                                                      const std::vector<ir::Value*>& zeros,
                                                      const std::vector<char>* pinned,
                                                      const ZeroPropagation& hooks) {
  detail::ZeroPass pass(graph, stage, pinned, hooks);
  for (ir::Value* z : zeros) pass.mark(z);
  pass.run();
  std::vector<ir::Value*> live;
  auto consider = [&](ir::Value* v) {
    if (!pass.is_zero(v)) return;
    for (const ir::Use& u : v->uses())
      if (u.user == graph.return_node() || u.user->stage() != stage) {
        live.push_back(v);
        return;
      }
  };
  for (ir::Value* in : graph.inputs()) consider(in);
  for (ir::Node* n : graph.nodes())
    if (n->stage() == stage)
      for (ir::Value* o : n->outputs()) consider(o);
  return live;
}

}  // namespace stagejit::passes
