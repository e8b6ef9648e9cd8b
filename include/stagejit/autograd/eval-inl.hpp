#pragma once
/// \file
/// Bodies of autograd/eval.hpp: `eval::wrap`, `eval::backward_eval` and the apply of an
/// `Eval` Function.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/eval.hpp>
#include <stagejit/autograd/detail/autograd_impl.hpp>
#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/core/error.hpp>

#include <unordered_map>
#include <unordered_set>

namespace stagejit {

namespace detail::autograd_impl {

// ------------------------------------------------------------------ Eval
STAGEJIT_FUNC variable_list apply_eval(Function& self, Eval& ev, variable_list& grads) {
  TraceHook* hook = current_trace_hook();
  const std::size_t n = self.next_functions.size();
  variable_list results(n);
  std::vector<Edge> roots;
  variable_list root_grads;
  for (std::size_t i = 0; i < ev.roots.size() && i < grads.size(); ++i) {
    if (grads[i].defined() && ev.roots[i].is_valid()) {
      roots.push_back(ev.roots[i]);
      root_grads.push_back(grads[i]);
    }
  }
  if (!roots.empty()) {
    ExecuteCallbacks cbs;
    for (std::size_t i = 0; i < ev.placeholders.size(); ++i)
      cbs.pre.emplace(ev.placeholders[i].get(), CaptureInput{0, i, /*stop=*/true});
    CallState state;
    state.values.resize(n);
    ExecuteOptions opts;
    opts.create_graph = GradMode::is_enabled();
    opts.keep_graph = true;
    TraceHookGuard suspend(nullptr);
    execute(roots, root_grads, opts, cbs, &state);
    for (std::size_t i = 0; i < n && i < state.values.size(); ++i) results[i] = std::move(state.values[i]);
  }
  for (std::size_t i = 0; i < n; ++i)
    if (!self.next_functions[i].is_valid()) results[i] = Variable();
  std::shared_ptr<Function> backward_of_outputs;
  bool any_rg = false;
  for (auto& r : results) any_rg = any_rg || r.requires_grad();
  if (GradMode::is_enabled() && any_rg)
    backward_of_outputs = eval::wrap(grads, results, self.shared_from_this());
  if (hook) hook->record_eval(self, grads, results, backward_of_outputs);
  return results;
}

struct EdgeHash {
  std::size_t operator()(const Edge& e) const noexcept {
    return std::hash<const void*>()(e.function.get()) * 31 + e.input_nr;
  }
};

}  // namespace detail::autograd_impl

namespace eval {

STAGEJIT_FUNC std::shared_ptr<Function> wrap(const variable_list& inputs, const variable_list& outputs,
                               const std::shared_ptr<Function>& inherited) {
  // Note [Eval boundary]: an edge ends the subgraph when it is the gradient edge of an
  // input or the outer edge of an inherited placeholder (new placeholders are patched in),
  // when it points to a leaf accumulator (likewise), or when it points to an existing
  // EvalOutput placeholder (of `inherited` or any earlier Eval): that placeholder is reused
  // as is, not patched, so the earlier Eval's subgraph stays intact.
  std::vector<Edge> boundary;
  std::unordered_map<Edge, std::size_t, detail::autograd_impl::EdgeHash> boundary_index;
  auto add_boundary = [&](const Edge& e) {
    if (!e.is_valid() || boundary_index.count(e)) return;
    boundary_index.emplace(e, boundary.size());
    boundary.push_back(e);
  };
  for (const auto& in : inputs)
    if (in.defined() && in.requires_grad()) add_boundary(in.gradient_edge());
  std::vector<std::shared_ptr<Function>> reused;   // existing placeholders, in order
  std::unordered_map<const Function*, bool> reused_reached;
  if (inherited) {
    const auto* ev = std::get_if<Eval>(&inherited->kind);
    STAGEJIT_CHECK(ev, "eval::wrap: `inherited` must be an Eval, got '", inherited->name(), "'");
    for (const auto& ph : ev->placeholders) {
      add_boundary(std::get<EvalOutput>(ph->kind).next_edge);
      reused.push_back(ph);
      reused_reached.emplace(ph.get(), false);
    }
  }
  std::vector<std::size_t> relevant;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const auto& o = outputs[i];
    if (!o.defined() || !o.requires_grad() || o.is_leaf()) continue;
    if (boundary_index.count(o.gradient_edge())) continue;  // pass-through of an input
    relevant.push_back(i);
  }
  if (relevant.empty()) return nullptr;
  struct Begin { Function* fn; std::size_t slot; Edge end; };
  std::vector<Begin> begins;
  std::unordered_set<const Function*> seen;
  std::vector<Function*> stack;
  for (std::size_t i : relevant) {
    Function* f = outputs[i].grad_fn().get();
    if (seen.insert(f).second) stack.push_back(f);
  }
  while (!stack.empty()) {
    Function* f = stack.back();
    stack.pop_back();
    for (std::size_t s = 0; s < f->next_functions.size(); ++s) {
      const Edge& e = f->next_functions[s];
      if (!e.is_valid()) continue;
      if (e.function->is<EvalOutput>()) {
        auto [it, inserted] = reused_reached.emplace(e.function.get(), true);
        if (inserted) reused.push_back(e.function);
        it->second = true;
      } else if (boundary_index.count(e) || e.function->is<AccumulateGrad>()) {
        add_boundary(e);
        begins.push_back({f, s, e});
      } else if (seen.insert(e.function.get()).second) {
        stack.push_back(e.function.get());
      }
    }
  }
  std::vector<bool> reached(boundary.size(), false);
  for (auto& b : begins) reached[boundary_index.at(b.end)] = true;
  std::vector<Edge> next;
  std::vector<std::shared_ptr<Function>> placeholders;
  std::unordered_map<Edge, std::shared_ptr<Function>, detail::autograd_impl::EdgeHash> ph_of;
  for (std::size_t i = 0; i < boundary.size(); ++i) {
    if (!reached[i]) continue;
    auto ph = make_function(EvalOutput{boundary[i]}, {}, 1);
    ph_of.emplace(boundary[i], ph);
    placeholders.push_back(ph);
    next.push_back(boundary[i]);
  }
  for (const auto& ph : reused) {
    if (!reused_reached.at(ph.get())) continue;
    placeholders.push_back(ph);
    next.push_back(std::get<EvalOutput>(ph->kind).next_edge);
  }
  for (auto& b : begins) b.fn->next_functions[b.slot] = Edge{ph_of.at(b.end), 0};
  Eval ev;
  for (std::size_t i : relevant) ev.roots.push_back(outputs[i].gradient_edge());
  ev.placeholders = placeholders;
  auto fn = make_function(std::move(ev), std::move(next), static_cast<uint32_t>(relevant.size()));
  for (std::size_t k = 0; k < relevant.size(); ++k)
    outputs[relevant[k]].set_gradient_edge(Edge{fn, static_cast<uint32_t>(k)});
  return fn;
}

STAGEJIT_FUNC std::shared_ptr<Function> backward_eval(const variable_list& outputs) {
  for (const auto& o : outputs)
    if (o.defined() && o.requires_grad())
      return (o.grad_fn() && o.grad_fn()->is<Eval>()) ? o.grad_fn() : nullptr;
  return nullptr;
}

}  // namespace eval

}  // namespace stagejit
