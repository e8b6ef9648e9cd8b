// The compiled build's one translation unit of function bodies (core/config.hpp): the
// `-inl.hpp` files of autograd and the op table, compiled once into the library.
#if defined(STAGEJIT_HEADER_ONLY)
#error "src/compiled_bodies.cpp is not part of a header-only build"
#endif
#include <stagejit/core/detail/bodies.hpp>

// The row-tiled region runner at its two element types (closure/tiled_region.hpp declares
// them `extern template` in the compiled build).
#include <stagejit/closure/tiled_region.hpp>
template stagejit::variable_list stagejit::closure::TiledRegionRunner::run_tiled<float>(
    const std::vector<at::Tensor>&, const stagejit::variable_list&) const;
template stagejit::variable_list stagejit::closure::TiledRegionRunner::run_tiled<double>(
    const std::vector<at::Tensor>&, const stagejit::variable_list&) const;
