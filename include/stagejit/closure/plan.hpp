#pragma once
/// \file
/// The cross-stage plan of a multi-stage graph (the seed's CrossStageStateDesc, docs/seed-system.md
/// §3.3, restated for Values and fixed for the cases the seed got wrong: values used two or
/// more stages later (carried through the stages between, docs/seed-system.md §6.3), stages left
/// empty by DCE, graph outputs produced at an earlier stage (docs/seed-system.md §6.5)).
///
/// Note [Cross-stage slots]: every value that crosses a stage boundary (a tensor or a
/// Handle produced at stage s and used at a stage t > s, by a node or as a graph output)
/// gets one slot number. A call of stage s stores what it produces for later stages in
/// its call state under those slots (captures); the closure of stage s+1 is primed with
/// the slots still needed at a stage > s (and nothing else); stage t reads the slots it
/// uses from that environment (previous-stage inputs).

#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/printer.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace stagejit::closure {

// Note [Program order of random ops]
// A compiled stage runs as a dataflow graph of Functions (closure/stage_closure.hpp): the
// engine starts a Function once its inputs arrived, in an order that follows the edges,
// not the program. Two random ops that do not depend on each other (`dropout(exp(a))`
// and `dropout(b)`) may then draw from ATen's default generator in the other order than
// the eager call did, and each gets the other's mask (the engine ran `dropout(b)` first
// as soon as the fusion group before `dropout(exp(a))` had a second output to hand on).
// So the nodes that must keep their program order (`keeps_program_order`: ops with side
// effects, i.e. random and in-place ops, and host functions, which may draw) are
// chained, per stage, in graph order: each waits for the previous one through an
// order gate (StageClosure: a Function between its first tensor input and its producer
// that also waits for the first output of the previous chained node). The graph
// order is the program order: the passes never move these nodes past each other (the
// fuser never groups them and places a group at its last member, DCE and CSE keep
// them). The row-tiled region planner (closure/tiled_plan.hpp) counts the chain as a
// dependency when it keeps regions convex, so the gates make no cycle.

/// True for nodes that run in graph order relative to each other in a compiled stage
/// (Note [Program order of random ops]).
inline bool keeps_program_order(const ir::Node& n) { return n.has_side_effects() || n.is<ir::HostOp>(); }

class CrossStagePlan {
 public:
  /// Builds the plan. Throws `CompileError` naming the node when a node uses a value of a
  /// later stage.
  explicit CrossStagePlan(const ir::Graph& graph)
      : num_stages_(graph.num_stages()), id_bound_(graph.id_bound()),
        slot_by_id_(graph.id_bound(), no_slot) {
    const std::size_t S = num_stages_;
    stage_nodes_.resize(S);
    stage_inputs_.resize(S);
    stage_outputs_.resize(S);
    uses_from_earlier_.resize(S);
    captures_.resize(S);
    needed_after_.resize(S);
    for (ir::Value* v : graph.inputs()) stage_inputs_.at(v->stage()).push_back(v);
    for (std::size_t s = 0; s < S; ++s) stage_outputs_[s] = graph.stage_outputs(s);

    // Per stage, which slots are already in its lists (dense by slot: a linear search of
    // the lists made the plan quadratic in the number of cross-stage values).
    std::vector<std::vector<char>> in_uses(S), in_caps(S), in_need(S);
    auto add_once = [](std::vector<std::size_t>& list, std::vector<char>& seen, std::size_t slot) {
      if (seen.size() <= slot) seen.resize(slot + 1, 0);
      if (!seen[slot]) {
        seen[slot] = 1;
        list.push_back(slot);
      }
    };
    auto note_use = [&](ir::Value* v, std::size_t user_stage, const char* what) {
      std::size_t def = v->stage();
      STAGEJIT_CHECK_AS(CompileError, def <= user_stage, what, " of stage ", user_stage,
                        " uses ", ir::value_label(v), " of the later stage ", def);
      STAGEJIT_CHECK_AS(CompileError, graph.stage_reads(user_stage, def), what, " of the joint stage ",
                        user_stage, " uses ", ir::value_label(v), " of stage ", def,
                        ", beside which it runs (Note [Joint stage] in ir/graph.hpp)");
      if (def == user_stage) return;
      std::size_t slot = slot_for(v);
      add_once(uses_from_earlier_[user_stage], in_uses[user_stage], slot);
      add_once(captures_[def], in_caps[def], slot);
      for (std::size_t s = def; s < user_stage; ++s) add_once(needed_after_[s], in_need[s], slot);
    };
    for (ir::Node* n : graph.nodes()) {
      STAGEJIT_CHECK_AS(CompileError, n->stage() < S, "node ", ir::node_label(n), " has stage ",
                        n->stage(), " but the graph has ", S, " stages");
      stage_nodes_[n->stage()].push_back(n);
      for (ir::Value* in : n->inputs()) note_use(in, n->stage(), "node");
    }
    for (std::size_t s = 0; s < S; ++s)
      for (ir::Value* out : stage_outputs_[s]) note_use(out, s, "an output");
  }

  std::size_t num_stages() const noexcept { return num_stages_; }
  /// Nodes of stage s in topological order (may be empty).
  const std::vector<ir::Node*>& stage_nodes(std::size_t s) const { return stage_nodes_.at(s); }
  /// Graph inputs of stage s, in order.
  const std::vector<ir::Value*>& stage_inputs(std::size_t s) const { return stage_inputs_.at(s); }
  /// Graph outputs of stage s, in order.
  const std::vector<ir::Value*>& stage_outputs(std::size_t s) const { return stage_outputs_.at(s); }
  /// Slots of earlier-stage values stage s reads (tensors and Handles), in first-use order.
  const std::vector<std::size_t>& uses_from_earlier(std::size_t s) const {
    return uses_from_earlier_.at(s);
  }
  /// Slots of values stage s produces that a later stage reads.
  const std::vector<std::size_t>& captures(std::size_t s) const { return captures_.at(s); }
  /// Slots a closure of stage s+1 must be primed with (used at a stage > s, made at <= s).
  const std::vector<std::size_t>& needed_after(std::size_t s) const { return needed_after_.at(s); }
  /// Number of slots (Note [Cross-stage slots]).
  std::size_t num_slots() const noexcept { return slot_values_.size(); }
  /// The value of a slot.
  ir::Value* slot_value(std::size_t slot) const { return slot_values_.at(slot); }
  /// One past the largest node or value id of the graph (`ir::Graph::id_bound`).
  std::size_t id_bound() const noexcept { return id_bound_; }
  /// The slot of a cross-stage value, or -1.
  std::ptrdiff_t slot_of(const ir::Value* v) const {
    if (v->id() >= slot_by_id_.size()) return -1;
    const std::size_t slot = slot_by_id_[v->id()];
    return slot != no_slot && slot_values_[slot] == v ? static_cast<std::ptrdiff_t>(slot) : -1;
  }

 private:
  std::size_t slot_for(ir::Value* v) {
    std::size_t& slot = slot_by_id_[v->id()];
    if (slot == no_slot) {
      slot_values_.push_back(v);
      slot = slot_values_.size() - 1;
    }
    return slot;
  }

  static constexpr std::size_t no_slot = static_cast<std::size_t>(-1);
  std::size_t num_stages_;
  std::size_t id_bound_;
  std::vector<std::vector<ir::Node*>> stage_nodes_;
  std::vector<std::vector<ir::Value*>> stage_inputs_;
  std::vector<std::vector<ir::Value*>> stage_outputs_;
  std::vector<std::vector<std::size_t>> uses_from_earlier_;
  std::vector<std::vector<std::size_t>> captures_;
  std::vector<std::vector<std::size_t>> needed_after_;
  std::vector<std::size_t> slot_by_id_;  // value id -> slot, no_slot for the others
  std::vector<ir::Value*> slot_values_;
};

}  // namespace stagejit::closure
