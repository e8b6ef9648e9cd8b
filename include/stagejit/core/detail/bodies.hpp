#pragma once
// The function bodies of a header-only build (core/config.hpp), included by
// stagejit/implementation.hpp (itself included at the end of the umbrella headers); the
// compiled build includes them once, in src/compiled_bodies.cpp.
#include <stagejit/ir/type-inl.hpp>
#include <stagejit/ir/detail/literals-inl.hpp>
#include <stagejit/ir/attributes-inl.hpp>
#include <stagejit/ir/kinds-inl.hpp>
#include <stagejit/ir/detail/op_words-inl.hpp>
#include <stagejit/ir/graph-inl.hpp>
#include <stagejit/ir/detail/names-inl.hpp>
#include <stagejit/ir/printer-inl.hpp>
#include <stagejit/ir/parser-inl.hpp>
#include <stagejit/ir/lint-inl.hpp>
#include <stagejit/autograd/grad_mode-inl.hpp>
#include <stagejit/autograd/trace_hook-inl.hpp>
#include <stagejit/autograd/variable-inl.hpp>
#include <stagejit/autograd/saved_variable-inl.hpp>
#include <stagejit/autograd/function-inl.hpp>
#include <stagejit/autograd/callbacks-inl.hpp>
#include <stagejit/autograd/grad-inl.hpp>
#include <stagejit/autograd/host_function-inl.hpp>
#include <stagejit/autograd/eval-inl.hpp>
#include <stagejit/ops/attribute_readers-inl.hpp>
#include <stagejit/ops/op_table-inl.hpp>
#include <stagejit/ops/nn-inl.hpp>
#include <stagejit/ops/tensor_ops-inl.hpp>
#include <stagejit/ops/ops-inl.hpp>
#include <stagejit/ops/small_gemm-inl.hpp>
#include <stagejit/ir/node_semantics-inl.hpp>
#include <stagejit/fusion/detail/codegen_ops-inl.hpp>
#include <stagejit/fusion/codegen-inl.hpp>
#include <stagejit/passes/dce-inl.hpp>
#include <stagejit/passes/peephole-inl.hpp>
#include <stagejit/passes/cse-inl.hpp>
#include <stagejit/passes/zeros-inl.hpp>
#include <stagejit/passes/rematerialize-inl.hpp>
#include <stagejit/passes/joint_siblings-inl.hpp>
#include <stagejit/passes/graph_fuser-inl.hpp>
#include <stagejit/trace/interpret-inl.hpp>
#include <stagejit/trace/detail/tracer_impl-inl.hpp>
#include <stagejit/closure/compile-inl.hpp>

// The macros of ops/detail/ops_impl.hpp stay inside the bodies.
#undef SJ_UNARY
#undef SJ_OP
