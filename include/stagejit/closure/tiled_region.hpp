#pragma once
/// \file
/// The runner of row-tiled regions (`TiledRegionRunner`): the Function that runs a
/// region planned by closure/tiled_plan.hpp tile by tile. Note [Row-tiled regions]
/// (closure/tiled_plan.hpp) says what a region is, how it runs and which nodes form one;
/// its part on the runner's results:
///
/// Results equal the untiled stage up to summation order and rounding: products of a
/// tile are the same LIBXSMM kernels on fewer rows; a reduction product is one product
/// per tile, each tile's added to the sum of the ones before by the GEMM itself (beta =
/// 1), as one product over all rows accumulates (the tiles' blocks in another order); a
/// column sum is a product with a row of ones per tile, the tiles' sums added in double
/// (at least as accurate as at::sum's cascade); a lone
/// elementwise op runs the fusion backend's formula (its tanh, exp) instead of ATen's.

#include <stagejit/autograd/variable.hpp>
#include <stagejit/closure/plan.hpp>
#include <stagejit/closure/tiled_plan.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/small_gemm.hpp>
#include <stagejit/passes/graph_fuser.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <chrono>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

namespace stagejit::closure {

namespace tiling {

// The kinds of region steps.
struct FusedStep {
  std::shared_ptr<const fusion::FusedGroup> group;  // for its subgraph and name
  std::shared_ptr<const ir::Graph> subgraph;
  std::string name;
  int64_t cols = 0;  // C of the iteration shape [rows, C]
};
struct RowMmStep {
  bool has_bias = false;  // addmm: input 0 is the bias
};
struct ReduceMmStep {};
struct ColSumStep {};
struct RowOpStep {
  const OpDef* op = nullptr;
  Attributes attrs;
  /// An elementwise op the fuser left alone (nothing to fuse it with): the same op as a
  /// one-node kernel, run instead of ATen's per-tile call when the CPU backend compiles it.
  std::optional<FusedStep> alone;
};

/// narrow or cat along the columns: each piece copies `cols` columns of input `input`
/// from column `src_col` to the output's column `dst_col`.
struct ColumnCopyStep {
  struct Piece {
    std::size_t input = 0;
    int64_t src_col = 0, dst_col = 0, cols = 0;
  };
  std::vector<Piece> pieces;
};

// The kernel form of a step: its fusion group, or a lone elementwise op's one-node group.
template <class Kind>
const FusedStep* fused_form(const Kind& kind) {
  if (auto* f = std::get_if<FusedStep>(&kind)) return f;
  if (auto* r = std::get_if<RowOpStep>(&kind); r && r->alone) return &*r->alone;
  return nullptr;
}

}  // namespace tiling

/// Runs a `TiledRegion` (Note [Row-tiled regions]). Built once per stage closure; `run`
/// is thread-safe.
class TiledRegionRunner {
 public:
  /// `region`: from `find_row_tiled_regions`; `tile_rows`: rows per tile (> 0);
  /// `group_names`: the printed name of each FusionGroup node, by node.
  TiledRegionRunner(TiledRegion region, int64_t tile_rows,
                    const std::unordered_map<const ir::Node*, std::string>& group_names)
      : region_(std::move(region)), tile_(tile_rows) {
    STAGEJIT_CHECK_AS(CompileError, tile_ > 0, "tiled region: tile_rows must be > 0, got ", tile_);
    // Values: inputs first, then every node output.
    auto add_value = [&](ir::Value* v, Storage st, int64_t index) {
      const ir::TensorType* t = v->tensor_type();
      Value val;
      val.ir = v;
      val.storage = st;
      val.index = index;
      if (t) {
        val.sizes.assign(t->sizes.begin(), t->sizes.end());
        val.dtype = t->dtype;
        val.elem = int64_t(c10::elementSize(t->dtype));
      }
      val.row = t && t->sizes.size() == 2 && t->sizes[0] == region_.rows;
      if (val.row) val.cols = t->sizes[1];
      index_of_[v] = values_.size();
      values_.push_back(std::move(val));
    };
    for (std::size_t i = 0; i < region_.inputs.size(); ++i) add_value(region_.inputs[i], Storage::Input, int64_t(i));
    for (ir::Node* n : region_.nodes) {
      Step step;
      step.node = n;
      const ir::Op* op = n->get_if<ir::Op>();
      if (auto* fg = n->get_if<ir::FusionGroup>()) {
        auto it = group_names.find(n);
        std::string name = it == group_names.end() ? "fusion_group" : it->second;
        auto group = std::make_shared<const fusion::FusedGroup>(fg->subgraph, name);
        step.kind = tiling::FusedStep{group, fg->subgraph, name, n->outputs()[0]->tensor_type()->sizes[1]};
      } else if (tiling::is_matrix_product(*n)) {
        if (region_.reductions.count(n))
          step.kind = tiling::ReduceMmStep{};
        else
          step.kind = tiling::RowMmStep{false};
      } else if (op->id() == OpId::addmm) {
        step.kind = tiling::RowMmStep{true};
      } else if (op->id() == OpId::sum_to_size) {
        step.kind = tiling::ColSumStep{};
      } else if (op->id() == OpId::narrow || op->id() == OpId::cat) {
        // Along the columns (find_row_tiled_regions admits no other): 2-D row inputs.
        tiling::ColumnCopyStep copy;
        auto cols_of = [&](ir::Value* v) { return v->tensor_type()->sizes.at(1); };
        if (op->id() == OpId::narrow) {
          const Attributes attrs = ::stagejit::detail::to_core_attributes(op->attributes);
          const Scalar* start = ir::find_attribute(attrs, "start");
          const Scalar* length = ir::find_attribute(attrs, "length");
          STAGEJIT_CHECK_AS(CompileError, start && length && std::holds_alternative<int64_t>(*start) &&
                                              std::holds_alternative<int64_t>(*length),
                            "tiled region: narrow %", n->outputs()[0]->id(), " without integer start and length");
          const int64_t cols = cols_of(n->inputs()[0]), len = std::get<int64_t>(*length);
          int64_t first = std::get<int64_t>(*start);
          if (first < 0) first += cols;
          STAGEJIT_CHECK_AS(CompileError, first >= 0 && len >= 0 && first + len <= cols, "tiled region: narrow %",
                            n->outputs()[0]->id(), " takes columns [", first, ", ", first + len, ") of ", cols);
          copy.pieces.push_back({0, first, 0, len});
        } else {
          int64_t offset = 0;
          for (std::size_t k = 0; k < n->inputs().size(); ++k) {
            copy.pieces.push_back({k, 0, offset, cols_of(n->inputs()[k])});
            offset += cols_of(n->inputs()[k]);
          }
        }
        step.kind = std::move(copy);
      } else if (op->id() == OpId::t) {
        step.kind = std::monostate{};  // a view the reduction product reads through
      } else {
        tiling::RowOpStep row_op{&ops::def(op->id()), ::stagejit::detail::to_core_attributes(op->attributes), {}};
        const ir::TensorType* out = n->outputs()[0]->tensor_type();
        // Inputs of the region's dtype, or Bool masks (masked_fill's).
        bool kernel_dtypes = out && out->dtype == region_.dtype;
        for (ir::Value* v : n->inputs())
          kernel_dtypes = kernel_dtypes && v->tensor_type() &&
                       (v->tensor_type()->dtype == region_.dtype || v->tensor_type()->dtype == at::kBool);
        if (passes::detail::is_fusable(*n) && kernel_dtypes && out->sizes.size() == 2 && out->sizes[0] == region_.rows) {
          // Per tile, ATen's call costs more than the op (from_blob, dispatch, a copy).
          auto sub = std::make_shared<ir::Graph>();
          ir::ValueList args;
          for (ir::Value* v : n->inputs()) args.push_back(sub->add_input(v->type(), 0));
          ir::Node* c = sub->append(sub->create(n->kind(), args, {n->outputs()[0]->type()}));
          sub->register_output(c->output(), 0);
          std::string name = "tiled " + n->describe() + " %" + std::to_string(n->outputs()[0]->id());
          auto group = std::make_shared<const fusion::FusedGroup>(sub, name);
          row_op.alone = tiling::FusedStep{group, sub, name, out->sizes[1]};
        }
        step.kind = std::move(row_op);
      }
      for (ir::Value* o : n->outputs()) add_value(o, Storage::Scratch, -1);
      for (ir::Value* v : n->inputs()) step.in.push_back(index_of_.at(v));
      for (ir::Value* o : n->outputs()) step.out.push_back(index_of_.at(o));
      if (std::holds_alternative<std::monostate>(step.kind)) {
        // t(X): the reduction products read X itself.
        values_[step.out[0]].storage = Storage::Alias;
        values_[step.out[0]].index = int64_t(step.in[0]);
      }
      steps_.push_back(std::move(step));
    }
    // Region outputs get full tensors; reductions too.
    for (std::size_t j = 0; j < region_.outputs.size(); ++j) {
      Value& v = values_[index_of_.at(region_.outputs[j])];
      STAGEJIT_CHECK_AS(CompileError, v.storage != Storage::Alias, "tiled region: a transposed row is read outside");
      if (v.storage == Storage::Scratch) {
        v.storage = Storage::Output;
        v.index = int64_t(j);
      }
    }
    for (const Step& st : steps_)
      if (std::holds_alternative<tiling::ReduceMmStep>(st.kind) || std::holds_alternative<tiling::ColSumStep>(st.kind)) {
        Value& v = values_[st.out[0]];
        if (v.storage == Storage::Scratch) {  // a reduction nobody reads: still computed
          v.storage = Storage::Reduction;
          v.index = int64_t(reductions_++);
        }
      }
    // Scratch slots: reuse a slot once its value is dead (after its last reading step).
    std::vector<std::size_t> last_use(values_.size(), 0);
    for (std::size_t i = 0; i < steps_.size(); ++i)
      for (std::size_t v : steps_[i].in) {
        std::size_t target = values_[v].storage == Storage::Alias ? std::size_t(values_[v].index) : v;
        last_use[target] = i;
      }
    std::vector<std::pair<int64_t, std::size_t>> free_slots;  // (cols, slot)
    std::vector<std::vector<std::size_t>> dies_after(steps_.size());
    for (std::size_t i = 0; i < steps_.size(); ++i) {
      for (std::size_t o : steps_[i].out) {
        Value& v = values_[o];
        if (v.storage != Storage::Scratch) continue;
        STAGEJIT_CHECK_AS(CompileError, v.row, "tiled region: scratch value %", v.ir->id(), " is not a row value");
        auto it = std::find_if(free_slots.begin(), free_slots.end(), [&](auto& f) { return f.first == v.cols; });
        if (it != free_slots.end()) {
          v.index = int64_t(it->second);
          free_slots.erase(it);
        } else {
          v.index = int64_t(slot_cols_.size());
          slot_cols_.push_back(v.cols);
        }
        dies_after[std::max(i, last_use[o])].push_back(o);
      }
      for (std::size_t o : dies_after[i]) free_slots.emplace_back(values_[o].cols, std::size_t(values_[o].index));
    }
  }

  const TiledRegion& region() const noexcept { return region_; }
  int64_t tile_rows() const noexcept { return tile_; }
  /// Scratch buffers of one call ([tile_rows, C] each).
  std::size_t num_scratch_slots() const noexcept { return slot_cols_.size(); }

  /// The region's steps by how a tile runs them: "kernel" (fusion groups, and lone
  /// elementwise ops as one-node kernels), "product" (mm/addmm by rows), "reduction"
  /// (t(X) @ Y and column sums), "copy" (narrow/cat along the columns), "aten" (ATen's
  /// op on the tile's rows). Before the first tiled `run` a lone op counts as a kernel
  /// when it has a kernel form; after it (on the same thread, or one synchronised with
  /// it), as a kernel only when the CPU backend built one.
  std::map<std::string, std::size_t> step_counts() const {
    std::map<std::string, std::size_t> counts;
    const bool planned = kernels_.size() == steps_.size();
    for (std::size_t i = 0; i < steps_.size(); ++i) {
      const char* kind = std::visit(
          Overloaded{[](const std::monostate&) { return ""; },
                     [](const tiling::FusedStep&) { return "kernel"; },
                     [](const tiling::RowMmStep&) { return "product"; },
                     [](const tiling::ReduceMmStep&) { return "reduction"; },
                     [](const tiling::ColSumStep&) { return "reduction"; },
                     [](const tiling::ColumnCopyStep&) { return "copy"; },
                     [&](const tiling::RowOpStep& op) {
                       return op.alone && (!planned || kernels_[i]) ? "kernel" : "aten";
                     }},
          steps_[i].kind);
      if (*kind) ++counts[kind];
    }
    return counts;
  }

  /// Runs the region on `inputs` (one per `region().inputs`), returning one Variable per
  /// `region().outputs`. Falls back to running the nodes one by one when the inputs do
  /// not match the recorded types (Note [Row-tiled regions]).
  variable_list run(const variable_list& inputs) const {
    std::vector<at::Tensor> in;
    in.reserve(inputs.size());
    for (const auto& v : inputs) in.push_back(v.data());
    if (!inputs_match(in)) return run_untiled(inputs);
    if (region_.dtype == at::kFloat) return run_tiled<float>(in, inputs);
    return run_tiled<double>(in, inputs);
  }

  /// The region's nodes one by one on whole tensors, as the untiled closure runs them
  /// (what `run` falls back to, and the reference its tiles must equal). Throws what
  /// the nodes throw.
  variable_list run_untiled(const variable_list& inputs) const {
    std::vector<Variable> vals(values_.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) vals[i] = inputs[i];
    for (const Step& st : steps_) {
      variable_list args;
      for (std::size_t v : st.in) args.push_back(vals[v]);
      variable_list outs;
      if (auto* f = std::get_if<tiling::FusedStep>(&st.kind)) {
        std::vector<at::Tensor> tensors;
        for (const auto& a : args) tensors.push_back(a.data());
        for (auto& t : f->group->run(tensors)) outs.emplace_back(std::move(t));
      } else {
        const ir::Op* op = st.node->get_if<ir::Op>();
        outs = ops::apply(ops::def(op->id()), args, ::stagejit::detail::to_core_attributes(op->attributes));
      }
      for (std::size_t k = 0; k < st.out.size() && k < outs.size(); ++k) vals[st.out[k]] = outs[k];
    }
    variable_list result;
    for (ir::Value* o : region_.outputs) result.push_back(vals[index_of_.at(o)]);
    return result;
  }

 private:
  enum class Storage : uint8_t { Input, Scratch, Output, Reduction, Alias };
  struct Value {
    ir::Value* ir = nullptr;
    Storage storage = Storage::Scratch;
    int64_t index = -1;  // input, per-call, slot, output or reduction index; Alias: the value
    bool row = false;
    int64_t cols = 0;
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::kFloat;
    int64_t elem = 0;  // bytes per element
  };
  struct Step {
    ir::Node* node = nullptr;
    std::variant<std::monostate, tiling::FusedStep, tiling::RowMmStep, tiling::ReduceMmStep, tiling::ColSumStep,
                 tiling::RowOpStep, tiling::ColumnCopyStep>
        kind;
    std::vector<std::size_t> in, out;  // value indices
  };

  bool inputs_match(const std::vector<at::Tensor>& in) const {
    if (in.size() != region_.inputs.size()) return false;
    for (std::size_t i = 0; i < in.size(); ++i) {
      const at::Tensor& t = in[i];
      const Value& v = values_[i];
      if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || t.sizes() != at::IntArrayRef(v.sizes))
        return false;
      if (t.scalar_type() != v.dtype) return false;
      if (t.is_conj() || t.is_neg() || t._is_zerotensor()) return false;
    }
    return true;
  }

  // A row value's rows [r0, r0 + rows) as a kernel argument (sizes set by the caller).
  struct View {
    char* data = nullptr;
    int64_t s0 = 0, s1 = 0;  // element strides
  };

  // Writes `t` broadcast to [rows, C] (as `t.expand({rows, C})` reads it) into the dense
  // block `dst` of t's element type: a 0-d tensor, [C], [1] or [1, C] is one row repeated; a
  // [R, C] tensor whose rows are alike (stride 0) too; any other [R, C] gives its first
  // `rows` rows. Raw copies, where narrow, expand and contiguous cost a dispatch and a
  // tensor each.
  static void fill_broadcast_block(char* dst, const at::Tensor& t, int64_t rows, int64_t C) {
    STAGEJIT_CHECK(t.dim() <= 2, "tiled region: a broadcast kernel input of ", t.dim(),
                   " dimensions (expected at most 2)");
    const int64_t esz = static_cast<int64_t>(t.element_size());
    const char* src = static_cast<const char*>(t.data_ptr());
    const int64_t sc = t.dim() == 0 || t.size(-1) == 1 ? 0 : t.stride(-1);
    STAGEJIT_CHECK(sc == 0 || t.size(-1) == C, "tiled region: a broadcast kernel input of ", t.size(-1),
                   " columns for a kernel of ", C);
    int64_t sr = 0;
    if (t.dim() == 2 && t.size(0) != 1 && t.stride(0) != 0) {
      STAGEJIT_CHECK(t.size(0) >= rows, "tiled region: a kernel input of ", t.size(0),
                     " rows read as a block of ", rows);
      sr = t.stride(0);
    }
    const int64_t row_bytes = C * esz;
    const int64_t first = sr == 0 ? 1 : rows;  // rows to read from t
    for (int64_t r = 0; r < first; ++r) {
      char* out = dst + r * row_bytes;
      const char* in = src + r * sr * esz;
      if (sc == 1) {
        std::memcpy(out, in, std::size_t(row_bytes));
      } else {
        for (int64_t c = 0; c < C; ++c) std::memcpy(out + c * esz, in + c * sc * esz, std::size_t(esz));
      }
    }
    for (int64_t r = first; r < rows; ++r) std::memcpy(dst + r * row_bytes, dst, std::size_t(row_bytes));
  }

  // Runs the tiles at element type T (float or double); defined after the class, and
  // instantiated once in the compiled library (extern template below).
  template <class T>
  variable_list run_tiled(const std::vector<at::Tensor>& in, const variable_list& inputs) const;

  // One fused step's kernel arguments in this call, laid out once before the tile loop:
  // each tile only moves the data pointers and sets the row count.
  struct FusedCall {
    const fusion::CpuKernel* kernel = nullptr;
    int64_t cols = 0;
    bool flat = false;       // one merged dimension (every argument dense, or C = 1)
    std::size_t first = 0;   // its arguments: FusedArgs entries [first, first + count)
    std::size_t count = 0;
  };
  // The kernel arguments of every fused step of one call, in two allocations for the call
  // (a stage of one tile runs each step once: per-step buffers would cost more than the
  // step's bookkeeping saves). `args` are handed to the kernel; a tile rewrites their data
  // pointers and row counts, the rest is set once.
  struct FusedArgs {
    std::vector<fusion::TensorArg> args;
    std::vector<std::pair<char*, int64_t>> at_row0;  // data pointer at row 0, bytes per row (0: not a row value)
  };

  // Appends the arguments of fused step `st` (kernel `kernel`, iteration shape [rows, C])
  // for this call to `out`. `base`: where each value lives; `dense_in[k]` (one per input of
  // the step): a dense [tile_rows, C] block that replaces input k (or null).
  FusedCall plan_fused_call(const Step& st, const tiling::FusedStep& f, const fusion::CpuKernel& kernel,
                            const std::vector<View>& base, const char* const* dense_in,
                            FusedArgs& out) const {
    const int64_t C = f.cols;
    const std::size_t n = st.in.size() + st.out.size();
    STAGEJIT_CHECK(n <= tiling::kMaxTiledKernelArgs, "tiled region: ", f.name, " has more than ",
                   tiling::kMaxTiledKernelArgs, " arguments (find_row_tiled_regions leaves such groups out)");
    FusedCall call;
    call.kernel = &kernel;
    call.cols = C;
    call.first = out.args.size();
    call.count = n;
    out.args.resize(call.first + n);
    out.at_row0.resize(call.first + n, {nullptr, 0});
    bool dense = true;
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t v = k < st.in.size() ? st.in[k] : st.out[k - st.in.size()];
      const Value& val = values_[v];
      fusion::TensorArg& a = out.args[call.first + k];
      auto& [data, row_bytes] = out.at_row0[call.first + k];
      if (k < st.in.size() && dense_in[k]) {
        data = const_cast<char*>(dense_in[k]);
        a.strides[0] = C;
        a.strides[1] = 1;
        continue;
      }
      const View x = base[v];
      data = x.data;
      if (val.row && val.storage != Storage::Scratch) row_bytes = x.s0 * val.elem;
      int64_t s0 = x.s0, s1 = x.s1;
      if (!val.row) {  // broadcast invariant: [C], [1, C], [1, 1], [1] or a 0-d tensor
        s0 = 0;
        const int64_t last = val.sizes.empty() ? 1 : val.sizes.back();
        s1 = last == 1 ? 0 : x.s1;
      } else if (val.cols == 1 && C != 1) {
        s1 = 0;
      }
      a.strides[0] = s0;
      a.strides[1] = s1;
      dense = dense && s1 == 1 && s0 == C;
    }
    call.flat = dense || C == 1;
    for (std::size_t k = 0; k < n; ++k) {
      fusion::TensorArg& a = out.args[call.first + k];
      if (call.flat)
        a.strides[0] = C == 1 ? a.strides[0] : 1;
      else
        a.sizes[1] = C;
    }
    return call;
  }

  // One fused kernel on rows [r0, r0 + rows): the iteration shape [rows, C], merged to
  // one dimension when every argument is dense.
  static void run_fused_tile(const FusedCall& call, FusedArgs& fa, int64_t rows, int64_t r0) {
    const int64_t C = call.cols;
    fusion::TensorArg* args = fa.args.data() + call.first;
    for (std::size_t k = 0; k < call.count; ++k) {
      const auto [data, row_bytes] = fa.at_row0[call.first + k];
      args[k].data = data + r0 * row_bytes;
      args[k].sizes[0] = call.flat ? rows * C : rows;
    }
    call.kernel->entry_fn()(0, rows * C, call.flat ? 1 : 2, args);
  }

  // The CPU kernel of every fused step (null entries for other steps), planned on the
  // first call from tensors shaped as a tile; empty when some group cannot use a kernel.
  const std::vector<std::shared_ptr<const fusion::CpuKernel>>& kernels_for(
      const std::vector<at::Tensor>& in) const {
    // Planned once; a call made while a kernel is still being compiled (fusion::
    // waits_for_kernels) runs the region untiled and plans again next time.
    std::lock_guard<std::mutex> lock(kernels_mutex_);
    if (kernels_planned_) return kernels_;
    static const std::vector<std::shared_ptr<const fusion::CpuKernel>> not_yet;
    bool deferred = false;
    [&] {
      std::vector<std::shared_ptr<const fusion::CpuKernel>> ks(steps_.size());
      const auto options = at::TensorOptions().dtype(region_.dtype).device(at::kCPU);
      for (std::size_t i = 0; i < steps_.size(); ++i) {
        const tiling::FusedStep* f = tiling::fused_form(steps_[i].kind);
        if (!f) continue;
        // A lone op without a kernel runs through ATen; a fusion group without one makes
        // the whole region run untiled.
        const bool optional = std::holds_alternative<tiling::RowOpStep>(steps_[i].kind);
        std::vector<at::Tensor> sample;
        for (std::size_t v : steps_[i].in) {
          const Value& val = values_[v];
          if (val.row) {
            // A row's own dtype: a Bool mask read by a group is Bool in its kernel too.
            sample.push_back(at::empty({tile_, val.cols}, options.dtype(val.dtype)));
          } else {
            sample.push_back(in[std::size_t(val.index)]);
          }
        }
        fusion::detail::GroupPlan plan;
        try {
          plan = fusion::detail::plan_group(*f->subgraph, ir::to_string(*f->subgraph), sample, {}, f->name,
                                            /*may_defer=*/true);
          if (plan.pending.valid()) {
            if (plan.pending.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
              deferred = true;
              return;
            }
            plan.kernel = plan.pending.get();
          }
        } catch (const Error&) {
          if (optional) continue;
          return;
        }
        bool usable = plan.kernel && plan.fallback.empty() && plan.shape == std::vector<int64_t>{tile_, f->cols};
        // Each output in its value's dtype (a Bool mask among the region's rows).
        usable = usable && plan.output_dtypes.size() == steps_[i].out.size();
        for (std::size_t k = 0; usable && k < plan.output_dtypes.size(); ++k)
          usable = plan.output_dtypes[k] == values_[steps_[i].out[k]].dtype;
        if (!usable && optional) continue;
        if (!usable) return;
        ks[i] = plan.kernel;
      }
      kernels_ = std::move(ks);
    }();
    if (deferred) return not_yet;
    kernels_planned_ = true;
    return kernels_;
  }

  TiledRegion region_;
  int64_t tile_;
  std::vector<Value> values_;
  std::unordered_map<const ir::Value*, std::size_t> index_of_;
  std::vector<Step> steps_;
  std::vector<int64_t> slot_cols_;
  std::size_t reductions_ = 0;
  mutable std::mutex kernels_mutex_;
  mutable bool kernels_planned_ = false;
  mutable std::vector<std::shared_ptr<const fusion::CpuKernel>> kernels_;
};

template <class T>
variable_list TiledRegionRunner::run_tiled(const std::vector<at::Tensor>& in, const variable_list& inputs) const {
  const int64_t N = region_.rows;
  const auto options = at::TensorOptions().dtype(region_.dtype).device(at::kCPU);
  // Once per call: the outputs and the scratch buffers.
  // A product's right operand [K, M] as the GEMM reads it (rows of unit stride): the
  // input itself, or a dense copy in the scratch allocation below (a transposed weight).
  struct ProductOperand {
    const T* data = nullptr;
    int64_t K = 0, M = 0, s0 = 0;
  };
  std::vector<ProductOperand> operand_b(values_.size());
  c10::SmallVector<std::size_t, 8> transposed_b;  // values whose operand is copied
  auto tensor_of = [&](std::size_t v) -> const at::Tensor& { return in[std::size_t(values_[v].index)]; };
  // Every output and reduction result is allocated once, whole; row outputs are
  // filled tile by tile, reductions at the end.
  std::vector<at::Tensor> outputs(region_.outputs.size());
  for (std::size_t j = 0; j < outputs.size(); ++j) {
    const Value& val = values_[index_of_.at(region_.outputs[j])];
    outputs[j] = at::empty(val.sizes, options.dtype(val.dtype));
  }
  std::vector<at::Tensor> reductions(reductions_);
  auto full_of = [&](std::size_t v) -> at::Tensor {
    const Value& val = values_[v];
    switch (val.storage) {
      case Storage::Input: return tensor_of(v);
      case Storage::Output: return outputs[std::size_t(val.index)];
      case Storage::Reduction: return reductions[std::size_t(val.index)];
      default: return {};
    }
  };
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    const Step& st = steps_[i];
    if (std::holds_alternative<tiling::ReduceMmStep>(st.kind) || std::holds_alternative<tiling::ColSumStep>(st.kind)) {
      const Value& o = values_[st.out[0]];
      if (o.storage == Storage::Reduction) reductions[std::size_t(o.index)] = at::empty(o.sizes, options);
    }
    if (auto* mm = std::get_if<tiling::RowMmStep>(&st.kind)) {
      const at::Tensor& b = tensor_of(st.in[mm->has_bias ? 2 : 1]);
      const std::size_t v = st.in[mm->has_bias ? 2 : 1];
      operand_b[v] = {b.data_ptr<T>(), b.size(0), b.size(1), b.stride(0)};
      if (b.stride(1) != 1 && std::find(transposed_b.begin(), transposed_b.end(), v) == transposed_b.end())
        transposed_b.push_back(v);
    }
  }
  // Kernels of the fused steps, planned once per region.
  const std::vector<std::shared_ptr<const fusion::CpuKernel>>& kernels = kernels_for(in);
  if (kernels.empty()) return run_untiled(inputs);

  // Kernel inputs that every tile sees alike (a broadcast bias, a row of an expand with
  // stride 0) become one dense [tile_rows, C] block per call, so that every argument of
  // such a kernel is dense and it runs as one long vector loop instead of row by row; a
  // product's bias becomes one too, copied into the product's output before each tile.
  // `dense_in` holds, per fused step, one entry per input (from `dense_first[i]`): the
  // input's block, or null.
  struct BlockRequest {
    at::Tensor tensor;
    int64_t cols;
    const char** slot;  // where the block's address goes
  };
  std::vector<const char*> dense_in;
  std::vector<std::size_t> dense_first(steps_.size(), 0);
  std::vector<const char*> bias_block(steps_.size(), nullptr);
  c10::SmallVector<BlockRequest, 16> requests;
  {
    std::size_t n = 0;
    for (std::size_t i = 0; i < steps_.size(); ++i)
      if (tiling::fused_form(steps_[i].kind) && kernels[i]) n += steps_[i].in.size();
    dense_in.assign(n, nullptr);
    n = 0;
    for (std::size_t i = 0; i < steps_.size(); ++i) {
      const Step& st = steps_[i];
      if (const tiling::FusedStep* f = tiling::fused_form(st.kind); f && kernels[i]) {
        dense_first[i] = n;
        for (std::size_t k = 0; k < st.in.size(); ++k) {
          const Value& val = values_[st.in[k]];
          if (val.storage != Storage::Input) continue;
          const at::Tensor& t = in[std::size_t(val.index)];
          const int64_t s0 = t.dim() > 1 ? t.stride(0) : 0;
          if (!val.row || (s0 == 0 && val.cols == f->cols)) requests.push_back({t, f->cols, &dense_in[n + k]});
        }
        n += st.in.size();
      } else if (auto* mm = std::get_if<tiling::RowMmStep>(&st.kind); mm && mm->has_bias) {
        // The bias as one row: [M] or [1, M] as it is, any other shape flattened.
        const at::Tensor& bias = tensor_of(st.in[0]);
        const bool row = bias.dim() == 1 || (bias.dim() == 2 && bias.size(0) == 1);
        requests.push_back({row ? bias : bias.reshape({-1}), tensor_of(st.in[2]).size(1), &bias_block[i]});
      }
    }
  }
  // The scratch slots and the blocks, carved out of one allocation (64-byte aligned
  // each) of a size the host cache serves again call after call, where a few dozen small
  // ones left glibc's heap top to be trimmed and faulted in again on every call (a
  // 500-point PINN step in double spent 7 % of its time in page faults).
  c10::SmallVector<char*, 16> slots;
  at::Tensor scratch;
  {
    constexpr int64_t align = 64;
    auto aligned = [](int64_t bytes) { return (bytes + align - 1) / align * align; };
    int64_t total = 0;
    for (int64_t c : slot_cols_) total += aligned(tile_ * c * int64_t(sizeof(T)));
    for (const auto& r : requests) total += aligned(tile_ * r.cols * int64_t(r.tensor.element_size()));
    for (std::size_t v : transposed_b) total += aligned(operand_b[v].K * operand_b[v].M * int64_t(sizeof(T)));
    scratch = at::empty({std::max<int64_t>(total, 1)}, options.dtype(at::kByte));
    char* p = static_cast<char*>(scratch.data_ptr());
    for (int64_t c : slot_cols_) {
      slots.push_back(p);
      p += aligned(tile_ * c * int64_t(sizeof(T)));
    }
    for (const auto& r : requests) {
      fill_broadcast_block(p, r.tensor, tile_, r.cols);
      *r.slot = p;
      p += aligned(tile_ * r.cols * int64_t(r.tensor.element_size()));
    }
    // A transposed weight, copied once per call by a loop where `contiguous()` cost a
    // dispatch, a tensor and an iterator (3 % of a small Hessian-vector product's staged
    // step, perf).
    for (std::size_t v : transposed_b) {
      ProductOperand& b = operand_b[v];
      const at::Tensor& src = tensor_of(v);
      const T* x = src.data_ptr<T>();
      const int64_t s0 = src.stride(0), s1 = src.stride(1);
      T* y = reinterpret_cast<T*>(p);
      for (int64_t k = 0; k < b.K; ++k)
        for (int64_t m = 0; m < b.M; ++m) y[k * b.M + m] = x[k * s0 + m * s1];
      b = {y, b.K, b.M, b.M};
      p += aligned(b.K * b.M * int64_t(sizeof(T)));
    }
  }

  // Where each value lives in this call; a row value's tile starts r0 rows further.
  std::vector<View> base(values_.size());
  for (std::size_t v = 0; v < values_.size(); ++v) {
    const Value& val = values_[v];
    if (val.storage == Storage::Scratch) {
      base[v] = {slots[std::size_t(val.index)], val.cols, 1};
      continue;
    }
    if (val.storage != Storage::Input && val.storage != Storage::Output) continue;
    const at::Tensor t = full_of(v);
    base[v] = {static_cast<char*>(t.data_ptr()), t.dim() > 1 ? t.stride(0) : 0, t.dim() > 0 ? t.stride(-1) : 0};
  }
  auto view = [&](std::size_t v, int64_t r0) -> View {
    const Value& val = values_[v];
    View b = base[v];
    if (val.row && val.storage != Storage::Scratch) b.data += r0 * b.s0 * val.elem;
    return b;
  };
  std::vector<FusedCall> fused(steps_.size());
  FusedArgs fused_args;
  {
    std::size_t n = 0;
    for (std::size_t i = 0; i < steps_.size(); ++i)
      if (tiling::fused_form(steps_[i].kind) && kernels[i]) n += steps_[i].in.size() + steps_[i].out.size();
    fused_args.args.reserve(n);
    fused_args.at_row0.reserve(n);
  }
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    const Step& st = steps_[i];
    if (const tiling::FusedStep* f = tiling::fused_form(st.kind); f && kernels[i])
      fused[i] = plan_fused_call(st, *f, *kernels[i], base, dense_in.data() + dense_first[i], fused_args);
  }
  const std::vector<T> ones(std::size_t(tile_), T(1));  // column sums as products
  // Reduction products: the first tile's product is written to the step's result and
  // every later tile's product is added to it by the GEMM (beta = 1), so the sum over the
  // rows accumulates in T as one product over all N rows would (libtorch's own reduction).
  auto result_of = [&](std::size_t step_index) -> at::Tensor& {
    const Value& o = values_[steps_[step_index].out[0]];
    return o.storage == Storage::Output ? outputs[std::size_t(o.index)] : reductions[std::size_t(o.index)];
  };
  std::vector<char> summed(steps_.size(), 0);  // a reduction product's first tile is in
  // Column sums: each tile's in T (`part`), added over the tiles in double.
  std::vector<T> part;
  std::vector<std::vector<double>> column_sums(steps_.size());
  // A product LIBXSMM refuses (strides of this call's inputs it cannot read) sends the
  // whole call down the untiled path: nothing the region wrote is visible yet.
  bool refused = false;
  // The step visitor is built once per call: its lambdas read the loop's position
  // (tile r0 of `rows` rows, step i) through references. Built inside the loops, the
  // visitor (a few hundred bytes of captured references) was zeroed and filled again
  // for every step of every tile (3 % of a KdV step, perf).
  int64_t r0 = 0, rows = 0;
  std::size_t i = 0;
  const Step* step = nullptr;
  auto visitor = Overloaded{
    [&](const std::monostate&) {},
    [&](const tiling::FusedStep&) {
      run_fused_tile(fused[i], fused_args, rows, r0);
    },
    [&](const tiling::RowMmStep& mm) {
      const std::size_t a = step->in[mm.has_bias ? 1 : 0], b = step->in[mm.has_bias ? 2 : 1];
      const View A = view(a, r0), O = view(step->out[0], r0);
      const ProductOperand& B = operand_b[b];
      const int64_t K = B.K, M = B.M;
      T* out = reinterpret_cast<T*>(O.data);
      if (mm.has_bias) {  // out = bias, then out += A @ B
        const char* bias = bias_block[i];
        if (O.s0 == M)
          std::memcpy(out, bias, std::size_t(rows * M) * sizeof(T));
        else
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(out + r * O.s0, bias + r * M * int64_t(sizeof(T)), std::size_t(M) * sizeof(T));
      }
      refused = refused || !ops::small_mm_raw(reinterpret_cast<const T*>(A.data), A.s0, A.s1,
                                              B.data, B.s0, 1, out, O.s0,
                                              rows, K, M, mm.has_bias);
    },
    [&](const tiling::ReduceMmStep&) {
      // out [K, M] += X[rows, K]^T @ Y[rows, M]
      // The first operand: t(X) of a region value X, or a [K, N] tensor
      // from outside read by columns.
      const Value& xv = values_[step->in[0]];
      const T* xp = nullptr;
      int64_t a_s0 = 0, a_s1 = 0;
      if (xv.storage == Storage::Alias) {
        const View X = view(std::size_t(xv.index), r0);
        xp = reinterpret_cast<const T*>(X.data);
        a_s0 = X.s1;
        a_s1 = X.s0;
      } else {  // [K, N] by columns: base strides (stride(0), stride(1))
        const View c = base[step->in[0]];
        xp = reinterpret_cast<const T*>(c.data) + r0 * c.s1;
        a_s0 = c.s0;
        a_s1 = c.s1;
      }
      const View Y = view(step->in[1], r0);
      const Value& o = values_[step->out[0]];
      const int64_t K = o.sizes[0], M = o.sizes[1];
      T* acc = result_of(i).template data_ptr<T>();  // contiguous [K, M]
      const bool first = !summed[i];
      summed[i] = 1;
      refused = refused || !ops::small_mm_raw(xp, a_s0, a_s1, reinterpret_cast<const T*>(Y.data),
                                              Y.s0, Y.s1, acc, M, K, rows, M, !first);
    },
    [&](const tiling::ColSumStep&) {
      // out[1, C] += ones[1, rows] @ X[rows, C]: a reduction product.
      const View X = view(step->in[0], r0);
      const int64_t C = values_[step->in[0]].cols;
      const T* x = reinterpret_cast<const T*>(X.data);
      // Each tile's sum in T, the tiles' sums added in double: a bias gradient can be
      // a small difference of large sums (a critic's mean(D(fake)) - mean(D(real))),
      // and one float accumulator over all rows lost 4x libtorch's accuracy there
      // (at::sum sums in a cascade). C adds per tile, unlike a product's K x M.
      part.assign(std::size_t(C), T(0));
      if (!ops::small_mm_raw(ones.data(), rows, 1, x, X.s0, X.s1, part.data(), C, 1, rows, C, false))
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < C; ++c) part[std::size_t(c)] += x[r * X.s0 + c * X.s1];
      std::vector<double>& acc = column_sums[i];
      if (acc.empty()) acc.assign(std::size_t(C), 0.0);
      for (int64_t c = 0; c < C; ++c) acc[std::size_t(c)] += double(part[std::size_t(c)]);
    },
    [&](const tiling::ColumnCopyStep& copy) {
      const View O = view(step->out[0], r0);
      T* out = reinterpret_cast<T*>(O.data);
      for (const auto& p : copy.pieces) {
        const View I = view(step->in[p.input], r0);
        const T* x = reinterpret_cast<const T*>(I.data) + p.src_col * I.s1;
        T* y = out + p.dst_col * O.s1;
        if (I.s1 == 1 && O.s1 == 1) {
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(y + r * O.s0, x + r * I.s0, std::size_t(p.cols) * sizeof(T));
        } else {
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < p.cols; ++c) y[r * O.s0 + c * O.s1] = x[r * I.s0 + c * I.s1];
        }
      }
    },
    [&](const tiling::RowOpStep& op) {
      if (kernels[i]) {
        run_fused_tile(fused[i], fused_args, rows, r0);
        return;
      }
      std::vector<at::Tensor> args;
      for (std::size_t v : step->in) {
        const Value& val = values_[v];
        if (!val.row) {
          args.push_back(full_of(v));
          continue;
        }
        const View x = view(v, r0);
        args.push_back(at::from_blob(x.data, {rows, val.cols}, {x.s0, x.s1}, options.dtype(val.dtype)));
      }
      at::Tensor r = ops::run_forward(*op.op, args, op.attrs).at(0);
      const View O = view(step->out[0], r0);
      at::from_blob(O.data, {rows, values_[step->out[0]].cols}, {O.s0, O.s1}, options).copy_(r);
    },
  };
  for (r0 = 0; r0 < N && !refused; r0 += tile_) {
    rows = std::min(tile_, N - r0);
    for (i = 0; i < steps_.size() && !refused; ++i) {
      step = &steps_[i];
      std::visit(visitor, step->kind);
    }
  }
  if (refused) return run_untiled(inputs);
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    if (column_sums[i].empty()) continue;
    T* p = result_of(i).template data_ptr<T>();
    for (std::size_t k = 0; k < column_sums[i].size(); ++k) p[k] = static_cast<T>(column_sums[i][k]);
  }
  return variable_list(outputs.begin(), outputs.end());
}

#if !defined(STAGEJIT_HEADER_ONLY)
// The compiled build instantiates the runner at its two element types once, in
// src/compiled_bodies.cpp; other translation units only declare them.
extern template variable_list TiledRegionRunner::run_tiled<float>(const std::vector<at::Tensor>&,
                                                                  const variable_list&) const;
extern template variable_list TiledRegionRunner::run_tiled<double>(const std::vector<at::Tensor>&,
                                                                   const variable_list&) const;
#endif

}  // namespace stagejit::closure
