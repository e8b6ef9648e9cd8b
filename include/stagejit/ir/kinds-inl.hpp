#pragma once
/// \file
/// Bodies of ir/kinds.hpp (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/ir/attributes.hpp>

#include <boost/hana.hpp>

#include <variant>

namespace stagejit::ir {

STAGEJIT_FUNC bool kind_equal(const NodeKind& a, const NodeKind& b) {
  if (a.index() != b.index()) return false;
  auto opaque = [](const auto&) { return false; };
  return std::visit(
      Overloaded{
          [&](const Undefined&) { return true; },
          [&](const Op& x) {
            const auto& y = std::get<Op>(b);
            if (&x.schema() != &y.schema() || x.attributes.size() != y.attributes.size()) return false;
            for (size_t i = 0; i < x.attributes.size(); ++i)
              if (x.attributes[i].first != y.attributes[i].first ||
                  !attribute_equal(x.attributes[i].second, y.attributes[i].second))
                return false;
            return true;
          },
          // Constant, Transpose, Reshape, Gemm: every field, by name.
          [&]<class K>(const K& x) requires is_attribute_kind<K> {
            const auto& y = std::get<K>(b);
            bool eq = true;
            boost::hana::for_each(boost::hana::keys(x), [&](auto key) {
              eq = eq && attribute_equal(AttributeValue(boost::hana::at_key(x, key)),
                                         AttributeValue(boost::hana::at_key(y, key)));
            });
            return eq;
          },
          [&](const HostOp& x) { return opaque(x); },
          [&](const Eval& x) { return opaque(x); },
          [&](const FusionGroup& x) { return opaque(x); },
          [&](const Param& x) { return opaque(x); },
          [&](const Return& x) { return opaque(x); },
      },
      a);
}

}  // namespace stagejit::ir
