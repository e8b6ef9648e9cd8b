#pragma once
/// \file
/// Variable, grad mode, trace hook, saved variables, Function kinds' apply, callbacks,
/// grad()/backward(), host functions and Eval.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/eval.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/host_function.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>

#include <ATen/ExpandUtils.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace stagejit {

// ------------------------------------------------------------------ grad mode, trace hook
namespace detail::autograd_impl {
inline thread_local bool t_grad_enabled = true;
inline thread_local TraceHook* t_trace_hook = nullptr;

STAGEJIT_FUNC std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}
}  // namespace detail::autograd_impl
using namespace detail::autograd_impl;

STAGEJIT_FUNC bool GradMode::is_enabled() noexcept { return t_grad_enabled; }
STAGEJIT_FUNC void GradMode::set_enabled(bool enabled) noexcept { t_grad_enabled = enabled; }
STAGEJIT_FUNC TraceHook* current_trace_hook() noexcept { return t_trace_hook; }
STAGEJIT_FUNC void set_current_trace_hook(TraceHook* hook) noexcept { t_trace_hook = hook; }

// ------------------------------------------------------------------ Variable
namespace detail::autograd_impl {
STAGEJIT_FUNC const at::Tensor& undefined_tensor() {
  static const at::Tensor t;
  return t;
}
STAGEJIT_FUNC const std::shared_ptr<Function>& null_function() {
  static const std::shared_ptr<Function> f;
  return f;
}
STAGEJIT_FUNC at::Tensor strip(at::Tensor data) {
  if (data.defined() && data.requires_grad()) return data.detach();
  return data;
}
}  // namespace detail::autograd_impl
using namespace detail::autograd_impl;

STAGEJIT_FUNC Variable::Variable(at::Tensor data, bool requires_grad) {
  if (!data.defined()) {
    STAGEJIT_CHECK(!requires_grad, "Variable: an undefined tensor cannot require grad");
    return;
  }
  impl_ = std::make_shared<detail::VariableImpl>();
  impl_->data = strip(std::move(data));
  if (requires_grad) set_requires_grad(true);
}

STAGEJIT_FUNC Variable::Variable(at::Tensor data, Edge edge) {
  if (!data.defined()) return;
  impl_ = std::make_shared<detail::VariableImpl>();
  impl_->data = strip(std::move(data));
  impl_->grad_fn = std::move(edge.function);
  impl_->output_nr = edge.input_nr;
}

STAGEJIT_FUNC const at::Tensor& Variable::data() const noexcept {
  return impl_ ? impl_->data : undefined_tensor();
}

STAGEJIT_FUNC const std::shared_ptr<Function>& Variable::grad_fn() const noexcept {
  return impl_ ? impl_->grad_fn : null_function();
}

STAGEJIT_FUNC void Variable::set_requires_grad(bool requires_grad) {
  STAGEJIT_CHECK(impl_, "set_requires_grad on an undefined Variable");
  STAGEJIT_CHECK(is_leaf(), "set_requires_grad: only leaves can be marked (this Variable has "
                 "grad_fn '", impl_->grad_fn->name(), "')");
  STAGEJIT_CHECK(!requires_grad || at::isFloatingType(impl_->data.scalar_type()) ||
                     at::isComplexType(impl_->data.scalar_type()),
                 "only floating point Variables can require grad (got dtype ",
                 impl_->data.scalar_type(), ")");
  impl_->requires_grad = requires_grad;
}

STAGEJIT_FUNC Edge Variable::gradient_edge() const {
  if (!impl_) return {};
  if (impl_->grad_fn) return Edge{impl_->grad_fn, impl_->output_nr};
  if (!impl_->requires_grad) return {};
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto acc = impl_->grad_accumulator.lock();
  if (!acc) {
    acc = make_function(AccumulateGrad{impl_}, {}, 1);
    impl_->grad_accumulator = acc;
  }
  return Edge{acc, 0};
}

STAGEJIT_FUNC void Variable::set_gradient_edge(Edge edge) const {
  STAGEJIT_CHECK(impl_, "set_gradient_edge on an undefined Variable");
  impl_->grad_fn = std::move(edge.function);
  impl_->output_nr = edge.input_nr;
}

STAGEJIT_FUNC Variable Variable::grad() const {
  if (!impl_) return {};
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return Variable::from_impl(impl_->grad);
}

STAGEJIT_FUNC void Variable::set_grad(const Variable& grad) const {
  STAGEJIT_CHECK(impl_, "set_grad on an undefined Variable");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->grad = grad.impl();
}

STAGEJIT_FUNC uint64_t Variable::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const {
  STAGEJIT_CHECK(impl_, "register_post_accumulate_grad_hook on an undefined Variable");
  STAGEJIT_CHECK(is_leaf(), "register_post_accumulate_grad_hook: only leaves accumulate "
                 "gradients (this Variable has grad_fn '", impl_->grad_fn->name(), "')");
  STAGEJIT_CHECK(impl_->requires_grad, "register_post_accumulate_grad_hook: the leaf does not "
                 "require grad (no gradient is ever accumulated into it)");
  STAGEJIT_CHECK(hook, "register_post_accumulate_grad_hook: empty hook");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const uint64_t handle = impl_->next_hook_handle++;
  impl_->post_accumulate_hooks.emplace_back(
      handle, std::make_shared<const PostAccumulateGradHook>(std::move(hook)));
  return handle;
}

STAGEJIT_FUNC bool Variable::remove_post_accumulate_grad_hook(uint64_t handle) const {
  if (!impl_) return false;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& hooks = impl_->post_accumulate_hooks;
  auto it = std::find_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.first == handle; });
  if (it == hooks.end()) return false;
  hooks.erase(it);
  return true;
}

STAGEJIT_FUNC void Variable::backward(const Variable& grad_output, bool create_graph) const {
  stagejit::backward({*this}, {grad_output}, create_graph);
}

// ------------------------------------------------------------------ SavedVariable
STAGEJIT_FUNC SavedVariable::SavedVariable(const Variable& v, bool is_output) {
  if (!v.defined()) return;
  data_ = v.data();
  tracks_version_ = !data_.is_inference();
  if (tracks_version_) saved_version_ = data_._version();
  is_output_ = is_output;
  requires_grad_ = v.requires_grad();
  if (is_output) {
    output_ = v.impl();
    output_nr_ = v.output_nr();
  } else {
    input_ = v.impl();
  }
}

STAGEJIT_FUNC Variable SavedVariable::unpack(const std::shared_ptr<Function>& owner, std::size_t index,
                                            const char* role) const {
  if (!data_.defined()) return {};
  if (tracks_version_ && data_._version() != saved_version_) {
    throw Error(detail::str_cat(
        "one of the variables needed for gradient computation has been modified by an "
        "inplace operation: saved ", role ? role : (is_output_ ? "output" : "input"), " ", index,
        " of ", owner ? owner->name() : std::string("a function"), ", a ", data_.scalar_type(),
        " tensor of shape ", shape_str(data_.sizes()),
        ", is at version ", data_._version(), "; expected version ", saved_version_,
        " instead (it was modified in place after the forward saved it)"));
  }
  if (!is_output_) return Variable::from_impl(input_);
  if (auto alive = output_.lock()) return Variable::from_impl(std::move(alive));
  if (!requires_grad_ || !owner) return Variable(data_);
  return Variable(data_, Edge{owner, output_nr_});
}

STAGEJIT_FUNC void SavedVariable::reset() noexcept {
  data_.reset();
  input_.reset();
  output_.reset();
}

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

variable_list apply_host_backward(Function& self, HostBackward& hb, variable_list& grads);
variable_list apply_eval(Function& self, Eval& ev, variable_list& grads);

STAGEJIT_FUNC void check_one_undefined(const Function& self, const variable_list& inputs) {
  STAGEJIT_CHECK(inputs.size() == 1 && !inputs[0].defined(), "Function '", self.name(),
                 "' expects exactly one undefined input (got ", inputs.size(), " inputs)");
}

}  // namespace detail::autograd_impl
using namespace detail::autograd_impl;

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
            accumulate(*a.variable, inputs[0]);
            return {};
          },
          [&](OpBackward& o) { return apply_op_backward(*this, o, inputs); },
          [&](HostBackward& h) { return apply_host_backward(*this, h, inputs); },
          [&](ErrorFunction& e) -> variable_list { throw Error(e.message); },
          [&](Eval& e) { return apply_eval(*this, e, inputs); },
          [&](EvalOutput&) { return undefined_list(n); },
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
          [&](EmitNull&) { return undefined_list(1); },
          [&](OpCall& c) -> variable_list {
            STAGEJIT_CHECK(c.op, "OpCall without an op");
            if (c.op->max_inputs == 0) {
              check_one_undefined(*this, inputs);
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
            check_one_undefined(*this, inputs);
            return {Variable(w.value.clone())};
          },
          [&](ConstantFactory&) -> variable_list {
            check_one_undefined(*this, inputs);
            return undefined_list(n);
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
  if (auto* list = t_release_worklist) {
    list->push_back(std::move(fn));
    return;
  }
  std::vector<std::shared_ptr<Function>> worklist;
  t_release_worklist = &worklist;
  worklist.push_back(std::move(fn));
  while (!worklist.empty()) {
    std::shared_ptr<Function> next = std::move(worklist.back());
    worklist.pop_back();
    next.reset();  // its destructor adds what it owned to the worklist
  }
  t_release_worklist = nullptr;
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

STAGEJIT_FUNC detail::VariableImpl::~VariableImpl() { release_function(grad_fn); }

// ------------------------------------------------------------------ callbacks
STAGEJIT_FUNC bool run_callback(const CallbackPolicy& policy, Function& fn, variable_list& inputs,
                  variable_list* outputs, CallState* state) {
  auto need_state = [&](const char* what) {
    STAGEJIT_CHECK(state, "callback ", what, " on Function '", fn.name(),
                   "' needs a CallState (pass one to execute)");
  };
  auto need_outputs = [&](const char* what) {
    STAGEJIT_CHECK(outputs, what, " is a post callback (Function '", fn.name(), "')");
  };
  // The grad_fn of the first defined output that has one: the opaque backward a host
  // function or a Handle made (null when none did).
  auto first_grad_fn = [](const variable_list& outs) -> std::shared_ptr<Function> {
    for (const auto& o : outs)
      if (o.defined() && o.grad_fn()) return o.grad_fn();
    return nullptr;
  };
  auto store_handle = [&](std::size_t slot, std::shared_ptr<Function> h) {
    std::lock_guard<std::mutex> lock(state->mutex);
    if (state->handles.size() <= slot) state->handles.resize(slot + 1);
    state->handles[slot] = std::move(h);
  };
  return std::visit(
      Overloaded{
          [&](const CaptureInput& c) {
            need_state("CaptureInput");
            STAGEJIT_CHECK(c.input < inputs.size(), "CaptureInput: Function '", fn.name(),
                           "' has no input ", c.input);
            std::lock_guard<std::mutex> lock(state->mutex);
            if (state->values.size() <= c.slot) state->values.resize(c.slot + 1);
            state->values[c.slot] = inputs[c.input];
            return !c.stop;
          },
          [&](const CaptureOutput& c) {
            need_state("CaptureOutput");
            need_outputs("CaptureOutput");
            STAGEJIT_CHECK(c.output < outputs->size(), "CaptureOutput: Function '", fn.name(),
                           "' has no output ", c.output);
            std::lock_guard<std::mutex> lock(state->mutex);
            if (state->values.size() <= c.slot) state->values.resize(c.slot + 1);
            state->values[c.slot] = (*outputs)[c.output];
            return true;
          },
          [&](const CaptureHandle& c) {
            need_state("CaptureHandle");
            need_outputs("CaptureHandle");
            store_handle(c.slot, first_grad_fn(*outputs));
            return true;
          },
          [&](const RunHandle& r) {
            need_state("RunHandle");
            need_outputs("RunHandle");
            std::shared_ptr<Function> h;
            {
              std::lock_guard<std::mutex> lock(state->mutex);
              if (r.in_slot < state->handles.size()) h = state->handles[r.in_slot];
            }
            STAGEJIT_CHECK(h, "closure: Eval ", r.where, " received no Handle (the opaque "
                           "function it stands for made no backward in this call)");
            {
              // Mirror the trace: the incoming gradients required grad when a further
              // stage followed, which decides the shape of the next opaque backward.
              AutoGradMode grad_mode(r.makes_handle);
              variable_list grads;
              grads.reserve(inputs.size());
              for (auto& g : inputs) grads.push_back(g.defined() ? Variable(g.data(), r.makes_handle) : g);
              *outputs = h->apply(std::move(grads));
            }
            STAGEJIT_CHECK(outputs->size() == r.expected, "closure: Eval ", r.where, " returned ",
                           outputs->size(), " gradients, the trace recorded ", r.expected);
            if (r.out_slot >= 0) store_handle(static_cast<std::size_t>(r.out_slot), first_grad_fn(*outputs));
            return true;
          },
          [&](const CaptureOutputs&) {
            need_state("CaptureOutputs");
            std::lock_guard<std::mutex> lock(state->mutex);
            state->outputs = inputs;
            return false;
          },
          [&](const EmitOutput& e) {
            need_state("EmitOutput");
            need_outputs("EmitOutput");
            STAGEJIT_CHECK(e.output < outputs->size(), "EmitOutput: Function '", fn.name(),
                           "' has no output ", e.output);
            if (state->early_outputs) state->early_outputs(e.stage_output, (*outputs)[e.output]);
            return true;
          },
          [&](const GenericCallback& g) { return g.fn ? g.fn(fn, inputs, outputs, state) : true; },
      },
      policy);
}

// ------------------------------------------------------------------ grad(), backward()
namespace detail::autograd_impl {

STAGEJIT_FUNC void make_roots(const variable_list& outputs, const variable_list& grad_outputs,
                std::vector<Edge>& roots, variable_list& grads) {
  STAGEJIT_CHECK(!outputs.empty(), "grad/backward: no outputs given");
  STAGEJIT_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(),
                 "grad/backward: got ", grad_outputs.size(), " grad_outputs for ",
                 outputs.size(), " outputs");
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const Variable& out = outputs[i];
    STAGEJIT_CHECK(out.defined(), "grad/backward: output ", i, " is undefined");
    STAGEJIT_CHECK(out.requires_grad(), "grad/backward: element ", i,
                   " of outputs does not require grad and has no grad_fn");
    Variable g = grad_outputs.empty() ? Variable() : grad_outputs[i];
    if (g.defined()) {
      STAGEJIT_CHECK_AS(ShapeError, g.sizes() == out.sizes(), "grad/backward: grad_output ", i,
                        " has shape ", shape_str(g.sizes()), " but output ", i, " has shape ",
                        shape_str(out.sizes()));
      // As libtorch's validate_outputs: a gradient lives on its output's device.
      STAGEJIT_CHECK(g.data().device() == out.data().device(), "grad/backward: grad_output ", i,
                     " is on device ", g.data().device(), " but output ", i, " is on ",
                     out.data().device());
    } else {
      STAGEJIT_CHECK(out.numel() == 1, "grad can be implicitly created only for scalar outputs "
                     "(output ", i, " has shape ", shape_str(out.sizes()),
                     "; pass a grad_output)");
      g = Variable(at::ones_like(out.data(), at::MemoryFormat::Preserve));
    }
    roots.push_back(out.gradient_edge());
    grads.push_back(std::move(g));
  }
}

}  // namespace detail::autograd_impl
using namespace detail::autograd_impl;

STAGEJIT_FUNC variable_list grad(const variable_list& outputs, const variable_list& inputs,
                   const variable_list& grad_outputs, bool create_graph, bool allow_unused) {
  std::vector<Edge> roots;
  variable_list grads;
  make_roots(outputs, grad_outputs, roots, grads);
  STAGEJIT_CHECK(!inputs.empty(), "grad: no inputs given");
  ExecuteOptions opts;
  opts.create_graph = create_graph;
  opts.keep_graph = true;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    STAGEJIT_CHECK(inputs[i].defined(), "grad: input ", i, " is undefined");
    STAGEJIT_CHECK(inputs[i].requires_grad(), "grad: element ", i,
                   " of inputs does not require grad");
    opts.capture.push_back(inputs[i].gradient_edge());
  }
  variable_list res = execute(roots, grads, opts);
  for (std::size_t i = 0; i < res.size(); ++i) {
    STAGEJIT_CHECK(res[i].defined() || allow_unused, "grad: element ", i,
                   " of inputs was not used in the graph (pass allow_unused = true to get an "
                   "undefined gradient instead)");
  }
  return res;
}

STAGEJIT_FUNC void backward(const variable_list& outputs, const variable_list& grad_outputs,
              bool create_graph) {
  std::vector<Edge> roots;
  variable_list grads;
  make_roots(outputs, grad_outputs, roots, grads);
  ExecuteOptions opts;
  opts.create_graph = create_graph;
  execute(roots, grads, opts);
}

// ------------------------------------------------------------------ host functions
STAGEJIT_FUNC variable_list HostContext::get_saved_variables() const {
  if (!finalized_) return to_save_;
  auto owner = owner_.lock();
  variable_list out;
  out.reserve(saved_.size());
  for (std::size_t i = 0; i < saved_.size(); ++i) out.push_back(saved_[i].unpack(owner, i, "variable"));
  return out;
}

STAGEJIT_FUNC void HostContext::finalize(const variable_list& outputs, const std::shared_ptr<Function>& owner) {
  owner_ = owner;
  saved_.clear();
  for (const auto& v : to_save_) {
    bool is_output = false;
    for (const auto& o : outputs) is_output = is_output || (v.defined() && o.impl_id() == v.impl_id());
    saved_.emplace_back(v, is_output && owner != nullptr);
  }
  to_save_.clear();
  finalized_ = true;
}

namespace detail {

STAGEJIT_FUNC std::shared_ptr<Function> finish_host_call(
    const std::string& name, const std::shared_ptr<HostContext>& ctx,
    const variable_list& inputs, variable_list& outputs,
    std::function<variable_list(HostContext*, variable_list)> backward, bool traceable,
    const std::string& calling_convention, const std::vector<Scalar>& scalars,
    const HostCallable& call) {
  for (auto& o : outputs) {
    if (!o.defined()) continue;
    bool is_input = false;
    for (const auto& in : inputs) is_input = is_input || in.impl_id() == o.impl_id();
    if (is_input || o.requires_grad()) o = Variable(o.data());
  }
  bool needs = false;
  if (GradMode::is_enabled())
    for (const auto& in : inputs) needs = needs || in.requires_grad();
  std::shared_ptr<Function> fn;
  if (needs) {
    std::vector<Edge> edges;
    std::vector<InputMeta> metas;
    for (const auto& in : inputs) {
      edges.push_back(in.gradient_edge());
      metas.push_back(InputMeta{at::DimVector(in.sizes()), in.options()});
    }
    fn = make_function(HostBackward{name, ctx, std::move(backward), std::move(metas), traceable, calling_convention},
                       std::move(edges), static_cast<uint32_t>(outputs.size()));
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && at::isFloatingType(outputs[i].scalar_type()))
        outputs[i].set_gradient_edge(Edge{fn, static_cast<uint32_t>(i)});
    }
  }
  ctx->finalize(outputs, fn);
  if (!traceable)
    if (auto* hook = current_trace_hook())
      hook->record_host_op(name, calling_convention, scalars, inputs, outputs, fn, call);
  return fn;
}

}  // namespace detail

namespace detail::autograd_impl {

// A host backward's gradients, one per tensor input. It may return one per tensor input,
// or one per forward argument (libtorch's Function<T>, the seed's MulConstant:
// `{g * c, Variable()}`), whose non-tensor slots must be undefined. As libtorch's
// CppNode<T>::apply, gradients past the forward's arguments are dropped when they are all
// undefined (a defined one is an error).
STAGEJIT_FUNC variable_list per_tensor_input(const HostBackward& hb, variable_list results) {
  const std::string& conv = hb.calling_convention;
  if (results.size() > conv.size() && results.size() > hb.input_meta.size()) {
    bool all_undefined = true;
    for (std::size_t k = conv.size(); k < results.size(); ++k) all_undefined = all_undefined && !results[k].defined();
    if (all_undefined) results.resize(conv.size());
  }
  if (results.size() == hb.input_meta.size()) return results;
  STAGEJIT_CHECK(results.size() == conv.size(), "HostFunction '", hb.name, "': backward returned ",
                 results.size(), " gradients, expected ", hb.input_meta.size(),
                 " (one per tensor input) or ", conv.size(),
                 " (one per forward argument, undefined for the non-tensor ones; further undefined "
                 "ones are dropped)");
  variable_list tensors;
  tensors.reserve(hb.input_meta.size());
  for (std::size_t k = 0; k < conv.size(); ++k) {
    if (conv[k] == 't') {
      tensors.push_back(std::move(results[k]));
      continue;
    }
    STAGEJIT_CHECK(!results[k].defined(), "HostFunction '", hb.name, "': backward returned a defined gradient for argument ",
                   k, ", which is not a tensor (a scalar argument has no gradient: return an undefined Variable there)");
  }
  return tensors;
}

STAGEJIT_FUNC variable_list apply_host_backward(Function& self, HostBackward& hb, variable_list& grads) {
  TraceHook* hook = hb.traceable ? nullptr : current_trace_hook();
  variable_list grads_in = grads;
  variable_list results;
  {
    TraceHookGuard suspend(hb.traceable ? current_trace_hook() : nullptr);
    results = hb.backward(hb.ctx.get(), grads);
    results = per_tensor_input(hb, std::move(results));
    // As libtorch's validate_outputs (engine.cpp): a gradient of another shape that the
    // input's shape broadcasts to is summed back to the input's shape (`at::sum_to`, here
    // the differentiable `sum_to_size`: [2, 3] or [1, 3] for an input [3]), any other shape
    // is a ShapeError; the device must be the input's; another dtype is cast to the input's
    // (inside the suspended hook: part of the opaque backward).
    for (std::size_t i = 0; i < results.size(); ++i) {
      if (!results[i].defined()) continue;
      const InputMeta& meta = hb.input_meta[i];
      if (results[i].sizes() != at::IntArrayRef(meta.sizes)) {
        STAGEJIT_CHECK_AS(ShapeError, at::is_expandable_to(meta.sizes, results[i].sizes()),
                          "HostFunction '", hb.name, "': backward gradient ", i, " has shape ",
                          shape_str(results[i].sizes()), ", expected ", shape_str(meta.sizes),
                          " (the shape of input ", i, ") or a shape ", shape_str(meta.sizes),
                          " broadcasts to (summed back to it, as libtorch does)");
        results[i] = sum_to_size(results[i], std::vector<int64_t>(meta.sizes.begin(), meta.sizes.end()));
      }
      STAGEJIT_CHECK(results[i].data().device() == meta.options.device(), "HostFunction '",
                     hb.name, "': backward gradient ", i, " is on device ",
                     results[i].data().device(), ", expected ", meta.options.device(),
                     " (the device of input ", i, ")");
      if (!self.next_functions[i].is_valid()) {
        results[i] = Variable();
        continue;
      }
      const at::ScalarType dtype = meta.options.dtype().toScalarType();
      if (results[i].scalar_type() != dtype) results[i] = to(results[i], dtype);
    }
  }
  std::shared_ptr<Function> backward_of_outputs;
  bool any_rg = false;
  for (auto& r : results) any_rg = any_rg || r.requires_grad();
  if (GradMode::is_enabled() && any_rg && !hb.traceable) {
    variable_list boundary = grads_in;
    for (auto& s : hb.ctx->get_saved_variables()) boundary.push_back(s);
    backward_of_outputs = eval::wrap(boundary, results);
  }
  if (hook) hook->record_eval(self, grads_in, results, backward_of_outputs);
  return results;
}

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
using namespace detail::autograd_impl;

namespace eval {

STAGEJIT_FUNC std::shared_ptr<Function> wrap(const variable_list& inputs, const variable_list& outputs,
                               const std::shared_ptr<Function>& inherited) {
  // Note [Eval boundary]: an edge ends the subgraph when it is the gradient edge of an
  // input or the outer edge of an inherited placeholder (new placeholders are patched in),
  // when it points to a leaf accumulator (likewise), or when it points to an existing
  // EvalOutput placeholder (of `inherited` or any earlier Eval): that placeholder is reused
  // as is, not patched, so the earlier Eval's subgraph stays intact.
  std::vector<Edge> boundary;
  std::unordered_map<Edge, std::size_t, EdgeHash> boundary_index;
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
  std::unordered_map<Edge, std::shared_ptr<Function>, EdgeHash> ph_of;
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
