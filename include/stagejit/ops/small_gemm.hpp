#pragma once
/// \file
/// Matrix products of thin shapes through LIBXSMM's JIT-generated kernels (Debian's
/// `libxsmm-dev`; Heinecke et al., "LIBXSMM: accelerating small matrix multiplications
/// by runtime code generation", SC'16), and wide float products through oneDNN's `sgemm`
/// (Debian's `libdnnl-dev`). Bodies in ops/small_gemm-inl.hpp (core/config.hpp).
///
/// The products of a narrow network on many points (a PINN's 20-unit layers on 10 000
/// collocation points) are [M, K] x [K, N] with M large and K, N tiny, or [K, M]^T x
/// [M, N] reductions over the points. OpenBLAS runs them at 8-17 GFLOP/s on one core
/// (packing and scaling the output dominate); LIBXSMM's generated kernels for a block of
/// 64 rows (or 256 reduced rows) run them 3-4x faster (bench/pinn.md). Layers of 128-256
/// units on a few hundred to a few thousand rows gain 15-40 % the same way
/// (bench/higher_order.md). Every `mm` and
/// `addmm` of the op table, eager and compiled, goes through `small_mm` first.

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace stagejit::ops {

/// `a @ b` through LIBXSMM when the shape is thin or medium: 2-D float or double CPU
/// tensors of one dtype, no autograd, and either M >= 256 with K, N <= 64 ("tall": blocks
/// of 64 rows of `a`), K >= 256 with M, N <= 64 and `b`'s rows dense ("reduction":
/// blocks of 256 along K, accumulated), or M >= 128 with either `a`'s rows dense and at
/// most 2 KiB long, or `a` a transposed view with K <= 512 and `b` at most 512 KiB
/// ("medium": blocks of 64 rows, as tall; a `b` over 512 KiB runs in passes over blocks
/// of its columns that fit, so that each stays in the L2 cache: Note [Medium products]
/// in ops/small_gemm-inl.hpp), with each
/// operand's rows or columns dense (the other stride is the leading dimension).
/// Float products that are not thin and either fall outside those shapes or are medium
/// with a `b` of 1 MiB or more (w >= 512 units) go to oneDNN's `sgemm` instead when it
/// is built in (`STAGEJIT_HAVE_DNNL`), `$STAGEJIT_DNNL_SGEMM` is not `0`, the product has
/// at least 2^20 multiply-adds and each operand has dense rows or columns: 15-45 %
/// faster than OpenBLAS on weight gradients and 20-25 % on layers of 512 units or more
/// (Note [Wide float products through oneDNN] in ops/small_gemm-inl.hpp). Doubles past
/// LIBXSMM's shapes stay with ATen.
/// Returns a contiguous [M, N] tensor equal to `at::mm(a, b)` up to summation order, or
/// nullopt (the caller runs `at::mm`) when the shape qualifies for neither, the library
/// that would take it is not built in (`STAGEJIT_HAVE_LIBXSMM`, `STAGEJIT_HAVE_DNNL`),
/// LIBXSMM cannot generate a kernel and oneDNN does not take the shape, or
/// `$STAGEJIT_SMALL_GEMM=0` (LIBXSMM's shapes) / `$STAGEJIT_DNNL_SGEMM=0` (oneDNN's).
/// Never throws for a shape it refuses.
std::optional<at::Tensor> small_mm(const at::Tensor& a, const at::Tensor& b);

/// `c [M, N] = a [M, K] @ b [K, N]` (or `c += a @ b` when `accumulate`) on raw CPU
/// pointers, through LIBXSMM, for the pieces of a row-tiled stage (closure/tiled_region.hpp).
/// `a` and `b` are row-major with the given element strides (each must have its rows
/// or its columns dense; `b` must have dense rows, stride `b_s1 == 1`); `c` is dense
/// with leading dimension `ldc`. Either "tall" (K, N <= 256: blocks of 64 rows of `a`)
/// or "reduction" (M, N <= 256: blocks of 256 along K); no lower bound on M or K (the
/// tiled stages call it with at most 128: `closure::tiling::kMaxTiledWidth`). Returns
/// false, writing nothing, when the shape or strides do not qualify, LIBXSMM is not built
/// in or disabled (`small_mm_enabled`), or it cannot generate a kernel.
bool small_mm_raw(const float* a, int64_t a_s0, int64_t a_s1, const float* b, int64_t b_s0, int64_t b_s1,
                  float* c, int64_t ldc, int64_t M, int64_t K, int64_t N, bool accumulate) noexcept;
bool small_mm_raw(const double* a, int64_t a_s0, int64_t a_s1, const double* b, int64_t b_s0, int64_t b_s1,
                  double* c, int64_t ldc, int64_t M, int64_t K, int64_t N, bool accumulate) noexcept;

/// True when this build calls LIBXSMM and `$STAGEJIT_SMALL_GEMM` is not `0`.
bool small_mm_enabled() noexcept;

/// True when this build calls oneDNN's `sgemm` for wide float products and
/// `$STAGEJIT_DNNL_SGEMM` is not `0`.
bool dnnl_mm_enabled() noexcept;

}  // namespace stagejit::ops
