#pragma once
/// \file
/// Host side of the launch ABI (see kernel_spec.hpp): packs `at::Tensor`s into
/// `TensorArg`s over one iteration shape, broadcasting inputs with stride 0 and merging
/// dimensions that are contiguous in every tensor so that kernels see few, long rows.

#include <stagejit/core/error.hpp>
#include <stagejit/fusion/kernel_spec.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace stagejit::fusion {

/// The arguments of one kernel call: `args` (inputs then outputs) over an iteration
/// shape of `rank` dimensions (`1 <= rank <= kMaxDims`; a 0-dim shape becomes `[1]`)
/// holding `numel` elements. The `TensorArg`s point into the tensors' storage: the
/// tensors must outlive the call.
struct PackedArgs {
  int32_t rank = 1;
  int64_t numel = 0;
  std::vector<int64_t> shape;  ///< the iteration shape after merging dimensions
  std::vector<TensorArg> args;
  std::vector<at::ScalarType> dtypes;  ///< dtype of each of `args`
  at::Device device = at::kCPU;        ///< the device of every tensor
};

/// Packs `inputs` broadcast to `shape` (NumPy rules: missing leading dimensions and
/// size-1 dimensions get stride 0) and `outputs` of exactly `shape` into a `PackedArgs`.
/// The dimensions are iterated in the first output's memory order (its largest stride
/// outermost; the kernels compute every element on its own), and adjacent ones are merged
/// when they are contiguous with each other in every tensor, so tensors sharing a
/// transposed dense layout run as one row. Outputs must not overlap themselves (no
/// stride-0 dimension of size > 1).
/// Throws `ShapeError` naming the argument when an input does not broadcast to `shape`
/// or an output's sizes differ from it, and `FusionError` when tensors are on different
/// devices, undefined, or the shape has more than `kMaxDims` dimensions after merging.
PackedArgs pack_tensor_args(at::IntArrayRef shape, at::TensorList inputs, at::TensorList outputs);

}  // namespace stagejit::fusion
