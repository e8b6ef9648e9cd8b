#pragma once
/// \file
/// The planner of row-tiled regions: which nodes of a compiled stage form a row-tiled
/// region (`find_row_tiled_regions`) and the plan of one (`TiledRegion`); the runner,
/// `TiledRegionRunner`, is closure/tiled_region.hpp.
///
/// Row-tiled regions of a compiled stage: the nodes of a stage that work row by row on
/// tall [N, C] tensors (fused elementwise kernels, products with a small right operand,
/// and the reductions over the rows that weight and bias gradients are) run as one
/// Function that walks the rows in tiles, so that the intermediates of a tile stay in the
/// core's cache instead of making a round trip through memory between nodes.
///
/// Note [Row-tiled regions]
/// A PINN's stages (bench/pinn.md) are chains of [10 000, 20] tensors: each elementwise
/// kernel and each product reads and writes 800 KB tensors, far beyond L1 and L2 once a
/// stage holds a few dozen of them, so every node runs at memory speed (measured: a
/// 5-in, 3-out float kernel takes 1.39 ns per element on such tensors and 0.31 ns when
/// its operands are in L2). Every node of such a chain but the reductions is *row local*:
/// row i of its output needs row i of its row inputs only. So the region runs, for each
/// tile of `tile_rows` rows, every node on that tile: fused kernels through their
/// generated entry point on the tile's rows, products `[rows, K] x [K, M]` through LIBXSMM
/// (`ops::small_mm_raw`), and accumulates the reductions (`t(X) @ Y` over the rows,
/// `sum_to_size` to one row) across tiles. Values only the region reads live in per-tile
/// scratch buffers (reused once dead); values read outside the region are written to
/// full [N, C] tensors.
///
/// Which nodes form regions (`find_row_tiled_regions`), given N (the most common
/// leading size of the stage's 2-D values, at least `min_rows` and 2, among those of 256
/// rows and more when there are any; one of the next two most common instead when its
/// regions tile more row products) and the value types the trace recorded:
/// - a row value is 2-D with N rows, of the region's dtype (float or double), on the CPU;
///   an invariant value is any other tensor (weights, biases) not made by a row node.
///   Operands are read as their products read them, whatever their shape (when N equals
///   a width, a weight has the shape of a row): a product's right operand is invariant,
///   the left operand t(X) of a reduction is read by columns, and a [C] or [1, C]
///   broadcast is invariant;
/// - FusionGroup: row outputs [N, C] (one C; Bool masks among them), inputs row (Bool
///   masks among them, made inside or outside the region) or broadcastable invariants;
///   fusion groups and elementwise ops read Bool masks, no other node does;
/// - mm (or matmul of two matrices) (row [N, K], invariant [K, M]) and addmm(invariant
///   bias, row, invariant) with beta = alpha = 1 and K, M <= `max_width` (128 by
///   default, `tiling::kMaxTiledWidth`): row;
/// - t(row) read only as the first operand of mm(t(row), row): a reduction [K, M];
/// - sum_to_size(row [N, C], [1, C] or [C]): a reduction;
/// - another elementwise op on row (Bool masks among them) and invariant inputs: row (run per tile as a
///   one-node kernel of the CPU fusion backend, or by ATen when the backend has none:
///   ATen's call costs more than the op on a tile);
/// - narrow and cat along the columns of rows: row (per tile, each input's columns
///   copied into the output's, row by row);
/// - nodes that read no row value stay outside (t(W), expand(b)); a region reads their
///   outputs whole, or by rows (a stride-0 expand).
/// A stage can hold several regions, run in order: a node reading a reduction (complete
/// only after its region ran: `t(dW)` of a double backward) or a value made outside
/// from a region's value goes to a later region, so each region is convex (no node
/// outside it both reads a region value and feeds the region). At run time, inputs that
/// do not match the recorded types, a kernel that cannot be planned, or strides LIBXSMM
/// cannot read make the region run its nodes one by one as the untiled closure would
/// (`TiledRegionRunner::run_untiled`: same results, same errors).

#include <stagejit/closure/plan.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/small_gemm.hpp>

#include <algorithm>
#include <cstddef>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace stagejit::closure {

/// The nodes of one stage that run as a row-tiled region (Note [Row-tiled regions]).
struct TiledRegion {
  int64_t rows = 0;                  ///< N: the rows every row value has
  at::ScalarType dtype = at::kFloat;  ///< float or double
  std::vector<ir::Node*> nodes;      ///< in stage order
  std::vector<ir::Value*> inputs;    ///< distinct values read from outside (Function inputs)
  std::vector<ir::Value*> outputs;   ///< distinct region values read outside (Function outputs)
  /// The nodes summed over the rows (reduction products `mm(t(X), Y)`, column sums):
  /// decided by the planner from how the node reads its operands, not from the output's
  /// shape, which cannot tell `[N, M]` from `[C, M]` when C = N.
  std::unordered_set<const ir::Node*> reductions;

  std::ptrdiff_t input_index(const ir::Value* v) const {
    auto it = std::find(inputs.begin(), inputs.end(), v);
    return it == inputs.end() ? -1 : it - inputs.begin();
  }
  std::ptrdiff_t output_index(const ir::Value* v) const {
    auto it = std::find(outputs.begin(), outputs.end(), v);
    return it == outputs.end() ? -1 : it - outputs.begin();
  }
};

namespace tiling {

/// Whether `n` is a product of two matrices: `mm`, or `matmul` of two 2-D operands (what
/// `matmul(h, t(W))` traces to in a forward stage); the runner runs both as `mm`.
inline bool is_matrix_product(const ir::Node& n) {
  const ir::Op* op = n.get_if<ir::Op>();
  if (!op || n.inputs().size() != 2) return false;
  if (op->id() == OpId::mm) return true;
  if (op->id() != OpId::matmul) return false;
  for (const ir::Value* v : n.inputs()) {
    const ir::TensorType* t = v->tensor_type();
    if (!t || t->sizes.size() != 2) return false;
  }
  return true;
}

/// The most arguments (inputs and outputs) of a fusion group inside a region: the
/// runner hands a tile's to the kernel in a fixed array.
inline constexpr std::size_t kMaxTiledKernelArgs = 64;
/// The widest product a region tiles: K and M of a row product, K and M of a reduction.
inline constexpr int64_t kMaxTiledWidth = 128;

// How a region reads a value: Row ([N, C], tiled by rows), RowT (t of a row value of
// the region: read as that value), Col ([K, N] from outside, tiled by columns: a
// transposed row), Reduction (summed over the rows; complete after the region),
// Invariant (read whole by every tile).
enum class RowLayout : uint8_t { Bad, Invariant, Row, RowT, Col, Reduction };

inline bool attr_is_one(const Attributes& attrs, std::string_view name) {
  const Scalar* s = ir::find_attribute(attrs, name);
  if (!s) return true;
  if (auto* d = std::get_if<double>(s)) return *d == 1.0;
  if (auto* i = std::get_if<int64_t>(s)) return *i == 1;
  return false;
}

}  // namespace tiling

namespace tiling {

/// The row-tiled regions of a stage whose row values have `N` rows (see
/// `find_row_tiled_regions`, which chooses N).
inline std::vector<TiledRegion> row_tiled_regions_with_rows(const std::vector<ir::Node*>& nodes, int64_t N,
                                                            int64_t max_width) {
  using tiling::RowLayout;
  std::optional<at::ScalarType> dtype;
  for (ir::Node* n : nodes)
    if (n->is<ir::FusionGroup>() || tiling::is_matrix_product(*n))
      if (auto* t = n->outputs().empty() ? nullptr : n->outputs()[0]->tensor_type(); t && t->sizes.size() == 2 && t->sizes[0] == N) {
        dtype = t->dtype;
        break;
      }
  if (!dtype || (*dtype != at::kFloat && *dtype != at::kDouble)) return {};

  // Region nodes: their level (the region they belong to) and their outputs' layouts.
  // Nodes outside that read region values get a taint level: the highest level they
  // depend on; a region node reading them must sit at a higher level (convexity).
  std::unordered_map<const ir::Value*, RowLayout> layout;
  std::unordered_map<const ir::Node*, int> level, taint, floating_need;
  const int kFloating = -1;  // a t(row) whose level its reduction product decides
  auto tensor_of = [](const ir::Value* v) { return v->tensor_type(); };
  auto is_row_type = [&](const ir::TensorType* t) {
    return t && t->sizes.size() == 2 && t->sizes[0] == N && t->dtype == *dtype && t->device.is_cpu();
  };
  // What a product does with its operands, whatever their shapes: a row product mm(A, B)
  // reads its right operand B whole (so does addmm its matrix), and a reduction
  // mm(t(X), Y) reads t(X) by columns. Shapes alone cannot tell these apart when N equals
  // a width: with 32 rows and 32-wide layers, a [32, 32] weight looks like a row value
  // and a t(X) from an earlier stage like one too, and the stage's products ran untiled.
  // `whole_operands` are invariants and `column_operands` (a t() output as the left
  // operand of mm) are read by columns whatever their shape. Either reading is valid for
  // any operand of that shape: B is used whole by every tile's product, and a reduction
  // tiles its contracted dimension.
  std::unordered_set<const ir::Value*> whole_operands, column_operands;
  for (ir::Node* n : nodes) {
    const ir::Op* op = n->get_if<ir::Op>();
    if (!op) continue;
    if (tiling::is_matrix_product(*n)) {
      const ir::Op* a = n->inputs()[0]->node()->get_if<ir::Op>();
      if (a && a->id() == OpId::t)
        column_operands.insert(n->inputs()[0]);
      else
        whole_operands.insert(n->inputs()[1]);
    } else if (op->id() == OpId::addmm && n->inputs().size() == 3) {
      whole_operands.insert(n->inputs()[2]);
    }
  }
  // The layout a region node reads `v` with.
  auto layout_of = [&](const ir::Value* v) -> RowLayout {
    if (auto it = layout.find(v); it != layout.end())
      return it->second == RowLayout::Reduction ? RowLayout::Invariant : it->second;  // complete once its region ran
    const ir::TensorType* t = tensor_of(v);
    if (!t || v->node()->is<ir::Undefined>() || !t->device.is_cpu()) return RowLayout::Bad;
    if (whole_operands.count(v)) return RowLayout::Invariant;
    if (column_operands.count(v) && t->sizes.size() == 2 && t->sizes[1] == N && t->dtype == *dtype)
      return RowLayout::Col;
    if (is_row_type(t)) return RowLayout::Row;
    // A Bool mask of N rows made outside (a comparison an earlier stage saved: the
    // backward of leaky ReLU or softplus): a row only a fusion group may read (classify).
    if (t->dtype == at::kBool && t->sizes.size() == 2 && t->sizes[0] == N && t->device.is_cpu())
      return RowLayout::Row;
    if (t->sizes.size() == 2 && t->sizes[1] == N && t->sizes[0] != N && t->dtype == *dtype) return RowLayout::Col;
    // A vector [C] or a row [1, C] broadcasts along the rows whatever C is (a bias of
    // width N when N rows meet N-wide layers); other shapes holding N are neither rows
    // nor small.
    const bool broadcast_row = t->sizes.size() == 1 || (t->sizes.size() == 2 && t->sizes[0] == 1);
    if (!broadcast_row)
      for (int64_t d : t->sizes)
        if (d == N) return RowLayout::Bad;
    return RowLayout::Invariant;
  };
  auto small = [max_width](int64_t d) { return d >= 1 && d <= max_width; };
  // Whether invariant `v` broadcasts to [N, C] without its own rows (no leading size but 1).
  auto broadcasts_to = [&](const ir::Value* v, int64_t C) {
    const ir::TensorType* t = tensor_of(v);
    if (!t || t->sizes.size() > 2) return false;
    if (t->sizes.size() == 2 && t->sizes[0] != 1) return false;
    return t->sizes.empty() || t->sizes.back() == 1 || t->sizes.back() == C;
  };

  // The layout node `n` would give its outputs in a region, or Bad.
  auto classify = [&](ir::Node* n) -> RowLayout {
    if (n->outputs().empty()) return RowLayout::Bad;
    for (ir::Value* o : n->outputs())
      if (!tensor_of(o)) return RowLayout::Bad;
    std::vector<RowLayout> in;
    for (ir::Value* v : n->inputs()) in.push_back(layout_of(v));
    for (RowLayout l : in)
      if (l == RowLayout::Bad) return RowLayout::Bad;
    const bool all_invariant = std::all_of(in.begin(), in.end(), [](RowLayout l) { return l == RowLayout::Invariant; });
    const ir::TensorType* out = tensor_of(n->outputs()[0]);
    if (auto* fg = n->get_if<ir::FusionGroup>()) {
      if (!fg->subgraph || all_invariant) return RowLayout::Bad;
      // The runner passes a tile's kernel arguments in a fixed array; a larger group (a
      // 16-dimensional Laplacian's backward has one) runs whole, outside the region.
      if (n->inputs().size() + n->outputs().size() > tiling::kMaxTiledKernelArgs) return RowLayout::Bad;
      const int64_t C = out->sizes.size() == 2 ? out->sizes[1] : -1;
      for (ir::Value* o : n->outputs()) {
        // Rows of the region's dtype, or a Bool mask (a comparison that a later group or
        // elementwise op reads: leaky ReLU's forward and backward write one for the nodes
        // after them): its rows are written tile by tile like any other, read inside the
        // region, or written out whole for the outside. (Kept outside, such a group split a
        // critic's stages into regions of one product each, which ran whole:
        // bench/higher_order.md, 2026-12-06.)
        const ir::TensorType* t = tensor_of(o);
        const bool mask = t && t->dtype == at::kBool && t->sizes.size() == 2 && t->sizes[0] == N && t->device.is_cpu();
        if ((!is_row_type(t) && !mask) || t->sizes[1] != C || !t->is_contiguous()) return RowLayout::Bad;
      }
      for (std::size_t i = 0; i < in.size(); ++i) {
        if (in[i] == RowLayout::RowT || in[i] == RowLayout::Col) return RowLayout::Bad;
        const ir::TensorType* t = tensor_of(n->inputs()[i]);
        if (t->dtype != *dtype && !(in[i] == RowLayout::Row && t->dtype == at::kBool)) return RowLayout::Bad;
        if (in[i] == RowLayout::Row && t->sizes[1] != C && t->sizes[1] != 1) return RowLayout::Bad;
        if (in[i] == RowLayout::Invariant && !broadcasts_to(n->inputs()[i], C)) return RowLayout::Bad;
      }
      return RowLayout::Row;
    }
    const ir::Op* op = n->get_if<ir::Op>();
    if (!op || op->id() == OpId::unknown) return RowLayout::Bad;
    const OpDef& def = ops::def(op->id());
    // Rows of another dtype (Bool masks) are read by fusion groups and elementwise ops
    // only: a lone masked_fill(g, mask, 0), ReLU's backward between two products, would
    // otherwise split a region around it (a ReLU critic's whole loss ran its backward's
    // products whole, 2026-12-06).
    for (std::size_t i = 0; i < in.size(); ++i)
      if (in[i] == RowLayout::Row && tensor_of(n->inputs()[i])->dtype != *dtype &&
          !(def.elementwise && tensor_of(n->inputs()[i])->dtype == at::kBool))
        return RowLayout::Bad;
    if (def.side_effects || n->inputs().empty()) return RowLayout::Bad;
    // Nodes reading no row run outside (before the region, or after the region whose
    // reduction they read).
    if (all_invariant) return RowLayout::Bad;
    if (n->outputs().size() != 1) return RowLayout::Bad;
    const Attributes attrs = ::stagejit::detail::to_core_attributes(op->attributes);
    auto size_of = [&](std::size_t i, std::size_t d) { return tensor_of(n->inputs()[i])->sizes[d]; };
    auto matrix = [&](std::size_t i) {  // an invariant product operand
      const ir::TensorType* t = tensor_of(n->inputs()[i]);
      return t->sizes.size() == 2 && t->dtype == *dtype;
    };
    switch (tiling::is_matrix_product(*n) ? OpId::mm : op->id()) {
      case OpId::mm:
        if (in[0] == RowLayout::Row && in[1] == RowLayout::Invariant && matrix(1) && small(size_of(0, 1)) &&
            small(size_of(1, 1)) && is_row_type(out) && out->is_contiguous())
          return RowLayout::Row;
        if ((in[0] == RowLayout::RowT || in[0] == RowLayout::Col) && in[1] == RowLayout::Row && small(size_of(0, 0)) &&
            small(size_of(1, 1)) && tensor_of(n->inputs()[1])->strides[1] == 1 &&
            (tensor_of(n->inputs()[0])->strides[0] == 1 || tensor_of(n->inputs()[0])->strides[1] == 1) &&
            out->is_contiguous() && out->dtype == *dtype)
          return RowLayout::Reduction;
        return RowLayout::Bad;
      case OpId::addmm:
        if (in[0] == RowLayout::Invariant && in[1] == RowLayout::Row && in[2] == RowLayout::Invariant &&
            tiling::attr_is_one(attrs, "beta") && tiling::attr_is_one(attrs, "alpha") && matrix(2) &&
            small(size_of(1, 1)) && small(size_of(2, 1)) && broadcasts_to(n->inputs()[0], size_of(2, 1)) &&
            tensor_of(n->inputs()[0])->dtype == *dtype && is_row_type(out) && out->is_contiguous())
          return RowLayout::Row;
        return RowLayout::Bad;
      case OpId::t: {
        if (in[0] != RowLayout::Row) return RowLayout::Bad;
        // Only as the first operand of reduction products.
        for (const ir::Use& u : n->outputs()[0]->uses()) {
          const ir::Op* uop = u.user->get_if<ir::Op>();
          if (!uop || !tiling::is_matrix_product(*u.user) || u.offset != 0 || u.user->stage() != n->stage())
            return RowLayout::Bad;
        }
        return RowLayout::RowT;
      }
      case OpId::sum_to_size: {
        const Scalar* size = ir::find_attribute(attrs, "size");
        auto* v = size ? std::get_if<std::vector<int64_t>>(size) : nullptr;
        if (in[0] != RowLayout::Row || !v || !out->is_contiguous()) return RowLayout::Bad;
        const int64_t C = size_of(0, 1);
        if ((v->size() == 2 && (*v)[0] == 1 && (*v)[1] == C) || (v->size() == 1 && (*v)[0] == C))
          return RowLayout::Reduction;
        return RowLayout::Bad;
      }
      case OpId::narrow:
      case OpId::cat: {
        // Along the columns: row local (a ColumnCopyStep per tile).
        const Scalar* dim = ir::find_attribute(attrs, "dim");
        auto* d = dim ? std::get_if<int64_t>(dim) : nullptr;
        if (!d || (*d != 1 && *d != -1) || !is_row_type(out)) return RowLayout::Bad;
        for (RowLayout l : in)
          if (l != RowLayout::Row) return RowLayout::Bad;
        return RowLayout::Row;
      }
      default:
        break;
    }
    // ones_like and zeros_like read only their input's shape: row local like an
    // elementwise op. An inner grad call's seed, ones_like(u), left out, split a whole
    // loss's stage at every such call: each later region read the earlier ones' values
    // back whole (a KdV whole loss: three splits in its first stage).
    const bool fill = op->id() == OpId::ones_like || op->id() == OpId::zeros_like;
    if (!(def.elementwise || fill) || !is_row_type(out) || !out->is_contiguous()) return RowLayout::Bad;
    for (std::size_t i = 0; i < in.size(); ++i)
      if (in[i] == RowLayout::RowT || in[i] == RowLayout::Col ||
          (in[i] == RowLayout::Invariant && !broadcasts_to(n->inputs()[i], out->sizes[1])))
        return RowLayout::Bad;
    return RowLayout::Row;
  };

  auto drop = [&](ir::Node* n) { level.erase(n); };
  // The highest taint of the nodes kept in program order so far: each of them waits for
  // the ones before it (Note [Program order of random ops] in closure/plan.hpp), so it
  // carries their taint too. They never join a region (side effects, host functions).
  int chain_carry = -1;
  for (ir::Node* n : nodes) {
    // The lowest level `n` may take, and the highest taint it would carry outside.
    int need = 0, carry = -1;
    const bool ordered = keeps_program_order(*n);
    if (ordered) carry = chain_carry;
    for (ir::Value* v : n->inputs()) {
      const ir::Node* p = v->node();
      if (auto it = level.find(p); it != level.end()) {
        const int l = it->second == kFloating ? 0 : it->second;
        const bool reduction = layout.at(v) == RowLayout::Reduction;
        need = std::max(need, reduction ? l + 1 : l);
        carry = std::max(carry, l);
      } else if (auto tt = taint.find(p); tt != taint.end()) {
        need = std::max(need, tt->second + 1);
        carry = std::max(carry, tt->second);
      }
    }
    RowLayout l = classify(n);
    // A value some product reads whole is not made tile by tile (a reduction's result is
    // whole once its region ran).
    if (l != RowLayout::Reduction)
      for (ir::Value* o : n->outputs())
        if (whole_operands.count(o)) l = RowLayout::Bad;
    if (l == RowLayout::Reduction && layout_of(n->inputs()[0]) == RowLayout::RowT) {
      // A reduction product takes its t(X) into its own region: at least X's level.
      ir::Node* t = n->inputs()[0]->node();
      int& tl = level.at(t);
      if (tl == kFloating) {
        need = std::max(need, floating_need.at(t));
        tl = need;
      } else if (tl < need) {
        l = RowLayout::Bad;  // its t(X) already sits in an earlier region
      } else {
        need = tl;
      }
    }
    if (ordered) {
      chain_carry = std::max(chain_carry, carry);
      l = RowLayout::Bad;
    }
    if (l == RowLayout::Bad) {
      if (carry >= 0) taint[n] = carry;
      continue;
    }
    level[n] = l == RowLayout::RowT ? kFloating : need;
    if (l == RowLayout::RowT) floating_need[n] = need;
    for (ir::Value* o : n->outputs()) layout[o] = l;
  }
  // A t(X) whose reading product stayed outside leaves too (with its products: they
  // read only it and a row, and feed only later regions or the outside).
  for (ir::Node* n : nodes) {
    auto it = level.find(n);
    if (it == level.end() || layout.at(n->outputs()[0]) != RowLayout::RowT) continue;
    bool ok = it->second != kFloating;
    for (const ir::Use& u : n->outputs()[0]->uses()) {
      auto ut = level.find(u.user);
      ok = ok && ut != level.end() && ut->second == it->second;
    }
    if (!ok) {
      for (const ir::Use& u : n->outputs()[0]->uses()) drop(u.user);
      drop(n);
    }
  }
  // Group by level; a region with fewer than two row products or kernels is dropped
  // whole (its nodes read only lower levels and feed only higher ones: still convex).
  int max_level = -1;
  for (auto& [n, l] : level) max_level = std::max(max_level, l);
  std::vector<TiledRegion> regions;
  for (int L = 0; L <= max_level; ++L) {
    TiledRegion region;
    region.rows = N;
    region.dtype = *dtype;
    int work = 0;
    for (ir::Node* n : nodes) {
      auto it = level.find(n);
      if (it == level.end() || it->second != L) continue;
      region.nodes.push_back(n);
      const RowLayout l = layout.at(n->outputs()[0]);
      if (n->is<ir::FusionGroup>()) ++work;
      if (auto* op = n->get_if<ir::Op>(); op && (tiling::is_matrix_product(*n) || op->id() == OpId::addmm) && l == RowLayout::Row)
        ++work;
      if (l == RowLayout::Reduction) region.reductions.insert(n);
    }
    if (work < 2) continue;
    std::unordered_set<const ir::Node*> members(region.nodes.begin(), region.nodes.end());
    for (ir::Node* n : region.nodes) {
      for (ir::Value* v : n->inputs())
        if (!members.count(v->node()) && region.input_index(v) < 0) region.inputs.push_back(v);
      for (ir::Value* o : n->outputs()) {
        bool outside = false;
        for (const ir::Use& u : o->uses()) outside = outside || !members.count(u.user);
        if (outside) region.outputs.push_back(o);
      }
    }
    regions.push_back(std::move(region));
  }
  return regions;
}

}  // namespace tiling

/// Builds the row-tiled regions of a stage (`nodes`: the stage's nodes in order), in
/// an order the stage can run them: region k reads only what regions before it and
/// nodes outside every region make. Empty when none is worth it (a region needs two row
/// products or kernels), no 2-D value has at least `min_rows` rows, or LIBXSMM is not
/// available. `max_width`: the widest K and M of a product a region takes (the runner's
/// default, `tiling::kMaxTiledWidth`). See Note [Row-tiled regions].
inline std::vector<TiledRegion> find_row_tiled_regions(const std::vector<ir::Node*>& nodes, int64_t min_rows,
                                                       int64_t max_width = tiling::kMaxTiledWidth) {
  if (!ops::small_mm_enabled() || nodes.empty()) return {};
  // One row is never tiled: a [1, C] row value reads like a broadcast row.
  min_rows = std::max<int64_t>(min_rows, 2);
  // N, the rows of the row values: the leading sizes of the stage's 2-D tensor outputs are
  // the candidates, the tall ones (kTallRows and more) when there are any. A stage's
  // weight-shaped values (the weight gradients of a backward stage, their transposes) can
  // outnumber its rows: with 50 rows and 128-wide layers the most common leading size was
  // 128 and the stage's [50, 128] x [128, 128] products ran whole. So each of the most
  // common sizes is planned, and a less common one replaces the most common only when its
  // regions hold more row products.
  constexpr int64_t kTallRows = 256;
  constexpr std::size_t kCandidates = 3;
  std::map<int64_t, int> counts;
  for (int64_t floor : {std::max(min_rows, kTallRows), min_rows}) {
    for (ir::Node* n : nodes)
      for (ir::Value* o : n->outputs())
        if (auto* t = o->tensor_type(); t && t->sizes.size() == 2 && t->sizes[0] >= floor) ++counts[t->sizes[0]];
    if (!counts.empty()) break;
  }
  std::vector<std::pair<int, int64_t>> by_count;  // (count, N), most common first
  for (const auto& [n_rows, count] : counts) by_count.emplace_back(count, n_rows);
  std::stable_sort(by_count.begin(), by_count.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  if (by_count.size() > kCandidates) by_count.resize(kCandidates);
  std::vector<TiledRegion> best;
  std::size_t best_products = 0;
  for (std::size_t c = 0; c < by_count.size(); ++c) {
    std::vector<TiledRegion> regions = tiling::row_tiled_regions_with_rows(nodes, by_count[c].second, max_width);
    std::size_t products = 0;
    for (const TiledRegion& r : regions)
      for (const ir::Node* n : r.nodes) {
        const ir::Op* op = n->get_if<ir::Op>();
        if (!r.reductions.count(n) && (tiling::is_matrix_product(*n) || (op && op->id() == OpId::addmm))) ++products;
      }
    if (c == 0 || products > best_products) {
      best = std::move(regions);
      best_products = products;
    }
  }
  return best;
}

}  // namespace stagejit::closure
