#pragma once
/// \file
/// One include for users: everything in API.md. Users write `namespace sj = stagejit;`.

#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/core/version.hpp>
#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/eval.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/host_function.hpp>
#include <stagejit/autograd/saved_variable.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/passes/cse.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/passes/graph_fuser.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/fusion/codegen.hpp>
