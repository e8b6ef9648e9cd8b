#pragma once
/// \file
/// Where libtorch 1.13 (Debian's libtorch-dev, what CI builds against) and libtorch 2.x
/// (PyTorch's wheels and archives, `-Dlibtorch=PATH`) differ for stagejit, in one place.
/// Every other file compiles unchanged against both (README, "Building against libtorch
/// 2.x").
///
/// - `STAGEJIT_TORCH_VERSION_AT_LEAST(major, minor)`: the libtorch's version (from
///   `torch/version.h`, which both ship on the include path stagejit's build uses).
/// - `c10::Allocator`: 2.3 made `allocate` non-const and added the pure virtual
///   `copy_data(dest, src, count) const` (used by `Allocator::clone`). Allocators declare
///   `allocate` with `STAGEJIT_ALLOCATE_CONST` and add `STAGEJIT_ALLOCATOR_COPY_DATA`
///   (`default_copy_data`, a plain memcpy, as c10's CPU allocator does) to their body.
/// - Behaviour that changed, followed where the op lives: `clamp`'s gradient at a bound
///   (0 from 2.14, 1 before: ops/op_table-inl.hpp); CPU `mm` in Half (refused by 1.13,
///   computed by 2.x: a test expectation only).

#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstddef>

#define STAGEJIT_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if STAGEJIT_TORCH_VERSION_AT_LEAST(2, 3)
#define STAGEJIT_ALLOCATE_CONST
#define STAGEJIT_ALLOCATOR_COPY_DATA                                                 \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    default_copy_data(dest, src, count);                                            \
  }
#else
#define STAGEJIT_ALLOCATE_CONST const
#define STAGEJIT_ALLOCATOR_COPY_DATA
#endif
