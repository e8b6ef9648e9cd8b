#pragma once
/// \file
/// Bodies of trace/interpret.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/trace/interpret.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/trace/host_op_payload.hpp>

#include <memory>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

namespace stagejit {

STAGEJIT_FUNC variable_list interpret(const ir::Graph& graph, const variable_list& inputs) {
  using RtValue = std::variant<Variable, std::shared_ptr<Function>>;
  STAGEJIT_CHECK_AS(CompileError, inputs.size() == graph.inputs().size(), "interpret: graph has ",
                    graph.inputs().size(), " inputs (all stages), given ", inputs.size());
  AutoGradMode grad_on(true);
  TraceHookGuard no_trace(nullptr);
  std::unordered_map<const ir::Value*, RtValue> env;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    env[graph.inputs()[i]] = inputs[i].defined()
                                 ? Variable(inputs[i].data(), inputs[i].requires_grad())
                                 : Variable();

  auto var = [&](const ir::Node* n, ir::Value* v) -> Variable {
    auto it = env.find(v);
    STAGEJIT_CHECK_AS(CompileError, it != env.end(), "interpret: node ", n->describe(),
                      " reads a value that was never computed");
    const Variable* p = std::get_if<Variable>(&it->second);
    STAGEJIT_CHECK_AS(CompileError, p, "interpret: node ", n->describe(),
                      " expects a tensor input but got a Handle");
    return *p;
  };

  for (ir::Node* n : graph.nodes()) {
    variable_list in;
    std::shared_ptr<Function> handle;
    for (std::size_t i = 0; i < n->inputs().size(); ++i) {
      ir::Value* v = n->inputs()[i];
      if (v->is_handle()) {
        auto it = env.find(v);
        STAGEJIT_CHECK_AS(CompileError, it != env.end(), "interpret: node ", n->describe(),
                          " reads a Handle that was never made");
        auto* f = std::get_if<std::shared_ptr<Function>>(&it->second);
        STAGEJIT_CHECK_AS(CompileError, f && *f, "interpret: node ", n->describe(),
                          " received an empty Handle (the forward it stands for made no "
                          "backward: did its inputs require grad as when traced?)");
        handle = *f;
      } else {
        in.push_back(var(n, v));
      }
    }
    variable_list out;
    std::shared_ptr<Function> out_handle;
    bool has_handle_out = !n->outputs().empty() && n->outputs().back()->is_handle();
    auto capture_handle = [&] {
      if (!has_handle_out) return;
      for (const auto& o : out)
        if (o.defined() && o.grad_fn()) { out_handle = o.grad_fn(); break; }
    };
    auto no_autograd = [&](std::string_view what) {
      detail::throw_error<CompileError>("interpret: node ", n->describe(), " (", what,
                                        ") has no backward formula; the reference interpreter "
                                        "runs only differentiable kinds");
    };
    std::visit(
        Overloaded{
            [&](const ir::Constant& kind) { out.push_back(Variable(kind.value.clone())); },
            [&](const ir::Undefined&) { out.push_back(Variable()); },
            [&](const ir::Op& kind) {
              out = ops::apply(ops::def(kind.schema()), in, detail::to_core_attributes(kind.attributes));
            },
            [&](const ir::HostOp& kind) {
              auto payload = std::static_pointer_cast<HostOpPayload>(kind.payload);
              STAGEJIT_CHECK_AS(CompileError, payload && payload->call, "interpret: HostOp ",
                                n->describe(), " has no callable (only traced graphs can run "
                                "host functions)");
              out = payload->call(in);
              capture_handle();
            },
            [&](const ir::Eval&) {
              STAGEJIT_CHECK_AS(CompileError, handle, "interpret: Eval ", n->describe(),
                                " has no Handle input");
              out = handle->apply(in);
              capture_handle();
            },
            [&](const ir::FusionGroup&) { no_autograd("a fusion group: interpret the graph before fusion"); },
            [&](const ir::Transpose&) { no_autograd("Transpose"); },
            [&](const ir::Reshape&) { no_autograd("Reshape"); },
            [&](const ir::Gemm&) { no_autograd("Gemm"); },
            [&](const ir::Param&) { detail::throw_error<CompileError>("interpret: a Param in the node list"); },
            [&](const ir::Return&) { detail::throw_error<CompileError>("interpret: a Return in the node list"); },
        },
        n->kind());
    std::size_t tensor_outputs = n->outputs().size() - (has_handle_out ? 1 : 0);
    STAGEJIT_CHECK_AS(CompileError, out.size() == tensor_outputs, "interpret: node ",
                      n->describe(), " produced ", out.size(), " values, the graph expects ",
                      tensor_outputs);
    for (std::size_t i = 0; i < tensor_outputs; ++i) env[n->outputs()[i]] = out[i];
    if (has_handle_out) env[n->outputs().back()] = out_handle;
  }
  variable_list result;
  for (ir::Value* v : graph.outputs()) {
    auto it = env.find(v);
    STAGEJIT_CHECK_AS(CompileError, it != env.end(), "interpret: graph output %", v->id(),
                      " was never computed");
    const Variable* p = std::get_if<Variable>(&it->second);
    STAGEJIT_CHECK_AS(CompileError, p, "interpret: a graph output is a Handle");
    result.push_back(*p);
  }
  return result;
}

}  // namespace stagejit
