// The CUDA C++ prelude of generated CUDA kernels (see include/stagejit/fusion/cuda_backend.hpp).
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

namespace stagejit::fusion {

static_assert(kMaxCudaArgs >= 24, "the CUDA prelude declares stagejit_ArgPack with 24 tensors");

const std::string& cuda_prelude() {
  static const std::string text = R"PRELUDE(// ---- stagejit CUDA kernel prelude ----
/// Same layout as stagejit::fusion::TensorArg: element pointer, sizes, element strides.
struct stagejit_TensorArg {
  void* data;
  long long sizes[8];
  long long strides[8];
};
/// The N tensors of a launch, passed by value (inputs then outputs); the launcher passes
/// a buffer of kMaxCudaArgs tensors, of which the kernel's parameter reads the first N.
template <int N>
struct stagejit_Args {
  stagejit_TensorArg t[N];
};
/// The pack of hand-written kernels: up to 24 tensors.
typedef stagejit_Args<24> stagejit_ArgPack;
/// Element offset of linear index i (row-major over the iteration shape) in t.
__device__ __forceinline__ long long sj_offset(const stagejit_TensorArg& t, int rank, long long i) {
  long long off = 0;
  for (int d = rank - 1; d > 0; --d) {
    const long long s = t.sizes[d];
    off += (i % s) * t.strides[d];
    i /= s;
  }
  return off + i * t.strides[0];
}
template <class T>
__device__ __forceinline__ T sj_load(const stagejit_TensorArg& t, int rank, long long i) {
  return static_cast<const T*>(t.data)[sj_offset(t, rank, i)];
}
template <class T>
__device__ __forceinline__ void sj_store(const stagejit_TensorArg& t, int rank, long long i, T v) {
  static_cast<T*>(t.data)[sj_offset(t, rank, i)] = v;
}
/// 16-bit storage types (IEEE half, bfloat16), converted to and from float by the
/// loads and stores below; computation happens in float.
struct sj_half { unsigned short bits; };
struct sj_bfloat16 { unsigned short bits; };
/// Conversion of a stored element of type S to the compute type T and back.
template <class T, class S>
struct sj_convert {
  static __device__ __forceinline__ T load(S s) { return static_cast<T>(s); }
  static __device__ __forceinline__ S store(T v) { return static_cast<S>(v); }
};
template <class T>
struct sj_convert<T, sj_half> {
  static __device__ __forceinline__ T load(sj_half s) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s.bits));
    return static_cast<T>(f);
  }
  static __device__ __forceinline__ sj_half store(T v) {
    sj_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(static_cast<float>(v)));
    return h;
  }
};
template <class T>
struct sj_convert<T, sj_bfloat16> {
  static __device__ __forceinline__ T load(sj_bfloat16 s) {
    return static_cast<T>(__uint_as_float(static_cast<unsigned>(s.bits) << 16));
  }
  static __device__ __forceinline__ sj_bfloat16 store(T v) {
    // c10::BFloat16's round to nearest even; NaN stays a (quiet) NaN.
    const float f = static_cast<float>(v);
    unsigned u = __float_as_uint(f);
    sj_bfloat16 b;
    if (f != f) {
      b.bits = 0x7fc0;
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      b.bits = static_cast<unsigned short>(u >> 16);
    }
    return b;
  }
};
template <class T>
struct sj_convert<T, bool> {
  static __device__ __forceinline__ T load(bool s) { return s ? T(1) : T(0); }
  static __device__ __forceinline__ bool store(T v) { return v != T(0); }
};
/// Element i of t (storage type S) in the compute type T, and back.
template <class T, class S>
__device__ __forceinline__ T sj_load_as(const stagejit_TensorArg& t, int rank, long long i) {
  return sj_convert<T, S>::load(sj_load<S>(t, rank, i));
}
template <class T, class S>
__device__ __forceinline__ void sj_store_as(const stagejit_TensorArg& t, int rank, long long i, T v) {
  sj_store<S>(t, rank, i, sj_convert<T, S>::store(v));
}
#define SJ_GRID_STRIDE_LOOP(i, begin, end)                                                \
  for (long long i = (begin) + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (end); \
       i += (long long)blockDim.x * gridDim.x)
// ---- end of prelude ----
)PRELUDE";
  return text;
}

}  // namespace stagejit::fusion
