#pragma once
// Hand-written kernel sources following the launch ABI of stagejit/fusion/kernel_spec.hpp,
// standing in for the code generator's output in the backend tests.
#include <stagejit/fusion/kernel_spec.hpp>

#include <ATen/ATen.h>

#include <string>

namespace stagejit::fusion::testing {

/// CPU kernel `y = tanh(a*b + c) * sigmoid(a)` in T (`float` or `double`), named `entry`.
inline std::string cpu_tanh_sigmoid_source(const std::string& t, const std::string& entry) {
  return "extern \"C\" void " + entry +
         "(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args) {\n"
         "  sjk::elementwise<" + t + ", sjk::types<" + t + ", " + t + ", " + t + ">, sjk::types<" + t + ">>(\n"
         "      begin, end, rank, args, [](const sjk::Vec<" + t + ">* in, sjk::Vec<" + t + ">* out) {\n"
         "        out[0] = (in[0] * in[1] + in[2]).tanh() * sjk::sigmoid(in[0]);\n"
         "      });\n"
         "}\n";
}

/// CUDA kernel `y = tanh(a*b + c) * sigmoid(a)` in T (`float` or `double`), named `entry`.
inline std::string cuda_tanh_sigmoid_source(const std::string& t, const std::string& entry) {
  const bool f = t == "float";
  const std::string one = f ? "1.0f" : "1.0";
  return "extern \"C\" __global__ void " + entry +
         "(long long begin, long long end, int rank, stagejit_ArgPack p) {\n"
         "  SJ_GRID_STRIDE_LOOP(i, begin, end) {\n"
         "    " + t + " a = sj_load<" + t + ">(p.t[0], rank, i), b = sj_load<" + t + ">(p.t[1], rank, i),\n"
         "      c = sj_load<" + t + ">(p.t[2], rank, i);\n"
         "    sj_store<" + t + ">(p.t[3], rank, i, " + (f ? "tanhf" : "tanh") + "(a * b + c) * (" + one + " / (" + one +
         " + " + (f ? "expf" : "exp") + "(-a))));\n"
         "  }\n"
         "}\n";
}

/// The key of a three-input, one-output kernel of dtype `dtype` on `device`.
inline KernelKey tanh_sigmoid_key(at::ScalarType dtype, DeviceKind device = DeviceKind::CPU) {
  KernelKey key;
  key.device = device;
  key.device_index = device == DeviceKind::CUDA ? 0 : -1;
  key.inputs.assign(3, TensorDesc{dtype, 1, true});
  key.outputs.assign(1, TensorDesc{dtype, 1, true});
  return key;
}

/// The oracle: libtorch eager.
inline at::Tensor eager_tanh_sigmoid(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  return at::tanh(a * b + c) * at::sigmoid(a);
}

}  // namespace stagejit::fusion::testing
