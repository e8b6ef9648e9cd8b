#pragma once
/// \file
/// Anticipated stages: the forward call of a compiled function also runs the backward
/// stages its chain will be asked for, in one graph, when every call before fed them
/// the same seeds.
///
/// Note [Anticipated stages]
/// A PINN step calls the compiled net (stage 0), then `grad(u, x, ones_like(u))` with a
/// graph (stage 1), then `grad(u_x, x, ...)` (stage 2), then the loss's backward. Each
/// call is a graph of its own: stage 1 reads back what stage 0 saved, recomputes cheap
/// values rather than save them (Note [Cross-stage rematerialisation]) and cannot fuse
/// with the forward; the whole loss compiled as one function runs the forward and its
/// inner derivatives as one graph, tile by tile in the cache (bench/higher_order.md: the
/// staged Burgers forward and its two grad calls took 9.8 ms where the whole loss's
/// forward took 7.4 ms, the backward sweeps equal).
///
/// A stage's only inputs are its seeds (the incoming gradients); everything else it
/// reads comes from the chain's earlier calls. So when the seeds of stages 1..m are known
/// before the forward runs, stages 0..m are one pure function of the forward's inputs.
/// They are known when the calls before fed the same ones: a PINN's `ones_like(u)`, the
/// one-hot column `narrow` hands back, a critic's `ones` for `grad(D, x)`. So:
/// - each call of stage t >= 1 compares its seeds with the closure's *pattern* (the
///   seeds, needed outputs and grad mode of stages 1..m, from an earlier chain), bitwise;
///   when a chain ends (its calls are freed) it confirms the pattern or replaces it;
/// - after two chains in a row with one pattern, a forward call in grad mode runs the
///   *anticipated graph*: stages 0..m copied into one stage (fusion groups inlined), the
///   pattern's seeds as inputs, the outputs of stages 0..m and the values later stages
///   read as outputs, then CSE, DCE and fusion over the whole (`build_anticipated_graph`);
/// - the call of stage t then returns what that run computed when its seeds, its needed
///   outputs and grad mode are the pattern's; stage m's call hands the values later
///   stages read to stage m+1, as a call of stage m would have;
/// - anything else (another seed, another mask, a second call of one stage) is a *miss*:
///   the call rebuilds what the chain's calls would have saved (stages 0..t-1 rerun from
///   copies of the forward's inputs, kept by the run ahead, so a caller's in-place change
///   of an input no stage reads saved changes nothing) and runs its stage as always. A
///   chain that leaves the pattern disarms it until two chains confirm it again; three
///   anticipated chains not served in full turn anticipation off for the closure.
/// - a served call makes the version checks its stage's call would make on what it reads
///   saved (the forward's inputs and views of them, earlier calls' seeds, outputs
///   returned), so an in-place change is refused, or taken, exactly as without.
/// Only for closures whose stages 0..m have no random or in-place op, host function or
/// Eval (they must compute the same at any time), on the CPU, without cross-stage
/// gradients (whose stages feed each other), and only where the anticipated graph runs at
/// least half its matrix products in row-tiled regions (tall inputs, layers of at most 128
/// columns): there one graph keeps the former stages' values in the cache; elsewhere its
/// products run whole either way and it gained nothing (Fashion-MNIST's MLP,
/// 784-256-128-10 at 128 images, ran 6-10 % slower; hvp's 256-wide layers, even). `CompileOptions::anticipate_stages` (or
/// STAGEJIT_ANTICIPATE=0 in the environment) turns it off. Results are those of the
/// calls one by one, up to the order of float sums (one fused graph).
///
/// Note [Forward calls whose backward never comes]
/// A call in grad mode saves, for stage 1, what stage 1 reads, since its outputs may be
/// differentiated later. A training step that computes its gradients inside the compiled
/// function (`out = {loss, grad(loss, w)...}`) is called in grad mode, with weights that
/// require grad, and compiled with the default one derivative; its outputs are never
/// differentiated, yet every call wrote what stage 1 would read. That is the forward's
/// values and the inner backward's, row values that leave the cache: a Burgers step of this
/// form ran 11.2-13.0 ms where the same step compiled with no derivative ran 8.0-8.7 ms
/// (bench/higher_order.md, 2026-12-08). So, with the same switch as anticipation:
/// - a chain whose calls of stages >= 1 never came (its outputs freed undifferentiated)
///   counts as idle;
/// - after two idle chains in a row, a forward call in grad mode runs stage 0 without saving
///   anything (the variant that captures nothing), keeps its inputs' tensors, their versions
///   and copies (as a run ahead does), and links its outputs to stage 1 as always;
/// - if stage 1 is called after all, its call reruns stage 0 from the copies first (as a
///   missed anticipated call does, `ensure_env`). What it reads saved is then the caller's
///   inputs and the outputs as returned, at their versions then: an in-place change since is
///   refused exactly as without. The chain counts as a miss; after three, this is off for
///   the closure.
/// Only where stage 0 could be rerun (no random or in-place op, host function or Eval, no
/// Handle saved for later stages), on the CPU, where anticipation runs.
/// `anticipation_stats()` counts `uncaptured` calls and `uncaptured_misses`.

#include <stagejit/closure/plan.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/passes/cse.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/passes/graph_fuser.hpp>
#include <stagejit/passes/peephole.hpp>
#include <stagejit/passes/zeros.hpp>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace stagejit::closure {

/// The largest m such that stages 0..m of a graph (optimised and fused; `plan` its plan)
/// can be anticipated (Note [Anticipated stages]): no node of them keeps program order
/// (random or in-place ops, host functions) or is an Eval, and no Handle crosses out of
/// them. At most `last` (the last regular stage). 0: none.
inline std::size_t max_anticipated_stage(const CrossStagePlan& plan, std::size_t last) {
  std::size_t m = 0;
  for (std::size_t s = 0; s <= last && s < plan.num_stages(); ++s) {
    for (const ir::Node* n : plan.stage_nodes(s))
      if (keeps_program_order(*n) || n->is<ir::Eval>()) return s == 0 ? 0 : m;
    for (std::size_t slot : plan.captures(s))
      if (plan.slot_value(slot)->is_handle()) return s == 0 ? 0 : m;
    if (s > 0) m = s;
  }
  return m;
}

/// Where each output of an anticipated graph goes (`build_anticipated_graph`).
struct AnticipatedLayout {
  std::size_t m = 0;
  /// Per stage t = 0..m: for each output of stage t, its index among the graph's
  /// outputs, or -1 (not needed: the call returns it undefined).
  std::vector<std::vector<std::ptrdiff_t>> stage_outputs;
  /// The slots (full plan) a call of stage m+1 is primed with, and per slot where its
  /// value comes from: `kind` 0 an output of the graph (`index`), 1 input `index` of stage
  /// 0, 2 the seed `index` of stage `stage`.
  struct SlotSource {
    std::size_t slot;
    int kind;
    std::size_t stage;
    std::size_t index;
  };
  std::vector<SlotSource> primed;
};

/// Builds the anticipated graph of stages 0..m (Note [Anticipated stages]) from `graph`
/// (optimised and fused; `plan` its plan): one stage whose inputs are those of stage 0,
/// then the seeds of stages 1..m, and whose outputs are stage 0's, then stage t's where
/// `needed[t-1]` marks them, then (when `primes`) the values a call of stage m+1 reads
/// from stages 0..m. A seed that `defined[t-1]` marks 0 is a symbolic zero (Note
/// [Symbolic zeros]; the input stays, unread): outputs that become zero are undefined,
/// as a stage variant leaves them. Fusion groups are inlined, then CSE, DCE and the
/// fuser run over the whole. Fills `layout`. Throws `CompileError` for a graph
/// `max_anticipated_stage` did not accept, or a zero that cannot be propagated.
inline std::shared_ptr<ir::Graph> build_anticipated_graph(const ir::Graph& graph, const CrossStagePlan& plan,
                                                          std::size_t m, const std::vector<std::vector<char>>& needed,
                                                          const std::vector<std::vector<char>>& defined, bool primes,
                                                          AnticipatedLayout& layout) {
  STAGEJIT_CHECK_AS(CompileError, m >= 1 && m < plan.num_stages() && needed.size() == m && defined.size() == m,
                    "anticipated stages: stages 0..", m, " of a graph of ", plan.num_stages(), " stages");
  auto g = std::make_shared<ir::Graph>();
  std::vector<ir::Value*> map(graph.id_bound(), nullptr);
  auto lookup = [&](ir::Value* v) {
    ir::Value* to = v->id() < map.size() ? map[v->id()] : nullptr;
    STAGEJIT_CHECK_AS(CompileError, to != nullptr, "anticipated stages: ", ir::value_label(v),
                      " of stage ", v->stage(), " is read before it is made");
    return to;
  };
  std::vector<ir::Value*> zeros;
  for (std::size_t t = 0; t <= m; ++t) {
    const auto& ins = plan.stage_inputs(t);
    for (std::size_t i = 0; i < ins.size(); ++i) {
      ir::Value* in = map[ins[i]->id()] = g->add_input(ins[i]->type(), 0, ins[i]->name());
      if (t > 0 && !(i < defined[t - 1].size() && defined[t - 1][i])) zeros.push_back(in);
    }
  }
  for (std::size_t t = 0; t <= m; ++t) {
    for (ir::Node* n : plan.stage_nodes(t)) {
      if (const auto* fg = n->get_if<ir::FusionGroup>()) {
        std::vector<ir::Value*> ins;
        for (ir::Value* v : n->inputs()) ins.push_back(lookup(v));
        std::vector<ir::Value*> outs = g->inline_graph(*fg->subgraph, ins, g->return_node(), 0);
        for (std::size_t i = 0; i < outs.size(); ++i) map[n->output(i)->id()] = outs[i];
        continue;
      }
      ir::Node* c = g->create_clone(*n, lookup, /*copy_names=*/true)->set_stage(0);
      g->append(c);
      for (std::size_t i = 0; i < n->outputs().size(); ++i) map[n->output(i)->id()] = c->output(i);
    }
  }
  layout = AnticipatedLayout{};
  layout.m = m;
  std::size_t count = 0;
  layout.stage_outputs.resize(m + 1);
  for (std::size_t t = 0; t <= m; ++t) {
    const auto& outs = plan.stage_outputs(t);
    for (std::size_t j = 0; j < outs.size(); ++j) {
      const bool want = t == 0 || (j < needed[t - 1].size() && needed[t - 1][j]);
      if (!want) {
        layout.stage_outputs[t].push_back(-1);
        continue;
      }
      g->register_output(lookup(outs[j]), 0);
      layout.stage_outputs[t].push_back(static_cast<std::ptrdiff_t>(count++));
    }
  }
  if (primes) {
    for (std::size_t slot : plan.needed_after(m)) {
      ir::Value* v = plan.slot_value(slot);
      if (v->stage() > m) continue;  // not made by stages 0..m (never: needed after m is made at <= m)
      if (v->node()->is<ir::Param>()) {
        const auto& ins = plan.stage_inputs(v->stage());
        std::size_t i = 0;
        while (i < ins.size() && ins[i] != v) ++i;
        STAGEJIT_CHECK_AS(CompileError, i < ins.size(), "anticipated stages: input ", ir::value_label(v),
                          " of stage ", v->stage(), " is not among its stage's inputs");
        layout.primed.push_back({slot, v->stage() == 0 ? 1 : 2, v->stage(), i});
        continue;
      }
      g->register_output(lookup(v), 0);
      layout.primed.push_back({slot, 0, 0, count++});
    }
  }
  if (!zeros.empty()) {
    ir::Value* undefined = nullptr;
    for (ir::Value* z : passes::propagate_zeros(*g, 0, zeros)) {
      auto uses = z->uses();
      for (const ir::Use& u : uses) {
        if (u.user != g->return_node()) continue;  // a node that reads it whole (never: one stage)
        if (!undefined) {
          ir::Node* n = g->create(ir::Undefined{}, {}, {ir::UnknownType{}});
          g->prepend(n);
          undefined = n->output();
        }
        u.user->replace_input(u.offset, undefined);
      }
    }
  }
  passes::eliminate_dead_code(*g);
  passes::eliminate_common_subexpressions(*g);
  passes::fold_double_transposes(*g);
  passes::eliminate_dead_code(*g);
  passes::fuse(*g);
  return g;
}

/// The graph input `v` is, or is a view of through ops that may return views (Transpose,
/// Reshape, and view ops: such a view shares its base's version counter); null otherwise.
inline const ir::Value* view_base_input(const ir::Value* v) {
  static const char* const kViews[] = {"t",        "transpose", "view",   "reshape", "narrow", "expand",
                                       "expand_as", "squeeze",  "unsqueeze", "select", "slice",  "permute",
                                       "alias",    "as_strided", "chunk",  "split",   "view_as", "flatten",
                                       "unflatten", "detach",   "diagonal"};
  for (int hops = 0; v && hops < 64; ++hops) {
    const ir::Node* n = v->node();
    if (n->is<ir::Param>()) return v;
    bool view = n->is<ir::Transpose>() || n->is<ir::Reshape>();
    if (!view && n->is<ir::Op>()) {
      const std::string d = n->describe();
      for (const char* name : kViews) view = view || d == name;
    }
    if (!view || n->inputs().empty()) return nullptr;
    v = n->input(0);
  }
  return nullptr;
}

/// Whether anticipation is on in this process: STAGEJIT_ANTICIPATE unset or not "0".
inline bool anticipation_enabled_by_environment() {
  static const bool on = [] {
    const char* e = std::getenv("STAGEJIT_ANTICIPATE");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

/// True when `a` and `b` hold the same sizes, dtype, device and bits (CPU tensors).
inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes() || !a.device().is_cpu() || !b.device().is_cpu())
    return false;
  if (a.numel() == 0) return true;
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();  // bits, not values: -0.0 and NaN too
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

}  // namespace stagejit::closure
