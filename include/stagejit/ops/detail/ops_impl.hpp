#pragma once
/// \file
/// Internal: the helpers the op table's entries and the op free functions share across
/// their files (ops/op_table-inl.hpp, ops/nn-inl.hpp, ops/tensor_ops-inl.hpp,
/// ops/ops-inl.hpp), and their macros `SJ_UNARY` and `SJ_OP` (undefined again at the end
/// of core/detail/bodies.hpp). Bodies in ops/op_table-inl.hpp (`run1`: ops/ops-inl.hpp;
/// `define_nn_ops`: ops/nn-inl.hpp; `define_tensor_ops`: ops/tensor_ops-inl.hpp).

#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ops/detail/attribute_readers.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace stagejit::detail::ops_impl {

using Tensors = std::vector<at::Tensor>;

std::vector<int64_t> vec(at::IntArrayRef r);
std::vector<int64_t> meta_sizes(const BackwardArgs& a, std::size_t i);
Variable pad_slice(const BackwardArgs& a, const Variable& g, int64_t dim, int64_t start, int64_t len);
Variable cat_pieces(const BackwardArgs& a, int64_t dim, int64_t step,
                    const std::vector<int64_t>& lengths = {});
int64_t cross_dim(const Attributes& a, at::IntArrayRef x, at::IntArrayRef y);
Tensors one(at::Tensor t);
const Variable& G(const BackwardArgs& a, std::size_t i = 0);
const Variable& In(const BackwardArgs& a, std::size_t i);
const Variable& Out(const BackwardArgs& a, std::size_t i = 0);
bool column_major(const Variable& m);
at::Tensor matrix_product(const at::Tensor& a, const at::Tensor& b);
Variable mm_mat1_grad(const Variable& g, const Variable& m1, const Variable& m2);
Variable mm_mat2_grad(const Variable& g, const Variable& m1, const Variable& m2);
Variable reduce_backward(const BackwardArgs& a);
double reduced_count(const BackwardArgs& a);
Variable zeros_of(std::vector<int64_t> size, const at::TensorOptions& o);
Variable run1(const OpDef& d, variable_list in, const Attributes& attrs = {});

// The ops for models, each group in its own file, add their entries to the table
// (build_table, ops/op_table-inl.hpp): ops/nn-inl.hpp (convolution, pooling,
// normalisation, gather, scatter_add) and ops/tensor_ops-inl.hpp (activations,
// embeddings and indexing, batched products, shapes, reductions, losses, dropout).
// build_table instantiates them with its local `def` lambda, so their definitions must be
// in the translation unit of op_table-inl.hpp: core/detail/bodies.hpp includes the three
// (op_table-inl.hpp alone does not compile).
template <class Def> void define_nn_ops(Def& def);
template <class Def> void define_tensor_ops(Def& def);

}  // namespace stagejit::detail::ops_impl

// A forward that applies the ATen function NAME to its one input.
#define SJ_UNARY(NAME) [](const Tensors& in, const Attributes&) { return one(at::NAME(in[0])); }
// In an op free function: `d`, the OpDef of the op NAME.
#define SJ_OP(NAME) const OpDef& d = ops::def(OpId::NAME)
