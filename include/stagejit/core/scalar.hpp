#pragma once
/// \file
/// `Scalar`: the non-tensor arguments of ops and host functions, and `Attributes`,
/// the named scalar arguments an op carries into the IR (`alpha`, `dim`, `other`, ...).

#include <stagejit/core/detail/bodies_begin.hpp>
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace stagejit {

/// A non-tensor argument: `double`, `int64_t`, `bool`, `std::string`,
/// `std::vector<int64_t>` or `std::vector<double>` (docs/api.md, Host functions).
using Scalar = std::variant<double, int64_t, bool, std::string, std::vector<int64_t>,
                            std::vector<double>>;

/// Named scalar arguments in a fixed order (the op's argument order).
using Attributes = std::vector<std::pair<std::string, Scalar>>;

}  // namespace stagejit
#include <stagejit/core/detail/bodies_end.hpp>
