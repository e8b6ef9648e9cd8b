#pragma once
/// \file
/// One include for users: Variables, the differentiable ops, gradients, host functions and
/// `compile()` (docs/api.md). Users write `namespace sj = stagejit;`.
///
/// It declares what it does not need to define: the compiler behind `compile()` (the
/// tracer, the IR, the passes, the fusion backends, the closure compiler) is compiled once
/// in the library (core/config.hpp), so a translation unit using this header costs about
/// what one using ATen does (bench/compile_time.md). Code that works on graphs (printing
/// `CompiledFunction::graph_for`, `trace`, running passes) includes
/// `stagejit/compiler.hpp`.
///
/// Data-parallel training (`distributed/process_group.hpp`, `distributed/data_parallel.hpp`)
/// is not included: it needs c10d's Gloo headers and `-DUSE_C10D_GLOO` (Meson's
/// `stagejit_distributed_dep`, built only where libgloo-dev is found); code that uses it
/// includes those headers itself.

#include <stagejit/core/aten_error.hpp>
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
#include <stagejit/ops/small_gemm.hpp>
#include <stagejit/core/arg_spec.hpp>
#include <stagejit/closure/compile.hpp>
// Header-only builds (STAGEJIT_HEADER_ONLY): the function bodies, once.
#include <stagejit/implementation.hpp>
