#pragma once
/// \file
/// `StageClosure`: the immutable function graph of one stage (seed SPEC.md 3.4-3.7),
/// built once and shared by every call. Per-call state never lives here: captures,
/// Handles and outputs go through the engine's per-execution callbacks into the
/// caller's `CallState` (Note [Cross-stage slots] in plan.hpp), so one closure can run
/// on several threads at once.
///
/// Function per node (SPEC 3.5): Param -> InputPlaceholder (a root); a value of an
/// earlier stage -> PrevStageInput (a root); Constant -> WrapConstant fed by the single
/// ConstantFactory root (so are nullary ops such as `zeros`); Undefined -> EmitNull (never run: consumers see undefined);
/// Op -> Lambda over the op table; FusionGroup -> FusedKernel running the generated
/// kernel (`fusion::FusedGroup`, which falls back to the nodes one by one); HostOp -> HostCall; Eval -> EvalPlaceholder whose
/// post-callback applies the Handle; Transpose / Reshape / Gemm -> Lambda over ATen; the
/// stage's outputs -> one Output stopped by a CaptureOutputs pre-callback. Fan-out and
/// unused outputs go through Replicate (a Function has one edge per output, and the
/// engine sums what meets at one input).

#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/closure/plan.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/trace/host_op_payload.hpp>
#include <stagejit/trace/op_attributes.hpp>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <vector>

namespace stagejit::closure {

/// The function graph of one stage. See the file comment.
struct StageClosure {
  /// Roots in a fixed order: one InputPlaceholder per stage input, one PrevStageInput per
  /// entry of `prev_slots`, then the ConstantFactory.
  std::vector<Edge> roots;
  /// The slot each PrevStageInput root reads (Note [Cross-stage slots]).
  std::vector<std::size_t> prev_slots;
  /// Callback policies; a call copies this and points `state` at its own CallState.
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
  StageClosure(const CrossStagePlan& plan, std::size_t s,
               const std::vector<std::size_t>* slot_map = nullptr)
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
    // Where each value of this stage goes: (consumer, input slot) pairs.
    auto targets_of = [&](ir::Value* v) {
      std::vector<Edge> edges;
      for (const ir::Use& u : v->uses()) {
        if (u.user->stage() != s || u.user == u.user->owning_graph()->return_node()) continue;
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

    const auto& nodes = plan.stage_nodes(s);
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
      ir::Node* n = *it;
      auto fn = keep(function_for(n, factory));
      fill_next(*fn, n);
      fn_of_[n->id()] = fn;
    }
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

    // Captures of values later stages read.
    for (std::size_t slot : plan.captures(s)) {
      ir::Value* v = plan.slot_value(slot);
      if (v->is_handle()) continue;  // captured by HostCall / EvalPlaceholder callbacks
      ir::Node* producer = v->node();
      Function* found = fn_of_[producer->id()].get();
      if (!found) continue;  // e.g. produced by nothing that runs
      if (producer->is<ir::Undefined>()) continue;  // never runs: the slot stays undefined
      std::size_t index = v->offset();
      callbacks.post.emplace(found,
                             GenericCallback{[slot = renumber(slot), index](Function&, variable_list&,
                                                           variable_list* outputs, CallState* st) {
                               std::lock_guard<std::mutex> lock(st->mutex);
                               if (st->values.size() <= slot) st->values.resize(slot + 1);
                               st->values[slot] = (*outputs).at(index);
                               return true;
                             }});
    }
    std::vector<std::shared_ptr<Function>>().swap(fn_of_);  // only needed while building
  }

 private:
  std::shared_ptr<Function> keep(std::shared_ptr<Function> f) {
    functions.push_back(f);
    return f;
  }

  std::shared_ptr<Function> function_for(ir::Node* n, const std::shared_ptr<Function>& factory) {
    const uint32_t n_in = static_cast<uint32_t>(n->inputs().size());
    return std::visit(
        [&](const auto& kind) -> std::shared_ptr<Function> {
          using K = std::decay_t<decltype(kind)>;
          if constexpr (std::is_same_v<K, ir::Constant>) {
            auto fn = make_function(WrapConstant{kind.value}, {}, 1);
            factory->next_functions.push_back(Edge{fn, 0});
            return fn;
          } else if constexpr (std::is_same_v<K, ir::Undefined>) {
            return make_function(EmitNull{}, {}, 0);
          } else if constexpr (std::is_same_v<K, ir::Op>) {
            const OpDef* def = ops::find(kind.name);
            STAGEJIT_CHECK_AS(CompileError, def, "closure: node ", n->describe(),
                              " calls the unknown op '", kind.name, "'");
            Attributes attrs = detail::to_core_attributes(kind.attributes);
            if (n_in == 0) {
              // A nullary op (e.g. `zeros`) is triggered by the ConstantFactory like a
              // constant: the engine only runs functions that receive an input.
              auto fn = make_function(
                  Lambda{nullptr, {}, [def, attrs](const variable_list&) {
                           return ops::apply(*def, {}, attrs);
                         }},
                  {}, 1);
              factory->next_functions.push_back(Edge{fn, 0});
              return fn;
            }
            return make_function(Lambda{def, std::move(attrs), {}}, {}, n_in);
          } else if constexpr (std::is_same_v<K, ir::HostOp>) {
            return host_call(n, kind);
          } else if constexpr (std::is_same_v<K, ir::Eval>) {
            return eval_placeholder(n);
          } else if constexpr (std::is_same_v<K, ir::FusionGroup>) {
            STAGEJIT_CHECK_AS(CompileError, kind.subgraph, "closure: FusionGroup ",
                              n->describe(), " has no subgraph");
            std::string name = "fusion_group_" + std::to_string(n->id());
            auto group = std::make_shared<const fusion::FusedGroup>(kind.subgraph, name);
            return make_function(
                FusedKernel{name, [group](const variable_list& in) -> variable_list {
                              std::vector<at::Tensor> tensors;
                              tensors.reserve(in.size());
                              for (const auto& v : in) tensors.push_back(v.data());
                              auto outs = group->run(tensors);
                              return variable_list(outs.begin(), outs.end());
                            }},
                {}, n_in);
          } else if constexpr (std::is_same_v<K, ir::Transpose>) {
            auto perm = kind.perm;
            return make_function(
                Lambda{nullptr, {}, [perm](const variable_list& in) -> variable_list {
                         return {Variable(in.at(0).data().permute(perm))};
                       }},
                {}, 1);
          } else if constexpr (std::is_same_v<K, ir::Reshape>) {
            auto shape = kind.shape;
            return make_function(
                Lambda{nullptr, {}, [shape](const variable_list& in) -> variable_list {
                         return {Variable(in.at(0).data().reshape(shape))};
                       }},
                {}, 1);
          } else if constexpr (std::is_same_v<K, ir::Gemm>) {
            double alpha = kind.alpha, beta = kind.beta;
            return make_function(
                Lambda{nullptr, {}, [alpha, beta](const variable_list& in) -> variable_list {
                         return {Variable(at::addmm(in.at(2).data(), in.at(0).data(),
                                                    in.at(1).data(), beta, alpha))};
                       }},
                {}, 3);
          } else {
            detail::throw_error<CompileError>("closure: node ", n->describe(),
                                              " cannot be compiled into a closure (",
                                              ir::kind_name(n->kind()), ")");
          }
        },
        n->kind());
  }

  // A HostOp: runs the host function on fresh leaves flagged as when traced (so its
  // backward exists exactly when it did), and captures that backward as the node's Handle.
  std::shared_ptr<Function> host_call(ir::Node* n, const ir::HostOp& kind) {
    auto payload = std::static_pointer_cast<HostOpPayload>(kind.payload);
    STAGEJIT_CHECK_AS(CompileError, payload && payload->call, "closure: HostOp ", n->describe(),
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
      callbacks.post.emplace(fn, GenericCallback{[slot](Function&, variable_list&,
                                                        variable_list* outputs, CallState* st) {
                               std::shared_ptr<Function> h;
                               for (const auto& o : *outputs)
                                 if (o.defined() && o.grad_fn()) { h = o.grad_fn(); break; }
                               std::lock_guard<std::mutex> lock(st->mutex);
                               if (st->handles.size() <= std::size_t(slot)) st->handles.resize(slot + 1);
                               st->handles[slot] = h;
                               return true;
                             }});
    }
    for (auto& [fn, node] : eval_nodes_) {
      std::ptrdiff_t in_slot = renumber(plan.slot_of(node->inputs().back()));
      STAGEJIT_CHECK_AS(CompileError, in_slot >= 0, "closure: Eval ", node->describe(),
                        " reads a Handle made at its own stage");
      bool makes_handle = !node->outputs().empty() && node->outputs().back()->is_handle();
      std::ptrdiff_t out_slot = makes_handle ? renumber(plan.slot_of(node->outputs().back())) : -1;
      std::size_t expected = node->outputs().size() - (makes_handle ? 1 : 0);
      std::string where = node->describe();
      // One callback, so running the Handle always precedes capturing the next one
      // (the seed relied on multimap order here: SPEC 7 item 16).
      callbacks.post.emplace(
          fn, GenericCallback{[in_slot, out_slot, makes_handle, expected, where](
                                  Function&, variable_list& inputs, variable_list* outputs,
                                  CallState* st) {
            std::shared_ptr<Function> h;
            {
              std::lock_guard<std::mutex> lock(st->mutex);
              if (std::size_t(in_slot) < st->handles.size()) h = st->handles[in_slot];
            }
            STAGEJIT_CHECK(h, "closure: Eval ", where, " received no Handle (the opaque "
                           "function it stands for made no backward in this call)");
            variable_list grads;
            {
              // Mirror the trace: the incoming gradients required grad when a further
              // stage followed, which decides the shape of the next opaque backward.
              AutoGradMode grad_mode(makes_handle);
              for (auto& g : inputs) grads.push_back(g.defined() ? Variable(g.data(), makes_handle) : g);
              *outputs = h->apply(grads);
            }
            STAGEJIT_CHECK(outputs->size() == expected, "closure: Eval ", where, " returned ",
                           outputs->size(), " gradients, the trace recorded ", expected);
            if (out_slot >= 0) {
              std::shared_ptr<Function> next;
              for (const auto& o : *outputs)
                if (o.defined() && o.grad_fn()) { next = o.grad_fn(); break; }
              std::lock_guard<std::mutex> lock(st->mutex);
              if (st->handles.size() <= std::size_t(out_slot)) st->handles.resize(out_slot + 1);
              st->handles[out_slot] = next;
            }
            return true;
          }});
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
