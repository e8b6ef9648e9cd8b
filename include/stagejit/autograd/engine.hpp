#pragma once
/// \file
/// The engine: runs a backward graph from root edges (docs/seed-system.md §4, docs/design.md
/// "The engine"). Dependencies are counted from the roots; ready functions run on a pool of
/// worker threads and on the calling thread (a linear chain stays on one thread); a
/// function that itself calls `execute` (reentrant backward) runs the nested task on its
/// own thread. Gradients meeting at one input are summed in a fixed order (by producer
/// discovery order), so results do not depend on thread count or timing. The grad mode
/// (set to `create_graph`) and the calling thread's trace hook are installed on every
/// thread that runs a function of the task. Compiled in src/engine.cpp.

#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/variable.hpp>

#include <vector>

namespace stagejit {

struct Function;

struct ExecuteOptions {
  /// Grad mode while functions run (record the backward's own graph).
  bool create_graph = false;
  /// Keep saved variables after running (false releases them: a second run throws).
  bool keep_graph = true;
  /// Run everything on the calling thread in a deterministic order (the tracer uses it).
  bool single_threaded = false;
  /// Run each function inside a `memory::HostCacheScope`: large CPU tensors it allocates
  /// come from `memory::HostCachingAllocator` (compiled stages set this; see
  /// core/memory/host_allocator.hpp). Also on when `execute` is called inside an open
  /// `HostCacheScope` (as `compile()` traces).
  bool cache_host_memory = false;
  /// Run each function below libtorch's Autograd and ADInplaceOrView dispatch keys, on
  /// whichever thread (Note [Below libtorch's autograd keys] in core/aten_dispatch.hpp;
  /// compiled stages set this). Host functions' own code gets the keys back.
  bool below_aten_autograd = false;
  /// Edges whose incoming gradient `execute` returns (summed), in this order. When
  /// non-empty, only functions on a path to one of them run, and the functions of these
  /// edges are not run unless another capture lies behind them.
  std::vector<Edge> capture;
};

/// Runs the graph: `inputs[i]` flows into `roots[i]` (null roots are skipped). Returns one
/// Variable per `options.capture` edge (undefined if nothing reached it). `callbacks` are
/// run around the Functions they name (autograd/callbacks.hpp); they write into `state`,
/// this execution's own (the tables are only read, so executions may share them).
/// Throws `Error` when no root is valid ("no graph nodes require computing gradients"),
/// when a function returns the wrong number of outputs, and rethrows (as the same
/// stagejit::Error subclass, else `Error`) the first exception of any function, prefixed
/// with "Function 'Name': ". The engine stays usable afterwards.
variable_list execute(const std::vector<Edge>& roots, const variable_list& inputs,
                      const ExecuteOptions& options = {},
                      const ExecuteCallbacks& callbacks = {}, CallState* state = nullptr);

namespace engine {
/// While the engine applies a Function on this thread (e.g. inside a HostFunction's
/// `backward`): true when that Function's output `i` is needed by the running graph task
/// — its edge is valid and leads to a Function that runs or to an input whose gradient
/// `grad` captures (libtorch's `task_should_compute_output`, from its `exec_info`).
/// Outside an engine call: true.
bool should_compute_output(std::size_t i) noexcept;
/// The same for `self`: false only when `self` is the Function the engine is applying on
/// this thread and its output `i` is not needed, so a Function applied by hand inside
/// another one computes everything. Backward formulas and compiled stages use this form
/// to skip the gradients nobody asked for (closure/specialize.hpp).
bool should_compute_output(const Function& self, std::size_t i) noexcept;
/// Number of threads that may run one graph task (the caller plus workers).
/// Initially STAGEJIT_NUM_THREADS, else the core count.
int num_threads() noexcept;
/// Resizes the worker pool (n >= 1; 1 = calling thread only). Safe between executions;
/// pending work of running tasks is still served by their callers.
void set_num_threads(int n);

// Note [Early outputs]
// A Function normally hands all its outputs to the engine when it returns. A compiled
// stage is one Function to the engine but computes its outputs one after another (the
// gradient of the last layer long before the first's), so it may deliver output `i` as
// soon as that value is final: `early_output_sink(self)` gives, while the engine applies
// `self` on this thread, a sink that delivers output `i` along `self.next_functions[i]`
// at once, exactly as the return would (same fan-in key, so sums keep their order:
// Note [Deterministic fan-in] in src/engine.cpp). A successor that becomes ready is queued on
// the task and announced to the worker pool, so it runs concurrently with the rest of
// `self` (on the caller's thread after `self` returns when the task is single-threaded
// or the pool has no workers). What the Function later returns at a delivered position
// is ignored. Emitting one output twice throws `Error`. This is what lets a leaf's
// AccumulateGrad, and its post-accumulate-grad hooks (autograd/variable.hpp), run while
// the rest of a compiled backward still runs: data-parallel training
// (distributed/data_parallel.hpp) starts a bucket's all-reduce there.

/// While the engine applies `self` on this thread: a sink delivering output `i` of
/// `self` before `self` returns (Note [Early outputs]); it stays valid, and may be called
/// from any thread, until `self` returns. Otherwise (outside an engine call, or when
/// another Function is being applied) an empty function.
OutputSink early_output_sink(const Function& self);
}  // namespace engine

}  // namespace stagejit
