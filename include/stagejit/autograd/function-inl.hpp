#pragma once
/// \file
/// Bodies of autograd/function.hpp: each Function kind's `apply` (`Function::apply`),
/// the accumulation into leaves, and the iterative release of a graph.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/detail/autograd_impl.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/host_function.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>

#include <ATen/ExpandUtils.h>

#include <memory>
#include <vector>

namespace stagejit {

// ------------------------------------------------------------------ Function kinds
namespace detail::autograd_impl {

STAGEJIT_FUNC variable_list undefined_list(std::size_t n) { return variable_list(n); }

// Note [Post-accumulate-grad hooks]
// A leaf's AccumulateGrad adds the incoming gradient into `grad()` and then runs the
// leaf's post-accumulate-grad hooks (Variable::register_post_accumulate_grad_hook), outside
// the leaf's lock, on the engine thread that ran it. The engine runs an AccumulateGrad as
// soon as every contribution to the leaf has arrived, and a compiled stage delivers each
// of its outputs as soon as it is computed (Note [Early outputs] in autograd/engine.hpp),
// so a hook learns that a parameter's gradient of this backward is final while the rest of
// the backward still runs, whether eager or compiled. Data-parallel training uses it to
// start a bucket's all-reduce (distributed/data_parallel.hpp), as PyTorch's DDP reducer
// does from its own AccumulateGrad hooks. An undefined incoming gradient accumulates
// nothing and runs no hook.
STAGEJIT_FUNC void accumulate(detail::VariableImpl& var, const Variable& incoming) {
  if (!incoming.defined()) return;
  STAGEJIT_CHECK_AS(ShapeError, incoming.sizes() == var.data.sizes(),
                    "AccumulateGrad: gradient of shape ", shape_str(incoming.sizes()),
                    " for a leaf of shape ", shape_str(var.data.sizes()));
  Variable g = incoming;
  if (!GradMode::is_enabled()) g = g.detach();
  std::vector<std::shared_ptr<const PostAccumulateGradHook>> hooks;
  {
    std::lock_guard<std::mutex> lock(var.mutex);
    if (!var.grad) {
      var.grad = g.impl();
    } else {
      Variable old = Variable::from_impl(var.grad);
      if (GradMode::is_enabled()) {
        var.grad = stagejit::add(old, g).impl();
      } else {
        var.grad = Variable(at::add(old.data(), g.data())).impl();
      }
    }
    hooks.reserve(var.post_accumulate_hooks.size());
    for (const auto& h : var.post_accumulate_hooks) hooks.push_back(h.second);
  }
  if (hooks.empty()) return;
  const Variable leaf = Variable::from_impl(var.shared_from_this());
  for (const auto& h : hooks) (*h)(leaf);
}

STAGEJIT_FUNC variable_list apply_op_backward(Function& self, OpBackward& ob, variable_list& grads) {
  STAGEJIT_CHECK(!ob.released, "Function '", self.name(),
                 "': saved variables were already freed (run the earlier backward with "
                 "keep_graph = true)");
  const std::size_t n = self.next_functions.size();
  bool any = false;
  for (auto& g : grads) any = any || g.defined();
  if (!any) return undefined_list(n);
  auto me = self.shared_from_this();
  variable_list inputs(ob.saved_inputs.size()), outputs(ob.saved_outputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) inputs[i] = ob.saved_inputs[i].unpack(me, i);
  for (std::size_t i = 0; i < outputs.size(); ++i) outputs[i] = ob.saved_outputs[i].unpack(me, i);
  uint64_t mask = 0;
  for (std::size_t i = 0; i < n && i < 64; ++i)
    if (self.next_functions[i].is_valid() && engine::should_compute_output(self, i))
      mask |= (uint64_t{1} << i);
  BackwardArgs args{ob.attrs, inputs, outputs, grads, ob.input_meta, mask};
  variable_list res = ob.op->backward(args);
  res.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (!self.next_functions[i].is_valid()) {
      res[i] = Variable();
      continue;
    }
    if (!res[i].defined()) continue;
    const InputMeta& meta = ob.input_meta[i];
    if (res[i].sizes() != at::IntArrayRef(meta.sizes)) {
      STAGEJIT_CHECK_AS(ShapeError, at::is_expandable_to(meta.sizes, res[i].sizes()),
                        "Function '", self.name(), "': gradient ", i, " has shape ",
                        shape_str(res[i].sizes()), ", expected ", shape_str(meta.sizes));
      res[i] = sum_to_size(res[i], std::vector<int64_t>(meta.sizes.begin(), meta.sizes.end()));
    }
    if (res[i].scalar_type() != meta.options.dtype().toScalarType())
      res[i] = to(res[i], meta.options.dtype().toScalarType());
  }
  return res;
}

STAGEJIT_FUNC void check_one_undefined(const Function& self, const variable_list& inputs) {
  STAGEJIT_CHECK(inputs.size() == 1 && !inputs[0].defined(), "Function '", self.name(),
                 "' expects exactly one undefined input (got ", inputs.size(), " inputs)");
}

}  // namespace detail::autograd_impl

STAGEJIT_FUNC std::string Function::name() const {
  return std::visit(
      Overloaded{
          [](const AccumulateGrad&) -> std::string { return "AccumulateGrad"; },
          [](const OpBackward& o) -> std::string { return o.op ? std::string(o.op->backward_name) : "OpBackward"; },
          [](const HostBackward& h) -> std::string { return h.name + "Backward"; },
          [](const ErrorFunction&) -> std::string { return "Error"; },
          [](const Eval&) -> std::string { return "Eval"; },
          [](const EvalOutput&) -> std::string { return "EvalOutput"; },
          [](const Replicate&) -> std::string { return "Replicate"; },
          [](const InputPlaceholder&) -> std::string { return "InputPlaceholder"; },
          [](const PrevStageInput&) -> std::string { return "PrevStageInput"; },
          [](const EvalPlaceholder&) -> std::string { return "EvalPlaceholder"; },
          [](const Output&) -> std::string { return "Output"; },
          [](const EmitNull&) -> std::string { return "EmitNull"; },
          [](const OpCall& c) -> std::string {
            return c.op ? "OpCall(" + std::string(c.op->name) + ")" : "OpCall";
          },
          [](const AtenCall& c) -> std::string { return "AtenCall(" + std::string(c.name) + ")"; },
          [](const HostCall& h) -> std::string { return "HostCall(" + h.name + ")"; },
          [](const WrapConstant&) -> std::string { return "WrapConstant"; },
          [](const ConstantFactory&) -> std::string { return "ConstantFactory"; },
          [](const FusedKernel& f) -> std::string { return "FusedKernel(" + f.name + ")"; },
          [](const ClosureFunction& c) -> std::string {
            return c.impl ? std::string(c.impl->name()) : "Closure";
          },
      },
      kind);
}

STAGEJIT_FUNC variable_list Function::apply(variable_list inputs) {
  const std::size_t n = next_functions.size();
  return std::visit(
      Overloaded{
          [&](AccumulateGrad& a) -> variable_list {
            STAGEJIT_CHECK(inputs.size() == 1, "AccumulateGrad expects 1 input, got ",
                           inputs.size());
            detail::autograd_impl::accumulate(*a.variable, inputs[0]);
            return {};
          },
          [&](OpBackward& o) { return detail::autograd_impl::apply_op_backward(*this, o, inputs); },
          [&](HostBackward& h) { return detail::autograd_impl::apply_host_backward(*this, h, inputs); },
          [&](ErrorFunction& e) -> variable_list { throw Error(e.message); },
          [&](Eval& e) { return detail::autograd_impl::apply_eval(*this, e, inputs); },
          [&](EvalOutput&) { return detail::autograd_impl::undefined_list(n); },
          [&](Replicate&) -> variable_list {
            STAGEJIT_CHECK(inputs.size() == 1, "Replicate expects 1 input");
            return variable_list(n, inputs[0]);
          },
          [&](InputPlaceholder&) { return inputs; },
          [&](PrevStageInput&) -> variable_list {
            STAGEJIT_CHECK(inputs.size() == 1, "PrevStageInput expects 1 input");
            return variable_list(n, inputs[0]);
          },
          [&](EvalPlaceholder&) { return inputs; },
          [&](Output&) -> variable_list {
            throw Error("Output::apply called (an Output must be stopped by a "
                        "CaptureOutputs pre-callback)");
          },
          [&](EmitNull&) { return detail::autograd_impl::undefined_list(1); },
          [&](OpCall& c) -> variable_list {
            STAGEJIT_CHECK(c.op, "OpCall without an op");
            if (c.op->max_inputs == 0) {
              detail::autograd_impl::check_one_undefined(*this, inputs);
              return ops::apply(*c.op, {}, c.attrs);
            }
            return ops::apply(*c.op, inputs, c.attrs);
          },
          [&](AtenCall& c) -> variable_list {
            STAGEJIT_CHECK(c.fn, "AtenCall '", c.name, "' without a callable");
            return c.fn(inputs);
          },
          [&](HostCall& h) -> variable_list {
            STAGEJIT_CHECK(h.call, "HostCall '", h.name, "' without a callable");
            return h.call(inputs);
          },
          [&](WrapConstant& w) -> variable_list {
            detail::autograd_impl::check_one_undefined(*this, inputs);
            return {Variable(w.value.clone())};
          },
          [&](ConstantFactory&) -> variable_list {
            detail::autograd_impl::check_one_undefined(*this, inputs);
            return detail::autograd_impl::undefined_list(n);
          },
          [&](FusedKernel& f) -> variable_list {
            STAGEJIT_CHECK(f.run, "FusedKernel '", f.name, "' has no kernel");
            return f.run(inputs);
          },
          [&](ClosureFunction& c) -> variable_list {
            STAGEJIT_CHECK(c.impl, "ClosureFunction without an implementation");
            std::vector<char> needed(next_functions.size());
            for (std::size_t i = 0; i < needed.size(); ++i)
              needed[i] = engine::should_compute_output(*this, i);
            return c.impl->apply(std::move(inputs), needed, engine::early_output_sink(*this));
          },
      },
      kind);
}

STAGEJIT_FUNC void Function::release_variables() {
  if (auto* o = std::get_if<OpBackward>(&kind)) {
    for (auto& s : o->saved_inputs) s.reset();
    for (auto& s : o->saved_outputs) s.reset();
    o->released = true;
  }
}

// ------------------------------------------------------------------ iterative release
// Note [Iterative release]
// A Function owns the next Functions of its graph through its edges (and, through saved
// Variables, their grad_fns), so freeing the last Variable of an eager chain of n ops
// used to run n nested destructors: `y = -y` 200 000 times overflowed the stack when y
// went away. As libtorch's deleteNode (torch/csrc/autograd/function.cpp), a Function's
// destructor does not free what it owns itself: `~Function` and `~VariableImpl` hand each
// owned Function to `release_function`, which puts it on this thread's worklist when a
// release is already running further up the stack, and otherwise runs one, freeing the
// worklist's Functions one at a time until it is empty. The stack holds at most one
// Function destructor under the running release, whatever the graph's length; memory is
// still freed before the outermost release returns. The worklist pointer is a trivially
// destructible thread_local (a release at thread or program exit stays valid); the list
// itself lives in the outermost release's frame.
namespace detail::autograd_impl {
inline thread_local std::vector<std::shared_ptr<Function>>* t_release_worklist = nullptr;
}  // namespace detail::autograd_impl

STAGEJIT_FUNC void detail::release_function(std::shared_ptr<Function>& fn) noexcept {
  if (!fn) return;
  if (fn.use_count() > 1) {  // another owner keeps it: nothing is freed now
    fn.reset();
    return;
  }
  if (auto* list = detail::autograd_impl::t_release_worklist) {
    list->push_back(std::move(fn));
    return;
  }
  std::vector<std::shared_ptr<Function>> worklist;
  detail::autograd_impl::t_release_worklist = &worklist;
  worklist.push_back(std::move(fn));
  while (!worklist.empty()) {
    std::shared_ptr<Function> next = std::move(worklist.back());
    worklist.pop_back();
    next.reset();  // its destructor adds what it owned to the worklist
  }
  detail::autograd_impl::t_release_worklist = nullptr;
}

STAGEJIT_FUNC Function::~Function() {
  for (auto& e : next_functions) detail::release_function(e.function);
  if (auto* ev = std::get_if<Eval>(&kind)) {
    for (auto& e : ev->roots) detail::release_function(e.function);
    for (auto& p : ev->placeholders) detail::release_function(p);
  } else if (auto* out = std::get_if<EvalOutput>(&kind)) {
    detail::release_function(out->next_edge.function);
  }
}

}  // namespace stagejit
