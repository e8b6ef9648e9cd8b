#pragma once
/// \file
/// The function bodies of a header-only build, in one place (toml++'s
/// `TOML_IMPLEMENTATION`, fmt's `FMT_HEADER_ONLY`).
///
/// With `STAGEJIT_HEADER_ONLY` defined (Meson's `stagejit_header_only_dep`), this header
/// includes every `-inl.hpp` file (core/detail/bodies.hpp) as `inline` definitions. The
/// umbrella headers `stagejit/stagejit.hpp` and `stagejit/compiler.hpp` include it at their
/// end, so a translation unit that includes either needs nothing more. A translation unit
/// that includes only narrower headers (say `stagejit/autograd/variable.hpp`) in a
/// header-only build includes this header once, after them; without it, the linker reports
/// the stagejit functions it uses as undefined.
///
/// In the default (compiled) build this header is empty: the bodies are compiled once, in
/// the library (src/compiled_bodies.cpp).
///
/// This is the one place where a lower layer's bodies are reached from the top of the
/// include tree: the header-only mechanism.
#include <stagejit/core/config.hpp>

#if defined(STAGEJIT_HEADER_ONLY)
#include <stagejit/core/detail/bodies.hpp>
#endif
