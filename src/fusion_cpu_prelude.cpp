// The C++ prelude of generated CPU kernels (see include/stagejit/fusion/cpu_backend.hpp).
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

namespace stagejit::fusion {

static_assert(kMaxDims == 8, "the preludes declare stagejit_TensorArg with 8 dimensions");

const std::string& cpu_prelude() {
  static const std::string text = R"PRELUDE(// ---- stagejit CPU kernel prelude ----
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
// The widest of ATen's vector capabilities the compiling machine has (-march=native):
// AVX-512 (16 floats, SLEEF's *_f16 functions, which give the same bits as the *_f8
// ones ATen's AVX2 kernels call) or AVX2, else ATen's portable DEFAULT. Define
// STAGEJIT_NO_AVX512 (in $STAGEJIT_CXX) to stay on AVX2.
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__FMA__) && !defined(STAGEJIT_NO_SLEEF) && !defined(STAGEJIT_NO_AVX512)
#define CPU_CAPABILITY_AVX512 1
#define CPU_CAPABILITY AVX512
#elif defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(STAGEJIT_NO_SLEEF)
#define CPU_CAPABILITY_AVX2 1
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#include <ATen/cpu/vec/vec.h>

extern "C" {
/// Same layout as stagejit::fusion::TensorArg: element pointer, sizes, element strides.
struct stagejit_TensorArg {
  void* data;
  int64_t sizes[8];
  int64_t strides[8];
};
}

namespace sjk {

template <class T>
using Vec = at::vec::Vectorized<T>;

template <class... Ts>
struct types {};

/// ATen's vectorised sigmoid: 1 / (1 + exp(-x)).
template <class T>
inline Vec<T> sigmoid(const Vec<T>& x) {
  return (Vec<T>(T(1)) + x.neg().exp()).reciprocal();
}

/// tanh of floats in less than half of SLEEF's time (ATen's `Vectorized<float>::tanh` is
/// SLEEF's tanhf_u10, about 5x the cost of its expf on AVX-512, and was most of the
/// compute of kernels holding a tanh; bench/fusion.md): Cephes' tanhf, an odd polynomial
/// below |x| = 0.625 and 1 - 2 / (exp(2|x|) + 1) with the sign of x above (SLEEF's expf
/// underneath). Checked over every 3rd float bit pattern (AVX-512): equal to SLEEF's
/// result in 99.8 %, else 1 ulp apart, and within 1 ulp of the correctly rounded tanh;
/// exactly +-1 for large |x| and +-inf, -0 for -0, NaN for NaN. Define
/// STAGEJIT_SLEEF_TANH (in $STAGEJIT_CXX) for ATen's bits.
inline Vec<float> tanh(const Vec<float>& x) {
#if defined(STAGEJIT_SLEEF_TANH) || !(defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
  return x.tanh();
#else
  using V = Vec<float>;
  const V one(1.f), two(2.f);
  const V ax = x.abs();
  const V e = (ax + ax).exp();
  const V big = one - two / (e + one);  // in [0, 1] (or NaN)
  const V z = x * x;
  V p = at::vec::fmadd(V(-5.70498872745e-3f), z, V(2.06390887954e-2f));
  p = at::vec::fmadd(p, z, V(-5.37397155531e-2f));
  p = at::vec::fmadd(p, z, V(1.33314422036e-1f));
  p = at::vec::fmadd(p, z, V(-3.33332819422e-1f));
  const V small = at::vec::fmadd(p * z, x, x);
  // tanh is odd and |tanh(x)| <= |x|: the magnitude, then x's sign (also for -0).
  const V magnitude = V::blendv(big, small.abs(), ax < V(0.625f));
  return magnitude | (x & V(-0.f));
#endif
}

/// erf with SLEEF's erf_u10 (1 ulp), the function ATen's CPU erf kernel gives: libtorch
/// 2.x's `Vectorized<float>::erf` is instead a polynomial with about 1e-7 absolute error
/// (erf(1e-30) comes out near 0, not 1.128e-30); 1.13's member was SLEEF's already.
inline Vec<float> erf(const Vec<float>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec<float>(Sleef_erff16_u10(x));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec<float>(Sleef_erff8_u10(x));
#else
  return x.erf();
#endif
}
inline Vec<double> erf(const Vec<double>& x) { return x.erf(); }
/// Double keeps ATen's (SLEEF's tanh_u10): the kernels' `sjf::tanh` calls `sjk::tanh`.
inline Vec<double> tanh(const Vec<double>& x) { return x.tanh(); }

/// Whether the bool lanes of a whole contiguous vector convert with vector instructions
/// (bool_lanes_load / bool_lanes_store below): float and double compute types on AVX-512
/// or AVX2. Masks (leaky ReLU's and ReLU's `x > 0`, saved for the backward stages) are
/// bool tensors; converting them one element at a time made the kernels that read or
/// write them 3-4x slower than their float arithmetic (bench/higher_order.md).
template <class T>
inline constexpr bool kBoolLanes =
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    std::is_same_v<T, float> || std::is_same_v<T, double>;
#else
    false;
#endif

/// The Vec<T>::size() bools at `p` (bytes 0 or 1) as T lanes 0 or 1.
template <class T>
inline Vec<T> bool_lanes_load(const bool* p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // 16 bytes
    return Vec<T>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));  // 8 bytes
    return Vec<T>(_mm512_cvtepi32_pd(_mm256_cvtepu8_epi32(b)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));  // 8 bytes
    return Vec<T>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
  } else {
    int32_t w;
    std::memcpy(&w, p, 4);  // 4 bytes
    return Vec<T>(_mm256_cvtepi32_pd(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(w))));
  }
#else
  alignas(64) T buf[Vec<T>::size()];
  for (int64_t k = 0; k < Vec<T>::size(); ++k) buf[k] = static_cast<T>(p[k]);
  return Vec<T>::loadu(buf);
#endif
}

/// Stores the Vec<T>::size() lanes of `v` as bools at `p`: true where a lane is not 0
/// (NaN included), as static_cast<bool> does.
template <class T>
inline void bool_lanes_store(const Vec<T>& v, bool* p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    const __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_maskz_set1_epi8(m, 1));
  } else {
    const __mmask8 m = _mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_NEQ_UQ);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_maskz_set1_epi8(__mmask16(m), 1));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  int m;
  if constexpr (std::is_same_v<T, float>) m = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ));
  else m = _mm256_movemask_pd(_mm256_cmp_pd(v, _mm256_setzero_pd(), _CMP_NEQ_UQ));
  for (int k = 0; k < Vec<T>::size(); ++k) p[k] = (m >> k) & 1;
#else
  alignas(64) T buf[Vec<T>::size()];
  v.store(buf);
  for (int64_t k = 0; k < Vec<T>::size(); ++k) p[k] = static_cast<bool>(buf[k]);
#endif
}

/// Loads `count` (<= Vec<T>::size()) elements of storage type S at stride `s`,
/// converted to T. Unused lanes are zero.
template <class T, class S>
inline Vec<T> load(const S* p, int64_t s, int64_t count) {
  if constexpr (std::is_same_v<S, T>) {
    if (s == 1) return Vec<T>::loadu(p, count);
  }
  if constexpr (std::is_same_v<S, bool> && kBoolLanes<T>) {
    if (s == 1 && count == Vec<T>::size()) return bool_lanes_load<T>(p);
  }
  if (s == 0) return Vec<T>(static_cast<T>(*p));
  alignas(64) T buf[Vec<T>::size()] = {};
  for (int64_t k = 0; k < count; ++k) buf[k] = static_cast<T>(p[k * s]);
  return Vec<T>::loadu(buf);
}

/// Stores the first `count` lanes of `v` as storage type S at stride `s` (s != 0).
template <class T, class S>
inline void store(const Vec<T>& v, S* p, int64_t s, int64_t count) {
  if constexpr (std::is_same_v<S, T>) {
    if (s == 1) {
      v.store(p, static_cast<int>(count));
      return;
    }
  }
  if constexpr (std::is_same_v<S, bool> && kBoolLanes<T>) {
    if (s == 1 && count == Vec<T>::size()) {
      bool_lanes_store<T>(v, p);
      return;
    }
  }
  alignas(64) T buf[Vec<T>::size()];
  v.store(buf);
  for (int64_t k = 0; k < count; ++k) p[k * s] = static_cast<S>(buf[k]);
}

/// Launches whose outputs hold at least this many bytes each (twice a core's L2 on the
/// development machine) store them with non-temporal (streaming) stores on the
/// contiguous path: they would not stay in the near caches anyway, and a streaming store
/// writes a line without first reading it (a plain store reads every line it writes:
/// three memory transfers per element copied instead of two).
inline constexpr int64_t kStreamBytes = int64_t(4) << 20;

/// Whether `store_stream` is a streaming store here.
inline constexpr bool kCanStream =
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    true;
#else
    false;
#endif

/// Stores a whole vector at `p`, aligned to the vector's size, bypassing the caches.
template <class T>
inline void store_stream(const Vec<T>& v, T* p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) _mm512_stream_ps(p, v);
  else _mm512_stream_pd(p, v);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) _mm256_stream_ps(p, v);
  else _mm256_stream_pd(p, v);
#else
  v.store(p);
#endif
}

template <class T, class... In, class... Out, class Body, std::size_t... I, std::size_t... O>
inline void elementwise_impl(types<In...>, types<Out...>, int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args,
                             Body& body, std::index_sequence<I...>, std::index_sequence<O...>) {
  constexpr int NI = sizeof...(In);
  constexpr int NO = sizeof...(Out);
  constexpr int64_t W = Vec<T>::size();
  if (begin >= end) return;
  const stagejit_TensorArg* outs = args + NI;
  const int64_t* sizes = args[0].sizes;
  const int last = rank - 1;
  int64_t idx[8];
  {
    int64_t rem = begin;
    for (int d = last; d >= 0; --d) {
      idx[d] = rem % sizes[d];
      rem /= sizes[d];
    }
  }
  auto offset = [&](const stagejit_TensorArg& t) {
    int64_t off = 0;
    for (int d = 0; d <= last; ++d) off += idx[d] * t.strides[d];
    return off;
  };
  int64_t in_stride[NI > 0 ? NI : 1] = {(args[I].strides[last])...};
  int64_t out_stride[NO] = {(outs[O].strides[last])...};
  bool dense = true;
  for (int k = 0; k < NI; ++k) dense = dense && in_stride[k] == 1;
  for (int k = 0; k < NO; ++k) dense = dense && out_stride[k] == 1;
  dense = dense && (std::is_same_v<In, T> && ...) && (std::is_same_v<Out, T> && ...);
  const int64_t inner = sizes[last];
  // Streaming stores (kStreamBytes) for large launches on the contiguous path.
  constexpr bool same_types = (std::is_same_v<In, T> && ...) && (std::is_same_v<Out, T> && ...);
  bool stream = false;
  if constexpr (kCanStream && same_types) {
    if (dense) {
      int64_t numel = 1;
      for (int d = 0; d <= last; ++d) numel *= sizes[d];
      stream = numel * int64_t(sizeof(T)) >= kStreamBytes;
    }
  }
  bool streamed = false;
  int64_t i = begin;
  while (i < end) {
    const int64_t run = std::min(inner - idx[last], end - i);
    std::tuple<const In*...> ip{(static_cast<const In*>(args[I].data) + offset(args[I]))...};
    std::tuple<Out*...> op{(static_cast<Out*>(outs[O].data) + offset(outs[O]))...};
    Vec<T> in[NI > 0 ? NI : 1];
    Vec<T> out[NO];
    int64_t j = 0;
    if constexpr (kCanStream && same_types) {
    if (dense && stream) {
      // Streaming stores need every output aligned to the vector size: peel a partial
      // vector until the first output is; the others must then be too.
      constexpr uintptr_t VB = sizeof(Vec<T>);
      const uintptr_t mis = reinterpret_cast<uintptr_t>(std::get<0>(op) + j) % VB;
      bool aligned = mis % sizeof(T) == 0;
      const int64_t peel = aligned ? int64_t(((VB - mis) % VB) / sizeof(T)) : 0;
      ((aligned = aligned && reinterpret_cast<uintptr_t>(std::get<O>(op) + peel) % VB == 0), ...);
      if (aligned && peel + W <= run) {
        if (peel > 0) {
          ((in[I] = Vec<T>::loadu(std::get<I>(ip), peel)), ...);
          body(static_cast<const Vec<T>*>(in), static_cast<Vec<T>*>(out));
          (out[O].store(std::get<O>(op), static_cast<int>(peel)), ...);
          j = peel;
        }
        for (; j + W <= run; j += W) {
          ((in[I] = Vec<T>::loadu(std::get<I>(ip) + j)), ...);
          body(static_cast<const Vec<T>*>(in), static_cast<Vec<T>*>(out));
          (store_stream<T>(out[O], std::get<O>(op) + j), ...);
        }
        streamed = true;
      }
    }
    }
    if (dense) {
      // Contiguous fast path: every row is dense and stored in the compute type.
      for (; j + W <= run; j += W) {
        ((in[I] = Vec<T>::loadu(std::get<I>(ip) + j)), ...);
        body(static_cast<const Vec<T>*>(in), static_cast<Vec<T>*>(out));
        (out[O].store(std::get<O>(op) + j), ...);
      }
    } else {
      for (; j + W <= run; j += W) {
        ((in[I] = load<T>(std::get<I>(ip) + j * in_stride[I], in_stride[I], W)), ...);
        body(static_cast<const Vec<T>*>(in), static_cast<Vec<T>*>(out));
        (store<T>(out[O], std::get<O>(op) + j * out_stride[O], out_stride[O], W), ...);
      }
    }
    if (j < run) {
      const int64_t n = run - j;
      ((in[I] = load<T>(std::get<I>(ip) + j * in_stride[I], in_stride[I], n)), ...);
      body(static_cast<const Vec<T>*>(in), static_cast<Vec<T>*>(out));
      (store<T>(out[O], std::get<O>(op) + j * out_stride[O], out_stride[O], n), ...);
    }
    i += run;
    idx[last] += run;
    for (int d = last; d > 0 && idx[d] == sizes[d]; --d) {
      idx[d] = 0;
      ++idx[d - 1];
    }
  }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (streamed) _mm_sfence();  // streaming stores are weakly ordered: publish them
#else
  (void)streamed;
#endif
}

template <class... X>
constexpr std::index_sequence_for<X...> indices_of(types<X...>) { return {}; }

/// Runs `body(const Vec<T>* in, Vec<T>* out)` over the linear indices [begin, end):
/// inputs have storage types In... (Ins = types<In...>), outputs Out..., computed in T.
template <class T, class Ins, class Outs, class Body>
inline void elementwise(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args, Body body) {
  elementwise_impl<T>(Ins{}, Outs{}, begin, end, rank, args, body, indices_of(Ins{}), indices_of(Outs{}));
}

}  // namespace sjk

// ---- end of prelude ----
)PRELUDE";
  return text;
}

}  // namespace stagejit::fusion
