#pragma once
/// \file
/// Bodies of trace/detail/tracer_impl.hpp and of `trace()` (trace/trace.hpp;
/// core/config.hpp): compiled once in src/compiled_bodies.cpp, or inline in every
/// translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/trace/detail/tracer_impl.hpp>
#include <stagejit/trace/trace.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/trace/host_op_payload.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/passes/zeros.hpp>
#include <stagejit/ops/ops.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagejit::detail {

STAGEJIT_FUNC ir::Value* TracingState::add_input(const Variable& v, std::size_t stage) {
  std::lock_guard<std::mutex> lock(mutex_);
  ir::Value* p = graph_->add_input(ir::TensorType::of(v.data()), stage);
  bind(v, p);
  return p;
}

STAGEJIT_FUNC Edge TracingState::gradient_edge_of(const Variable& v) {
  if (!v.defined() || !v.requires_grad()) return v.gradient_edge();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cutting_) return v.gradient_edge();
  auto it = values_.find(v.impl_id());
  if (it == values_.end()) return v.gradient_edge();
  ir::Value* value = it->second;
  const std::size_t now = graph_->current_stage();
  if (value->stage() >= now) return v.gradient_edge();
  const auto key = std::make_pair(static_cast<const void*>(value), now);
  auto b = boundary_index_.find(key);
  if (b == boundary_index_.end()) {
    b = boundary_index_.emplace(key, boundaries_.size()).first;
    boundaries_.push_back(Boundary{value, Variable(v.data(), /*requires_grad=*/true), now});
  }
  return boundaries_[b->second].leaf.gradient_edge();
}

STAGEJIT_FUNC void TracingState::add_output(const Variable& v, std::size_t stage, std::size_t index, bool require_traced) {
  std::lock_guard<std::mutex> lock(mutex_);
  ir::Value* value = nullptr;
  if (!v.defined()) {
    value = graph_->append_undefined();
  } else if (auto it = values_.find(v.impl_id()); it != values_.end()) {
    value = it->second;
  } else {
    STAGEJIT_CHECK_AS(TraceError, !require_traced, "output ", index, " of stage ", stage,
                      " of the traced function has no observable data dependence on its "
                      "inputs (it was not computed by a stagejit op); return a value "
                      "computed from the inputs, or pass the tensor in as an input");
    value = constant_for(v);
  }
  graph_->register_output(value, stage);
}

STAGEJIT_FUNC void TracingState::record_op(const OpSchema& op, const Attributes& attrs, const variable_list& inputs,
                                           const variable_list& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<ir::Value*> in = values_for(inputs);
  std::vector<ir::Type> types;
  types.reserve(outputs.size());
  for (const auto& o : outputs) types.push_back(type_of(o));
  ir::Node* n = graph_->create_and_append(ir::Op::with(op.id, attrs), in, types);
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].defined()) bind_made(outputs[i], n->output(i));
}

STAGEJIT_FUNC void TracingState::record_host_op(std::string_view name, std::string_view calling_convention,
                                                const std::vector<Scalar>& scalars, const variable_list& inputs,
                                                const variable_list& outputs, const std::shared_ptr<Function>& backward,
                                                const HostCallable& call) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<ir::Value*> in = values_for(inputs);
  // Sized up front: no regrowth (ir::Type copies on regrowth, its move not being noexcept,
  // and that path trips a GCC 12 maybe-uninitialized false positive).
  std::vector<ir::Type> types(outputs.size() + (backward ? 1 : 0));
  for (std::size_t i = 0; i < outputs.size(); ++i) types[i] = type_of(outputs[i]);
  if (backward) types.back() = ir::HandleType{};
  auto payload = std::make_shared<HostOpPayload>();
  payload->call = call;
  for (const auto& v : inputs) payload->input_requires_grad.push_back(v.requires_grad());
  ir::HostOp kind{std::string(name), std::string(calling_convention), scalars, payload};
  ir::Node* n = graph_->create_and_append(std::move(kind), in, types);
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].defined()) bind_made(outputs[i], n->output(i));
  if (backward) bind_handle(backward, n->outputs().back());
}

STAGEJIT_FUNC void TracingState::record_eval(const Function& fn, const variable_list& grad_inputs,
                                             const variable_list& grad_outputs,
                                             const std::shared_ptr<Function>& backward_of_outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto h = handles_.find(&fn);
  STAGEJIT_CHECK_AS(TraceError, h != handles_.end(), "opaque backward '", fn.name(),
                    "' ran at stage ", graph_->current_stage(),
                    " but the trace holds no Handle for it (its forward ran outside the "
                    "trace, or an earlier stage was not traced)");
  std::vector<ir::Value*> in = values_for(grad_inputs);
  in.push_back(h->second);
  std::vector<ir::Type> types(grad_outputs.size() + (backward_of_outputs ? 1 : 0));
  for (std::size_t i = 0; i < grad_outputs.size(); ++i) types[i] = type_of(grad_outputs[i]);
  if (backward_of_outputs) types.back() = ir::HandleType{};
  ir::Node* n = graph_->create_and_append(ir::Eval{}, in, types);
  for (std::size_t i = 0; i < grad_outputs.size(); ++i)
    if (grad_outputs[i].defined()) bind_made(grad_outputs[i], n->output(i));
  if (backward_of_outputs) bind_handle(backward_of_outputs, n->outputs().back());
}

STAGEJIT_FUNC void TracingState::bind_made(const Variable& v, ir::Value* value) {
  bind(v, value);
  if (!v.requires_grad()) return;
  const std::size_t s = graph_->current_stage();
  if (intermediates_.size() <= s) intermediates_.resize(s + 1);
  intermediates_[s].emplace_back(v, value);
}

STAGEJIT_FUNC ir::Value* TracingState::constant_for(const Variable& v) {
  STAGEJIT_CHECK_AS(TraceError, !v.requires_grad(), "trace: a Variable that requires grad (a ",
                    v.scalar_type(), " tensor of shape ", v.sizes(),
                    ") is used but is neither an input of the traced function nor computed from one "
                    "by a stagejit op; frozen as a constant its gradient would be lost: pass it in as an "
                    "input, or detach() it");
  ir::Value* c = graph_->append_constant(v.data().clone());
  bind(v, c);
  return c;
}

STAGEJIT_FUNC std::vector<ir::Value*> TracingState::values_for(const variable_list& vars) {
  std::vector<ir::Value*> out;
  out.reserve(vars.size());
  for (const auto& v : vars) {
    if (!v.defined()) {
      out.push_back(graph_->append_undefined());
    } else if (auto it = values_.find(v.impl_id()); it != values_.end()) {
      out.push_back(it->second);
    } else {
      out.push_back(constant_for(v));
    }
  }
  return out;
}

STAGEJIT_FUNC std::pair<std::vector<std::vector<char>>, std::vector<ir::Value*>> CrossStagePrune::run() {
  std::unordered_map<const ir::Value*, char> fed;
  for (const auto& f : feeds)
    for (ir::Value* v : f) fed[v] = 1;
  std::unordered_map<const ir::Value*, char> dead;  // graph inputs to erase
  std::vector<std::vector<char>> erase_outputs(k + 1);
  std::vector<std::vector<ir::Value*>> carry(k + 1);
  for (std::size_t s = 1; s <= k; ++s) {
    std::vector<ir::Value*> zeros = carry[s];
    for (ir::Value* e : extras[s])
      if (!fed.count(e)) {
        dead[e] = 1;
        zeros.push_back(e);
      }
    // Regular inputs that are gradients of outputs erased at stage s-1.
    const auto& prev_erase = erase_outputs[s - 1];
    for (std::size_t o = 0; o < prev_erase.size() && o < input_of_output[s].size(); ++o)
      if (prev_erase[o] && input_of_output[s][o]) {
        dead[input_of_output[s][o]] = 1;
        zeros.push_back(input_of_output[s][o]);
      }
    if (!zeros.empty()) {
      std::vector<ir::Value*> live = passes::propagate_zeros(g, s, zeros);
      // Carried zeros of earlier stages are not reported: look at their uses too.
      live.insert(live.end(), carry[s].begin(), carry[s].end());
      for (ir::Value* z : live) {
        auto uses = z->uses();
        ir::Value* undef = nullptr;
        for (const ir::Use& u : uses) {
          if (u.user == g.return_node()) {
            if (!undef) {
              // An Undefined node of stage s, before the first node of a later stage
              // (node stages never decrease along the list).
              g.set_current_stage(s);
              ir::Node* n = g.create(ir::Undefined{}, {}, {ir::UnknownType{}});
              ir::Node* later = nullptr;
              for (ir::Node* m : g.nodes())
                if (m->stage() > s) {
                  later = m;
                  break;
                }
              if (later) n->insert_before(later);
              else g.append(n);
              undef = n->output();
            }
            u.user->replace_input(u.offset, undef);  // a zero gradient is an undefined one
          } else if (u.user->stage() > s) {
            auto& c = carry[u.user->stage()];
            if (std::find(c.begin(), c.end(), z) == c.end()) c.push_back(z);
          }
        }
      }
    }
    // Regular outputs that are gradients of inputs being erased.
    erase_outputs[s].assign(g.stage_output_counts()[s], 0);
    g.set_current_stage(k);
    for (std::size_t o = 0; o < gradient_of[s].size(); ++o)
      if (dead.count(gradient_of[s][o])) erase_outputs[s][o] = 1;
  }
  std::vector<ir::Value*> dead_inputs;
  for (ir::Value* in : g.inputs())
    if (dead.count(in)) dead_inputs.push_back(in);
  return {std::move(erase_outputs), std::move(dead_inputs)};
}

STAGEJIT_FUNC Trace trace_stages(const traced_fn& fn, const variable_list& inputs, std::size_t k, bool cut,
                                 bool joint) {
  detail::TracingState state;
  Trace t;
  t.graph_ = state.graph();

  AutoGradMode grad_on(true);
  TraceHookGuard hook(&state);

  // ---- stage 0: fresh leaves sharing the inputs' tensors become the stage-0 Params.
  variable_list leaves;
  leaves.reserve(inputs.size());
  StageFlags flags0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Variable& in = inputs[i];
    flags0.inputs.push_back(VariableFlags::of(in));
    STAGEJIT_CHECK_AS(TraceError, in.defined(), "trace: input ", i,
                      " is undefined; every traced input must hold a tensor");
    Variable leaf(in.data(), in.requires_grad());
    state.add_input(leaf, 0);
    leaves.push_back(leaf);
  }
  state.begin_stage(0);
  variable_list outs = fn(leaves);
  STAGEJIT_CHECK_AS(TraceError, !outs.empty(), "trace: the traced function returned no outputs");
  for (std::size_t i = 0; i < outs.size(); ++i) {
    state.add_output(outs[i], 0, i, /*require_traced=*/true);
    flags0.outputs.push_back(VariableFlags::of(outs[i]));
  }
  t.stage_inputs_.push_back(leaves);
  t.stage_outputs_.push_back(outs);
  t.flags_.push_back(std::move(flags0));
  t.output_edges_.emplace_back();
  t.gradient_of_.emplace_back();
  t.feeds_.emplace_back();

  // Every graph input so far (in graph-input order) and its Variable.
  variable_list all_inputs = leaves;
  std::vector<ir::Value*> all_input_values = t.graph_->inputs();

  CrossStagePrune prune{*t.graph_, k, {}, {}, {}, {}};
  prune.input_of_output.emplace_back();
  prune.extras.emplace_back();
  prune.gradient_of.emplace_back();
  prune.feeds.emplace_back();
  // Extra gradient input of each earlier-stage value that has one.
  std::unordered_map<const ir::Value*, ir::Value*> extra_input_of;

  // ---- stages 1..k: the backward of the previous stage, recorded.
  for (std::size_t s = 1; s <= k; ++s) {
    StageFlags flags;
    variable_list roots_vars, grad_outputs;
    std::vector<std::size_t> regular_of_output;  // output index of stage s-1 per regular input
    const variable_list& prev_outs = t.stage_outputs_.back();
    for (std::size_t o = 0; o < prev_outs.size(); ++o) {
      const Variable& out = prev_outs[o];
      if (!out.defined() || !out.requires_grad()) continue;
      Variable g(at::ones_like(out.data()), /*requires_grad=*/s < k);
      roots_vars.push_back(out);
      grad_outputs.push_back(g);
      flags.inputs.push_back(VariableFlags::of(g));
      regular_of_output.push_back(o);
    }
    state.begin_stage(s);
    state.set_cutting(cut && s < k);
    prune.input_of_output.emplace_back(prev_outs.size(), nullptr);
    for (std::size_t r = 0; r < grad_outputs.size(); ++r)
      prune.input_of_output[s][regular_of_output[r]] = state.add_input(grad_outputs[r], s);
    // Note [Cross-stage gradients]: a gradient input for every value of stage s-1 that
    // requires grad, flowing into it as into an output.
    prune.extras.emplace_back();
    if (cut && s < k) {
      for (auto& [var, value] : state.intermediates(s - 1)) {
        Variable g(at::ones_like(var.data()), /*requires_grad=*/true);
        roots_vars.push_back(var);
        grad_outputs.push_back(g);
        flags.inputs.push_back(VariableFlags::of(g));
        ir::Value* in = state.add_input(g, s);
        extra_input_of[value] = in;
        prune.extras[s].push_back(in);
      }
    }

    std::vector<Edge> capture;
    std::vector<std::size_t> gradient_of;
    for (std::size_t i = 0; i < all_inputs.size(); ++i) {
      if (!all_inputs[i].requires_grad()) continue;
      capture.push_back(all_inputs[i].gradient_edge());
      gradient_of.push_back(i);
    }
    const std::size_t num_regular = capture.size();
    // The boundary leaves of the stages before (Note [Cross-stage gradients]).
    std::vector<TracingState::Boundary> bounds;
    if (cut)
      for (auto& b : state.boundaries())
        if (b.stage < s) {
          capture.push_back(b.leaf.gradient_edge());
          bounds.push_back(b);
        }
    variable_list grads(capture.size());
    if (!roots_vars.empty() && !capture.empty()) {
      std::vector<Edge> roots;
      for (const auto& o : roots_vars) roots.push_back(o.gradient_edge());
      ExecuteOptions opts;
      opts.create_graph = s < k;
      opts.keep_graph = true;
      opts.single_threaded = true;
      opts.capture = capture;
      grads = execute(roots, grad_outputs, opts);
    }
    variable_list stage_outs(grads.begin(), grads.begin() + static_cast<std::ptrdiff_t>(num_regular));
    std::vector<Edge> out_edges(capture.begin(), capture.begin() + static_cast<std::ptrdiff_t>(num_regular));
    std::vector<ir::Value*> feeds;
    {
      AutoGradMode mode(s < k);
      for (std::size_t m = 0; m < bounds.size(); ++m) {
        const Variable& gb = grads[num_regular + m];
        if (!gb.defined()) continue;
        const auto& b = bounds[m];
        if (b.value->node()->is<ir::Param>()) {
          // A graph input read by a later stage: its gradient joins the regular one.
          auto pos = std::find(all_input_values.begin(), all_input_values.end(), b.value);
          const std::size_t gi = static_cast<std::size_t>(pos - all_input_values.begin());
          auto r = std::find(gradient_of.begin(), gradient_of.end(), gi);
          if (pos == all_input_values.end() || r == gradient_of.end()) throw CrossStageFallback{};
          Variable& slot = stage_outs[static_cast<std::size_t>(r - gradient_of.begin())];
          slot = slot.defined() ? ::stagejit::add(slot, gb) : gb;
          continue;
        }
        auto e = extra_input_of.find(b.value);
        if (e == extra_input_of.end()) throw CrossStageFallback{};
        stage_outs.push_back(gb);
        out_edges.push_back(capture[num_regular + m]);
        feeds.push_back(e->second);
      }
    }
    for (std::size_t i = 0; i < stage_outs.size(); ++i) {
      state.add_output(stage_outs[i], s, i, /*require_traced=*/false);
      flags.outputs.push_back(VariableFlags::of(stage_outs[i]));
    }
    prune.gradient_of.emplace_back();
    for (std::size_t gi : gradient_of) prune.gradient_of[s].push_back(all_input_values[gi]);
    prune.feeds.push_back(feeds);
    t.stage_inputs_.push_back(grad_outputs);
    t.stage_outputs_.push_back(stage_outs);
    t.flags_.push_back(std::move(flags));
    t.output_edges_.push_back(std::move(out_edges));
    t.gradient_of_.push_back(std::move(gradient_of));
    t.feeds_.emplace_back();
    for (const auto& g : grad_outputs) all_inputs.push_back(g);
    all_input_values = t.graph_->inputs();
  }
  state.set_cutting(false);
  if (!cut) {
    // Note [Joint stage]: stage k + 1, one backward of every output of stages 0..k-1
    // that a stage 1..k differentiates, each with a fresh grad output of its own (the
    // joint stage's inputs, stage by stage), into the inputs stage k differentiates to.
    // Not recorded when the graph holds an opaque host function (its Handles belong to
    // one stage's backward).
    if (!joint || k < 2) return t;
    ir::Graph& g = *t.graph_;
    for (ir::Node* n : g.nodes())
      if (n->is<ir::HostOp>() || n->is<ir::Eval>()) return t;
    const std::size_t J = k + 1;
    StageFlags flags;
    variable_list roots_vars, grad_outputs;
    state.begin_stage(J);
    for (std::size_t s = 1; s <= k; ++s)
      for (const Variable& out : t.stage_outputs_[s - 1]) {
        if (!out.defined() || !out.requires_grad()) continue;
        Variable gv(at::ones_like(out.data()), /*requires_grad=*/false);
        roots_vars.push_back(out);
        grad_outputs.push_back(gv);
        flags.inputs.push_back(VariableFlags::of(gv));
        state.add_input(gv, J);
      }
    const std::vector<Edge> capture = t.output_edges_[k];
    variable_list grads(capture.size());
    if (!roots_vars.empty() && !capture.empty()) {
      std::vector<Edge> roots;
      for (const auto& o : roots_vars) roots.push_back(o.gradient_edge());
      ExecuteOptions opts;
      opts.create_graph = false;
      opts.keep_graph = true;
      opts.single_threaded = true;
      opts.capture = capture;
      grads = execute(roots, grad_outputs, opts);
    }
    for (std::size_t i = 0; i < grads.size(); ++i) {
      state.add_output(grads[i], J, i, /*require_traced=*/false);
      flags.outputs.push_back(VariableFlags::of(grads[i]));
    }
    t.stage_inputs_.push_back(grad_outputs);
    t.stage_outputs_.push_back(grads);
    t.flags_.push_back(std::move(flags));
    t.output_edges_.push_back(capture);
    std::vector<std::size_t> gradient_of_k = t.gradient_of_[k];
    t.gradient_of_.push_back(std::move(gradient_of_k));
    t.feeds_.emplace_back();
    g.set_joint_stage(J);
    return t;
  }

  // ---- prune the gradient inputs nobody feeds (Note [Cross-stage gradients]).
  ir::Graph& g = *t.graph_;
  auto [erase_outputs, dead_inputs] = [&] {
    try {
      return prune.run();
    } catch (const CompileError&) {
      throw CrossStageFallback{};  // a zero without a type to materialise
    }
  }();
  passes::eliminate_dead_code(g);
  for (std::size_t s = k; s >= 1; --s) {
    std::size_t begin = 0;
    for (std::size_t r = 0; r < s; ++r) begin += g.stage_output_counts()[r];
    for (std::size_t o = erase_outputs[s].size(); o-- > 0;) {
      if (!erase_outputs[s][o]) continue;
      g.erase_output(begin + o);
      t.flags_[s].outputs.erase(t.flags_[s].outputs.begin() + static_cast<std::ptrdiff_t>(o));
      t.stage_outputs_[s].erase(t.stage_outputs_[s].begin() + static_cast<std::ptrdiff_t>(o));
      t.output_edges_[s].erase(t.output_edges_[s].begin() + static_cast<std::ptrdiff_t>(o));
      prune.gradient_of[s].erase(prune.gradient_of[s].begin() + static_cast<std::ptrdiff_t>(o));
    }
  }
  passes::eliminate_dead_code(g);
  for (ir::Value* in : dead_inputs) {
    if (in->has_uses()) throw CrossStageFallback{};
    const auto& ins = g.inputs();
    const std::size_t gi = static_cast<std::size_t>(std::find(ins.begin(), ins.end(), in) - ins.begin());
    const std::size_t s = in->stage();
    auto stage_ins = g.stage_inputs(s);
    const std::size_t local = static_cast<std::size_t>(std::find(stage_ins.begin(), stage_ins.end(), in) - stage_ins.begin());
    t.flags_[s].inputs.erase(t.flags_[s].inputs.begin() + static_cast<std::ptrdiff_t>(local));
    t.stage_inputs_[s].erase(t.stage_inputs_[s].begin() + static_cast<std::ptrdiff_t>(local));
    g.erase_input(gi);
  }
  // Indices from values.
  const auto& ins = g.inputs();
  auto index_of = [&](const ir::Value* v) {
    return static_cast<std::size_t>(std::find(ins.begin(), ins.end(), v) - ins.begin());
  };
  for (std::size_t s = 1; s <= k; ++s) {
    t.gradient_of_[s].clear();
    for (ir::Value* v : prune.gradient_of[s]) t.gradient_of_[s].push_back(index_of(v));
    for (ir::Value* v : prune.feeds[s]) {
      auto stage_ins = g.stage_inputs(v->stage());
      t.feeds_[s].push_back(StageInputRef{
          v->stage(),
          static_cast<std::size_t>(std::find(stage_ins.begin(), stage_ins.end(), v) - stage_ins.begin())});
    }
  }
  return t;
}

}  // namespace stagejit::detail

namespace stagejit {

STAGEJIT_FUNC Trace trace(const traced_fn& fn, const variable_list& inputs, TraceOptions options) {
  STAGEJIT_CHECK(options.derivatives >= 0, "trace: derivatives must be >= 0, got ",
                 options.derivatives);
  const std::size_t k = static_cast<std::size_t>(options.derivatives);
  if (options.cross_stage_gradients && k >= 2) {
    try {
      return detail::trace_stages(fn, inputs, k, /*cut=*/true, /*joint=*/false);
    } catch (const detail::CrossStageFallback&) {
      // traced again below, each stage differentiating through the earlier ones
    }
  }
  return detail::trace_stages(fn, inputs, k, /*cut=*/false, options.joint_backward);
}

}  // namespace stagejit
