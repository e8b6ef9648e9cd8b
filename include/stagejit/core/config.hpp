#pragma once
/// \file
/// Build configuration of stagejit's own function bodies (fmt's and toml++'s pattern).
///
/// Most of stagejit is templates and inline functions in headers. The bodies of the
/// non-template parts (the `-inl.hpp` files of ir/, autograd/, ops/, fusion/, passes/,
/// trace/ and closure/, listed in core/detail/bodies.hpp) are built one of two ways:
///
/// - compiled (default; Meson's `stagejit_dep`): one translation unit of the library
///   (src/compiled_bodies.cpp) includes the `-inl.hpp` files; users' translation units see
///   only declarations, so they build fast;
/// - header-only (`STAGEJIT_HEADER_ONLY` defined; Meson's `stagejit_header_only_dep`, or
///   `-Dheader_only=true` for stagejit's own tests): every function body is `inline` and
///   `stagejit/implementation.hpp` includes the `-inl.hpp` files; the umbrella headers
///   (`stagejit/stagejit.hpp`, `stagejit/compiler.hpp`) include it at their end, and a
///   translation unit that includes only narrower headers includes it itself. Only the shim (src/:
///   the threaded engine, the CPU kernel compiler/loader, the CUDA launcher) is linked.
///
/// `STAGEJIT_FUNC` marks a function defined in an `-inl.hpp` file.

#if defined(STAGEJIT_HEADER_ONLY)
#define STAGEJIT_FUNC inline
#else
#define STAGEJIT_FUNC
#endif
