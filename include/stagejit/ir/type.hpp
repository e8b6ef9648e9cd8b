#pragma once
/// \file
/// The types of IR values: `TensorType` (dtype, sizes, strides, device), `HandleType`
/// (an opaque backward closure crossing stages) and `UnknownType` (not yet inferred).
///
/// Text form (docs/seed-system.md §1.3): `Float(3, 4)`, `Double(4!, 2)`, `Handle`, `UNKNOWN_TYPE`.
/// A `!` follows a size whose stride differs from the contiguous one, i.e. from
/// `size[d+1] * stride[d+1]` (1 for the last dimension). A device other than the CPU is
/// printed as a last item: `Float(3, 4, device=cuda:0)`.
///
/// Note [Stride reconstruction]: text keeps only *whether* a stride is contiguous, not
/// its value. `parse_strides` rebuilds strides from the last dimension to the first:
/// an unmarked dimension gets its contiguous stride `e` (`size[d+1]*stride[d+1]`, 1 for
/// the last); a `!` dimension gets `2*e` (or 1 when `e` is 0). The rebuilt strides print
/// back to the same marks, so text round-trips; the exact stride values do not.
///
/// The longer functions' bodies are in ir/type-inl.hpp (core/config.hpp).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>

namespace stagejit::ir {

/// Sizes or strides of a tensor type, in elements: inline up to four dimensions (no
/// heap block per value; Note [Inline edge lists] in graph.hpp). Converts to
/// `at::IntArrayRef`; `.vec()` of that gives a `std::vector<int64_t>`.
using DimList = c10::SmallVector<int64_t, 4>;

/// A dense tensor value: element type, sizes, strides (in elements) and device.
struct TensorType {
  at::ScalarType dtype = at::kFloat;
  DimList sizes;
  DimList strides;
  at::Device device = at::kCPU;

  /// The type of a real tensor (sizes and strides as they are).
  static TensorType of(const at::Tensor& t) {
    return TensorType{t.scalar_type(), DimList(t.sizes()), DimList(t.strides()), t.device()};
  }
  /// A contiguous tensor type of the given sizes.
  static TensorType contiguous(at::ScalarType dtype, at::IntArrayRef sizes,
                               at::Device device = at::kCPU);
  /// True when every stride equals its contiguous value.
  bool is_contiguous() const;
  friend bool operator==(const TensorType& a, const TensorType& b) {
    return a.dtype == b.dtype && a.sizes == b.sizes && a.strides == b.strides &&
           a.device == b.device;
  }
};

/// The type of a Handle value: an opaque backward closure made at one stage and run by
/// an `Eval` node at a later one.
struct HandleType {
  friend bool operator==(const HandleType&, const HandleType&) { return true; }
};

/// A value whose type is not known (printed `UNKNOWN_TYPE`).
struct UnknownType {
  friend bool operator==(const UnknownType&, const UnknownType&) { return true; }
};

/// The type of an IR value.
using Type = std::variant<UnknownType, TensorType, HandleType>;

/// Contiguous strides (row-major, in elements) for `sizes`.
inline DimList contiguous_strides(at::IntArrayRef sizes) {
  DimList strides(sizes.size());
  int64_t expected = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = expected;
    expected *= sizes[d];
  }
  return strides;
}

inline TensorType TensorType::contiguous(at::ScalarType dtype, at::IntArrayRef sizes,
                                         at::Device device) {
  return TensorType{dtype, DimList(sizes), ir::contiguous_strides(sizes), device};
}

/// For each dimension, whether its stride differs from the contiguous expectation
/// (the `!` marks of the text form). `strides` must have the length of `sizes`.
STAGEJIT_FUNC std::vector<bool> noncontiguous_marks(at::IntArrayRef sizes, at::IntArrayRef strides);

/// Rebuilds strides from `!` marks (Note [Stride reconstruction]).
STAGEJIT_FUNC DimList parse_strides(at::IntArrayRef sizes, const std::vector<bool>& marks);

/// Every dtype the text form names, in ATen's spelling (`Float`, `Long`, ...).
STAGEJIT_FUNC const std::vector<at::ScalarType>& printable_dtypes();

/// The dtype named `name` (`"Float"` -> `at::kFloat`), or nullopt.
STAGEJIT_FUNC std::optional<at::ScalarType> dtype_from_name(std::string_view name);

/// The text form of a type (`Float(3, 4!)`, `Handle`, `UNKNOWN_TYPE`).
STAGEJIT_FUNC std::string to_string(const Type& type);

}  // namespace stagejit::ir

#ifdef STAGEJIT_HEADER_TEST_CASES
#include <stagejit/testing/doctest.hpp>
TEST_SUITE("ir") {
  TEST_CASE("TensorType prints ! exactly where a stride is not the contiguous one") {
    using namespace stagejit::ir;
    CHECK(to_string(Type{TensorType::contiguous(at::kFloat, {3, 20})}) == "Float(3, 20)");
    auto t = at::zeros({4, 4}, at::kDouble).narrow(1, 0, 2);  // strides (4, 1)
    CHECK(to_string(Type{TensorType::of(t)}) == "Double(4!, 2)");
    CHECK(to_string(Type{TensorType::of(at::zeros({2, 2}, at::kDouble).t())}) ==
          "Double(2!, 2!)");
    CHECK(to_string(Type{TensorType::of(at::zeros({}, at::kLong))}) == "Long()");
    CHECK(to_string(Type{HandleType{}}) == "Handle");
    CHECK(to_string(Type{UnknownType{}}) == "UNKNOWN_TYPE");
  }
  TEST_CASE("stride reconstruction reproduces the marks") {
    using namespace stagejit::ir;
    std::vector<int64_t> sizes = {4, 0, 3, 2};
    for (int bits = 0; bits < 16; ++bits) {
      std::vector<bool> marks = {bool(bits & 1), bool(bits & 2), bool(bits & 4), bool(bits & 8)};
      CHECK(noncontiguous_marks(sizes, parse_strides(sizes, marks)) == marks);
    }
  }
}
#endif
