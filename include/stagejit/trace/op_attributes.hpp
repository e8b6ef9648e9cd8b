#pragma once
/// \file
/// Converts IR attributes back to the op table's `Attributes` (the inverse of
/// `ir::to_attribute`): f -> double, i -> int64_t, is -> vector<int64_t>,
/// fs -> vector<double>, s -> string. Tensor and graph attributes have no op-table form.

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/attributes.hpp>

namespace stagejit::detail {

/// Throws `CompileError` for a tensor, string-list or graph attribute.
inline Attributes to_core_attributes(const ir::AttributeList& attrs) {
  Attributes out;
  out.reserve(attrs.size());
  for (const auto& [name, value] : attrs) {
    std::visit(
        [&, &name = name, &value = value](const auto& v) {  // clang < 16 cannot capture bindings
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, double> || std::is_same_v<T, int64_t> ||
                        std::is_same_v<T, std::string> ||
                        std::is_same_v<T, std::vector<int64_t>> ||
                        std::is_same_v<T, std::vector<double>>) {
            out.emplace_back(name, Scalar(v));
          } else {
            throw CompileError("attribute '" + name + "' of kind " +
                               std::string(ir::attribute_kind(value)) +
                               " cannot be passed to a table op");
          }
        },
        value);
  }
  return out;
}

}  // namespace stagejit::detail
#include <stagejit/core/detail/bodies_end.hpp>
