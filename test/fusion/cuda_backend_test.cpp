// The `gpu` suite: CUDA kernels compiled with NVRTC, launched through the driver API and
// compared with libtorch eager on the CPU. Skipped (reported by doctest) without a GPU.
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/testing/doctest.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include "kernels.hpp"

#include <cmath>

using namespace stagejit::fusion;
using namespace stagejit::fusion::testing;

namespace {

bool no_gpu() { return !cuda_driver_available(); }

/// A CPU tensor copied to the GPU, described over `shape` (broadcast with stride 0).
struct DeviceTensor {
  at::Tensor host;
  std::unique_ptr<CudaBuffer> buffer;
  TensorArg arg;
  DeviceTensor(const at::Tensor& t, at::IntArrayRef shape) : host(t.contiguous()) {
    buffer = std::make_unique<CudaBuffer>(host.nbytes(), 0);
    buffer->copy_from_host(host.data_ptr());
    // The broadcast view's strides (0 where expanded) over `shape`, in elements.
    const at::Tensor view = host.expand(shape);
    arg = TensorArg{};
    arg.data = buffer->data();
    for (int64_t d = 0; d < view.dim(); ++d) {
      arg.sizes[d] = view.size(d);
      arg.strides[d] = view.stride(d);
    }
  }
};

void run_case(at::ScalarType dtype, at::IntArrayRef shape, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& c) {
  const std::string t = dtype == at::kFloat ? "float" : "double";
  const std::string entry = "tanh_sigmoid_" + t;
  auto kernel = default_cuda_backend().get(
      KernelSource{cuda_tanh_sigmoid_source(t, entry), entry, tanh_sigmoid_key(dtype, DeviceKind::CUDA)});
  DeviceTensor da(a, shape), db(b, shape), dc(c, shape);
  at::Tensor out = at::empty(shape, a.options());
  CudaBuffer dout(out.nbytes(), 0);
  TensorArg oarg{};
  oarg.data = dout.data();
  for (int64_t d = 0; d < out.dim(); ++d) {
    oarg.sizes[d] = out.size(d);
    oarg.strides[d] = out.stride(d);
  }
  const int32_t rank = std::max<int32_t>(1, static_cast<int32_t>(shape.size()));
  if (shape.empty()) {
    for (TensorArg* x : {&da.arg, &db.arg, &dc.arg, &oarg}) x->sizes[0] = 1;
  }
  kernel->launch(out.numel(), rank, {da.arg, db.arg, dc.arg, oarg});
  cuda_synchronize(0);
  dout.copy_to_host(out.data_ptr());
  const at::Tensor want = eager_tanh_sigmoid(a, b, c);
  const double tol = dtype == at::kFloat ? 1e-6 : 1e-12;
  CHECK(at::allclose(out, want, tol, tol));
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("CUDA kernel tanh(a*b+c)*sigmoid(a) matches ATen" * doctest::skip(no_gpu())) {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      const std::string dtype_name = c10::toString(dtype);
      CAPTURE(dtype_name);
      const auto opt = at::TensorOptions().dtype(dtype);
      at::Tensor a = at::randn({1 << 20}, opt), b = at::randn({1 << 20}, opt), c = at::randn({1 << 20}, opt);
      run_case(dtype, {1 << 20}, a, b, c);
      run_case(dtype, {16, 4}, at::randn({16, 1}, opt), at::randn({4}, opt), at::randn({}, opt));
      run_case(dtype, {}, at::randn({}, opt), at::randn({}, opt), at::randn({}, opt));
    }
  }

  TEST_CASE("CUDA compile errors carry the NVRTC log" * doctest::skip(no_gpu())) {
    KernelSource bad{"extern \"C\" __global__ void bad(long long, long long, int, stagejit_ArgPack) { nope; }",
                     "bad", tanh_sigmoid_key(at::kFloat, DeviceKind::CUDA)};
    CHECK_THROWS_WITH_AS(default_cuda_backend().get(bad), doctest::Contains("nope"), stagejit::FusionError);
  }
}
