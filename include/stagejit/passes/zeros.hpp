#pragma once
/// \file
/// `passes::propagate_zeros`: removes the work a backward stage does on gradients that
/// are zero because they were never given (undefined), as libtorch's backward formulas
/// skip an undefined `grad` (`if (grad.defined())`) instead of multiplying by zeros.
///
/// Note [Symbolic zeros]
/// A *zero* value is known to be all zeros without being computed (an undefined
/// incoming gradient). Walking one stage's nodes in order, a node reading a zero:
/// - linear in that input (mul, mm/matmul, div's numerator, neg, sum, expand,
///   reshape, view, t/transpose, (un)squeeze, sum_to_size, narrow, chunk, to,
///   zeros_like, `Transpose`/`Reshape` kinds; cat, where and addmm/`Gemm` when every
///   input that matters is zero, beta = 0 ignoring C as ATen does) makes zero outputs,
///   and the node is left to DCE (not `mean`: the mean of an empty tensor is NaN);
/// - additive (add, sub, rsub, addmm/Gemm with a zero product) becomes the other operand
///   (scaled by `alpha`/`beta` through a scalar `mul` when not 1), when its type equals
///   the output's (no broadcast hidden in the add); otherwise, as for every other node,
/// - the zero is *materialised*: a `zeros` op of the value's traced type (one per zero
///   value, placed before its first such consumer) replaces it at that input.
/// A FusionGroup reading a zero has its subgraph specialised the same way (outputs that
/// became zero or a pass-through of an input leave the group, inputs no longer read are
/// dropped); when that would need a materialised zero inside the kernel, the group keeps
/// its subgraph and gets materialised inputs. Nodes listed in `pinned` (their outputs are
/// read by a later stage) are never replaced by a value that already exists: their
/// outputs become zeros (which the caller hands on to the later stage as zeros), or the
/// outputs of a specialised FusionGroup made for them (`on_replace` reports each), or
/// they run on materialised zeros.
///
/// Mathematically exact for finite values and, for 0 * inf and 0 * NaN, it follows
/// libtorch's semantics of an undefined gradient ("no contribution") rather than IEEE's.
/// Needs the sizes and dtype (`TensorType`) of every value it materialises; throws
/// `CompileError` naming the value otherwise (the caller then keeps the unspecialised
/// stage).

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/passes/dce.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace stagejit::passes {

/// What `propagate_zeros` reports for the caller's bookkeeping.
struct ZeroPropagation {
  /// `on_replace(from, to)`: every use of `from` was redirected to `to` (a value that
  /// stands for the same tensor). Lets the caller follow values it tracks.
  std::function<void(ir::Value* from, ir::Value* to)> on_replace;
};

namespace detail {

class ZeroPass {
 public:
  /// Thrown inside a FusionGroup's subgraph, where no `zeros` op can run.
  struct NeedsMaterialising {};

  ZeroPass(ir::Graph& g, std::optional<std::size_t> stage, const std::vector<char>* pinned,
           const ZeroPropagation& hooks)
      : g_(g), stage_(stage), pinned_(pinned), hooks_(hooks) {}

  void mark(const ir::Value* v) { set(zero_, v->id(), 1); }
  bool is_zero(const ir::Value* v) const { return get(zero_, v->id()); }

  /// Runs over the graph's nodes (of `stage_`, when set) in order.
  STAGEJIT_FUNC void run();

  /// A `zeros` node for zero value `z` placed before `before` (made once per value).
  STAGEJIT_FUNC ir::Value* materialised(ir::Value* z, ir::Node* before);

 private:
  STAGEJIT_FUNC void visit(ir::Node* n);

  static double attr_double(const ir::Op& op, std::string_view key, double fallback) {
    if (const ir::AttributeValue* v = op.attribute(key))
      if (auto d = ir::attribute_as<double>(*v)) return *d;
    return fallback;
  }

  STAGEJIT_FUNC void visit_op(ir::Node* n, const ir::Op& op);

  // The node's output is `scale * v`; v is not zero.
  STAGEJIT_FUNC void forward_scaled(ir::Node* n, ir::Value* v, double scale);

  void zero_outputs(ir::Node* n) {
    for (ir::Value* o : n->outputs()) mark(o);
  }

  void materialise_inputs(ir::Node* n) {
    for (std::size_t i = 0; i < n->inputs().size(); ++i)
      if (is_zero(n->input(i))) n->replace_input(i, materialised(n->input(i), n));
  }

  // Specialises a FusionGroup's subgraph on its zero inputs (Note [Symbolic zeros]).
  STAGEJIT_FUNC void visit_group(ir::Node* n, const ir::FusionGroup& fg);

  void replace(ir::Value* from, ir::Value* to) {
    if (hooks_.on_replace) hooks_.on_replace(from, to);
    from->replace_all_uses_with(to);
  }

  static void set(std::vector<char>& v, std::size_t i, char x) {
    if (v.size() <= i) v.resize(std::max<std::size_t>(2 * v.size(), i + 1), 0);
    v[i] = x;
  }
  static bool get(const std::vector<char>& v, std::size_t i) { return i < v.size() && v[i]; }
  ir::Value* get_ptr(std::size_t i) const { return i < zeros_.size() ? zeros_[i] : nullptr; }
  void set_ptr(std::size_t i, ir::Value* z) {
    if (zeros_.size() <= i) zeros_.resize(std::max<std::size_t>(2 * zeros_.size(), i + 1), nullptr);
    zeros_[i] = z;
  }

  ir::Graph& g_;
  std::optional<std::size_t> stage_;
  const std::vector<char>* pinned_;
  ZeroPropagation hooks_;
  std::vector<char> zero_;
  std::vector<ir::Value*> zeros_;  // zero value id -> its materialised `zeros`
  bool inner_ = false;  // inside a FusionGroup: materialising is not possible
  bool pinned_mode_ = false;  // the node being visited is pinned
};

}  // namespace detail

/// Propagates the zero values `zeros` through the nodes of `stage` (Note [Symbolic
/// zeros]); nodes whose id is set in `pinned` (may be null) are not rewritten. Returns the
/// zero values (inputs, or outputs of `stage`'s nodes) that a graph output or a node of
/// another stage still reads: the caller decides what they become (an undefined output,
/// an undefined value for a later stage). Nodes of `stage` no longer read zeros except
/// nodes whose outputs are all zero; dead nodes are left for `eliminate_dead_code`. Throws `CompileError` when a zero must
/// be materialised and its value has no tensor type.
STAGEJIT_FUNC std::vector<ir::Value*> propagate_zeros(ir::Graph& graph, std::size_t stage,
                                                      const std::vector<ir::Value*>& zeros,
                                                      const std::vector<char>* pinned = nullptr,
                                                      const ZeroPropagation& hooks = {});

}  // namespace stagejit::passes
