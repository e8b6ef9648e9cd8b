#pragma once
/// \file
/// `StageClosure`: the immutable function graph of one stage (docs/seed-system.md §3.4-3.7),
/// built once and shared by every call. Per-call state never lives here: captures,
/// Handles and outputs go through the callback policies (CaptureOutput, CaptureHandle,
/// RunHandle, CaptureOutputs: autograd/callbacks.hpp) into the `CallState` each call
/// passes to `execute` (Note [Cross-stage slots] in plan.hpp), so one closure can run
/// on several threads at once and a call copies no table.
///
/// Function per node (docs/seed-system.md §3.5): Param -> InputPlaceholder (a root); a value of an
/// earlier stage -> PrevStageInput (a root); Constant -> WrapConstant fed by the single
/// ConstantFactory root (so are nullary ops such as `zeros`); Undefined -> EmitNull (never run: consumers see undefined);
/// Op -> OpCall over the op table; FusionGroup -> FusedKernel running the generated
/// kernel (`fusion::FusedGroup`, which falls back to the nodes one by one); HostOp -> HostCall; Eval -> EvalPlaceholder whose
/// post-callback applies the Handle; Transpose / Reshape / Gemm -> AtenCall; the
/// stage's outputs -> one Output stopped by a CaptureOutputs pre-callback, each output's
/// producer also emitting it early through an EmitOutput post-callback. Fan-out and
/// unused outputs go through Replicate (a Function has one edge per output, and the
/// engine sums what meets at one input).

#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/closure/plan.hpp>
#include <stagejit/closure/tiled_region.hpp>
#include <stagejit/core/aten_dispatch.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/node_semantics.hpp>
#include <stagejit/ir/printer.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/trace/host_op_payload.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace stagejit::closure {

/// Stages whose row values have fewer than `kMinTiledRows` rows are not tiled. A region of
/// a single tile still pays: it runs its products and kernels in one Function, without the
/// engine's per-node bookkeeping and ATen's per-op dispatch, and that overhead is most of a
/// step at a few dozen rows. One row is excluded: a [1, C] row value cannot be told apart
/// from a broadcast row. Measured (float, one engine thread, staged against libtorch eager;
/// bench/higher_order.md "Regions from 2 rows"): a Poisson PINN 2-32x3-1 tanh at 16 rows
/// 0.78x -> 1.11x, at 128 rows 0.74x -> 1.11x; 2-64x4-1 SiLU at 200 rows 0.87x -> 1.65x.
/// It was 256 (at least two tiles), and 2 048 before `passes::rematerialize_cross_stage`
/// left costly ops saved.
inline constexpr int64_t kMinTiledRows = 2;

/// The function graph of one stage. See the file comment.
struct StageClosure {
  /// Roots in a fixed order: one InputPlaceholder per stage input, one PrevStageInput per
  /// entry of `prev_slots`, then the ConstantFactory.
  std::vector<Edge> roots;
  /// The slot each PrevStageInput root reads (Note [Cross-stage slots]).
  std::vector<std::size_t> prev_slots;
  /// Callback policies (built once; each call passes its own CallState to `execute`).
  ExecuteCallbacks callbacks;
  /// Number of outputs of the stage.
  std::size_t num_outputs = 0;
  /// Every Function of the stage (keeps them alive; for inspection).
  std::vector<std::shared_ptr<Function>> functions;

  /// Builds the closure of stage `s`. Throws `CompileError` naming the node for a node
  /// kind the closure compiler cannot run (a FusionGroup without a kernel, a HostOp
  /// without the tracer's payload). `slot_map` (optional) renumbers `plan`'s slots into
  /// another plan's (a stage variant, closure/specialize.hpp): `prev_slots` and the
  /// captures then use that numbering.
  ///
  /// `tile_rows` > 0: the stage's row-local nodes on tall tensors run as one row-tiled
  /// region of that many rows per tile (closure/tiled_plan.hpp, Note [Row-tiled
  /// regions]); 0: every node is its own Function.
  StageClosure(const CrossStagePlan& plan, std::size_t s,
               const std::vector<std::size_t>* slot_map = nullptr, int64_t tile_rows = 0)
      : fn_of_(plan.id_bound()) {
    if (slot_map) slot_map_ = *slot_map;
    num_outputs = plan.stage_outputs(s).size();
    auto output = keep(make_function(Output{}, {}, static_cast<uint32_t>(num_outputs)));
    auto factory = keep(make_function(ConstantFactory{}, {}, 1));
    callbacks.pre.emplace(output.get(), CaptureOutputs{});

    // The positions of each stage output (a value may be returned more than once).
    std::unordered_map<const ir::Value*, std::vector<uint32_t>> output_positions;
    const auto& outs = plan.stage_outputs(s);
    for (std::size_t j = 0; j < outs.size(); ++j) output_positions[outs[j]].push_back(static_cast<uint32_t>(j));
    const auto& nodes = plan.stage_nodes(s);
    // The row-tiled regions, one Function for all the nodes of each (Note [Row-tiled regions]).
    std::vector<TiledRegion> regions;
    if (tile_rows > 0) regions = find_row_tiled_regions(nodes, kMinTiledRows);
    std::vector<std::shared_ptr<Function>> region_fns;
    std::unordered_map<const ir::Node*, std::size_t> region_of;
    for (std::size_t r = 0; r < regions.size(); ++r) {
      const TiledRegion& region = regions[r];
      std::unordered_map<const ir::Node*, std::string> names;
      for (ir::Node* n : region.nodes) {
        region_of[n] = r;
        if (n->is<ir::FusionGroup>()) names[n] = "fusion_group_" + std::to_string(fusion_index(n));
      }
      auto runner = std::make_shared<const TiledRegionRunner>(region, tile_rows, names);
      auto fn = keep(make_function(
          FusedKernel{"tiled_region", [runner](const variable_list& in) { return runner->run(in); }}, {},
          static_cast<uint32_t>(region.inputs.size())));
      fn->origin = "row-tiled region " + std::to_string(r) + " of stage " + std::to_string(s) + " (" +
                   std::to_string(region.nodes.size()) + " nodes, " + std::to_string(tile_rows) + " rows per tile)";
      for (ir::Node* n : region.nodes) fn_of_[n->id()] = fn;
      region_fns.push_back(std::move(fn));
    }
    // The order gates (Note [Program order of random ops] in closure/plan.hpp): each node
    // kept in program order waits for the previous one that has a tensor output. Its gate
    // sits on its first tensor input (on the ConstantFactory's edge for a node without
    // inputs): input 0 is that value, passed on unchanged, input 1 the previous node's
    // first output, ignored.
    struct OrderGate {
      ir::Node* node;
      ir::Node* after;  // the previous node of the chain
      std::shared_ptr<Function> gate;
      std::size_t slot;  // the input of the node the gate passes its input 0 to
    };
    std::vector<OrderGate> gates;  // in stage order
    std::unordered_map<const ir::Node*, std::size_t> gate_of;
    {
      ir::Node* previous = nullptr;
      for (ir::Node* n : nodes) {
        if (!keeps_program_order(*n) || region_of.count(n)) continue;
        std::optional<std::size_t> slot;
        for (std::size_t i = 0; i < n->inputs().size() && !slot; ++i)
          if (!n->input(i)->is_handle()) slot = i;
        if (n->inputs().empty() && n->is<ir::Op>()) slot = 0;  // triggered by the ConstantFactory
        if (previous && slot) {
          auto gate = keep(make_function(AtenCall{"program_order", [](const variable_list& in) -> variable_list {
                                                    return {in.empty() ? Variable() : in[0]};
                                                  }},
                                         {}, 2));
          gate->origin = "program order: " + label(n) + " after " + label(previous);
          gate_of.emplace(n, gates.size());
          gates.push_back(OrderGate{n, previous, std::move(gate), *slot});
        }
        const bool has_tensor_output =
            std::any_of(n->outputs().begin(), n->outputs().end(), [](ir::Value* o) { return !o->is_handle(); });
        if (has_tensor_output) previous = n;
      }
    }
    // Where each value of this stage goes: (consumer, input slot) pairs.
    auto targets_of = [&](ir::Value* v) {
      std::vector<Edge> edges;
      std::vector<char> to_region(regions.size(), 0);
      auto made_in = region_of.find(v->node());
      for (const ir::Use& u : v->uses()) {
        if (u.user->stage() != s || u.user == u.user->owning_graph()->return_node()) continue;
        if (auto it = region_of.find(u.user); it != region_of.end()) {
          // Read inside a region: one edge into its input, none from inside it.
          const std::size_t r = it->second;
          if ((made_in != region_of.end() && made_in->second == r) || to_region[r]) continue;
          to_region[r] = 1;
          edges.push_back(Edge{region_fns[r], static_cast<uint32_t>(regions[r].input_index(v))});
          continue;
        }
        if (auto g = gate_of.find(u.user); g != gate_of.end() && gates[g->second].slot == u.offset) {
          edges.push_back(Edge{gates[g->second].gate, 0});
          continue;
        }
        edges.push_back(Edge{function_of(u.user), static_cast<uint32_t>(u.offset)});
      }
      if (auto it = output_positions.find(v); it != output_positions.end())
        for (uint32_t j : it->second) edges.push_back(Edge{output, j});
      return edges;
    };
    auto edge_to = [&](std::vector<Edge> edges) -> Edge {
      if (edges.size() == 1) return edges[0];
      auto rep = keep(make_function(Replicate{}, std::move(edges), 1));
      return Edge{rep, 0};
    };
    auto fill_next = [&](Function& fn, ir::Node* n) {
      for (ir::Value* o : n->outputs()) {
        if (o->is_handle()) continue;
        fn.next_functions.push_back(edge_to(targets_of(o)));
      }
    };

    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
      ir::Node* n = *it;
      if (region_of.count(n)) continue;
      auto fn = keep(function_for(n, factory));
      if (n->location().known()) fn->origin = label(n);
      fill_next(*fn, n);
      fn_of_[n->id()] = fn;
    }
    for (std::size_t r = 0; r < regions.size(); ++r)
      for (ir::Value* o : regions[r].outputs) region_fns[r]->next_functions.push_back(edge_to(targets_of(o)));
    // Stage inputs and values of earlier stages are the roots.
    for (ir::Value* in : plan.stage_inputs(s)) {
      auto fn = keep(make_function(InputPlaceholder{}, {edge_to(targets_of(in))}, 1));
      fn_of_[in->node()->id()] = fn;
      roots.push_back(Edge{fn, 0});
    }
    for (std::size_t slot : plan.uses_from_earlier(s)) {
      ir::Value* v = plan.slot_value(slot);
      if (v->is_handle()) continue;  // Handles go through the call state, not edges
      auto fn = keep(make_function(PrevStageInput{}, {}, 1));
      auto edges = targets_of(v);
      fn->next_functions = std::move(edges);
      roots.push_back(Edge{fn, 0});
      prev_slots.push_back(renumber(slot));
    }
    roots.push_back(Edge{factory, 0});
    // Close the order gates: each passes its input 0 to its node, and hears from the
    // previous node through a Replicate on that node's first tensor output (fill_next
    // gives tensor outputs only: edge 0).
    for (OrderGate& g : gates) {
      ir::Node* n = g.node;
      const std::shared_ptr<Function>& fn = function_of(n);
      g.gate->next_functions = {Edge{fn, static_cast<uint32_t>(g.slot)}};
      if (n->inputs().empty())
        for (Edge& e : factory->next_functions)
          if (e.function == fn) e = Edge{g.gate, 0};
      Function& previous = *function_of(g.after);
      STAGEJIT_CHECK_AS(CompileError, !previous.next_functions.empty(), "closure: ", label(g.after),
                        " has no tensor output to order ", label(n), " after");
      Edge& first = previous.next_functions[0];
      first = Edge{keep(make_function(Replicate{}, {first, Edge{g.gate, 1}}, 1)), 0};
    }

    // Captures of values later stages read.
    for (std::size_t slot : plan.captures(s)) {
      ir::Value* v = plan.slot_value(slot);
      if (v->is_handle()) continue;  // captured by HostCall / EvalPlaceholder callbacks
      ir::Node* producer = v->node();
      Function* found = fn_of_[producer->id()].get();
      if (!found) continue;  // e.g. produced by nothing that runs
      if (producer->is<ir::Undefined>()) continue;  // never runs: the slot stays undefined
      if (auto it = region_of.find(producer); it != region_of.end()) {
        const std::ptrdiff_t j = regions[it->second].output_index(v);
        STAGEJIT_CHECK_AS(CompileError, j >= 0, "closure: the captured value %", v->id(),
                          " is not an output of the row-tiled region");
        callbacks.post.emplace(found, CaptureOutput{static_cast<std::size_t>(j), renumber(slot)});
        continue;
      }
      callbacks.post.emplace(found, CaptureOutput{v->offset(), renumber(slot)});
    }
    std::vector<std::shared_ptr<Function>>().swap(fn_of_);  // only needed while building

    // Each stage output leaves through the one edge that feeds its slot of the Output:
    // its producer emits it there as soon as it is computed (Note [Early outputs] in
    // autograd/engine.hpp). Not for an Eval's placeholder, whose outputs its RunHandle
    // post-callback replaces (post-callbacks of one Function run in no set order).
    for (const auto& fn : functions) {
      if (fn->is<EvalPlaceholder>()) continue;
      for (std::size_t j = 0; j < fn->next_functions.size(); ++j) {
        const Edge& e = fn->next_functions[j];
        if (e.function == output) callbacks.post.emplace(fn.get(), EmitOutput{j, e.input_nr});
      }
    }
  }

 private:
  // A node for messages as `--print` shows it (ir::node_label), the graph's names and
  // fusion group indices computed once per closure.
  std::string label(const ir::Node* n) {
    if (!names_) names_.emplace(*n->owning_graph());
    return ir::node_label(n, *names_, n->is<ir::FusionGroup>() ? fusion_index(n) : -1);
  }
  // The printer's index of fusion group `n` (`fusion_group_N`).
  int64_t fusion_index(const ir::Node* n) {
    if (fusion_index_of_.empty()) {
      int64_t next = 0;
      for (const ir::Node* m : n->owning_graph()->nodes()) {
        if (!m->is<ir::FusionGroup>()) continue;
        if (fusion_index_of_.size() <= m->id()) fusion_index_of_.resize(m->id() + 1, -1);
        fusion_index_of_[m->id()] = next++;
      }
    }
    return n->id() < fusion_index_of_.size() ? fusion_index_of_[n->id()] : -1;
  }
  std::optional<ir::detail::NameTable> names_;
  std::vector<int64_t> fusion_index_of_;

  std::shared_ptr<Function> keep(std::shared_ptr<Function> f) {
    functions.push_back(f);
    return f;
  }

  std::shared_ptr<Function> function_for(ir::Node* n, const std::shared_ptr<Function>& factory) {
    const uint32_t n_in = static_cast<uint32_t>(n->inputs().size());
    // A node without inputs is triggered by the ConstantFactory: the engine only runs
    // functions that receive an input.
    auto triggered = [&](std::shared_ptr<Function> fn) {
      factory->next_functions.push_back(Edge{fn, 0});
      return fn;
    };
    // Transpose / Reshape / Gemm: their meaning (ir/node_semantics.hpp) on the tensors.
    auto aten_call = [&](std::string_view name, auto tensor_fn) {
      return make_function(AtenCall{name, [tensor_fn](const variable_list& in) -> variable_list {
                                      std::vector<at::Tensor> t;
                                      t.reserve(in.size());
                                      for (const auto& v : in) t.push_back(v.data());
                                      at::Tensor out = tensor_fn(t);
                                      // A Transpose or Reshape view made below libtorch's
                                      // autograd keys (Note [Below libtorch's autograd keys]).
                                      share_version_counter_with_base(out, t);
                                      return {Variable(std::move(out))};
                                    }},
                           {}, n_in);
    };
    auto not_a_node = [&](std::string_view what) -> std::shared_ptr<Function> {
      detail::throw_error<CompileError>("closure: ", what, " ", label(n),
                                        " cannot be compiled into a closure");
    };
    return std::visit(
        Overloaded{
            [&](const ir::Constant& kind) { return triggered(make_function(WrapConstant{kind.value}, {}, 1)); },
            [&](const ir::Undefined&) { return make_function(EmitNull{}, {}, 0); },
            [&](const ir::Op& kind) {
              STAGEJIT_CHECK_AS(CompileError, kind.id() != OpId::unknown, "closure: node ", label(n),
                                " calls the unknown op '", kind.name(), "' (not in the op table, ops/op_schema.hpp)");
              auto fn = make_function(OpCall{&ops::def(kind.id()), detail::to_core_attributes(kind.attributes)}, {},
                                      n_in == 0 ? 1 : n_in);
              return n_in == 0 ? triggered(std::move(fn)) : fn;
            },
            [&](const ir::HostOp& kind) { return host_call(n, kind); },
            [&](const ir::Eval&) { return eval_placeholder(n); },
            [&](const ir::FusionGroup& kind) {
              STAGEJIT_CHECK_AS(CompileError, kind.subgraph, "closure: ", label(n),
                                " has no subgraph");
              std::string name = "fusion_group_" + std::to_string(fusion_index(n));
              auto group = std::make_shared<const fusion::FusedGroup>(kind.subgraph, name);
              return make_function(FusedKernel{name, [group](const variable_list& in) -> variable_list {
                                                  std::vector<at::Tensor> tensors;
                                                  tensors.reserve(in.size());
                                                  for (const auto& v : in) tensors.push_back(v.data());
                                                  auto outs = group->run(tensors);
                                                  return variable_list(outs.begin(), outs.end());
                                                }},
                                   {}, n_in);
            },
            [&](const ir::Transpose& kind) {
              return aten_call("Transpose", [kind](const std::vector<at::Tensor>& t) {
                return semantics::transpose(kind, t.at(0));
              });
            },
            [&](const ir::Reshape& kind) {
              return aten_call("Reshape", [kind](const std::vector<at::Tensor>& t) {
                return semantics::reshape(kind, t.at(0));
              });
            },
            [&](const ir::Gemm& kind) {
              return aten_call("Gemm", [kind](const std::vector<at::Tensor>& t) {
                return semantics::gemm(kind, t.at(0), t.at(1), t.at(2));
              });
            },
            [&](const ir::Param&) { return not_a_node("the Param"); },
            [&](const ir::Return&) { return not_a_node("the Return"); },
        },
        n->kind());
  }

  // A HostOp: runs the host function on fresh leaves flagged as when traced (so its
  // backward exists exactly when it did), and captures that backward as the node's Handle.
  std::shared_ptr<Function> host_call(ir::Node* n, const ir::HostOp& kind) {
    auto payload = std::static_pointer_cast<HostOpPayload>(kind.payload);
    STAGEJIT_CHECK_AS(CompileError, payload && payload->call, "closure: HostOp ", label(n),
                      " has no callable (graphs parsed from text cannot run host functions)");
    auto call = [payload](const variable_list& in) -> variable_list {
      AutoGradMode grad_on(true);
      variable_list leaves;
      leaves.reserve(in.size());
      for (std::size_t i = 0; i < in.size(); ++i) {
        bool rg = i < payload->input_requires_grad.size() && payload->input_requires_grad[i];
        leaves.push_back(in[i].defined() ? Variable(in[i].data(), rg) : Variable());
      }
      return payload->call(leaves);
    };
    auto fn = make_function(HostCall{kind.name, call}, {}, static_cast<uint32_t>(n->inputs().size()));
    if (!n->outputs().empty() && n->outputs().back()->is_handle()) {
      handle_captures_.push_back({fn.get(), n->outputs().back()});
    }
    return fn;
  }

  std::shared_ptr<Function> eval_placeholder(ir::Node* n) {
    STAGEJIT_CHECK_AS(CompileError, !n->inputs().empty() && n->inputs().back()->is_handle(),
                      "closure: Eval ", n->describe(), " has no Handle as its last input");
    auto fn = make_function(EvalPlaceholder{}, {}, static_cast<uint32_t>(n->inputs().size() - 1));
    eval_nodes_.push_back({fn.get(), n});
    return fn;
  }

 public:
  /// Installs the Handle callbacks once the plan's slots are known (called by the
  /// builder right after construction).
  void install_handle_callbacks(const CrossStagePlan& plan) {
    for (auto& [fn, value] : handle_captures_) {
      std::ptrdiff_t slot = renumber(plan.slot_of(value));
      if (slot < 0) continue;  // the Handle is used by no later stage
      callbacks.post.emplace(fn, CaptureHandle{static_cast<std::size_t>(slot)});
    }
    for (auto& [fn, node] : eval_nodes_) {
      std::ptrdiff_t in_slot = renumber(plan.slot_of(node->inputs().back()));
      STAGEJIT_CHECK_AS(CompileError, in_slot >= 0, "closure: Eval ", node->describe(),
                        " reads a Handle made at its own stage");
      bool makes_handle = !node->outputs().empty() && node->outputs().back()->is_handle();
      std::ptrdiff_t out_slot = makes_handle ? renumber(plan.slot_of(node->outputs().back())) : -1;
      std::size_t expected = node->outputs().size() - (makes_handle ? 1 : 0);
      callbacks.post.emplace(fn, RunHandle{static_cast<std::size_t>(in_slot), out_slot, makes_handle,
                                           expected, node->describe()});
    }
    handle_captures_.clear();
    eval_nodes_.clear();
  }

 private:
  // A slot of the plan the closure is built from, in the numbering of `slot_map_`.
  std::size_t renumber(std::size_t slot) const {
    return slot_map_.empty() ? slot : slot_map_.at(slot);
  }
  std::ptrdiff_t renumber(std::ptrdiff_t slot) const {
    if (slot < 0 || slot_map_.empty()) return slot;
    std::size_t r = slot_map_.at(static_cast<std::size_t>(slot));
    return r == static_cast<std::size_t>(-1) ? -1 : static_cast<std::ptrdiff_t>(r);
  }
  std::vector<std::size_t> slot_map_;
  // The Function of each node of the stage being built, by node id (every id of the
  // plan's graph is below `plan.id_bound()`).
  std::vector<std::shared_ptr<Function>> fn_of_;
  const std::shared_ptr<Function>& function_of(const ir::Node* n) const {
    STAGEJIT_CHECK_AS(CompileError, n->id() < fn_of_.size() && fn_of_[n->id()],
                      "closure compiler: node #", n->id(), " (", n->describe(),
                      ") is used at its stage before a Function was made for it");
    return fn_of_[n->id()];
  }
  std::vector<std::pair<Function*, ir::Value*>> handle_captures_;
  std::vector<std::pair<Function*, ir::Node*>> eval_nodes_;
};

}  // namespace stagejit::closure
