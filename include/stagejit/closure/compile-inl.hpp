#pragma once
/// \file
/// Bodies of closure/compile.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
/// They hold the whole compiler behind `compile()`: the tracer, the passes, the fuser and
/// the closure compiler, whose headers only this file (and tools working on graphs)
/// include.
#include <stagejit/core/config.hpp>
#include <stagejit/closure/compile.hpp>
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
#include <stagejit/passes/joint_siblings.hpp>
#include <stagejit/passes/rematerialize.hpp>
#include <stagejit/passes/peephole.hpp>
#include <stagejit/trace/trace.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace stagejit {

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


// Note [Choosing cross-stage gradients]
// A loss that reads several stages of one call (a PINN's u, u_x, u_xx; forces F = -dE/dx
// beside E) reaches stages 1..k of it in one backward. Without cross-stage gradients each
// of those stages differentiates back through every earlier stage on its own: the forward
// is differentiated k times (more matrix products than libtorch: bench/higher_order.md,
// "Product counts"). With them each part is differentiated once, but the gradients of the
// values crossing stages are written out whole and summed by the engine between the
// stage calls. Which costs more depends on the row-tiled regions (Note [Row-tiled
// regions]): where a backward stage runs them (tall inputs, layers of at most 128
// columns) the repeated sweeps run tile by tile in the cache and the hand-off's full-size
// tensors cost more; elsewhere every value is written out anyway and the extra products
// and elementwise sweeps dominate. Measured (bench/higher_order.md, one engine thread,
// float, ratio to libtorch): row-tiled Burgers 1.25x without / 1.27x with, KdV 1.96x /
// 1.35x; untiled Burgers (tile_rows 0) 0.91x / 1.15x, 1 500 points 0.94x / 1.04x; forces
// (softplus) 0.93x / 1.33x, HVP 0.90x / 1.06x, MAML 1.05x / 1.10x. So, unless the option
// is set, a spec is traced without them first, and traced again with them when fewer
// than half of the products after the forward run in row-tiled regions.

// Whether the matrix products of the stages after the forward of `g` (optimised and
// fused) run mostly inside row-tiled regions with `tile_rows`: at least half of them
// (Note [Choosing cross-stage gradients]). Regions of elementwise kernels alone (layers
// wider than the tiled products allow) do not count: there the repeated sweeps' products
// run whole, as libtorch's would, and cost what they cost.
//
// Counted with regions of the widths the stages run them at (`tiling::kMaxTiledWidth`,
// 128). Counted at 64 until 2026-12-07, which traced every PINN of 65-128 units with
// cross-stage gradients: a user-style Laplacian PINN, tanh 1-128x3-1, 2 000 points, float,
// ran its staged step 55 % behind its whole loss with them and 8 % without (1.45x -> 2.06x
// libtorch; gelu 2-128x3-1 with two grad calls 1.57x -> 2.05x; double alike), while
// 96- and 128-wide critics read the same either way (bench/higher_order.md, "Session of
// 2026-12-07, 02:30").
inline bool backward_products_tile(const ir::Graph& g, int64_t tile_rows) {
  if (tile_rows <= 0) return false;
  std::vector<std::vector<ir::Node*>> by_stage;
  for (ir::Node* n : g.nodes()) {
    if (n->stage() >= by_stage.size()) by_stage.resize(n->stage() + 1);
    by_stage[n->stage()].push_back(n);
  }
  std::size_t products = 0, tiled = 0;
  for (std::size_t s = 1; s < by_stage.size(); ++s) {
    const auto [p, t] = closure::detail::tiled_products(by_stage[s]);
    products += p;
    tiled += t;
  }
  return products > 0 && 2 * tiled >= products;
}

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


inline ArgSpec spec_of(const variable_list& inputs) {
  ArgSpec spec;
  spec.inputs.reserve(inputs.size());
  for (const auto& v : inputs)
    spec.inputs.push_back(TensorSpec::of(v.data(), v.requires_grad() && GradMode::is_enabled()));
  return spec;
}

}  // namespace detail

/// The cache shared by the copies of one CompiledFunction.
struct CompiledFunction::State {
  State(traced_fn f, CompileOptions o)
      : fn(std::move(f)), options(o),
        // Installed here, typically before the threads that call the function start.
        cache_host_memory(o.cache_host_memory && memory::install_host_cache()) {}
  traced_fn fn;
  CompileOptions options;
  bool cache_host_memory;
  std::mutex mutex;
  std::unordered_map<ArgSpec, std::shared_ptr<const closure::MultiStageClosure>, ArgSpecHash> cache;
  std::atomic<std::size_t> hits{0}, misses{0}, meta_traces{0}, cross_stage_traces{0};
  std::atomic<int64_t> trace_us{0}, passes_us{0}, build_us{0};
};

STAGEJIT_FUNC CompiledFunction::CompiledFunction(traced_fn fn, CompileOptions options)
    : state_(std::make_shared<State>(std::move(fn), options)) {
  STAGEJIT_CHECK(options.derivatives >= 0, "compile: derivatives must be >= 0, got ", options.derivatives);
  STAGEJIT_CHECK(options.tile_rows >= 0, "compile: tile_rows must be >= 0 (0: no row tiling), got ",
                 options.tile_rows);
}

STAGEJIT_FUNC variable_list CompiledFunction::operator()(const variable_list& inputs) {
  auto closure = lookup(inputs);
  std::vector<Edge> no_edges;
  closure::StageCall call(closure, 0, {}, {}, no_edges);
  return call.apply(inputs);
}

STAGEJIT_FUNC std::shared_ptr<const ir::Graph> CompiledFunction::graph_for(const variable_list& inputs) {
  return lookup(inputs)->graph;
}

STAGEJIT_FUNC std::shared_ptr<const closure::MultiStageClosure> CompiledFunction::closure_for(
    const variable_list& inputs) {
  return lookup(inputs);
}

STAGEJIT_FUNC CompiledFunction::Stats CompiledFunction::stats() const {
  return Stats{state_->hits.load(), state_->misses.load(), 1e-6 * double(state_->trace_us.load()),
               1e-6 * double(state_->passes_us.load()), 1e-6 * double(state_->build_us.load()),
               state_->meta_traces.load(), state_->cross_stage_traces.load()};
}

STAGEJIT_FUNC void CompiledFunction::clear_cache() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->cache.clear();
}

STAGEJIT_FUNC std::shared_ptr<const closure::MultiStageClosure> CompiledFunction::lookup(const variable_list& inputs) {
  ArgSpec spec = detail::spec_of(inputs);
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
  bool on_meta = false;  // the trace kept was taken on meta tensors
  auto traced = [&](bool cross_stage) {
    detail::GeneratorStates saved;
    const TraceOptions topts{o.derivatives, cross_stage, o.joint_backward && !cross_stage};
    on_meta = false;
    if (o.trace_on_meta)
      if (std::optional<Trace> t = detail::trace_on_meta(state_->fn, leaves, topts)) {
        on_meta = true;
        return std::move(*t);
      }
    // The trace runs every stage eagerly at full size: its large tensors come from the
    // host cache (as the compiled stages' do), and the blocks they free serve the first
    // compiled call (bench/first_call.md).
    memory::HostCacheScope host_cache(state_->cache_host_memory);
    memory::NoHostCacheScope no_host_cache(!state_->cache_host_memory);
    return trace(state_->fn, leaves, topts);
  };
  auto optimised = [&](Trace& tr, bool cross_stage) {
    std::shared_ptr<ir::Graph> g = tr.graph();
    if (o.optimize) {
      passes::eliminate_dead_code(*g);
      passes::eliminate_common_subexpressions(*g);
      passes::fold_double_transposes(*g);
      passes::eliminate_dead_code(*g);
      if (o.rematerialize && !cross_stage) passes::rematerialize_cross_stage(*g);
      if (const std::size_t J = g->joint_stage(); J != 0 && o.joint_siblings > 0) {
        // Note [Joint siblings]: the outputs that are gradients of stage k-1's inputs.
        const auto& grads_of = tr.gradient_of(J);
        std::vector<char> seed_outputs(grads_of.size(), 0);
        for (std::size_t i = 0; i < grads_of.size(); ++i)
          seed_outputs[i] = grads_of[i] < g->inputs().size() && g->inputs()[grads_of[i]]->stage() + 2 == J;
        passes::add_joint_siblings(*g, tr.flags(J - 1).inputs.size(), seed_outputs, o.joint_siblings);
      }
    }
    if (o.fuse) passes::fuse(*g);
    return g;
  };
  bool cross_stage = o.cross_stage_gradients.value_or(false);
  Trace tr = traced(cross_stage);
  auto t1 = clock::now();
  std::shared_ptr<ir::Graph> g = optimised(tr, cross_stage);
  // Note [Choosing cross-stage gradients].
  if (!o.cross_stage_gradients && o.derivatives >= 2 && !detail::backward_products_tile(*g, o.tile_rows)) {
    const auto t = clock::now();
    cross_stage = true;
    tr = traced(true);
    t1 += clock::now() - t;  // the second trace counts as tracing
    g = optimised(tr, true);
  }
  if (cross_stage) ++state_->cross_stage_traces;
  if (on_meta) ++state_->meta_traces;
  const auto t2 = clock::now();
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
  msc->anticipate = o.anticipate_stages && o.specialize && closure::anticipation_enabled_by_environment();
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto [it, inserted] = state_->cache.emplace(std::move(spec), std::move(msc));
  return it->second;
}


}  // namespace stagejit
