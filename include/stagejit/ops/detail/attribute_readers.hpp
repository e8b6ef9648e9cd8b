#pragma once
/// \file
/// Internal: the readers of an op's attributes (`Attributes`, core/scalar.hpp) that the op
/// table's forwards and backwards use (ops/op_table-inl.hpp, ops/nn-inl.hpp,
/// ops/tensor_ops-inl.hpp). Bodies in ops/attribute_readers-inl.hpp (core/config.hpp).

#include <stagejit/core/scalar.hpp>

#include <ATen/core/Scalar.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace stagejit::detail::ops_impl {

const Scalar* find_attr(const Attributes& a, std::string_view n);
const Scalar& need_attr(const Attributes& a, std::string_view n);
double as_double(const Scalar& s, std::string_view n);
double attr_double(const Attributes& a, std::string_view n, double dflt);
std::optional<double> attr_opt_double(const Attributes& a, std::string_view n);
at::Scalar attr_scalar(const Attributes& a, std::string_view n, std::optional<double> dflt = {});
int64_t attr_int(const Attributes& a, std::string_view n, std::optional<int64_t> dflt = {});
bool attr_bool(const Attributes& a, std::string_view n, bool dflt);
std::vector<int64_t> attr_ints(const Attributes& a, std::string_view n);

}  // namespace stagejit::detail::ops_impl
