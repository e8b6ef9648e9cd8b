#pragma once
/// \file
/// Stage variants: one stage of a compiled multi-stage graph specialised on what a call
/// needs (libtorch computes only the gradients a backward asks for, through the engine's
/// `exec_info` / `needs_input_grad`; a compiled stage does the same through these).
///
/// Note [Stage variants]
/// A call of stage s is described by a `StageVariantKey`:
/// - `defined_inputs`: which stage inputs (incoming gradients) and which earlier-stage
///   values read by the stage are defined. An undefined one is a symbolic zero
///   (`passes::propagate_zeros`): the work on it disappears instead of running on a
///   tensor of zeros (and 0 * inf never makes a NaN that libtorch would not make). An
///   undefined stage input that a later stage reads stays undefined in the call's
///   environment, so the later stage treats it as a zero too.
/// - `needed_outputs`: which outputs the running backward needs (the engine says so:
///   `engine::should_compute_output`). The others are replaced by undefined values.
/// - `captures`: whether a later stage will run from this call (the call is made in grad
///   mode: create_graph). Without it nothing is computed for later stages.
/// The variant is built from the stage's optimised and fused graph: a clone whose stage
/// s is rewritten as above and cleaned by DCE (fusion groups reading a zero get a
/// specialised subgraph), and a `StageClosure` built from it whose cross-stage slots are
/// renumbered to the full closure's (so a variant reads and fills the same call state).
/// When captures are kept, nodes whose outputs a later stage reads are *pinned*: never
/// replaced by another value, so every value a later stage expects is computed as in the
/// full stage, or is a zero the call leaves undefined in its environment (the later
/// stage's variant then treats it as a symbolic zero).
/// Variants are built on first use and cached per key by the `MultiStageClosure`; the
/// all-defined, all-needed, capturing key is the full stage itself.

#include <stagejit/closure/plan.hpp>
#include <stagejit/closure/stage_closure.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/passes/zeros.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace stagejit::closure {

/// What a call of one stage needs (Note [Stage variants]).
struct StageVariantKey {
  std::size_t stage = 0;
  /// One per stage input, then one per earlier-stage tensor the stage reads (the full
  /// closure's `prev_slots`, in order): 1 defined, 0 undefined (a symbolic zero).
  std::vector<char> defined_inputs;
  std::vector<char> needed_outputs;  ///< one per stage output: 1 computed, 0 left undefined
  bool captures = true;              ///< compute what later stages read

  /// True when the key asks for everything: the full stage serves it.
  bool is_full() const noexcept {
    if (!captures) return false;
    for (char c : defined_inputs)
      if (!c) return false;
    for (char c : needed_outputs)
      if (!c) return false;
    return true;
  }
  friend bool operator==(const StageVariantKey&, const StageVariantKey&) = default;
  /// E.g. `stage 2 inputs 10 outputs 011 captures 0`.
  std::string to_string() const {
    std::string s = "stage " + std::to_string(stage) + " inputs ";
    for (char c : defined_inputs) s += c ? '1' : '0';
    s += " outputs ";
    for (char c : needed_outputs) s += c ? '1' : '0';
    s += captures ? " captures 1" : " captures 0";
    return s;
  }
};

struct StageVariantKeyHash {
  std::size_t operator()(const StageVariantKey& k) const noexcept {
    std::size_t h = std::hash<std::size_t>{}(k.stage) * 31 + (k.captures ? 1 : 0);
    for (char c : k.defined_inputs) h = h * 1000003u ^ static_cast<std::size_t>(c + 2);
    h = h * 1000003u ^ 7u;
    for (char c : k.needed_outputs) h = h * 1000003u ^ static_cast<std::size_t>(c + 2);
    return h;
  }
};

/// One specialised stage (Note [Stage variants]).
struct StageVariant {
  StageVariantKey key;
  /// The specialised graph (a clone of the full graph; only stage `key.stage` is
  /// meaningful). Kept for inspection (`ir::to_string`) and tests.
  std::shared_ptr<ir::Graph> graph;
  /// The closure of the specialised stage; its slots use the full plan's numbering.
  StageClosure closure;
  /// Nodes of the specialised stage (the full stage's count is in its plan).
  std::size_t num_nodes = 0;
};

namespace detail {

// Whether use `u` belongs to a stage that runs after a call of stage `s`, from what that
// call leaves: a later stage, but not the joint stage beside `s` (Note [Joint stage] in
// ir/graph.hpp), which runs from the environment `s` was primed with, not from its call.
inline bool later_use(const ir::Graph& g, const ir::Use& u, std::size_t s) {
  const std::size_t t = u.user == g.return_node() ? g.output_stage(u.offset) : u.user->stage();
  return t > s && !(g.joint_stage() != 0 && t == g.joint_stage() && s + 1 == t);
}

}  // namespace detail

/// Builds the variant `key` of a stage of `graph` (the full, optimised graph whose plan
/// is `plan`). Throws `CompileError` when the stage cannot be specialised (a zero without
/// a tensor type to materialise, a cross-stage value the full plan does not know); the
/// caller then runs the full stage.
///
/// `prev_slots`: the earlier-stage tensors the full stage reads (its closure's
/// `prev_slots`), which the tail of `key.defined_inputs` describes. `tile_rows`: as
/// `StageClosure`'s (row-tiled regions; 0: none).
inline std::shared_ptr<const StageVariant> build_stage_variant(
    const ir::Graph& graph, const CrossStagePlan& plan, const std::vector<std::size_t>& prev_slots,
    const StageVariantKey& key, int64_t tile_rows = 0) {
  const std::size_t s = key.stage;
  STAGEJIT_CHECK_AS(CompileError, s < plan.num_stages(), "stage variant: stage ", s,
                    " of a graph of ", plan.num_stages(), " stages");
  const auto& full_inputs = plan.stage_inputs(s);
  const auto& full_outputs = plan.stage_outputs(s);
  STAGEJIT_CHECK_AS(CompileError,
                    key.defined_inputs.size() == full_inputs.size() + prev_slots.size() &&
                        key.needed_outputs.size() == full_outputs.size(),
                    "stage variant: ", key.to_string(), " does not match stage ", s, " (",
                    full_inputs.size(), " inputs, ", prev_slots.size(),
                    " earlier-stage values, ", full_outputs.size(), " outputs)");

  std::vector<ir::Value*> map;
  std::shared_ptr<ir::Graph> g = graph.clone(&map);
  // Each value of the clone -> the value of `graph` it copies (grown for new values).
  std::vector<const ir::Value*> origin(g->id_bound(), nullptr);
  for (ir::Value* v : graph.inputs()) origin[map[v->id()]->id()] = v;
  for (ir::Node* n : graph.nodes())
    for (ir::Value* v : n->outputs()) origin[map[v->id()]->id()] = v;
  auto origin_of = [&](const ir::Value* v) -> const ir::Value* {
    return v->id() < origin.size() ? origin[v->id()] : nullptr;
  };
  auto set_origin = [&](const ir::Value* v, const ir::Value* o) {
    if (origin.size() <= v->id()) origin.resize(std::max(2 * origin.size(), v->id() + 1), nullptr);
    origin[v->id()] = o;
  };

  auto undefined_at = [&](std::size_t stage) {
    ir::Node* u = g->create(ir::Undefined{}, {}, {ir::UnknownType{}});
    u->set_stage(stage);
    g->prepend(u);
    return u->output();
  };

  // Stage s's values, inputs first.
  std::vector<ir::Value*> stage_values = g->stage_inputs(s);
  for (ir::Node* n : g->nodes())
    if (n->stage() == s)
      for (ir::Value* v : n->outputs()) stage_values.push_back(v);

  // Later stages: cut (no captures) or pin the nodes they read.
  std::vector<char> pinned(g->id_bound(), 0);
  {
    // One Undefined per reading stage, made at that stage (the joint stage, which reads
    // no value of the stage before it, gets its own).
    std::vector<ir::Value*> cut(g->num_stages(), nullptr);
    for (ir::Value* v : stage_values) {
      auto uses = v->uses();
      for (const ir::Use& u : uses) {
        if (!detail::later_use(*g, u, s)) continue;
        if (key.captures) {
          if (!v->node()->is<ir::Param>()) pinned[v->node()->id()] = 1;
          continue;
        }
        std::size_t t = u.user == g->return_node() ? g->output_stage(u.offset) : u.user->stage();
        if (!(g->joint_stage() != 0 && t == g->joint_stage())) t = s + 1 < g->num_stages() ? s + 1 : s;
        if (!cut[t]) cut[t] = undefined_at(t);
        u.user->replace_input(u.offset, cut[t]);
      }
    }
  }

  // Outputs nobody needs.
  std::size_t begin = 0;
  for (std::size_t t = 0; t < s; ++t) begin += g->stage_output_counts()[t];
  ir::Value* undef = nullptr;
  auto undefine_output = [&](std::size_t j) {
    if (!undef) undef = undefined_at(s);
    g->return_node()->replace_input(begin + j, undef);
  };
  for (std::size_t j = 0; j < key.needed_outputs.size(); ++j)
    if (!key.needed_outputs[j]) undefine_output(j);

  // Undefined inputs are symbolic zeros.
  std::vector<ir::Value*> zeros;
  const std::vector<ir::Value*> inputs = g->stage_inputs(s);
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (!key.defined_inputs[i]) zeros.push_back(inputs[i]);
  for (std::size_t i = 0; i < prev_slots.size(); ++i)
    if (!key.defined_inputs[inputs.size() + i])
      zeros.push_back(map.at(plan.slot_value(prev_slots[i])->id()));
  if (!zeros.empty()) {
    passes::ZeroPropagation hooks;
    hooks.on_replace = [&](ir::Value* from, ir::Value* to) {
      // A pinned FusionGroup's outputs move to its specialised copy: later stages read
      // them under the same slots.
      if (!origin_of(to) && origin_of(from)) set_origin(to, origin_of(from));
    };
    std::vector<ir::Value*> live = passes::propagate_zeros(*g, s, zeros, &pinned, hooks);
    for (ir::Value* z : live) {
      auto uses = z->uses();
      ir::Value* left_undefined = nullptr;
      for (const ir::Use& u : uses) {
        if (u.user == g->return_node() && g->output_stage(u.offset) == s) {
          undefine_output(u.offset - begin);  // a zero gradient is an undefined one
          continue;
        }
        if (!detail::later_use(*g, u, s)) continue;  // an earlier stage's own use
        // A later stage reads it (captures are on: a zero stage input, or an all-zero
        // output of a pinned node): it stays undefined in the call's environment, and
        // the later stage's variant treats it as a zero.
        if (!left_undefined) {
          left_undefined = undefined_at(s);
          set_origin(left_undefined, origin_of(z));
        }
        u.user->replace_input(u.offset, left_undefined);
      }
    }
  }
  passes::eliminate_dead_code(*g);

  CrossStagePlan vplan(*g);
  std::vector<std::size_t> slot_map(vplan.num_slots(), static_cast<std::size_t>(-1));
  for (std::size_t slot = 0; slot < vplan.num_slots(); ++slot) {
    const ir::Value* o = origin_of(vplan.slot_value(slot));
    std::ptrdiff_t full = o ? plan.slot_of(o) : -1;
    // Slots of other stages' bookkeeping may not exist in the full plan (values cut
    // above); only the ones stage s reads or captures must.
    slot_map[slot] = full >= 0 ? static_cast<std::size_t>(full) : static_cast<std::size_t>(-1);
  }
  auto check_slots = [&](const std::vector<std::size_t>& slots, const char* what) {
    for (std::size_t slot : slots)
      STAGEJIT_CHECK_AS(CompileError, slot_map[slot] != static_cast<std::size_t>(-1),
                        "stage variant ", key.to_string(), ": the ", what, " %",
                        vplan.slot_value(slot)->id(), " has no slot in the full plan");
  };
  check_slots(vplan.uses_from_earlier(s), "earlier-stage value");
  check_slots(vplan.captures(s), "captured value");
  if (key.captures) {
    // Everything the full stage captures for later stages is captured here too.
    std::vector<char> have(plan.num_slots(), 0);
    for (std::size_t slot : vplan.captures(s)) have[slot_map[slot]] = 1;
    for (std::size_t slot : plan.captures(s))
      STAGEJIT_CHECK_AS(CompileError, have[slot], "stage variant ", key.to_string(),
                        ": value %", plan.slot_value(slot)->id(),
                        " a later stage reads is not captured");
  }

  auto variant = std::make_shared<StageVariant>(StageVariant{key, g, StageClosure(vplan, s, &slot_map, tile_rows), 0});
  variant->closure.install_handle_callbacks(vplan);
  variant->num_nodes = vplan.stage_nodes(s).size();
  return variant;
}

}  // namespace stagejit::closure
