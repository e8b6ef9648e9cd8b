#pragma once
// FusionGroup subgraphs shared by the CUDA dialect tests (fusion suite: generated sources
// and NVRTC) and the gpu suite (run on CUDA tensors against ATen on CUDA).
#include <string>

namespace stagejit::fusion::testing {

/// tanh(a*b + c) * sigmoid(a), the chain of bench/fusion.
inline const std::string tanh_sigmoid_group = R"(graph(%a : Float(4), %b : Float(4), %c : Float(4)) {
  %0 : Float(4) = mul(%a, %b);
  %1 : Float(4) = add[alpha=1](%0, %c);
  %2 : Float(4) = tanh(%1);
  %3 : Float(4) = sigmoid(%a);
  %4 : Float(4) = mul(%2, %3);
  return (%4);
}
)";

/// Special values: NaN-propagating maximum/minimum/clamp/relu, saturating tanh and
/// sigmoid, reciprocal and a scalar literal, division.
inline const std::string special_values_group = R"(graph(%x : Float(12), %y : Float(12)) {
  %0 : Float(12) = maximum(%x, %y);
  %1 : Float(12) = minimum(%x, %y);
  %2 : Float(12) = clamp[min=-1, max=2](%x);
  %3 : Float(12) = relu(%x);
  %4 : Float(12) = tanh(%x);
  %5 : Float(12) = sigmoid(%x);
  %6 : Float(12) = reciprocal(%x);
  %7 : Float(12) = mul[other=1.5](%6);
  %8 : Float(12) = clamp[min=0.5](%y);
  %9 : Float(12) = div(%x, %y);
  %10 : Float(12) = add(%0, %1);
  return (%0, %1, %2, %3, %4, %5, %7, %8, %9, %10);
}
)";

/// The first nodes of predicates_group, without a return: comparisons with bool outputs
/// read back by where/masked_fill; scalar forms; pow's special and general exponents;
/// sign; logical_and. The CPU codegen test returns a few of them.
inline const std::string predicates_head = R"(graph(%a : Double(6, 5), %b : Double(5)) {
  %0 : Bool(6, 5) = gt(%a, %b);
  %1 : Double(6, 5) = where(%0, %a, %b);
  %2 : Bool(6, 5) = le[other=0.25](%a);
  %3 : Double(6, 5) = masked_fill[value=-7](%1, %2);
  %4 : Double(6, 5) = sub[alpha=2](%3, %b);
  %5 : Double(6, 5) = pow[exponent=2](%4);
  %6 : Double(6, 5) = pow[exponent=2.5](%a);
  %7 : Double(6, 5) = sign(%4);
  %8 : Double(6, 5) = add[other=3, alpha=0.5](%7);
  %9 : Bool(6, 5) = logical_and(%0, %2);
)";

/// Comparisons with bool outputs read back by where/masked_fill; scalar forms; pow's
/// special and general exponents; sign; logical_and; rsqrt, exp, log, sin, cos, abs.
inline const std::string predicates_group = predicates_head + R"(  %10 : Double(6, 5) = abs(%a);
  %11 : Double(6, 5) = rsqrt(%10);
  %12 : Double(6, 5) = exp(%b);
  %13 : Double(6, 5) = log(%12);
  %14 : Double(6, 5) = sin(%a);
  %15 : Double(6, 5) = cos(%14);
  %16 : Double(6, 5) = threshold[threshold=0.1, value=20](%a);
  %17 : Double(6, 5) = pow[exponent=-0.5](%10);
  %18 : Double(6, 5) = rsub[other=1](%a);
  return (%0, %3, %5, %6, %8, %9, %11, %13, %15, %16, %17, %18);
}
)";

/// The activations of the ops for models (issue 19): both GELU forms, erf, silu, softplus
/// (default and beta/threshold), elu, leaky_relu, chained with a scalar mul so that a
/// kernel reads them from one another too.
inline const std::string activations_group = R"(graph(%x : Float(12), %y : Float(12)) {
  %0 : Float(12) = gelu(%x);
  %1 : Float(12) = gelu[approximate="tanh"](%x);
  %2 : Float(12) = erf(%x);
  %3 : Float(12) = silu(%x);
  %4 : Float(12) = softplus[beta=1, threshold=20](%x);
  %5 : Float(12) = softplus[beta=2, threshold=1](%y);
  %6 : Float(12) = elu[alpha=1](%x);
  %7 : Float(12) = elu[alpha=1.5](%y);
  %8 : Float(12) = leaky_relu[negative_slope=0.01](%x);
  %9 : Float(12) = leaky_relu[negative_slope=0.2](%y);
  %10 : Float(12) = mul[other=0.5](%y);
  %11 : Float(12) = gelu(%10);
  %12 : Float(12) = silu(%11);
  return (%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %12);
}
)";

/// The activations without GELU: erf, silu, softplus, elu, leaky_relu (the float check of
/// the CPU dialect; GELU's float gap is described at `OpId::gelu` in
/// fusion/detail/codegen_ops-inl.hpp).
inline const std::string activations_without_gelu_group = R"(graph(%x : Float(12), %y : Float(12)) {
  %0 : Float(12) = erf(%x);
  %1 : Float(12) = silu(%x);
  %2 : Float(12) = softplus[beta=1, threshold=20](%x);
  %3 : Float(12) = softplus[beta=2, threshold=1](%y);
  %4 : Float(12) = elu[alpha=1](%x);
  %5 : Float(12) = elu[alpha=1.5](%y);
  %6 : Float(12) = leaky_relu[negative_slope=0.2](%y);
  %7 : Float(12) = mul[other=0.5](%y);
  %8 : Float(12) = silu(%7);
  %9 : Float(12) = elu[alpha=1](%8);
  return (%0, %1, %2, %3, %4, %5, %6, %9);
}
)";

}  // namespace stagejit::fusion::testing
