#pragma once
/// \file
/// `compile()`: a traced, optimised, staged closure behind a cache keyed on the argument
/// spec (docs/api.md "Compiling"; the seed's CompiledFunction, docs/seed-system.md §2.6, with a trace cache
/// that retraces on a new spec instead of erroring).
///
/// A miss traces `fn` with `derivatives` backward stages, runs the passes (DCE, CSE and
/// the `t(t(x))` fold when `optimize`, the graph fuser when `fuse`), builds the stage
/// closures and serves the call from them; a hit
/// reuses them. Calls are thread-safe: the cache is guarded by a mutex (a miss traces
/// outside it; two threads missing on one spec may both trace, and the first to finish
/// is kept), and every call's state lives in the call.
///
/// This header declares; the bodies (tracing, the passes, the closure compiler behind
/// them) are compiled once, in closure/compile-inl.hpp (core/config.hpp), so a
/// translation unit calling `compile()` does not compile the compiler.

#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

namespace stagejit {

namespace ir {
class Graph;
}
namespace closure {
struct MultiStageClosure;
}


/// Options of `compile`.
struct CompileOptions {
  /// Backward stages traced and compiled after the forward (k: derivatives up to order k).
  int derivatives = 1;
  /// Run DCE, CSE and `fold_double_transposes` on the traced graph.
  bool optimize = true;
  /// Fuse elementwise chains of each stage into generated CPU kernels (`passes::fuse`).
  bool fuse = true;
  /// Run independent branches of a compiled stage on the engine's worker threads
  /// (`STAGEJIT_NUM_THREADS`). Off by default: ATen and BLAS already parallelise inside
  /// each op, and running branches concurrently on top of that oversubscribes the cores
  /// (bench/closure.md). Turn it on for stages with many independent single-threaded ops.
  bool inter_op_parallel = false;
  /// Large CPU tensors allocated while a compiled stage runs (outputs, saved values,
  /// gradients; 64 KiB or more) come from `memory::HostCachingAllocator`, which reuses
  /// freed blocks instead of returning them to the system, as PyTorch's CUDA caching
  /// allocator does. Installs the routing CPU allocator on first use (see
  /// core/memory/host_allocator.hpp). Once it is installed, stagejit's eager ops allocate
  /// from the cache too (a staged program's loss between compiled calls: Note [Eager ops
  /// allocate from the host cache], ops/op_table-inl.hpp); with this option off, the ops
  /// of this function's stages do not. libtorch's and the user's own ATen calls are
  /// unaffected. Free blocks
  /// are kept up to `$STAGEJIT_HOST_CACHE_MB` (default 1024 MiB);
  /// `memory::HostCachingAllocator::get().empty_cache()` releases them.
  bool cache_host_memory = true;
  /// Run each call of a stage through a variant specialised on what it needs: only the
  /// gradients the running backward asks for, nothing for later stages outside grad
  /// mode, no work on undefined incoming gradients (closure/specialize.hpp, Note [Stage
  /// variants]). Variants are built on first use and cached per (stage, mask).
  bool specialize = true;
  /// With two or more derivatives, each backward stage stops at the earlier-stage values
  /// it reads and hands their gradients to the stage that differentiates their producers,
  /// so a backward through stages 1..k differentiates the forward once, as libtorch's
  /// graph does (`TraceOptions::cross_stage_gradients`, Note [Cross-stage gradients] in
  /// trace/trace.hpp). `false`: each stage differentiates back through every earlier
  /// stage. Same results either way (up to the order of float sums).
  ///
  /// Unset (the default): chosen per input spec when compiling (Note [Choosing cross-stage
  /// gradients]): off when most matrix products after the forward run in row-tiled
  /// regions (`tile_rows`: tall inputs with layers of at most 128 columns, as a PINN's
  /// collocation points), where recomputing inside the tiles is cheaper than writing the
  /// gradients crossing stages out and summing them; on otherwise (short inputs, wider
  /// layers). `Stats::cross_stage_traces` counts the specs
  /// traced with it; `closure_for(inputs)->cross_stage` says it for one spec.
  std::optional<bool> cross_stage_gradients = std::nullopt;
  /// With two or more derivatives and without cross-stage gradients: also compile the
  /// joint backward of stages 1..k (Note [Joint stage] in ir/graph.hpp), so that one
  /// backward reaching several stage calls of one chain (a loss on u, u_x and u_xx)
  /// runs one compiled sweep, differentiating the forward once, where the stages would
  /// run one after another, each differentiating it again (Note [Joint backward] in
  /// closure/autograd_closure.hpp). Its variants are built on first use.
  bool joint_backward = true;
  /// With `joint_backward` and `optimize`: the joint backward also serves up to this many
  /// *sibling* calls of the last stage besides the chain's own (a Laplacian from one
  /// `grad` per input column applies u_x's backward once per column; Note [Joint
  /// siblings] in passes/joint_siblings.hpp), in the same sweep. 0: siblings run their
  /// stage on their own, each differentiating the forward again. Each copy adds the
  /// backward of the last stage to the joint stage's graph (passes, not kernels: a
  /// variant compiles the copies it runs).
  std::size_t joint_siblings = 2;
  /// Rows per tile of each stage's row-tiled region (closure/tiled_plan.hpp, Note
  /// [Row-tiled regions]): the nodes of a stage that work row by row on tensors of at
  /// least 2 rows (`closure::kMinTiledRows`) (fused kernels, thin products, weight and
  /// bias gradient reductions) run tile by tile, so intermediates stay in the cache.
  /// Needs LIBXSMM (`ops::small_mm_enabled`); 0 turns it off. Measured on the Burgers
  /// PINN step (bench/pinn.md, float): staged 1.48x -> 1.80x libtorch, compile-loss
  /// 1.51x -> 1.80x. 128 rows, not 512 as first: a tile's values stay in L1/L2 (KdV,
  /// float: staged 1.98x -> 2.35x, whole-loss 2.90x -> 3.30x; Poisson 2-64x3-1 at 8 000
  /// rows 1.79x -> 1.88x; bench/higher_order.md).
  int64_t tile_rows = 128;
  /// With `optimize`: later stages recompute cheap elementwise values of earlier stages
  /// (of at least 16 384 elements) from values they read anyway instead of reading them
  /// saved, so fewer tensors cross stages (passes/rematerialize.hpp, Note [Cross-stage
  /// rematerialisation]). Not where cross-stage gradients are on, whose stages hand on
  /// the gradients of exactly the values they read.
  bool rematerialize = true;
  /// With `specialize`: once two chains of calls in a row fed the backward stages 1..m
  /// the same seeds (a PINN's `ones_like(u)`, a critic's `grad(D, x)` seed), a forward
  /// call in grad mode runs stages 0..m as one fused graph and the calls of stages 1..m
  /// return what it computed, after checking their seeds bit for bit; any other call runs
  /// its stage as before (Note [Anticipated stages] in closure/anticipate.hpp). Not for
  /// stages with random or in-place ops or host functions, nor off the CPU. Also: once two
  /// calls in a row had their outputs freed undifferentiated (a step with its `grad`
  /// calls inside), a forward call saves nothing for stage 1, and a stage-1 call after all
  /// reruns the forward first (Note [Forward calls whose backward never comes]). The
  /// environment variable STAGEJIT_ANTICIPATE=0 turns both off too.
  bool anticipate_stages = true;
  /// Trace on meta tensors (ATen's shape-only device: no data, no arithmetic) with the
  /// inputs' sizes, strides and dtypes, then record the real device in the graph's types:
  /// the trace then costs its recording alone instead of a full eager run of every stage
  /// (the staged Burgers PINN: 0.08 s instead of 0.3 s, bench/first_call.md). The graph is
  /// the one a real trace records. `compile` traces the real tensors instead, with the
  /// same result, whenever the meta trace cannot stand for them: `fn` makes a tensor from
  /// an input's data that the graph would keep as a constant (`ones_like(x.data())`),
  /// calls a host function, reads a value (`item()`), uses an op without a meta kernel,
  /// or throws. `fn` must not read input data through raw pointers (`data_ptr`,
  /// accessors): a meta tensor has none; turn this off for such a function.
  bool trace_on_meta = true;
};

/// A function compiled by `compile`. Copies share one cache.
class CompiledFunction {
 public:
  struct Stats {
    std::size_t hits = 0;
    std::size_t misses = 0;
    /// Summed over the misses, in seconds: tracing (the eager run recording every
    /// stage), the optimisation and fusion passes, and building the stages' closures
    /// (with their kernels' source generation; the compiler runs overlap what follows,
    /// see `fusion::KernelBatchScope` and `fusion::CpuBackend::stats`).
    double trace_seconds = 0;
    double passes_seconds = 0;
    double build_seconds = 0;
    /// Misses traced on meta tensors (`CompileOptions::trace_on_meta`); the other misses
    /// traced the real tensors.
    std::size_t meta_traces = 0;
    /// Misses compiled with cross-stage gradients (`CompileOptions::cross_stage_gradients`,
    /// set or chosen).
    std::size_t cross_stage_traces = 0;
  };

  /// Checks the options (Error: `derivatives` or `tile_rows` negative).
  STAGEJIT_FUNC CompiledFunction(traced_fn fn, CompileOptions options);

  /// Runs the compiled stage 0 on `inputs` (tracing and compiling first on a new spec).
  /// Outputs that require grad carry the compiled stage 1 as grad_fn. Throws what
  /// `trace` and the closure compiler throw on a miss; ShapeError / Error from ops.
  STAGEJIT_FUNC variable_list operator()(const variable_list& inputs);

  /// The optimised graph used for inputs of this spec (compiling it if needed;
  /// `ir/ir.hpp` prints it).
  STAGEJIT_FUNC std::shared_ptr<const ir::Graph> graph_for(const variable_list& inputs);

  /// The compiled closure used for inputs of this spec (compiling it if needed): its
  /// stages, plan and stage variants (`MultiStageClosure::variant`, `num_variants`;
  /// closure/autograd_closure.hpp).
  STAGEJIT_FUNC std::shared_ptr<const closure::MultiStageClosure> closure_for(const variable_list& inputs);

  /// Cache hits and misses so far.
  STAGEJIT_FUNC Stats stats() const;
  /// Drops every compiled closure (and resets nothing else).
  STAGEJIT_FUNC void clear_cache();

 private:
  struct State;  // closure/compile-inl.hpp
  STAGEJIT_FUNC std::shared_ptr<const closure::MultiStageClosure> lookup(const variable_list& inputs);

  std::shared_ptr<State> state_;
};

/// Compiles `fn` (see the file comment and docs/api.md "Compiling").
inline CompiledFunction compile(traced_fn fn, CompileOptions options = {}) {
  return CompiledFunction(std::move(fn), options);
}

}  // namespace stagejit
