#pragma once
/// \file
/// Ops for models: activations, embeddings and indexing, batched products, shapes,
/// reductions, losses and dropout (docs/api.md "Ops for models"), as free functions with
/// ATen's names, argument order and semantics; each runs one entry of the op table, so it
/// is differentiable to any order and reported to the trace hook.
#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/autograd/variable.hpp>

#include <cstdint>
#include <vector>

namespace stagejit {

}  // namespace stagejit
#include <stagejit/core/detail/bodies_end.hpp>
