#pragma once
/// \file
/// Bodies of autograd/trace_hook.hpp: the thread-local current trace hook.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/trace_hook.hpp>

namespace stagejit {

// ------------------------------------------------------------------ trace hook
namespace detail::autograd_impl {
inline thread_local TraceHook* t_trace_hook = nullptr;
}  // namespace detail::autograd_impl

STAGEJIT_FUNC TraceHook* current_trace_hook() noexcept { return detail::autograd_impl::t_trace_hook; }
STAGEJIT_FUNC void set_current_trace_hook(TraceHook* hook) noexcept { detail::autograd_impl::t_trace_hook = hook; }

}  // namespace stagejit
