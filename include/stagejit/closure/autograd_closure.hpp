#pragma once
/// \file
/// `MultiStageClosure` (one immutable `StageClosure` per stage of a traced graph) and
/// `StageCall`, the autograd Function that runs stage k for one call (docs/seed-system.md §3.8
/// and §3.9, redesigned):
///
/// - A call of stage k feeds its inputs, the earlier-stage values it was primed with and
///   the ConstantFactory into the stage's roots, runs them on the engine (no grad mode:
///   the backward of compiled code is the next compiled stage, not eager autograd) and
///   collects the Output.
/// - Its outputs that required grad when traced get, as grad_fn, the closure of stage
///   k+1 primed with only the cross-stage values a later stage reads. Its
///   next_functions are the gradient edges, at call time, of the inputs (of any earlier
///   stage) that stage k+1's outputs are gradients of — so nothing depends on the order
///   in which the seed appended inherited edges (docs/seed-system.md §6.1).
/// - After the last compiled stage the grad_fn is an `ErrorFunction` that runs (it has
///   the edges) and throws "compiled only for K derivatives" (docs/seed-system.md §6.2).
/// - A call runs the stage's variant for what it needs (Note [Stage variants] in
///   closure/specialize.hpp): only the outputs the engine says are needed, nothing for
///   later stages unless a later stage will run (grad mode), and undefined incoming
///   gradients as symbolic zeros. Without specialisation (`specialize` off, or a stage
///   that cannot be specialised) undefined incoming gradients become zeros of the traced
///   shape and dtype.
/// - An output that is one of the tensors the call was fed (passes removed the ops
///   between) is returned as a view of it, never as the caller's tensor itself.
/// - Outputs get a grad_fn only in grad mode (stage 0: the caller's; stage k >= 1: the
///   backward's create_graph), as eager autograd does.
/// - A cross-stage value keeps the version (`at::Tensor::_version()`) it had when captured;
///   a later stage reading it throws `Error` when it was modified in place since, as
///   libtorch refuses a saved variable modified in place. A gradient fed to stage k >= 1
///   in another dtype than traced is cast to the traced dtype, as libtorch casts it.
///
/// Note [Joint backward]
/// A loss that reads several stages of one call (a PINN's u, u_x and u_xx; energy and
/// forces) reaches, in its final backward, the calls of stages 1..k of one chain: C1 (the
/// grad_fn of u), C2 (made by C1's create_graph run: u_x's), ..., Ck. Run one by one, each
/// differentiates back through the forward on its own (k sweeps of the forward's
/// products where libtorch's one graph makes one). When the graph has a joint stage
/// (Note [Joint stage] in ir/graph.hpp: `CompileOptions::joint_backward`), the call of
/// stage k names its chain's calls (`joint_members`), the engine runs those the backward
/// reaches as one node once all their gradients are in (Note [Joint nodes] in
/// src/engine.cpp), and that node runs the joint stage's variant for what arrived
/// (`apply_joint`): one sweep, the members' incoming gradients as its inputs (a member
/// the backward does not reach is a symbolic zero), from the environment of the call of
/// stage k, which holds every value of stages 0..k-1 the joint stage reads. Its outputs
/// are the total gradients of the inputs of stages 0..k-1, which the call of stage k's
/// edges lead to (the other members' edges are a subset of them); the other members
/// return nothing. Not joined (the calls run one by one, as before): in create_graph
/// backwards (the joint stage records no graph), when a member reaches another through
/// the backward graph (a grad output computed from u), and with cross-stage gradients,
/// whose calls feed each other. Calls of stage k that other applications of the chain's
/// call of stage k-1 made (a Laplacian's one grad per column) join the same node as
/// siblings (Note [Joint siblings] in passes/joint_siblings.hpp).

#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/closure/anticipate.hpp>
#include <stagejit/closure/plan.hpp>
#include <stagejit/closure/specialize.hpp>
#include <stagejit/closure/stage_closure.hpp>
#include <stagejit/core/aten_dispatch.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/memory/host_allocator.hpp>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/trace/trace.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagejit::closure {

struct ChainLog;

namespace detail {

/// The matrix products (mm, addmm, matmul) among `nodes` (one stage's, in order), and how
/// many of them the stage's row-tiled regions take (Note [Row-tiled regions]).
inline std::pair<std::size_t, std::size_t> tiled_products(const std::vector<ir::Node*>& nodes) {
  auto is_product = [](const ir::Node* n) {
    const std::string d = n->describe();
    return d == "mm" || d == "addmm" || d == "matmul";
  };
  std::size_t products = 0, tiled = 0;
  for (const ir::Node* n : nodes) products += is_product(n);
  for (const TiledRegion& r : find_row_tiled_regions(nodes, kMinTiledRows, tiling::kMaxTiledWidth))
    for (const ir::Node* n : r.nodes) tiled += is_product(n);
  return {products, tiled};
}

/// Note [Anticipated stages]: whether the one stage of `g` runs at least half of its matrix
/// products inside row-tiled regions with `tile_rows` (tall inputs, layers of at most 128
/// columns), where one graph across the former stages keeps their values in the cache.
inline bool products_mostly_tiled(const ir::Graph& g, int64_t tile_rows) {
  if (tile_rows <= 0) return false;
  const auto [products, tiled] = tiled_products(g.nodes());
  return products > 0 && 2 * tiled >= products;
}

}  // namespace detail

/// Everything a call needs that does not change between calls.
struct MultiStageClosure {
  std::shared_ptr<ir::Graph> graph;
  CrossStagePlan plan;
  std::vector<StageClosure> stages;
  std::vector<StageFlags> flags;                      ///< per stage, from the trace
  std::vector<std::vector<std::size_t>> gradient_of;  ///< per stage, from the trace
  std::vector<std::vector<StageInputRef>> feeds;      ///< per stage, from the trace
  /// Some stage has cross-stage gradients (Note [Cross-stage gradients]).
  bool cross_stage = false;
  /// Run a stage's independent branches on the engine's worker threads
  /// (`CompileOptions::inter_op_parallel`); false: on the calling thread only.
  bool inter_op_parallel = false;
  /// Run the stages' functions inside a `memory::HostCacheScope`
  /// (`CompileOptions::cache_host_memory`).
  bool cache_host_memory = false;
  /// Run each call through the stage variant for what it needs
  /// (`CompileOptions::specialize`, Note [Stage variants]).
  bool specialize = false;
  /// The graph's joint stage (Note [Joint stage] in ir/graph.hpp), 0 when it has none;
  /// `stages` holds the regular stages only, the joint one runs through variants
  /// (`joint_variant`, Note [Joint backward]).
  std::size_t joint_stage = 0;
  /// The earlier-stage tensors the joint stage reads (as `StageClosure::prev_slots`).
  std::vector<std::size_t> joint_prev_slots;
  /// Note [Joint siblings]: the joint stage's sibling copies (`ir::Graph::joint_siblings`)
  /// and the slots of the stage k-1 values each copy reads from its sibling's
  /// environment (those of the tie outputs).
  ir::Graph::JointSiblings joint_siblings;
  std::vector<std::size_t> joint_sibling_slots;
  /// Whether siblings can join (every tie output has a slot).
  bool joint_siblings_ok = false;
  /// Per output of the last stage: whether it is the gradient of an input of stage k-1
  /// (a sibling's own, which the copies leave to the chain's call).
  std::vector<char> joint_sibling_own;
  /// Note [Anticipated stages]: the last stage a forward call may run ahead (0: none),
  /// and whether it does (`CompileOptions::anticipate_stages`).
  std::size_t anticipate_max = 0;
  bool anticipate = false;
  /// Note [Forward calls whose backward never comes]: stage 0 has nothing a rerun could
  /// not repeat (no random or in-place op, host function or Eval; no Handle crosses out).
  bool forward_rerunnable = false;

  /// Note [Anticipated stages]: what the calls of stages 1..m of a chain were fed, and the
  /// anticipated graph for it (built on first use by `anticipated_closure`).
  struct AnticipationPattern {
    std::size_t m = 0;
    std::vector<variable_list> seeds;       ///< [t-1]: copies of the inputs stage t was fed
    std::vector<std::vector<char>> needed;  ///< [t-1]: the outputs its call needed
    std::vector<char> grad_mode;            ///< [t-1]: whether its call was in grad mode
    mutable std::once_flag once;
    mutable std::shared_ptr<const MultiStageClosure> graph_closure;  ///< null: cannot be built
    mutable AnticipatedLayout layout;
    /// What a call of stage t checks the version of, as it would its saved values: input
    /// `index` of stage `stage` (0: the forward's; s >= 1: the seed its call was fed), or
    /// output `index` of stage `stage` as returned.
    struct Check {
      bool output;
      std::size_t stage;
      std::size_t index;
    };
    mutable std::vector<std::vector<Check>> checks;  ///< [t-1]
  };
  /// Counts of Note [Anticipated stages], for tests and benches.
  struct AnticipationStats {
    std::size_t chains = 0;       ///< chains of calls that ended
    std::size_t anticipated = 0;  ///< of them, chains whose forward ran stages ahead
    std::size_t hits = 0;         ///< stage calls served by an anticipated run
    std::size_t misses = 0;       ///< anticipated chains not served in full
    bool disabled = false;        ///< off after too many misses or a failed build
    /// Note [Forward calls whose backward never comes]: forward calls run without saving
    /// for stage 1, of them those whose stage 1 was called after all (a rerun), and
    /// whether that is off for this closure (after three such calls).
    std::size_t uncaptured = 0;
    std::size_t uncaptured_misses = 0;
    bool uncaptured_disabled = false;
  };

  /// Builds every stage's closure. `graph` is the optimised graph of `trace` (same
  /// inputs and outputs). Throws `CompileError` (see StageClosure).
  ///
  /// `tile_rows` > 0: stages run their row-local nodes as row-tiled regions
  /// (`CompileOptions::tile_rows`, Note [Row-tiled regions]); variants too.
  MultiStageClosure(std::shared_ptr<ir::Graph> g, const Trace& trace, int64_t tile_rows = 0)
      : graph(std::move(g)), plan(*graph), tile_rows_(tile_rows) {
    STAGEJIT_CHECK_AS(CompileError, trace.num_stages() == plan.num_stages(), "closure: trace has ",
                      trace.num_stages(), " stages but the graph has ", plan.num_stages());
    STAGEJIT_CHECK_AS(CompileError, trace.joint_stage() == graph->joint_stage(),
                      "closure: the trace's joint stage is ", trace.joint_stage(), ", the graph's ",
                      graph->joint_stage());
    build_stages();
    for (std::size_t s = 0; s < stages.size(); ++s) {
      flags.push_back(trace.flags(s));
      gradient_of.push_back(trace.gradient_of(s));
      feeds.push_back(trace.feeds(s));
      cross_stage = cross_stage || !feeds.back().empty();
    }
    if (joint_stage != 0) {
      const std::size_t k = joint_stage - 1;
      for (std::size_t gi : gradient_of.at(k))
        joint_sibling_own.push_back(gi < graph->inputs().size() && graph->inputs()[gi]->stage() + 1 == k);
    }
    // Note [Anticipated stages]: never the last stage of a chain that has a joint stage
    // (its call hosts the joint backward, which reads its environment).
    if (!cross_stage && stages.size() >= 2) {
      const std::size_t k = stages.size() - 1;
      anticipate_max = max_anticipated_stage(plan, joint_stage != 0 ? k - 1 : k);
      forward_rerunnable = true;
      for (const ir::Node* n : plan.stage_nodes(0))
        if (keeps_program_order(*n) || n->is<ir::Eval>()) forward_rerunnable = false;
      for (std::size_t slot : plan.captures(0))
        if (plan.slot_value(slot)->is_handle()) forward_rerunnable = false;
    }
  }

  /// Builds every stage's closure of a graph that did not come from a trace (parsed IR
  /// text, an anticipated graph): without the trace's flags its outputs get no grad_fn,
  /// so the stages are run one after another with `run_stages`. `tile_rows` as above.
  /// Throws `CompileError` (see StageClosure).
  explicit MultiStageClosure(std::shared_ptr<ir::Graph> g, int64_t tile_rows = 0)
      : graph(std::move(g)), plan(*graph), tile_rows_(tile_rows) {
    build_stages();
  }

  /// Number of regular stages (derivatives + 1; the joint stage is not one).
  std::size_t num_stages() const noexcept { return stages.size(); }

  /// The closure serving `key`: the full stage for a full key, else the cached variant
  /// (built on first use). A stage that cannot be specialised (build_stage_variant
  /// throws) is served by the full stage, and that is remembered per key.
  const StageClosure& closure_for(const StageVariantKey& key) const {
    if (key.is_full()) return stages.at(key.stage);
    auto v = variant(key);
    return v ? v->closure : stages.at(key.stage);
  }

  /// The variant for `key`, built on first use; null when the stage cannot be
  /// specialised for it. Thread-safe (two threads missing on one key may both build it;
  /// the first stored is kept).
  std::shared_ptr<const StageVariant> variant(const StageVariantKey& key) const {
    {
      std::lock_guard<std::mutex> lock(variants_mutex_);
      auto it = variants_.find(key);
      if (it != variants_.end()) return it->second;
    }
    std::shared_ptr<const StageVariant> built;
    try {
      fusion::KernelBatchScope kernels;  // the variant's kernels: compiled together
      const auto& prev = joint_stage != 0 && key.stage == joint_stage ? joint_prev_slots
                                                                       : stages.at(key.stage).prev_slots;
      built = build_stage_variant(*graph, plan, prev, key, tile_rows_);
    } catch (...) {
      built = nullptr;  // the full stage serves this key (correct, only slower)
    }
    std::lock_guard<std::mutex> lock(variants_mutex_);
    auto [it, inserted] = variants_.emplace(key, built);
    if (inserted) ++variants_built_;
    return it->second;
  }

  /// Every stage variant built so far (not the keys served by the full stage), for
  /// inspection: `ir::to_string(*v->graph)`, `v->key.to_string()`, `v->num_nodes`.
  std::vector<std::shared_ptr<const StageVariant>> variants() const {
    std::lock_guard<std::mutex> lock(variants_mutex_);
    std::vector<std::shared_ptr<const StageVariant>> out;
    for (const auto& [key, v] : variants_)
      if (v) out.push_back(v);
    return out;
  }

  /// Number of stage variants built so far (keys served by the full stage after a
  /// failed specialisation count too).
  std::size_t num_variants() const {
    std::lock_guard<std::mutex> lock(variants_mutex_);
    return variants_built_;
  }

  /// True when built from a Trace (outputs of a call get the next stage as grad_fn).
  bool linked() const noexcept { return flags.size() == stages.size(); }

  /// Note [Anticipated stages]: the pattern a forward call runs ahead now (null: none);
  /// `current` gets the pattern chains are compared with (armed or not).
  std::shared_ptr<const AnticipationPattern> armed_pattern(std::shared_ptr<const AnticipationPattern>* current) const {
    std::lock_guard<std::mutex> lock(anticipation_mutex_);
    if (current) *current = pattern_;
    if (!anticipate || stats_.disabled || !pattern_ || streak_ < 2) return nullptr;
    return pattern_;
  }

  /// The closure of `p`'s anticipated graph, built on first use; null when it cannot be
  /// built or would not pay (fewer than half its products in row-tiled regions):
  /// anticipation is then off for this closure.
  const MultiStageClosure* anticipated_closure(const AnticipationPattern& p) const {
    std::call_once(p.once, [&] {
      try {
        AnticipatedLayout layout;
        std::vector<std::vector<char>> defined;
        for (const auto& seeds : p.seeds) {
          defined.emplace_back();
          for (const auto& v : seeds) defined.back().push_back(v.defined() ? 1 : 0);
        }
        auto g = build_anticipated_graph(*graph, plan, p.m, p.needed, defined, p.grad_mode.at(p.m - 1) != 0, layout);
        // Only where the one graph tiles its products: elsewhere they run whole either way
        // and it gained nothing (Fashion-MNIST's MLP, 784-256-128-10: 6-10 % slower).
        if (!detail::products_mostly_tiled(*g, tile_rows_)) throw CompileError("anticipated stages: products not tiled");
        std::shared_ptr<MultiStageClosure> c;
        {
          fusion::KernelBatchScope kernels;  // compiled together
          c = std::make_shared<MultiStageClosure>(g, tile_rows_);
        }
        c->cache_host_memory = cache_host_memory;
        c->inter_op_parallel = inter_op_parallel;
        // The saved values are those the variant a call of stage t runs reads (Note [Stage
        // variants]; built by the chains that made the pattern, so found in the cache).
        p.checks.assign(p.m, {});
        for (std::size_t t = 1; t <= p.m; ++t) {
          const StageClosure* sc = &stages.at(t);
          if (specialize) {
            StageVariantKey key;
            key.stage = t;
            for (const auto& v : p.seeds.at(t - 1)) key.defined_inputs.push_back(v.defined() ? 1 : 0);
            key.defined_inputs.resize(key.defined_inputs.size() + stages.at(t).prev_slots.size(), 1);
            key.needed_outputs = p.needed.at(t - 1);
            key.captures = p.grad_mode.at(t - 1) != 0 || plan.captures(t).empty();
            sc = &closure_for(key);
          }
          for (std::size_t slot : sc->prev_slots) {
            const ir::Value* v = plan.slot_value(slot);
            const auto& outs = plan.stage_outputs(v->stage());
            for (std::size_t j = 0; j < outs.size(); ++j)
              if (outs[j] == v) p.checks[t - 1].push_back({true, v->stage(), j});
            // An input, or a view of one (it shares the input's version counter).
            if (const ir::Value* in = view_base_input(v)) {
              const auto& ins = plan.stage_inputs(in->stage());
              for (std::size_t i = 0; i < ins.size(); ++i)
                if (ins[i] == in) p.checks[t - 1].push_back({false, in->stage(), i});
            }
          }
        }
        p.layout = std::move(layout);
        p.graph_closure = std::move(c);
      } catch (...) {
        p.graph_closure = nullptr;  // the stages run one by one, as without
      }
    });
    if (!p.graph_closure) {
      std::lock_guard<std::mutex> lock(anticipation_mutex_);
      stats_.disabled = true;
    }
    return p.graph_closure.get();
  }

  /// Note [Anticipated stages]: takes what a chain of calls was fed when it ends.
  inline void observe_chain(const ChainLog& log) const;

  /// Note [Forward calls whose backward never comes]: the pattern of a forward call run
  /// without saving for stage 1 (m = 0, no seeds) when the chains before it never called
  /// stage 1; null otherwise.
  std::shared_ptr<const AnticipationPattern> uncaptured_pattern() const {
    std::lock_guard<std::mutex> lock(anticipation_mutex_);
    if (!anticipate || !forward_rerunnable || stats_.uncaptured_disabled || idle_streak_ < 2) return nullptr;
    if (!uncaptured_pattern_) uncaptured_pattern_ = std::make_shared<AnticipationPattern>();
    return uncaptured_pattern_;
  }

  /// Note [Anticipated stages]: counts so far.
  AnticipationStats anticipation_stats() const {
    std::lock_guard<std::mutex> lock(anticipation_mutex_);
    return stats_;
  }

 private:
  int64_t tile_rows_ = 0;  // CompileOptions::tile_rows
  mutable std::mutex anticipation_mutex_;
  mutable std::shared_ptr<const AnticipationPattern> pattern_;
  mutable int streak_ = 0;  // chains in a row that confirmed pattern_
  // Note [Forward calls whose backward never comes]: chains in a row that called no later
  // stage, and the pattern of their uncaptured forward calls.
  mutable int idle_streak_ = 0;
  mutable std::shared_ptr<AnticipationPattern> uncaptured_pattern_;
  mutable AnticipationStats stats_;
  mutable std::mutex variants_mutex_;
  mutable std::unordered_map<StageVariantKey, std::shared_ptr<const StageVariant>, StageVariantKeyHash>
      variants_;
  mutable std::size_t variants_built_ = 0;

  void build_stages() {
    joint_stage = graph->joint_stage();
    const std::size_t regular = joint_stage != 0 ? joint_stage : plan.num_stages();
    stages.reserve(regular);
    for (std::size_t s = 0; s < regular; ++s) {
      stages.emplace_back(plan, s, nullptr, tile_rows_);
      stages.back().install_handle_callbacks(plan);
    }
    if (joint_stage != 0)
      for (std::size_t slot : plan.uses_from_earlier(joint_stage))
        if (!plan.slot_value(slot)->is_handle()) joint_prev_slots.push_back(slot);
    if (joint_stage != 0 && graph->joint_siblings().copies > 0) {
      joint_siblings = graph->joint_siblings();
      const auto& outs = plan.stage_outputs(joint_stage);
      bool ok = joint_siblings.outputs + joint_siblings.values == outs.size();
      for (std::size_t i = 0; ok && i < joint_siblings.values; ++i) {
        const std::ptrdiff_t slot = plan.slot_of(outs[joint_siblings.outputs + i]);
        ok = slot >= 0;
        if (ok) joint_sibling_slots.push_back(static_cast<std::size_t>(slot));
      }
      joint_siblings_ok = ok;  // else siblings run their stage alone
    }
  }
};

/// Note [Anticipated stages]: what the calls of one chain (a forward call and the calls
/// of later stages its outputs lead to) were fed; held by each of them, it reports to
/// the closure when the last is freed.
struct ChainLog {
  struct Call {
    variable_list seeds;
    std::vector<char> needed;
    bool grad_mode = false;
    bool seeds_ok = false;  ///< every defined seed on the CPU, of the traced sizes and dtype
    bool matched = false;   ///< equal to the pattern the chain started with
    int count = 0;          ///< calls of this stage in the chain
  };
  std::shared_ptr<const MultiStageClosure> desc;
  /// The pattern when the chain started (the one its forward ran ahead, if it did).
  std::shared_ptr<const MultiStageClosure::AnticipationPattern> against;
  std::mutex mutex;
  std::vector<Call> calls;       ///< [t-1]
  std::size_t anticipated = 0;   ///< the forward ran stages 1..anticipated ahead (0: not)
  std::size_t hits = 0;          ///< of them, calls served
  bool uncaptured = false;       ///< the forward saved nothing for stage 1

  ChainLog(std::shared_ptr<const MultiStageClosure> d, std::shared_ptr<const MultiStageClosure::AnticipationPattern> p)
      : desc(std::move(d)), against(std::move(p)) {}
  ChainLog(const ChainLog&) = delete;
  ChainLog& operator=(const ChainLog&) = delete;
  ~ChainLog() {
    try {
      desc->observe_chain(*this);
    } catch (...) {
      // an observation lost (out of memory copying seeds): the pattern waits for the next
    }
  }

  /// Records a call of stage `t` >= 1. True when it is the chain's first call of that
  /// stage and matches `against` (same seeds bit for bit, needed outputs and grad mode).
  bool record(std::size_t t, const variable_list& inputs, const std::vector<char>& needed, bool grad_mode) {
    std::lock_guard<std::mutex> lock(mutex);
    if (calls.size() < t) calls.resize(t);
    Call& c = calls[t - 1];
    if (++c.count > 1) return false;
    // Their tensors only: a seed's graph may lead back to the calls that hold this log.
    c.seeds.clear();
    for (const auto& v : inputs) c.seeds.push_back(v.defined() ? Variable(v.data()) : Variable());
    c.needed = needed;
    c.grad_mode = grad_mode;
    // A seed of another shape (which the stage refuses) or dtype (which it casts) is not
    // anticipated.
    const auto& traced = desc->plan.stage_inputs(t);
    c.seeds_ok = inputs.size() == traced.size();
    for (std::size_t i = 0; c.seeds_ok && i < inputs.size(); ++i) {
      if (!inputs[i].defined()) continue;
      const at::Tensor& d = inputs[i].data();
      const ir::TensorType* type = traced[i]->tensor_type();
      c.seeds_ok = d.device().is_cpu() && type && d.scalar_type() == type->dtype && d.sizes() == at::IntArrayRef(type->sizes);
    }
    const auto* p = against.get();
    c.matched = c.seeds_ok && p && t <= p->m && p->needed[t - 1] == needed && (p->grad_mode[t - 1] != 0) == grad_mode &&
                p->seeds[t - 1].size() == inputs.size();
    for (std::size_t i = 0; c.matched && i < inputs.size(); ++i)
      c.matched = same_bits(inputs[i].data(), p->seeds[t - 1][i].data());
    return c.matched;
  }
};

inline void MultiStageClosure::observe_chain(const ChainLog& log) const {
  // The longest run of stages 1..m each called once, defined seeds on the CPU (a stage called
  // outside grad mode ends it: nothing later follows from its call).
  std::size_t m = 0;
  for (std::size_t t = 1; t <= anticipate_max && t <= log.calls.size(); ++t) {
    const ChainLog::Call& c = log.calls[t - 1];
    if (c.count != 1 || !c.seeds_ok) break;
    m = t;
    if (!c.grad_mode) break;
  }
  bool same = m > 0;
  for (std::size_t t = 1; same && t <= m; ++t) same = log.calls[t - 1].matched;
  std::shared_ptr<AnticipationPattern> fresh;
  if (m > 0 && !same) {
    fresh = std::make_shared<AnticipationPattern>();
    fresh->m = m;
    for (std::size_t t = 1; t <= m; ++t) {
      const ChainLog::Call& c = log.calls[t - 1];
      variable_list copies;
      for (const auto& v : c.seeds)
        copies.emplace_back(v.defined() ? Variable(v.data().clone(at::MemoryFormat::Contiguous)) : Variable());
      fresh->seeds.push_back(std::move(copies));
      fresh->needed.push_back(c.needed);
      fresh->grad_mode.push_back(c.grad_mode ? 1 : 0);
    }
  }
  bool any_call = false;
  for (const ChainLog::Call& c : log.calls) any_call = any_call || c.count > 0;
  std::lock_guard<std::mutex> lock(anticipation_mutex_);
  ++stats_.chains;
  stats_.hits += log.hits;
  idle_streak_ = any_call ? 0 : std::min(idle_streak_ + 1, 2);
  if (log.uncaptured) {
    ++stats_.uncaptured;
    if (any_call && ++stats_.uncaptured_misses >= 3) stats_.uncaptured_disabled = true;
  }
  if (log.anticipated > 0) {
    ++stats_.anticipated;
    if (log.hits < log.anticipated && ++stats_.misses >= 3) stats_.disabled = true;
  }
  if (m == 0) {
    streak_ = 0;
  } else if (same && log.against == pattern_) {
    ++streak_;
  } else if (same) {
    pattern_ = log.against;  // matched a pattern another chain has replaced since
    streak_ = 1;
  } else {
    pattern_ = std::move(fresh);
    streak_ = 1;
  }
}

/// Note [Anticipated stages]: what a forward call ran ahead, held by the chain's calls of
/// stages 1..m.
struct AnticipatedRun {
  std::shared_ptr<const MultiStageClosure::AnticipationPattern> pattern;
  variable_list inputs0;            ///< the forward's inputs (their tensors)
  variable_list originals;          ///< copies of them, for a rerun of stage 0
  std::vector<int64_t> versions0;   ///< their versions then (-1: none)
  variable_list outputs;            ///< the anticipated graph's outputs
  std::vector<int64_t> output_versions;  ///< their versions after the run
  std::mutex mutex;
  /// [s]: the seeds the served call of stage s was fed (their tensors) and their versions then.
  std::vector<std::vector<std::pair<at::Tensor, int64_t>>> fed;
  /// [s][j]: output j of stage s as returned to the caller, and its version then.
  std::vector<std::vector<std::pair<at::Tensor, int64_t>>> returned;
  /// Note [Forward calls whose backward never comes]: the forward ran nothing ahead and
  /// saved nothing; its stage-1 call reruns it.
  bool uncaptured() const noexcept { return pattern->m == 0; }
};

/// Runs stage `stage` of a MultiStageClosure for one call; see the file comment.
class StageCall final : public ClosureImpl {
 public:
  /// `env_versions` (optional, one per slot): the version (`at::Tensor::_version()`) each
  /// env value had when it was captured, -1 for none; empty: their versions now.
  StageCall(std::shared_ptr<const MultiStageClosure> desc, std::size_t stage,
            std::vector<Variable> env_values, std::vector<std::shared_ptr<Function>> env_handles,
            std::vector<Edge> input_edges, std::vector<int64_t> env_versions = {})
      : desc_(std::move(desc)), stage_(stage), env_values_(std::move(env_values)),
        env_handles_(std::move(env_handles)), input_edges_(std::move(input_edges)),
        env_versions_(std::move(env_versions)) {
    name_ = "CompiledStage" + std::to_string(stage_);
    // Note [Joint siblings]: the identity the calls of the last stage this call makes
    // share (made here, not on first use: several threads may apply one call at once).
    if (desc_->joint_stage != 0 && stage_ + 2 == desc_->joint_stage) token_ = std::make_shared<const char>(0);
    if (env_versions_.empty()) {
      env_versions_.reserve(env_values_.size());
      for (const auto& v : env_values_) env_versions_.push_back(version_of(v));
    }
  }

  std::string_view name() const override { return name_; }

  bool caches_host_memory() const override { return desc_->cache_host_memory; }

  /// The stage this call runs.
  std::size_t stage() const noexcept { return stage_; }

  /// Runs the stage on `inputs` (one per stage input) without autograd linkage: fills
  /// `state` with the stage's outputs (`state.outputs`, one per stage output) and what it
  /// captured for later stages. An input of a later stage (a gradient) of another dtype
  /// than traced is cast to the traced dtype (as libtorch casts gradients). Throws `Error`
  /// naming the stage and input for a wrong count, `ShapeError` for a shape other than
  /// traced.
  ///
  /// `needed` (optional, one per stage output) and `captures` select the stage variant
  /// (Note [Stage variants]) when the closure specialises; by default every output is
  /// computed and everything later stages read is captured.
  void run(const variable_list& inputs, CallState& state, const std::vector<char>* needed = nullptr,
           bool captures = true) const {
    run_stage(stage_, inputs, state, needed, captures);
  }

  /// Note [Joint siblings]: the calls of the last stage made by one call of the stage
  /// before (one application each) share the key of that call.
  const void* joint_sibling_key() const override { return joint_sibling_capacity() > 0 ? parent_token_.get() : nullptr; }

  /// Note [Joint siblings]: the copies the joint stage has for sibling calls, when this
  /// call is of the last stage (0 otherwise).
  std::size_t joint_sibling_capacity() const override {
    const auto& d = *desc_;
    return d.joint_stage != 0 && stage_ + 1 == d.joint_stage && d.specialize && d.joint_siblings_ok
               ? d.joint_siblings.copies
               : 0;
  }

  /// Note [Joint backward]: the Functions of the calls of stages 1..k of this call's chain
  /// (this call is of stage k, the last, and the graph has a joint stage), earliest
  /// first, this call's own last; null where a call is gone. Empty otherwise.
  std::vector<std::shared_ptr<Function>> joint_members() const override {
    const auto& d = *desc_;
    if (d.joint_stage == 0 || stage_ + 1 != d.joint_stage || stage_functions_.size() <= stage_) return {};
    std::vector<std::shared_ptr<Function>> members;
    for (std::size_t t = 1; t <= stage_; ++t) members.push_back(stage_functions_[t].lock());
    return members;
  }

  /// Note [Joint backward]: runs the joint stage for the calls of `joint_members()`, from
  /// this call's environment: `inputs[m]` are the incoming gradients of member m (empty:
  /// the member is not part of the backward, its gradients are zeros), `needed[m]` which
  /// of its outputs the backward needs. The joint stage's outputs are this call's (the
  /// total gradients of the inputs of stages 0..k-1); the other members' come back
  /// undefined. Nullopt (the engine then applies the members one by one) in grad mode
  /// (the joint stage records no graph), without specialisation, or when the joint
  /// stage's variant cannot be built.
  ///
  /// Note [Joint siblings]: members after the chain's are siblings (calls of stage k of
  /// this closure made by other applications of the chain's call of stage k-1); each runs
  /// in a copy of the joint stage, from its incoming gradients and the stage k-1 values
  /// of its own environment, and returns only the gradients of its own stage k-1 inputs
  /// (the others are in this call's totals). A sibling that needs those runs apart.
  std::optional<std::vector<variable_list>> apply_joint(
      std::vector<variable_list> inputs, const std::vector<std::vector<char>>& needed,
      const std::vector<std::shared_ptr<Function>>& members) override {
    const auto& d = *desc_;
    const std::size_t J = d.joint_stage;
    const std::size_t siblings = inputs.size() - std::min(inputs.size(), stage_);
    if (J == 0 || stage_ + 1 != J || !d.specialize || GradMode::is_enabled() || inputs.size() < stage_ ||
        needed.size() != inputs.size() || (siblings > 0 && (!d.joint_siblings_ok || siblings > d.joint_siblings.copies)) ||
        (siblings > 0 && members.size() != inputs.size()))
      return std::nullopt;
    variable_list joint_inputs;
    joint_inputs.reserve(d.plan.stage_inputs(J).size());
    for (std::size_t m = 0; m < stage_; ++m) {
      const std::size_t count = d.flags[m + 1].inputs.size();
      STAGEJIT_CHECK(inputs[m].empty() || inputs[m].size() == count, "compiled stage ", m + 1,
                     ": joint backward got ", inputs[m].size(), " gradients, expected ", count);
      for (std::size_t i = 0; i < count; ++i) joint_inputs.push_back(inputs[m].empty() ? Variable() : inputs[m][i]);
    }
    // The siblings: a copy each, or apart when one needs the gradient of its own stage
    // k-1 inputs (a copy leaves those to the chain's call).
    const std::size_t k = stage_;
    std::vector<variable_list> outs(inputs.size());
    std::vector<char> apart(siblings, 0);
    for (std::size_t c = 0; c < d.joint_siblings.copies; ++c) {
      const StageCall* sib = nullptr;
      if (c < siblings) {
        const std::size_t m = k + c;
        const auto* fn = members[m] ? std::get_if<ClosureFunction>(&members[m]->kind) : nullptr;
        sib = fn ? dynamic_cast<const StageCall*>(fn->impl.get()) : nullptr;
        if (sib) sib->ensure_env();
        STAGEJIT_CHECK(sib && sib->desc_ == desc_ && sib->stage_ == stage_, "compiled stage ", stage_,
                       ": joint backward sibling ", c, " is not a call of this stage");
        STAGEJIT_CHECK(inputs[m].empty() || inputs[m].size() == d.joint_siblings.gradients, "compiled stage ",
                       stage_, ": joint backward sibling ", c, " got ", inputs[m].size(), " gradients, expected ",
                       d.joint_siblings.gradients);
        for (std::size_t i = 0; i < needed[m].size() && i < d.joint_sibling_own.size(); ++i)
          if (needed[m][i] && d.joint_sibling_own[i]) apart[c] = 1;
        if (apart[c]) sib = nullptr;
      }
      for (std::size_t i = 0; i < d.joint_siblings.gradients; ++i)
        joint_inputs.push_back(sib && !inputs[k + c].empty() ? inputs[k + c][i] : Variable());
      for (std::size_t v = 0; v < d.joint_siblings.values; ++v) {
        const std::size_t slot = v < d.joint_sibling_slots.size() ? d.joint_sibling_slots[v] : SIZE_MAX;
        if (sib && slot < sib->env_values_.size() && sib->env_values_[slot].defined()) {
          sib->check_version(slot);
          joint_inputs.push_back(sib->env_values_[slot]);
        } else {
          joint_inputs.push_back(Variable());
        }
      }
    }
    if (joint_inputs.size() != d.plan.stage_inputs(J).size()) return std::nullopt;
    ensure_env();
    std::vector<char> mask = needed[k - 1];
    mask.resize(d.joint_siblings.copies > 0 ? d.joint_siblings.outputs : d.plan.stage_outputs(J).size(), 1);
    mask.resize(d.plan.stage_outputs(J).size(), 0);  // the tie outputs: never
    CallState state;
    if (!run_stage(J, joint_inputs, state, &mask, /*captures=*/false)) return std::nullopt;
    for (std::size_t m = 0; m + 1 < k; ++m) outs[m].resize(d.gradient_of[m + 1].size());
    state.outputs.resize(d.gradient_of[k].size());
    outs[k - 1] = std::move(state.outputs);
    for (std::size_t c = 0; c < siblings; ++c) {
      const std::size_t m = k + c;
      if (!apart[c]) {
        outs[m].resize(d.gradient_of[k].size());
        continue;
      }
      auto* fn = std::get_if<ClosureFunction>(&members[m]->kind);
      outs[m] = fn->impl->apply(std::move(inputs[m]), needed[m]);
    }
    return outs;
  }

 private:
  /// `run` for stage `s`: this call's stage or the joint stage (Note [Joint backward]).
  /// Returns false (nothing run) when `s` is the joint stage and its variant cannot be built.
  bool run_stage(std::size_t s, const variable_list& inputs, CallState& state, const std::vector<char>* needed,
                 bool captures) const {
    const auto& d = *desc_;
    // Off: nothing the stage allocates goes to the cache, its ops included, also inside a
    // HostCacheScope opened around the call (Note [Eager ops allocate from the host cache],
    // ops/op_table-inl.hpp); the engine carries this to its other threads.
    memory::NoHostCacheScope no_host_cache(!d.cache_host_memory);
    // Note [Below libtorch's autograd keys]: here, and in the engine on every thread.
    BelowAtenAutograd below_autograd;
    const bool joint = d.joint_stage != 0 && s == d.joint_stage;
    const auto& stage_inputs = d.plan.stage_inputs(s);
    STAGEJIT_CHECK(inputs.size() == stage_inputs.size(), "compiled stage ", s, " expects ",
                   stage_inputs.size(), " inputs, got ", inputs.size());
    const StageClosure* full = joint ? nullptr : &d.stages[s];
    const StageClosure* chosen = full;
    auto prev_defined = [&](std::size_t slot) {
      return slot < env_values_.size() && env_values_[slot].defined();
    };
    if (d.specialize || joint) {
      StageVariantKey key;
      key.stage = s;
      const auto& full_prev = joint ? d.joint_prev_slots : full->prev_slots;
      key.defined_inputs.resize(inputs.size() + full_prev.size());
      for (std::size_t i = 0; i < inputs.size(); ++i) key.defined_inputs[i] = inputs[i].defined();
      for (std::size_t i = 0; i < full_prev.size(); ++i)
        key.defined_inputs[inputs.size() + i] = prev_defined(full_prev[i]);
      key.needed_outputs = needed ? *needed : std::vector<char>(d.plan.stage_outputs(s).size(), 1);
      // A stage that captures nothing (the last one) is the same with or without.
      key.captures = captures || d.plan.captures(s).empty();
      if (joint) {
        auto v = d.variant(key);  // never the full stage: it is not built ahead
        if (!v) return false;
        chosen = &v->closure;
      } else {
        chosen = &d.closure_for(key);
      }
    }
    const StageClosure& sc = *chosen;
    const bool zeros_are_symbolic = chosen != full;
    variable_list leaves;
    leaves.reserve(sc.roots.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const auto* type = stage_inputs[i]->tensor_type();
      if (!inputs[i].defined() && zeros_are_symbolic) {
        leaves.emplace_back();  // the variant does no work on it (Note [Symbolic zeros])
        continue;
      }
      if (!inputs[i].defined()) {
        // Undefined gradient: zeros of the traced shape.
        STAGEJIT_CHECK(type, "compiled stage ", s, ": input ", i, " is undefined and its "
                       "traced type is unknown");
        leaves.emplace_back(at::zeros(type->sizes, at::TensorOptions().dtype(type->dtype).device(type->device)));
        continue;
      }
      if (type && s > 0) {
        STAGEJIT_CHECK_AS(ShapeError, inputs[i].sizes() == at::IntArrayRef(type->sizes),
                          "compiled stage ", s, ": input ", i, " has shape ",
                          inputs[i].sizes(), " and dtype ", inputs[i].scalar_type(),
                          ", traced with ", at::IntArrayRef(type->sizes), " and ", type->dtype);
        // A gradient of another dtype is cast to the traced one, as libtorch's engine
        // casts a gradient to its input's dtype (validate_outputs).
        if (inputs[i].scalar_type() != type->dtype) {
          leaves.emplace_back(inputs[i].data().to(type->dtype));
          continue;
        }
      }
      leaves.emplace_back(inputs[i].data());
    }
    for (std::size_t slot : sc.prev_slots) {
      if (prev_defined(slot)) {
        check_version(slot);
        leaves.emplace_back(env_values_[slot].data());
      } else if (zeros_are_symbolic) {
        leaves.emplace_back();
      } else {
        // An earlier call's symbolic zero read by the full stage: zeros of its type.
        const auto* type = d.plan.slot_value(slot)->tensor_type();
        leaves.emplace_back(type ? Variable(at::zeros(type->sizes, at::TensorOptions()
                                                                        .dtype(type->dtype)
                                                                        .device(type->device)))
                                 : Variable());
      }
    }
    leaves.emplace_back();  // the ConstantFactory's single undefined input

    state.values.assign(d.plan.num_slots(), Variable());
    state.handles = env_handles_;
    state.handles.resize(d.plan.num_slots());
    state.outputs.clear();
    ExecuteOptions options;
    options.create_graph = false;
    options.keep_graph = true;
    options.single_threaded = !d.inter_op_parallel;
    options.cache_host_memory = d.cache_host_memory;
    options.below_aten_autograd = true;
    execute(sc.roots, leaves, options, sc.callbacks, &state);
    state.outputs.resize(sc.num_outputs);
    return true;
  }

 public:

  /// The call of stage `stage() + 1` primed with what this call captured in `state` (only
  /// the cross-stage values and Handles a later stage reads), for `run`. Throws `Error` at
  /// the last stage.
  std::shared_ptr<StageCall> next_call(const CallState& state) const {
    const auto& d = *desc_;
    STAGEJIT_CHECK(stage_ + 1 < d.num_stages(), "compiled stage ", stage_,
                   " is the last of ", d.num_stages(), " stages");
    auto [values, handles, versions] = primed(state);
    auto call = std::make_shared<StageCall>(desc_, stage_ + 1, std::move(values), std::move(handles),
                                            input_edges_, std::move(versions));
    call->stage_functions_ = stage_functions_;
    return call;
  }

  /// Runs the stage on `inputs` (see `run`) and links its outputs to the next stage as
  /// described in the file comment.
  variable_list apply(variable_list inputs) override {
    return apply(std::move(inputs), std::vector<char>(desc_->plan.stage_outputs(stage_).size(), 1));
  }

  /// As `apply`, computing only the outputs marked in `needed` (one per stage output; the
  /// engine's mask when the call is applied as a Function: the others come back
  /// undefined), and capturing for later stages only when one can follow (grad mode).
  variable_list apply(variable_list inputs, const std::vector<char>& needed_mask) override {
    return apply(std::move(inputs), needed_mask, OutputSink{});
  }

  /// As above; when `early` is set (the engine applies this call) and the outputs get no
  /// grad_fn (outside grad mode), each output is handed to `early` as soon as the stage
  /// has computed it, as the value `apply` would return (Note [Early outputs] in
  /// autograd/engine.hpp): a leaf's AccumulateGrad can then run while the rest of the
  /// stage runs. In grad mode the outputs need the next stage, primed by the whole call,
  /// as grad_fn, so they leave at the end.
  variable_list apply(variable_list inputs, const std::vector<char>& needed_mask,
                      const OutputSink& early) override {
    const auto& d = *desc_;
    CallState state;
    std::vector<char> needed = needed_mask;
    needed.resize(d.plan.stage_outputs(stage_).size(), 1);
    const bool captures = !d.linked() || (GradMode::is_enabled() && stage_ + 1 < d.num_stages());
    // Note [Anticipated stages]: a forward call may run stages ahead (`pack` then holds
    // them for the chain), a later call may be served by that run.
    std::shared_ptr<ChainLog> log = log_;
    std::shared_ptr<AnticipatedRun> pack;
    std::vector<int64_t> primed_versions;  // a served call of stage m: what it captured
    bool served = false;
    if (stage_ == 0) {
      served = run_ahead(inputs, needed, state, log, pack);
    } else {
      const bool first_match = log && log->record(stage_, inputs, needed, GradMode::is_enabled());
      if (pack_ && stage_ <= pack_->pattern->m && first_match && !pack_used_.exchange(true)) {
        served = serve_from_run(inputs, state, primed_versions);
        if (served) {
          pack = pack_;
          std::lock_guard<std::mutex> lock(log->mutex);
          ++log->hits;
        }
      }
      if (!served) ensure_env();
    }
    // The tensors the call was fed (its inputs and the earlier-stage values it was primed
    // with; for a call served by a run ahead, the forward's inputs), sorted, for
    // `alias_if_input`.
    std::vector<const c10::TensorImpl*> input_impls;
    input_impls.reserve(inputs.size() + d.stages[stage_].prev_slots.size());
    for (const auto& in : inputs)
      if (in.defined()) input_impls.push_back(in.data().unsafeGetTensorImpl());
    if (!served)  // a served call reads nothing of its environment (another thread may fill it)
      for (std::size_t slot : d.stages[stage_].prev_slots)
        if (slot < env_values_.size() && env_values_[slot].defined())
          input_impls.push_back(env_values_[slot].data().unsafeGetTensorImpl());
    if (pack)
      for (const auto& in : pack->inputs0)
        if (in.defined()) input_impls.push_back(in.data().unsafeGetTensorImpl());
    std::sort(input_impls.begin(), input_impls.end());
    if (!served) {
      if (early && !(GradMode::is_enabled() && d.linked())) {
        state.early_outputs = [&early, &input_impls](std::size_t i, Variable v) {
          early(i, v.defined() ? Variable(alias_if_input(v.data(), input_impls)) : Variable());
        };
      }
      run(inputs, state, &needed, captures);
      state.early_outputs = nullptr;
    }
    variable_list outs = std::move(state.outputs);

    // Edges of every graph input up to this stage, for the next stage's outputs.
    std::vector<Edge> edges = input_edges_;
    for (const auto& in : inputs) edges.push_back(in.requires_grad() ? in.gradient_edge() : Edge{});

    // Which outputs get the next stage as grad_fn. At the last compiled stage the trace
    // fed grad outputs that did not require grad, so its flags say nothing; there every
    // defined output gets the error function (asking for that derivative must fail
    // loudly, not look like a constant).
    const bool last = stage_ + 1 >= d.num_stages();
    std::vector<bool> wants(outs.size(), false);
    for (std::size_t i = 0; i < outs.size(); ++i)
      wants[i] = d.linked() && (last ? outs[i].defined()
                                     : (i < d.flags[stage_].outputs.size() &&
                                        d.flags[stage_].outputs[i].requires_grad));
    std::shared_ptr<Function> grad_fn;
    if (GradMode::is_enabled() && d.linked()) {
      bool any = false;
      for (std::size_t i = 0; i < outs.size(); ++i) any = any || (wants[i] && outs[i].defined());
      if (any) grad_fn = make_next(state, edges, log, pack, served ? &primed_versions : nullptr);
    }
    // Note [Forward calls whose backward never comes]: the inputs' copies, for a stage-1
    // call's rerun, once one can follow (nothing runs it before this call returns).
    if (pack && pack->uncaptured() && stage_ == 0 && grad_fn)
      for (const auto& in : pack->inputs0)
        pack->originals.push_back(in.defined() ? Variable(in.data().clone()) : Variable());
    variable_list result;
    result.reserve(outs.size());
    uint32_t next_input = 0;
    for (std::size_t i = 0; i < outs.size(); ++i) {
      bool rg = wants[i];
      if (!outs[i].defined()) {
        result.emplace_back();
        if (rg) ++next_input;
        continue;
      }
      at::Tensor data = alias_if_input(outs[i].data(), input_impls);
      if (rg && grad_fn) {
        result.emplace_back(std::move(data), Edge{grad_fn, next_input});
      } else {
        result.emplace_back(std::move(data));
      }
      if (rg) ++next_input;
    }
    if (pack && (stage_ < pack->pattern->m || (pack->uncaptured() && stage_ == 0))) {
      // What a later call of the chain checks the version of (Note [Anticipated stages]).
      std::lock_guard<std::mutex> lock(pack->mutex);
      auto& kept = pack->returned.at(stage_);
      kept.assign(result.size(), {});
      for (std::size_t j = 0; j < result.size(); ++j)
        if (result[j].defined()) kept[j] = {result[j].data(), version_of(result[j])};
    }
    return result;
  }

 private:
  /// Note [Anticipated stages]: for a forward call in grad mode, starts the chain's log
  /// and, when the closure's pattern is armed, runs stages 0..m as one graph, filling
  /// `state` as the stage would (its outputs; nothing captured: the calls of stages 1..m
  /// take what they need from `pack`). Returns true when it ran.
  bool run_ahead(const variable_list& inputs, const std::vector<char>& needed, CallState& state,
                 std::shared_ptr<ChainLog>& log, std::shared_ptr<AnticipatedRun>& pack) const {
    const auto& d = *desc_;
    if (!d.anticipate || d.anticipate_max == 0 || !d.linked() || !d.specialize || !GradMode::is_enabled())
      return false;
    for (char c : needed)
      if (!c) return false;
    std::shared_ptr<const MultiStageClosure::AnticipationPattern> current;
    auto armed = d.armed_pattern(&current);
    log = std::make_shared<ChainLog>(desc_, current);
    for (const auto& in : inputs)
      if (in.defined() && !in.data().device().is_cpu()) return false;
    if (!armed) {
      // Note [Forward calls whose backward never comes].
      auto idle = d.uncaptured_pattern();
      if (!idle) return false;
      run(inputs, state, &needed, /*captures=*/false);
      auto run_pack = std::make_shared<AnticipatedRun>();
      run_pack->pattern = std::move(idle);
      keep_inputs(*run_pack, inputs, /*copies=*/false);  // copied once a stage-1 call can follow (`apply`)
      run_pack->returned.resize(1);
      log->uncaptured = true;
      pack = std::move(run_pack);
      return true;
    }
    if (!d.anticipated_closure(*armed)) return false;
    variable_list all = inputs;
    for (const auto& seeds : armed->seeds) all.insert(all.end(), seeds.begin(), seeds.end());
    auto run = std::make_shared<AnticipatedRun>();
    run->pattern = armed;
    {
      StageCall call(armed->graph_closure, 0, {}, {}, {});
      CallState st;
      call.run(all, st);
      run->outputs = std::move(st.outputs);
    }
    for (const auto& o : run->outputs) run->output_versions.push_back(version_of(o));
    keep_inputs(*run, inputs);
    run->returned.resize(armed->m + 1);
    run->fed.resize(armed->m + 1);
    state.outputs.clear();
    for (std::ptrdiff_t idx : armed->layout.stage_outputs.at(0))
      state.outputs.push_back(idx >= 0 ? run->outputs.at(static_cast<std::size_t>(idx)) : Variable());
    state.values.assign(d.plan.num_slots(), Variable());
    state.handles.assign(d.plan.num_slots(), nullptr);
    log->anticipated = armed->m;
    pack = std::move(run);
    return true;
  }

  /// Note [Anticipated stages]: keeps the forward's inputs in `run`: their tensors, their
  /// versions now, and copies (the inputs are a small part of a step's memory traffic) in
  /// case a later call must rerun stage 0 after the caller changed an input in place.
  static void keep_inputs(AnticipatedRun& run, const variable_list& inputs, bool copies = true) {
    for (const auto& in : inputs) {
      run.inputs0.push_back(in.defined() ? Variable(in.data()) : Variable());  // no autograd record kept
      run.versions0.push_back(version_of(in));
      if (copies) run.originals.push_back(in.defined() ? Variable(in.data().clone()) : Variable());
    }
  }

  /// Note [Anticipated stages]: throws as `check_version` when a tensor a call of this
  /// stage would read saved (an input of the forward or a view of one, an earlier call's
  /// seed, an output returned by an earlier call) was modified in place since.
  void check_saved_versions() const {
    const auto& d = *desc_;
    const auto& P = *pack_->pattern;
    if (stage_ - 1 >= P.checks.size()) return;  // an uncaptured forward's stage 1: see ensure_env
    for (const auto& c : P.checks.at(stage_ - 1)) {
      at::Tensor tensor;
      int64_t saved = -1;
      if (!c.output && c.stage == 0) {
        if (c.index < pack_->inputs0.size() && pack_->inputs0[c.index].defined()) {
          tensor = pack_->inputs0[c.index].data();
          saved = pack_->versions0.at(c.index);
        }
      } else {
        std::lock_guard<std::mutex> lock(pack_->mutex);
        const auto& kept = c.output ? pack_->returned.at(c.stage) : pack_->fed.at(c.stage);
        if (c.index < kept.size()) std::tie(tensor, saved) = kept[c.index];
      }
      if (!tensor.defined() || saved < 0 || tensor.is_inference()) continue;
      const auto now = static_cast<int64_t>(tensor._version());
      if (now != saved)
        throw_modified(c.output ? d.plan.stage_outputs(c.stage).at(c.index) : d.plan.stage_inputs(c.stage).at(c.index),
                       tensor, now, saved);
    }
  }

  /// Note [Anticipated stages]: serves this call (stage t of 1..m, its seeds `inputs`
  /// matched) from the run ahead: checks the versions of what the stage would read saved
  /// (`check_saved_versions`), fills `state` with the stage's outputs and, at stage m, the
  /// values the next call is primed with and their versions (`versions`, per slot, -2 for
  /// none) as a call of stage m would have captured them. Reads nothing of this call's
  /// environment. Returns true.
  bool serve_from_run(const variable_list& inputs, CallState& state, std::vector<int64_t>& versions) const {
    const auto& d = *desc_;
    const auto& P = *pack_->pattern;
    const std::size_t t = stage_;
    {
      std::lock_guard<std::mutex> lock(pack_->mutex);
      auto& fed = pack_->fed.at(t);
      fed.clear();
      for (const auto& in : inputs)
        fed.emplace_back(in.defined() ? in.data() : at::Tensor(), in.defined() ? version_of(in) : -1);
    }
    check_saved_versions();
    // A result that is one of the pattern's seeds (a gradient passed through) is the seed
    // this chain was fed, as a view: never the pattern's own tensor.
    auto own = [&](Variable v) -> Variable {
      if (!v.defined()) return v;
      std::lock_guard<std::mutex> lock(pack_->mutex);
      for (std::size_t s = 1; s <= t; ++s)
        for (std::size_t i = 0; i < P.seeds.at(s - 1).size(); ++i)
          if (P.seeds[s - 1][i].defined() && P.seeds[s - 1][i].data().unsafeGetTensorImpl() == v.data().unsafeGetTensorImpl() &&
              i < pack_->fed.at(s).size() && pack_->fed[s][i].first.defined()) {
            at::Tensor alias = at::alias(pack_->fed[s][i].first);
            share_version_counter_with_base(alias, {pack_->fed[s][i].first});
            return Variable(std::move(alias));
          }
      return v;
    };
    const auto& L = P.layout;
    state.outputs.clear();
    for (std::ptrdiff_t idx : L.stage_outputs.at(t))
      state.outputs.push_back(idx >= 0 ? own(pack_->outputs.at(static_cast<std::size_t>(idx))) : Variable());
    state.values.assign(d.plan.num_slots(), Variable());
    state.handles.assign(d.plan.num_slots(), nullptr);
    versions.assign(d.plan.num_slots(), -2);
    if (t == P.m)
      for (const auto& src : L.primed) {
        Variable v;
        int64_t version = -1;
        if (src.kind == 0) {
          v = own(pack_->outputs.at(src.index));
          version = pack_->output_versions.at(src.index);
        } else if (src.kind == 1) {
          if (pack_->inputs0.at(src.index).defined()) v = Variable(pack_->inputs0[src.index].data());
          version = pack_->versions0.at(src.index);
        } else {
          std::lock_guard<std::mutex> lock(pack_->mutex);
          const auto& fed = pack_->fed.at(src.stage);
          if (src.index < fed.size() && fed[src.index].first.defined()) {
            v = Variable(fed[src.index].first);
            version = fed[src.index].second;
          }
        }
        state.values.at(src.slot) = std::move(v);
        versions.at(src.slot) = version;
      }
    return true;
  }

  /// Note [Anticipated stages]: a call primed by a run ahead that must run its stage after
  /// all (a miss, a second application, a joint backward) first gets the environment the
  /// chain's calls would have left it: stages 0..t-1 run again, once, from copies of the
  /// forward's inputs and the seeds its chain was fed. Throws `Error` as the stage's call
  /// would when a value it reads saved was modified in place since. No-op for every
  /// other call.
  void ensure_env() const {
    if (!pack_) return;
    std::call_once(env_once_, [this] {
      const auto& d = *desc_;
      check_saved_versions();  // as the stage's own call would, on what it reads saved
      // Stage 0 reruns on the copies of the forward's inputs (the caller may have changed
      // one it does not read saved since: a bias), the earlier stages on their seeds.
      auto call = std::make_shared<StageCall>(desc_, 0, std::vector<Variable>{}, std::vector<std::shared_ptr<Function>>{},
                                              std::vector<Edge>{});
      auto state = std::make_unique<CallState>();
      call->run(pack_->originals, *state);
      const variable_list rerun_outputs = state->outputs;  // stage 0's, of this rerun
      for (std::size_t s = 1; s < stage_; ++s) {
        call = call->next_call(*state);
        state = std::make_unique<CallState>();
        call->run(pack_->pattern->seeds.at(s - 1), *state);
      }
      std::shared_ptr<StageCall> mine = call->next_call(*state);
      env_values_ = std::move(mine->env_values_);
      env_handles_ = std::move(mine->env_handles_);
      env_versions_ = std::move(mine->env_versions_);
      // An input of the forward, or a seed an earlier call was fed, saved for this stage is
      // the caller's tensor at its version then, as the calls would have saved it (so an
      // in-place change since is refused as without anticipation).
      for (std::size_t slot = 0; slot < env_values_.size() && slot < d.plan.num_slots(); ++slot) {
        const ir::Value* v = d.plan.slot_value(slot);
        if (!env_values_[slot].defined() || !v->node()->is<ir::Param>()) continue;
        const auto& ins = d.plan.stage_inputs(v->stage());
        const std::size_t i = static_cast<std::size_t>(std::find(ins.begin(), ins.end(), v) - ins.begin());
        std::lock_guard<std::mutex> lock(pack_->mutex);
        if (v->stage() == 0 && i < pack_->inputs0.size() && pack_->inputs0[i].defined()) {
          env_values_[slot] = pack_->inputs0[i];
          if (slot < env_versions_.size()) env_versions_[slot] = pack_->versions0.at(i);
        } else if (v->stage() >= 1 && v->stage() < pack_->fed.size() && i < pack_->fed[v->stage()].size() &&
                   pack_->fed[v->stage()][i].first.defined()) {
          env_values_[slot] = Variable(pack_->fed[v->stage()][i].first);
          if (slot < env_versions_.size()) env_versions_[slot] = pack_->fed[v->stage()][i].second;
        }
      }
      // Note [Forward calls whose backward never comes]: an output of the forward saved for
      // this stage is the tensor the forward returned, at its version then, as the forward
      // would have saved it; a saved view of an input or of a returned output (a `t(W)`, a
      // value the output reshapes) counts the versions of that tensor, as the forward's own
      // view would have (so an in-place change since is refused exactly as without).
      if (pack_->uncaptured()) {
        const auto& outs = d.plan.stage_outputs(0);
        std::lock_guard<std::mutex> lock(pack_->mutex);
        const auto& kept = pack_->returned.at(0);
        for (std::size_t slot = 0; slot < env_values_.size() && slot < d.plan.num_slots(); ++slot) {
          if (!env_values_[slot].defined()) continue;
          const ir::Value* v = d.plan.slot_value(slot);
          bool replaced = false;
          for (std::size_t j = 0; j < outs.size() && j < kept.size(); ++j) {
            if (outs[j] != v || !kept[j].first.defined()) continue;
            env_values_[slot] = Variable(kept[j].first);
            if (slot < env_versions_.size()) env_versions_[slot] = kept[j].second;
            replaced = true;
            break;
          }
          if (replaced || v->node()->is<ir::Param>()) continue;
          at::Tensor e = env_values_[slot].data();
          if (e.is_inference()) continue;
          // The tensor whose versions it would have shared: an input it views (the rerun
          // read the input's copy), else a returned output it shares storage with.
          at::Tensor owner;
          int64_t version = -1;
          for (std::size_t i = 0; i < pack_->originals.size() && !owner.defined(); ++i)
            if (pack_->originals[i].defined() && pack_->inputs0[i].defined() && e.is_alias_of(pack_->originals[i].data())) {
              owner = pack_->inputs0[i].data();
              version = pack_->versions0.at(i);
            }
          for (std::size_t j = 0; j < rerun_outputs.size() && j < kept.size() && !owner.defined(); ++j)
            if (rerun_outputs[j].defined() && kept[j].first.defined() && e.is_alias_of(rerun_outputs[j].data())) {
              owner = kept[j].first;
              version = kept[j].second;
            }
          if (!owner.defined() || owner.is_inference() || version < 0) continue;
          e.unsafeGetTensorImpl()->set_version_counter(owner.unsafeGetTensorImpl()->version_counter());
          if (slot < env_versions_.size()) env_versions_[slot] = version;
        }
      }
    });
  }

  /// `out`, or a view of it (`at::alias`: same storage, sizes and strides, its own
  /// TensorImpl) when `out` is the very tensor of something the call was fed (`inputs`:
  /// their TensorImpls, sorted). A stage can return an input unchanged once passes have
  /// removed the ops between (`t(t(W))` folds to `W`, where eager code returns a view),
  /// so an output is never the caller's tensor itself: in-place metadata changes of it
  /// (`t_`, `resize_`, `as_strided_`) do not reach the caller's tensor, while data
  /// written in place does, as through any view.
  static at::Tensor alias_if_input(at::Tensor out, const std::vector<const c10::TensorImpl*>& inputs) {
    if (!std::binary_search(inputs.begin(), inputs.end(), out.unsafeGetTensorImpl())) return out;
    at::Tensor alias = at::alias(out);
    // An early output is aliased inside the stage, below libtorch's ADInplaceOrView kernel
    // (Note [Below libtorch's autograd keys]): it shares `out`'s version counter as that
    // kernel would make it, so a later in-place change of `out` is seen through it.
    share_version_counter_with_base(alias, {out});
    return alias;
  }

  /// The grad_fn of this call's outputs: the call of the next stage, whose next_functions
  /// are the edges of the graph inputs its regular outputs are gradients of, then, for
  /// its cross-stage gradients (Note [Cross-stage gradients] in trace/trace.hpp), the
  /// gradient inputs of the earlier calls of this chain that differentiate the values'
  /// producers. Null when no edge leads anywhere.
  std::shared_ptr<Function> make_next(CallState& state, const std::vector<Edge>& edges,
                                      const std::shared_ptr<ChainLog>& log = nullptr,
                                      const std::shared_ptr<AnticipatedRun>& pack = nullptr,
                                      const std::vector<int64_t>* served_versions = nullptr) {
    const auto& d = *desc_;
    const std::size_t next = stage_ + 1;
    if (next >= d.num_stages()) {
      const auto num_grads = static_cast<uint32_t>(d.flags[stage_].outputs.size());
      std::vector<Edge> live;
      for (const auto& e : edges)
        if (e.is_valid()) live.push_back(e);
      // With cross-stage gradients the next derivative would also flow into the calls of
      // this chain: asking for one through them must fail too.
      if (d.cross_stage)
        for (const auto& f : stage_functions_)
          if (auto fn = f.lock()) live.push_back(Edge{std::move(fn), 0});
      if (live.empty()) return nullptr;
      return make_function(ErrorFunction{"stagejit: the function was compiled only for " +
                                         std::to_string(d.num_stages() - 1) +
                                         " derivatives; trace more with "
                                         "CompileOptions::derivatives"},
                           std::move(live), num_grads);
    }
    std::vector<Edge> next_edges;
    bool any_edge = false;
    for (std::size_t gi : d.gradient_of[next]) {
      next_edges.push_back(gi < edges.size() ? edges[gi] : Edge{});
      any_edge = any_edge || next_edges.back().is_valid();
    }
    for (const StageInputRef& f : d.feeds[next]) {
      std::shared_ptr<Function> fn = f.stage < stage_functions_.size() ? stage_functions_[f.stage].lock() : nullptr;
      if (fn) {
        next_edges.push_back(Edge{std::move(fn), static_cast<uint32_t>(f.index)});
      } else {
        // The call this gradient feeds is gone (nothing holds it any more): never drop
        // the contribution silently; a backward reaching the inputs through here throws.
        std::vector<Edge> live;
        for (const auto& e : edges)
          if (e.is_valid()) live.push_back(e);
        next_edges.push_back(live.empty() ? Edge{}
                                          : Edge{make_function(ErrorFunction{
                                                     "stagejit: compiled stage " + std::to_string(next) +
                                                     ": the call of stage " + std::to_string(f.stage) +
                                                     " that its cross-stage gradient feeds was freed; keep the "
                                                     "earlier stages' outputs alive while differentiating"},
                                                 std::move(live), 1),
                                                 0});
      }
      any_edge = any_edge || next_edges.back().is_valid();
    }
    if (!any_edge) return nullptr;
    auto [values, handles, versions] = primed(state, served_versions);
    auto impl = std::make_shared<StageCall>(desc_, next, std::move(values), std::move(handles), edges,
                                            std::move(versions));
    impl->log_ = log;
    if (pack && (next <= pack->pattern->m || (pack->uncaptured() && next == 1))) impl->pack_ = pack;
    const auto num_grads = static_cast<uint32_t>(d.flags[next].inputs.size());
    auto fn = make_function(ClosureFunction{impl}, std::move(next_edges), num_grads);
    if (d.joint_stage != 0 && next + 1 == d.joint_stage) impl->parent_token_ = token_;  // Note [Joint siblings]
    if (d.cross_stage || d.joint_stage != 0) {
      impl->stage_functions_ = stage_functions_;
      impl->stage_functions_.resize(d.num_stages());
      impl->stage_functions_[next] = fn;
    }
    return fn;
  }

  /// The cross-stage values and Handles a stage after this one reads, from this call's
  /// captures or (for values of earlier stages) what this call was primed with, and the
  /// versions of those values when captured (now for this call's captures).
  std::tuple<std::vector<Variable>, std::vector<std::shared_ptr<Function>>, std::vector<int64_t>>
  primed(const CallState& state, const std::vector<int64_t>* served_versions = nullptr) const {
    const auto& d = *desc_;
    std::vector<Variable> values(d.plan.num_slots());
    std::vector<std::shared_ptr<Function>> handles(d.plan.num_slots());
    std::vector<int64_t> versions(d.plan.num_slots(), -1);
    for (std::size_t slot : d.plan.needed_after(stage_)) {
      if (served_versions) {
        // Note [Anticipated stages]: a served call primes from its run alone, with the
        // versions its values had when a call of its stage would have captured them.
        values[slot] = state.values[slot];
        const int64_t v = slot < served_versions->size() ? (*served_versions)[slot] : -2;
        versions[slot] = v >= -1 ? v : version_of(values[slot]);
      } else if (state.values[slot].defined()) {
        values[slot] = state.values[slot];
        versions[slot] = version_of(values[slot]);
      } else if (slot < env_values_.size()) {
        values[slot] = env_values_[slot];
        versions[slot] = slot < env_versions_.size() ? env_versions_[slot] : version_of(values[slot]);
      }
      if (slot < state.handles.size() && state.handles[slot]) handles[slot] = state.handles[slot];
    }
    return {std::move(values), std::move(handles), std::move(versions)};
  }

  /// The version counter of `v`'s tensor (`at::Tensor::_version()`), -1 when it has none
  /// (undefined, or an inference tensor).
  static int64_t version_of(const Variable& v) {
    if (!v.defined() || v.data().is_inference()) return -1;
    return static_cast<int64_t>(v.data()._version());
  }

  /// Throws `Error` when the env value of `slot` was modified in place since an earlier
  /// stage captured it, as libtorch refuses a modified saved variable.
  void check_version(std::size_t slot) const {
    const int64_t saved = slot < env_versions_.size() ? env_versions_[slot] : -1;
    if (saved < 0) return;
    const int64_t now = version_of(env_values_[slot]);
    if (now == saved) return;
    throw_modified(desc_->plan.slot_value(slot), env_values_[slot].data(), now, saved);
  }

  /// Throws the `Error` of `check_version` for value `v` of the graph, whose tensor `t`
  /// is at version `now` where `saved` was expected.
  [[noreturn]] void throw_modified(const ir::Value* v, const at::Tensor& t, int64_t now, int64_t saved) const {
    ::stagejit::detail::throw_error<Error>(
        "compiled stage ", stage_, ": one of the variables needed for gradient computation has been "
        "modified by an inplace operation: ", ir::value_label(v),
        " (", v->node()->is<ir::Param>() ? "an input" : "a value", " of stage ", v->stage(), ", a ",
        t.scalar_type(), " tensor of shape ", t.sizes(), "), saved for this stage, is at version ",
        now, "; expected version ", saved, " instead (it was modified in place after it was saved)");
  }

  std::shared_ptr<const MultiStageClosure> desc_;
  std::size_t stage_;
  // Mutable: a call served by a run ahead is primed with nothing; `ensure_env` fills
  // them once when it must run its stage after all (Note [Anticipated stages]).
  mutable std::vector<Variable> env_values_;
  mutable std::vector<std::shared_ptr<Function>> env_handles_;
  std::vector<Edge> input_edges_;
  mutable std::vector<int64_t> env_versions_;  ///< per slot: the env value's version when captured, or -1
  /// Note [Anticipated stages]: the chain's log, what its forward ran ahead (null: nothing
  /// for this call), whether a call took it, and the one rebuild of the environment.
  std::shared_ptr<ChainLog> log_;
  std::shared_ptr<AnticipatedRun> pack_;
  std::atomic<bool> pack_used_{false};
  mutable std::once_flag env_once_;
  /// Per stage t >= 1: the Function of stage t of this chain of calls (the grad_fn an
  /// earlier call made), where cross-stage gradients of stage t-1's values go, and the
  /// members of a joint backward (Note [Joint backward]). Weak: a later call's
  /// next_functions hold the ones it feeds.
  std::vector<std::weak_ptr<Function>> stage_functions_;
  /// Note [Joint siblings]: this call's identity, shared by the calls it makes (held by
  /// them, so never reused while one lives), and the identity of the call that made this one.
  std::shared_ptr<const char> token_;
  std::shared_ptr<const char> parent_token_;
  std::string name_;
};

/// Checks that each defined output of stage `s` has the dtype and sizes its value declares
/// (a graph read from text may declare types its ops do not compute; a traced graph's
/// types are what ran). Throws DtypeError / ShapeError naming the value as `--print`
/// does and the line and column of the node that made it.
inline void check_declared_types(const std::vector<ir::Value*>& values, const variable_list& outputs, std::size_t s) {
  for (std::size_t i = 0; i < values.size() && i < outputs.size(); ++i) {
    const ir::TensorType* declared = values[i]->tensor_type();
    if (!declared || !outputs[i].defined()) continue;
    const at::Tensor& t = outputs[i].data();
    const bool dtype_ok = t.scalar_type() == declared->dtype;
    if (dtype_ok && t.sizes() == at::IntArrayRef(declared->sizes)) continue;
    const std::string what = ::stagejit::detail::str_cat(
        "stage ", s, " output ", i, ", ", ir::value_label(values[i]), " (node ", ir::node_label(values[i]->node()),
        "), is a ", t.scalar_type(), " tensor of sizes ", t.sizes(), " but is declared ", ir::to_string(values[i]->type()));
    if (!dtype_ok) throw DtypeError(what);
    throw ShapeError(what);
  }
}

/// Runs stages 0..inputs.size()-1 of `closure` one after another, stage s on `inputs[s]`
/// (one Variable per stage input; an undefined one becomes zeros of the declared type),
/// each primed with what the earlier stages captured; no autograd linkage. Returns each
/// stage's outputs. Used by `stagejit-run --stage K` and for graphs parsed from text.
/// Throws `Error` for more input lists than stages, and what `StageCall::run` throws.
inline std::vector<variable_list> run_stages(std::shared_ptr<const MultiStageClosure> closure,
                                             const std::vector<variable_list>& inputs) {
  STAGEJIT_CHECK(closure, "run_stages: null closure");
  STAGEJIT_CHECK(inputs.size() <= closure->num_stages(), "run_stages: ", inputs.size(),
                 " input lists for a graph of ", closure->num_stages(), " stages");
  std::vector<variable_list> results;
  auto call = std::make_shared<StageCall>(closure, 0, std::vector<Variable>{},
                                          std::vector<std::shared_ptr<Function>>{},
                                          std::vector<Edge>{});
  for (std::size_t s = 0; s < inputs.size(); ++s) {
    CallState state;
    call->run(inputs[s], state);
    check_declared_types(closure->plan.stage_outputs(s), state.outputs, s);
    results.push_back(std::move(state.outputs));
    if (s + 1 < inputs.size()) call = call->next_call(state);
  }
  return results;
}

}  // namespace stagejit::closure
