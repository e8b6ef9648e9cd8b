// The compiled build's one translation unit of function bodies (core/config.hpp): the
// `-inl.hpp` files of autograd and the op table, compiled once into the library.
#if defined(STAGEJIT_HEADER_ONLY)
#error "src/compiled_bodies.cpp is not part of a header-only build"
#endif
#include <stagejit/core/detail/bodies.hpp>
