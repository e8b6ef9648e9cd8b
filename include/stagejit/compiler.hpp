#pragma once
/// \file
/// Everything of stagejit.hpp plus the compiler's parts, for code that works on graphs:
/// `trace` and `interpret` (docs/api.md "Tracing"), the IR with its parser, printer and
/// lint ("IR"), the passes, the fusion backends and the stage closures (closure/). Their
/// non-template bodies are inline here: a translation unit including this header compiles
/// the parts it calls.

#include <stagejit/stagejit.hpp>
#include <stagejit/trace/trace.hpp>
#include <stagejit/trace/interpret.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/passes/cse.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/passes/graph_fuser.hpp>
#include <stagejit/passes/peephole.hpp>
#include <stagejit/passes/rematerialize.hpp>
#include <stagejit/passes/zeros.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/closure/autograd_closure.hpp>
// Header-only builds (STAGEJIT_HEADER_ONLY): the function bodies, once.
#include <stagejit/implementation.hpp>
