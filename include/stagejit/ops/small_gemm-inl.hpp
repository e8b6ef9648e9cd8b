#pragma once
/// \file
/// Thin matrix products through LIBXSMM (see include/stagejit/ops/small_gemm.hpp).
//
/// Note [Row-major products as LIBXSMM calls]
/// LIBXSMM multiplies column-major matrices. A row-major C[M, N] = A[M, K] B[K, N] is the
/// column-major C'[N, M] = B'[N, K] A'[K, M] with C' = C^T (ldc = N), B' = B^T and
/// A' = A^T: a' = B and b' = A, read in place. B' is read without transposition when B's
/// rows are dense (stride(1) == 1, lda = stride(0)); LIBXSMM 1.17 cannot read it
/// transposed, so a B with dense columns is copied dense first. A' is read without
/// transposition when A's rows are dense (ldb = stride(0)), else transposed (stride(0) ==
/// 1, ldb = stride(1)). "Tall" products cut M into blocks of 64
/// rows (a kernel with n = 64); "reductions" cut K into blocks of 256 (a kernel with
/// beta = 0 for the first block, beta = 1 after). Kernels are generated once per shape
/// and kept by LIBXSMM's own registry (its dispatch is thread-safe).
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ops/small_gemm.hpp>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(STAGEJIT_HAVE_LIBXSMM)
#include <libxsmm.h>
#endif
#if defined(STAGEJIT_HAVE_DNNL)
#include <oneapi/dnnl/dnnl.h>
#endif

namespace stagejit::ops {

namespace detail::small_gemm_impl {

constexpr int64_t kSmall = 64;       // K and N (tall) or M and N (reduction) at most
constexpr int64_t kTileSmall = 256;  // the same for the pieces of a row-tiled stage (small_mm_raw)
constexpr int64_t kLarge = 256;      // M (tall) or K (reduction) at least
constexpr int64_t kRowBlock = 64;    // rows of A per kernel call (tall)
constexpr int64_t kReduceBlock = 256;  // columns of A per kernel call (reduction)
// "Medium" products (Note [Medium products]): M at least kMediumRows, B at most
// kMediumBytes, and K at most kMediumTransposedK when A is read transposed.
constexpr int64_t kMediumRows = 128;
constexpr int64_t kMediumBytes = 512 * 1024;
constexpr int64_t kMediumTransposedK = 512;
// ... and, when A is read by rows, rows of A of at most kMediumRowBytes; a larger B then
// runs in passes over column blocks, each block's slice of B at most kMediumBytes.
constexpr int64_t kMediumRowBytes = 2048;
// A reduction's B read transposed is copied dense when it is at most this large.
constexpr int64_t kReductionCopyBytes = 32 * 1024;

// Note [Medium products]
// Row blocks of 64 through one generated kernel also beat OpenBLAS on products of
// moderate width, not only thin ones, as long as B (K x N) stays in the L2 cache that
// every block re-reads it from: OpenBLAS packs both operands and scales C first, and at
// these sizes that costs more than the kernel saves. Measured on one Skylake-SP core
// (bench/higher_order.md, "LIBXSMM for medium products"), GFLOP/s ATen vs LIBXSMM:
// float [512,256]x[256,256] 142 vs 176, [512,256]x[256,10] 47 vs 92, A^T [256,512]^T x
// [512,256] 142 vs 167; double [512,256]x[256,256] 62 vs 86. Past the bounds LIBXSMM
// loses: float A^T [2048,512]^T x [2048,512] (B 4 MiB) 135 vs 43, double
// [2048,512]x[512,512] (B 2 MiB) 60 vs 31, double A^T with K = 1024 46 vs 42; under 128
// rows neither wins.
// A larger B runs in passes over column blocks whose slice of B fits the bound (B's
// block starts at its column j0 with B's leading dimension; C's too), each pass over
// all row blocks: float [2000,512]x[512,512] (B 1 MiB, blocks of 256 columns) 131-140
// vs 156-162, with W^T copied dense 133-143 vs 150-160 (bench/products, "critic512
// layer"). Not for a transposed A (float 142 vs 143) nor for rows of A over 2 KiB
// (double K = 512: 58 vs 25-32, whatever the block), which no medium product takes.

// False when the environment variable `name` is `0`.
inline bool on_unless_zero_in_environment(const char* name) {
  const char* v = std::getenv(name);
  return !(v && std::strcmp(v, "0") == 0);
}

STAGEJIT_FUNC bool enabled_by_environment() {
  static const bool on = on_unless_zero_in_environment("STAGEJIT_SMALL_GEMM");
  return on;
}

// One operand as a BLAS-style call reads it: its leading dimension and whether it is
// transposed. For LIBXSMM an [R, C] operand is read as the column-major [C, R] matrix
// (Note [Row-major products as LIBXSMM calls]); for oneDNN's row-major `sgemm` it is the
// same pair ('N' with ld = stride(0) when its rows are dense, 'T' with ld = stride(1)
// when its columns are).
struct Operand {
  bool ok = false;
  bool trans = false;
  int64_t ld = 0;
};

// An [R, C] operand with element strides (s0, s1), or not ok when neither its rows nor
// its columns are dense.
STAGEJIT_FUNC Operand operand_of(int64_t r, int64_t c, int64_t s0, int64_t s1) {
  // The stride of a size-1 dimension is never used: give it the dense value.
  if (r == 1) s0 = c;
  if (c == 1) s1 = 1;
  if (s1 == 1 && s0 >= std::max<int64_t>(c, 1)) return {true, false, s0};
  if (s0 == 1 && s1 >= std::max<int64_t>(r, 1)) return {true, true, s1};
  return {};
}

#if defined(STAGEJIT_HAVE_LIBXSMM)

// `t` [R, C] read as the column-major [C, R] matrix.
STAGEJIT_FUNC Operand as_column_major_transpose(const at::Tensor& t) {
  return operand_of(t.size(0), t.size(1), t.stride(0), t.stride(1));
}

template <class T>
struct Kernels;
template <>
struct Kernels<float> {
  using Fn = libxsmm_smmfunction;
  static Fn get(int m, int n, int k, int lda, int ldb, int ldc, float beta, int flags) {
    float alpha = 1;
    return libxsmm_smmdispatch(m, n, k, &lda, &ldb, &ldc, &alpha, &beta, &flags, nullptr);
  }
};
template <>
struct Kernels<double> {
  using Fn = libxsmm_dmmfunction;
  static Fn get(int m, int n, int k, int lda, int ldb, int ldc, double beta, int flags) {
    double alpha = 1;
    return libxsmm_dmmdispatch(m, n, k, &lda, &ldb, &ldc, &alpha, &beta, &flags, nullptr);
  }
};

// Note [Kernel lookups per thread]
// A row-tiled stage calls `small_mm_raw` once per product and tile: a PINN step makes
// 3 000-8 600 such calls, each asking LIBXSMM for one to four kernels. LIBXSMM's registry
// (a descriptor built, hashed and compared: `libxsmm_sgemm_descriptor_init`,
// `libxsmm_diff_n`, `internal_find_code`) took 1.3-1.6 % of the Burgers and MAML steps'
// samples (`perf record`, bench/higher_order.md, 2026-12-07). So each thread keeps the
// last kernels it got in a small direct-mapped table keyed by the whole request; a miss
// asks LIBXSMM. Its kernels live until `libxsmm_finalize`, which stagejit never calls.
template <class T>
typename Kernels<T>::Fn cached_kernel(int m, int n, int k, int lda, int ldb, int ldc, T beta, int flags) {
  using Fn = typename Kernels<T>::Fn;
  struct Entry {
    int key[7];
    T beta;
    Fn fn;
  };
  constexpr std::size_t kEntries = 64;
  thread_local Entry table[kEntries] = {};
  const int key[7] = {m, n, k, lda, ldb, ldc, flags};
  std::uint64_t h = static_cast<std::uint64_t>(beta != T(0));
  for (int v : key) h = (h ^ static_cast<std::uint32_t>(v)) * 0x9E3779B97F4A7C15ull;
  Entry& e = table[(h >> 58) & (kEntries - 1)];
  if (e.fn && e.beta == beta && std::memcmp(e.key, key, sizeof key) == 0) return e.fn;
  const Fn fn = Kernels<T>::get(m, n, k, lda, ldb, ldc, beta, flags);
  if (fn) {
    std::memcpy(e.key, key, sizeof key);
    e.beta = beta;
    e.fn = fn;
  }
  return fn;
}

// Columns of C (and B) per pass of a medium product (Note [Medium products]), 0 when it
// is not one: all N when B fits kMediumBytes, else the widest multiple of 16 whose slice
// of B does (at least 256, as rows of A are at most kMediumRowBytes long).
STAGEJIT_FUNC int64_t medium_columns(int64_t K, int64_t N, bool a_transposed, int64_t element_size) {
  if (a_transposed) return K <= kMediumTransposedK && K * N * element_size <= kMediumBytes ? N : 0;
  if (K * element_size > kMediumRowBytes) return 0;
  if (K * N * element_size <= kMediumBytes) return N;
  return kMediumBytes / (K * element_size) / 16 * 16;
}

// True for a product in row blocks that Note [Medium products] admits.
STAGEJIT_FUNC bool medium_product(int64_t M, int64_t K, int64_t N, bool a_transposed, int64_t element_size) {
  return M >= kMediumRows && medium_columns(K, N, a_transposed, element_size) > 0;
}

// True when LIBXSMM's blocking applies to `a @ b` (both 2-D, rows or columns dense).
STAGEJIT_FUNC bool thin_product(const at::Tensor& a, const at::Tensor& b) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const bool tall = M >= kLarge && K <= kSmall && N <= kSmall;
  const Operand A = as_column_major_transpose(a), B = as_column_major_transpose(b);
  // A reduction's B with dense columns is copied whole ([K, N], K long) first: past the
  // L1 cache that runs at 0.7x ATen (bench/products, "burgers weight grad" NT) and ATen
  // takes it; a small one (a classifier's W^T, "cnn classifier") costs next to nothing.
  const bool reduction = !tall && K >= kLarge && M <= kSmall && N <= kSmall &&
                         (!B.trans || K * N * a.element_size() <= kReductionCopyBytes);
  // LIBXSMM takes int sizes and leading dimensions.
  const int64_t limit = INT32_MAX;
  return (tall || reduction || medium_product(M, K, N, A.trans, a.element_size())) && A.ok && B.ok &&
         A.ld <= limit && B.ld <= limit && M <= limit && K <= limit && N <= limit;
}

// c = a @ b (c += a @ b when `accumulate`) on raw pointers: see `small_mm_raw`.
// `medium`: also row blocks for any K and N (the caller checked `medium_product`).
template <class T>
bool run_raw(const T* pa, int64_t a_s0, int64_t a_s1, const T* pb, int64_t b_s0, int64_t b_s1, T* pc,
             int64_t ldc, int64_t M, int64_t K, int64_t N, bool accumulate, bool medium = false,
             int64_t small = kSmall) {
  if (M <= 0 || K <= 0 || N <= 0) return false;
  const Operand A = operand_of(M, K, a_s0, a_s1), B = operand_of(K, N, b_s0, b_s1);
  // LIBXSMM 1.17 generates no kernel reading its first operand (b) transposed.
  if (!A.ok || !B.ok || B.trans) return false;
  const bool tall = medium || (K <= small && N <= small);
  if (!tall && !(M <= small && N <= small)) return false;
  const int64_t limit = INT32_MAX;  // LIBXSMM takes int sizes and leading dimensions
  if (A.ld > limit || B.ld > limit || ldc > limit || M > limit || K > limit || N < 1 || ldc < N) return false;
  const int flags = A.trans ? LIBXSMM_GEMM_FLAG_TRANS_B : 0;
  const int n = static_cast<int>(N), ldci = static_cast<int>(ldc);
  const int lda = static_cast<int>(B.ld), ldb = static_cast<int>(A.ld);
  const T beta0 = accumulate ? T(1) : T(0);
  if (tall) {
    // Block of rows m0..m0+rows of A: b' starts at row m0 of A. A medium product whose B
    // leaves the L2 cache runs in passes over column blocks j0..j0+columns of B and C
    // (b' keeps its rows, a' and C start at column j0), each pass over every row block.
    const int64_t columns = medium ? medium_columns(K, N, A.trans, sizeof(T)) : N;
    if (columns <= 0) return false;
    const int64_t a_row_step = A.trans ? 1 : A.ld;
    const int64_t rest = M % kRowBlock, column_rest = N % columns;
    using Fn = typename Kernels<T>::Fn;
    auto kernel = [&](int64_t cols, int64_t rows) -> Fn {
      return cached_kernel<T>(static_cast<int>(cols), static_cast<int>(rows), static_cast<int>(K), lda, ldb, ldci,
                             beta0, flags);
    };
    // [column block: full, tail][row block: full, tail]
    Fn fns[2][2] = {{nullptr, nullptr}, {nullptr, nullptr}};
    for (int c = 0; c < 2; ++c) {
      const int64_t cols = c == 0 ? columns : column_rest;
      if (cols == 0) continue;
      if (M >= kRowBlock && !(fns[c][0] = kernel(cols, kRowBlock))) return false;
      if (rest && !(fns[c][1] = kernel(cols, rest))) return false;
    }
    const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
    for (int64_t j0 = 0; j0 < N; j0 += columns) {
      const int c = j0 + columns <= N ? 0 : 1;
      at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
        for (int64_t blk = begin; blk < end; ++blk) {
          const int64_t m0 = blk * kRowBlock;
          fns[c][m0 + kRowBlock <= M ? 0 : 1](pb + j0, pa + m0 * a_row_step, pc + m0 * ldc + j0);
        }
      });
    }
    return true;
  }
  // Reduction over K: a' (from B) advances along k by its rows, b' (from A) along its
  // columns.
  const int64_t b_k_step = B.ld;
  const int64_t a_k_step = A.trans ? A.ld : 1;
  const int m = static_cast<int>(M);
  const int64_t rest = K % kReduceBlock;
  const bool whole = K >= kReduceBlock;
  const auto first = whole ? cached_kernel<T>(n, m, static_cast<int>(kReduceBlock), lda, ldb, ldci, beta0, flags) : nullptr;
  const auto next = whole ? cached_kernel<T>(n, m, static_cast<int>(kReduceBlock), lda, ldb, ldci, T(1), flags) : nullptr;
  const auto tail = rest ? cached_kernel<T>(n, m, static_cast<int>(rest), lda, ldb, ldci, whole ? T(1) : beta0, flags)
                         : next;
  if ((whole && (!first || !next)) || !tail) return false;
  int64_t k0 = 0;
  for (; k0 + kReduceBlock <= K; k0 += kReduceBlock)
    (k0 == 0 ? first : next)(pb + k0 * b_k_step, pa + k0 * a_k_step, pc);
  if (k0 < K) tail(pb + k0 * b_k_step, pa + k0 * a_k_step, pc);
  return true;
}

// `a @ b` for operands `thin_product` accepted.
template <class T>
STAGEJIT_FUNC std::optional<at::Tensor> run(const at::Tensor& a, const at::Tensor& b_in) {
  const int64_t M = a.size(0), N = b_in.size(1);
  // A `b` with dense columns (W^T of a backward) is copied dense (at most 64 x 64 in a
  // tall product, 32 KiB in a reduction, and K x N in a medium one, K at most 2 KiB).
  at::Tensor b = as_column_major_transpose(b_in).trans ? b_in.contiguous() : b_in;
  at::Tensor c = at::empty({M, N}, a.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t K = a.size(1);
  const bool thin = (K <= kSmall && N <= kSmall) || (M <= kSmall && N <= kSmall);
  const bool medium = !thin && medium_product(M, K, N, as_column_major_transpose(a).trans, a.element_size());
  if (!run_raw<T>(a.data_ptr<T>(), a.stride(0), a.stride(1), b.data_ptr<T>(), b.stride(0), b.stride(1),
                  c.data_ptr<T>(), N, M, K, N, false, medium))
    return std::nullopt;
  return c;
}

#endif  // STAGEJIT_HAVE_LIBXSMM

// Note [Wide float products through oneDNN]
// Past the shapes LIBXSMM's blocking wins on, a float product goes to oneDNN's `sgemm`
// (Debian's libdnnl, which ATen already loads for its mkldnn ops) rather than to ATen's
// BLAS (OpenBLAS). Measured on one Ice Lake core, float, GFLOP/s OpenBLAS / LIBXSMM /
// oneDNN (bench/higher_order.md, "Wide products through oneDNN"):
// - weight gradients A^T [w,2000]^T x [2000,w], which LIBXSMM never takes: 114 / - / 166
//   at w = 192, 116 / - / 152 at 256, 114 / - / 156 at 384, 122 / - / 140 at 512, and
//   84 / - / 147 for [32,2000]^T x [2000,512];
// - [2000,w] x [w,w] (and x W^T): 120 / 161 / 152 at 256, 121 / 153 / 140 at 384, 115 /
//   142 / 129 at 448 (LIBXSMM in column passes), 122 / 131 / 156 at 512, 128 / - / 156 at
//   768, 128 / - / 151 for [1000,1024] x [1024,1024].
// Thin products (K, N <= 64, or M, N <= 64) never go to oneDNN, whatever B's size (a
// reduction's B is [rows, N]): LIBXSMM runs them faster (float [64,20000]^T x
// [20000,64] 128 against oneDNN's 106, [10000,32] x [32,64] 165 against 124, [50,4000]^T x
// [4000,50] 96 against 77), and ATen takes those it refuses.
// So LIBXSMM keeps the thin products, and the medium ones whose B is under kDnnlMinBBytes
// (1 MiB: w < 512), and oneDNN takes every other float product of at least kDnnlMinMacs
// multiply-adds (below that its call costs more than OpenBLAS's: [64,64] x [64,64] 119
// against 146, [32,100] x [100,40] 33 against 50); doubles stay with ATen (oneDNN has no
// dgemm). oneDNN runs on the caller's OpenMP thread count, which
// `at::internal::lazy_init_num_threads` sets to ATen's first (`at::set_num_threads`).
constexpr int64_t kDnnlMinBBytes = int64_t{1} << 20;
constexpr int64_t kDnnlMinMacs = int64_t{1} << 20;

STAGEJIT_FUNC bool dnnl_enabled_by_environment() {
  static const bool on = on_unless_zero_in_environment("STAGEJIT_DNNL_SGEMM");
  return on;
}

#if defined(STAGEJIT_HAVE_DNNL)
// `a @ b` (float, 2-D, checked by `small_mm`) through oneDNN's row-major `sgemm`, or
// nullopt when an operand is neither row- nor column-dense or oneDNN refuses the call.
STAGEJIT_FUNC std::optional<at::Tensor> run_dnnl(const at::Tensor& a, const at::Tensor& b) {
  const Operand A = operand_of(a.size(0), a.size(1), a.stride(0), a.stride(1)),
                B = operand_of(b.size(0), b.size(1), b.stride(0), b.stride(1));
  if (!A.ok || !B.ok) return std::nullopt;
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::internal::lazy_init_num_threads();  // this thread's OpenMP count from ATen's
  at::Tensor c = at::empty({M, N}, a.options().memory_format(at::MemoryFormat::Contiguous));
  RECORD_FUNCTION("stagejit::small_mm", std::vector<c10::IValue>({a, b}));
  // beta = 0: C is written, not read.
  if (dnnl_sgemm(A.trans ? 'T' : 'N', B.trans ? 'T' : 'N', M, N, K, 1.0f, a.data_ptr<float>(), A.ld,
                 b.data_ptr<float>(), B.ld, 0.0f, c.data_ptr<float>(), N) != dnnl_success)
    return std::nullopt;
  return c;
}
#endif  // STAGEJIT_HAVE_DNNL

// `small_mm_raw` for either dtype.
template <class T>
bool raw_entry(const T* a, int64_t a_s0, int64_t a_s1, const T* b, int64_t b_s0, int64_t b_s1, T* c, int64_t ldc,
               int64_t M, int64_t K, int64_t N, bool accumulate) noexcept {
#if defined(STAGEJIT_HAVE_LIBXSMM)
  if (!enabled_by_environment()) return false;
  // One product for ATen's profilers (bench/pinn counts a row-tiled region's products
  // once per tile); no inputs to record.
  RECORD_FUNCTION("stagejit::small_mm", std::vector<c10::IValue>());
  return run_raw<T>(a, a_s0, a_s1, b, b_s0, b_s1, c, ldc, M, K, N, accumulate, /*medium=*/false, kTileSmall);
#else
  (void)a, (void)a_s0, (void)a_s1, (void)b, (void)b_s0, (void)b_s1, (void)c, (void)ldc, (void)M, (void)K, (void)N,
      (void)accumulate;
  return false;
#endif
}

}  // namespace detail::small_gemm_impl

STAGEJIT_FUNC bool small_mm_raw(const float* a, int64_t a_s0, int64_t a_s1, const float* b, int64_t b_s0,
                                int64_t b_s1, float* c, int64_t ldc, int64_t M, int64_t K, int64_t N,
                                bool accumulate) noexcept {
  return detail::small_gemm_impl::raw_entry<float>(a, a_s0, a_s1, b, b_s0, b_s1, c, ldc, M, K, N, accumulate);
}

STAGEJIT_FUNC bool small_mm_raw(const double* a, int64_t a_s0, int64_t a_s1, const double* b, int64_t b_s0,
                                int64_t b_s1, double* c, int64_t ldc, int64_t M, int64_t K, int64_t N,
                                bool accumulate) noexcept {
  return detail::small_gemm_impl::raw_entry<double>(a, a_s0, a_s1, b, b_s0, b_s1, c, ldc, M, K, N, accumulate);
}

STAGEJIT_FUNC bool small_mm_enabled() noexcept {
#if defined(STAGEJIT_HAVE_LIBXSMM)
  return detail::small_gemm_impl::enabled_by_environment();
#else
  return false;
#endif
}

STAGEJIT_FUNC bool dnnl_mm_enabled() noexcept {
#if defined(STAGEJIT_HAVE_DNNL)
  return detail::small_gemm_impl::dnnl_enabled_by_environment();
#else
  return false;
#endif
}

STAGEJIT_FUNC std::optional<at::Tensor> small_mm(const at::Tensor& a, const at::Tensor& b) {
  namespace impl = detail::small_gemm_impl;
#if defined(STAGEJIT_HAVE_LIBXSMM) || defined(STAGEJIT_HAVE_DNNL)
  if (!a.defined() || !b.defined() || a.layout() != at::kStrided || b.layout() != at::kStrided ||
      !a.has_storage() || !b.has_storage() || a._is_zerotensor() || b._is_zerotensor() ||
      a.dim() != 2 || b.dim() != 2 || !a.device().is_cpu() ||
      !b.device().is_cpu() || a.scalar_type() != b.scalar_type() || a.size(1) != b.size(0) ||
      a.requires_grad() || b.requires_grad() || a.is_conj() || b.is_conj() || a.is_neg() || b.is_neg())
    return std::nullopt;
  if (a.numel() == 0 || b.numel() == 0) return std::nullopt;
  if (a.scalar_type() != at::kFloat && a.scalar_type() != at::kDouble) return std::nullopt;
  // Note [Wide float products through oneDNN]: thin products are LIBXSMM's or ATen's;
  // LIBXSMM keeps its medium float products while B is under kDnnlMinBBytes, when oneDNN
  // can take them.
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  [[maybe_unused]] const bool thin =
      (K <= impl::kSmall && N <= impl::kSmall) || (M <= impl::kSmall && N <= impl::kSmall);
#if defined(STAGEJIT_HAVE_DNNL)
  // Sizes as doubles: M * K * N can overflow int64_t.
  const bool dnnl_shape = a.scalar_type() == at::kFloat && !thin && impl::dnnl_enabled_by_environment() &&
                          double(M) * double(K) * double(N) >= double(impl::kDnnlMinMacs);
#else
  const bool dnnl_shape = false;
#endif
#if defined(STAGEJIT_HAVE_LIBXSMM)
  if (!(dnnl_shape && K * N * int64_t(b.element_size()) >= impl::kDnnlMinBBytes) && impl::enabled_by_environment() &&
      impl::thin_product(a, b)) {
    // Seen by ATen's profilers and RecordFunction callbacks (bench/pinn's GEMM share) as
    // one product, like aten::mm.
    RECORD_FUNCTION("stagejit::small_mm", std::vector<c10::IValue>({a, b}));
    auto c = a.scalar_type() == at::kFloat ? impl::run<float>(a, b) : impl::run<double>(a, b);
    if (c) return c;
  }
#endif
#if defined(STAGEJIT_HAVE_DNNL)
  if (dnnl_shape) return impl::run_dnnl(a, b);
#endif
  return std::nullopt;
#else
  (void)a;
  (void)b;
  return std::nullopt;
#endif
}

}  // namespace stagejit::ops
