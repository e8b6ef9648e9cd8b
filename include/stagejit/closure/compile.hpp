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

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/closure/autograd_closure.hpp>
#include <stagejit/core/arg_spec.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/memory/host_allocator.hpp>
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/passes/cse.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/passes/graph_fuser.hpp>
#include <stagejit/passes/rematerialize.hpp>
#include <stagejit/passes/peephole.hpp>
#include <stagejit/trace/trace.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace stagejit {

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
  /// core/memory/host_allocator.hpp; code outside compiled stages is unaffected). Free blocks
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
  /// trace/trace.hpp). Off (the default): each stage differentiates back through every
  /// earlier stage. Same results either way. Measured on the Burgers PINN step
  /// (bench/pinn.md): on, 125 matrix products instead of 170, but 25 % slower, the
  /// gradients crossing stages being written out and summed by the engine instead of
  /// staying inside one stage's fused kernels; worth trying where products dominate.
  bool cross_stage_gradients = false;
  /// Rows per tile of each stage's row-tiled region (closure/tiled_region.hpp, Note
  /// [Row-tiled regions]): the nodes of a stage that work row by row on tensors of at
  /// least `max(2 * tile_rows, 2048)` rows (fused kernels, thin products, weight and
  /// bias gradient reductions) run tile by tile, so intermediates stay in the cache.
  /// Needs LIBXSMM (`ops::small_mm_enabled`); 0 turns it off. Measured on the Burgers
  /// PINN step (bench/pinn.md, float): staged 1.48x -> 1.80x libtorch, compile-loss
  /// 1.51x -> 1.80x.
  int64_t tile_rows = 512;
  /// With `optimize`: later stages recompute cheap elementwise values of earlier stages
  /// (of at least 16 384 elements) from values they read anyway instead of reading them
  /// saved, so fewer tensors cross stages (passes/rematerialize.hpp, Note [Cross-stage
  /// rematerialisation]). Not with `cross_stage_gradients`, whose stages hand on the
  /// gradients of exactly the values they read.
  bool rematerialize = true;
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

namespace detail {

/// `CompileOptions::trace_on_meta`: `fn` traced on meta tensors standing for `leaves`
/// (same sizes, strides, dtypes and requires_grad), the graph's types then moved to the
/// leaves' device. Empty when that trace cannot stand for a real one (see the option):
/// leaves on several devices or none, anything thrown, a host function (refused while
/// `MetaTraceScope` is open), a Constant made from meta data.
inline std::optional<Trace> trace_on_meta(const traced_fn& fn, const variable_list& leaves, TraceOptions options) {
  std::optional<at::Device> device;
  variable_list meta;
  meta.reserve(leaves.size());
  for (const auto& v : leaves) {
    if (!v.defined()) {
      meta.emplace_back();
      continue;
    }
    const at::Tensor& t = v.data();
    if (device && *device != t.device()) return std::nullopt;
    device = t.device();
    if (t.layout() != at::kStrided || t.is_meta()) return std::nullopt;
    meta.emplace_back(at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta)), v.requires_grad());
  }
  if (!device) return std::nullopt;
  std::optional<Trace> tr;
  try {
    MetaTraceScope scope;
    tr.emplace(trace(fn, meta, options));
  } catch (...) {
    return std::nullopt;  // the real trace reports the error, or succeeds
  }
  ir::Graph& g = *tr->graph();
  auto retype = [&](ir::Value* v) {
    if (const ir::TensorType* t = v->tensor_type(); t && t->device.is_meta()) {
      ir::TensorType real = *t;
      real.device = *device;
      v->set_type(real);
    }
  };
  for (ir::Value* v : g.inputs()) retype(v);
  for (ir::Node* n : g.nodes()) {
    if (n->is<ir::HostOp>() || n->is<ir::Eval>()) return std::nullopt;
    if (const auto* c = n->get_if<ir::Constant>(); c && c->value.defined() && c->value.is_meta())
      return std::nullopt;
    // A tensor attribute made from meta data (as a constant, it has no values).
    if (auto* op = n->get_if<ir::Op>()) {
      // A `device` attribute names the real device as a real trace would (`zeros_of`:
      // none for the CPU).
      auto& attrs = op->attributes;
      for (auto it = attrs.begin(); it != attrs.end();) {
        const auto* str = std::get_if<std::string>(&it->second);
        if (it->first != "device" || !str || *str != "meta") {
          ++it;
        } else if (device->is_cpu()) {
          it = attrs.erase(it);
        } else {
          it->second = device->str();
          ++it;
        }
      }
      for (const auto& [name, value] : op->attributes) {
        if (const auto* t = std::get_if<at::Tensor>(&value); t && t->defined() && t->is_meta()) return std::nullopt;
        if (const auto* ts = std::get_if<std::vector<at::Tensor>>(&value))
          for (const auto& t : *ts)
            if (t.defined() && t.is_meta()) return std::nullopt;
        // Any other attribute naming the meta device: a real trace would have named another.
        if (const auto* str = std::get_if<std::string>(&value); str && *str == "meta") return std::nullopt;
      }
    }
    for (ir::Value* v : n->outputs()) retype(v);
  }
  return tr;
}

}  // namespace detail

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
  };

  CompiledFunction(traced_fn fn, CompileOptions options)
      : state_(std::make_shared<State>(std::move(fn), options)) {
    STAGEJIT_CHECK(options.derivatives >= 0, "compile: derivatives must be >= 0, got ",
                   options.derivatives);
    STAGEJIT_CHECK(options.tile_rows >= 0, "compile: tile_rows must be >= 0 (0: no row tiling), got ",
                   options.tile_rows);
  }

  /// Runs the compiled stage 0 on `inputs` (tracing and compiling first on a new spec).
  /// Outputs that require grad carry the compiled stage 1 as grad_fn. Throws what
  /// `trace` and the closure compiler throw on a miss; ShapeError / Error from ops.
  variable_list operator()(const variable_list& inputs) {
    auto entry = lookup(inputs);
    std::vector<Edge> no_edges;
    closure::StageCall call(entry->closure, 0, {}, {}, no_edges);
    return call.apply(inputs);
  }

  /// The optimised graph used for inputs of this spec (compiling it if needed).
  std::shared_ptr<const ir::Graph> graph_for(const variable_list& inputs) {
    return lookup(inputs)->closure->graph;
  }

  /// The compiled closure used for inputs of this spec (compiling it if needed): its
  /// stages, plan and stage variants (`MultiStageClosure::variant`, `num_variants`).
  std::shared_ptr<const closure::MultiStageClosure> closure_for(const variable_list& inputs) {
    return lookup(inputs)->closure;
  }

  /// Cache hits and misses so far.
  Stats stats() const {
    return Stats{state_->hits.load(), state_->misses.load(), 1e-6 * double(state_->trace_us.load()),
                 1e-6 * double(state_->passes_us.load()), 1e-6 * double(state_->build_us.load()),
                 state_->meta_traces.load()};
  }
  /// Drops every compiled closure (and resets nothing else).
  void clear_cache() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->cache.clear();
  }

 private:
  struct Entry {
    std::shared_ptr<const closure::MultiStageClosure> closure;
  };
  struct State {
    State(traced_fn f, CompileOptions o)
        : fn(std::move(f)), options(o),
          // Installed here, typically before the threads that call the function start.
          cache_host_memory(o.cache_host_memory && memory::install_host_cache()) {}
    traced_fn fn;
    CompileOptions options;
    bool cache_host_memory;
    std::mutex mutex;
    std::unordered_map<ArgSpec, std::shared_ptr<Entry>, ArgSpecHash> cache;
    std::atomic<std::size_t> hits{0}, misses{0}, meta_traces{0};
    std::atomic<int64_t> trace_us{0}, passes_us{0}, build_us{0};
  };

  // ATen's default generators (CPU, and each CUDA device's when CUDA is available),
  // saved on construction and restored on destruction.
  struct GeneratorStates {
    std::vector<std::pair<at::Generator, at::Tensor>> saved;
    GeneratorStates() {
      auto keep = [&](at::Generator g) {
        std::lock_guard<std::mutex> lock(g.mutex());
        saved.emplace_back(g, g.get_state());
      };
      keep(at::detail::getDefaultCPUGenerator());
      if (at::hasCUDA())
        for (int64_t i = 0; i < static_cast<int64_t>(at::detail::getCUDAHooks().getNumGPUs()); ++i)
          keep(at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i))));
    }
    ~GeneratorStates() {
      for (auto& [g, state] : saved) {
        std::lock_guard<std::mutex> lock(g.mutex());
        g.set_state(state);
      }
    }
    GeneratorStates(const GeneratorStates&) = delete;
    GeneratorStates& operator=(const GeneratorStates&) = delete;
  };

  static ArgSpec spec_of(const variable_list& inputs) {
    ArgSpec spec;
    spec.inputs.reserve(inputs.size());
    for (const auto& v : inputs)
      spec.inputs.push_back(TensorSpec::of(v.data(), v.requires_grad() && GradMode::is_enabled()));
    return spec;
  }

  std::shared_ptr<Entry> lookup(const variable_list& inputs) {
    ArgSpec spec = spec_of(inputs);
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      auto it = state_->cache.find(spec);
      if (it != state_->cache.end()) {
        ++state_->hits;
        return it->second;
      }
    }
    ++state_->misses;
    // Trace on leaves flagged as the spec says (no grad mode: nothing requires grad).
    variable_list leaves;
    for (std::size_t i = 0; i < inputs.size(); ++i)
      leaves.push_back(inputs[i].defined() ? Variable(inputs[i].data(), spec.inputs[i].requires_grad)
                                           : Variable());
    const auto& o = state_->options;
    // The trace's eager results stay alive until the closures are built: freeing their
    // many small autograd records first makes malloc place the IR the passes create in
    // the holes they leave (Trace::drop_eager_results explains).
    // Tracing runs `fn` eagerly; its random ops (dropout) must not use up the draws of the
    // call being served, so the default generators are put back as they were: the first
    // compiled call after `at::manual_seed(s)` draws what an eager call would.
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    Trace tr = [&] {
      GeneratorStates saved;
      const TraceOptions topts{o.derivatives, o.cross_stage_gradients};
      if (o.trace_on_meta)
        if (std::optional<Trace> t = detail::trace_on_meta(state_->fn, leaves, topts)) {
          ++state_->meta_traces;
          return std::move(*t);
        }
      // The trace runs every stage eagerly at full size: its large tensors come from the
      // host cache (as the compiled stages' do), and the blocks they free serve the first
      // compiled call (bench/first_call.md).
      memory::HostCacheScope host_cache(state_->cache_host_memory);
      return trace(state_->fn, leaves, topts);
    }();
    std::shared_ptr<ir::Graph> g = tr.graph();
    const auto t1 = clock::now();
    if (o.optimize) {
      passes::eliminate_dead_code(*g);
      passes::eliminate_common_subexpressions(*g);
      passes::fold_double_transposes(*g);
      passes::eliminate_dead_code(*g);
      if (o.rematerialize && !o.cross_stage_gradients) passes::rematerialize_cross_stage(*g);
    }
    if (o.fuse) passes::fuse(*g);
    const auto t2 = clock::now();
    auto entry = std::make_shared<Entry>();
    std::shared_ptr<closure::MultiStageClosure> msc;
    {
      // Every stage's kernels, predicted from the traced types, compiled together in the
      // background while the closures are finished and the first call starts.
      fusion::KernelBatchScope kernels;
      msc = std::make_shared<closure::MultiStageClosure>(g, tr, o.tile_rows);
    }
    const auto t3 = clock::now();
    auto us = [](clock::duration d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); };
    state_->trace_us += us(t1 - t0);
    state_->passes_us += us(t2 - t1);
    state_->build_us += us(t3 - t2);
    msc->inter_op_parallel = o.inter_op_parallel;
    msc->cache_host_memory = state_->cache_host_memory;
    msc->specialize = o.specialize;
    entry->closure = std::move(msc);
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto [it, inserted] = state_->cache.emplace(std::move(spec), entry);
    return it->second;
  }

  std::shared_ptr<State> state_;
};

/// Compiles `fn` (see the file comment and docs/api.md "Compiling").
inline CompiledFunction compile(traced_fn fn, CompileOptions options = {}) {
  return CompiledFunction(std::move(fn), options);
}

}  // namespace stagejit
#include <stagejit/core/detail/bodies_end.hpp>
