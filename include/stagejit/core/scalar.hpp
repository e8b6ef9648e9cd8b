#pragma once
/// \file
/// `Scalar`: the non-tensor arguments of ops and host functions, and `Attributes`,
/// the named scalar arguments an op carries into the IR (`alpha`, `dim`, `other`, ...).

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace stagejit {

/// Python's `None` among a seed-era host op's scalar arguments (`^Index(None, 0)`), read
/// from text and printed back; ops take no None attributes.
struct NoneScalar {
  bool operator==(const NoneScalar&) const = default;
};

/// A non-tensor argument: `double`, `int64_t`, `bool`, `std::string`,
/// `std::vector<int64_t>`, `std::vector<double>` or `NoneScalar` (docs/api.md, Host
/// functions).
using Scalar = std::variant<double, int64_t, bool, std::string, std::vector<int64_t>,
                            std::vector<double>, NoneScalar>;

/// Named scalar arguments in a fixed order (the op's argument order).
using Attributes = std::vector<std::pair<std::string, Scalar>>;

}  // namespace stagejit
