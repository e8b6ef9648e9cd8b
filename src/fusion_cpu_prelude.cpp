// The C++ prelude of generated CPU kernels (see include/stagejit/fusion/cpu_backend.hpp).
#include <stagejit/fusion/cpu_backend.hpp>

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
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(STAGEJIT_NO_SLEEF)
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

/// Loads `count` (<= Vec<T>::size()) elements of storage type S at stride `s`,
/// converted to T. Unused lanes are zero.
template <class T, class S>
inline Vec<T> load(const S* p, int64_t s, int64_t count) {
  if constexpr (std::is_same_v<S, T>) {
    if (s == 1) return Vec<T>::loadu(p, count);
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
  alignas(64) T buf[Vec<T>::size()];
  v.store(buf);
  for (int64_t k = 0; k < count; ++k) p[k * s] = static_cast<S>(buf[k]);
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
  int64_t i = begin;
  while (i < end) {
    const int64_t run = std::min(inner - idx[last], end - i);
    std::tuple<const In*...> ip{(static_cast<const In*>(args[I].data) + offset(args[I]))...};
    std::tuple<Out*...> op{(static_cast<Out*>(outs[O].data) + offset(outs[O]))...};
    Vec<T> in[NI > 0 ? NI : 1];
    Vec<T> out[NO];
    int64_t j = 0;
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
