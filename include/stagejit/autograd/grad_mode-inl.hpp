#pragma once
/// \file
/// Bodies of autograd/grad_mode.hpp: the thread-local grad mode.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/autograd/grad_mode.hpp>

namespace stagejit {

// ------------------------------------------------------------------ grad mode
namespace detail::autograd_impl {
inline thread_local bool t_grad_enabled = true;
}  // namespace detail::autograd_impl

STAGEJIT_FUNC bool GradMode::is_enabled() noexcept { return detail::autograd_impl::t_grad_enabled; }
STAGEJIT_FUNC void GradMode::set_enabled(bool enabled) noexcept { detail::autograd_impl::t_grad_enabled = enabled; }

}  // namespace stagejit
