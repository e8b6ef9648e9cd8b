#pragma once
/// \file
/// Bodies of autograd/callbacks.hpp: `run_callback` for every policy.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/overloaded.hpp>

#include <mutex>

namespace stagejit {

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

}  // namespace stagejit
