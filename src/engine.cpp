// The threaded autograd engine (see include/stagejit/autograd/engine.hpp).
//
// Note [Engine scheduling]
// A graph task owns one node record per reachable Function (dependency count, input
// buffer). When a function finishes, the thread that ran it delivers its outputs, keeps
// the first successor that became ready and runs it next (a chain never changes thread),
// and puts the other ready successors on the task's queue, announcing each with a token on
// the pool's queue. The caller of `execute` works on its own task's queue until the task's
// outstanding count reaches zero, so nested `execute` calls always make progress.
//
// Note [Joint nodes]
// A ClosureImpl may name Functions it can run together with its own (`joint_members`:
// the compiled calls of stages 1..k of one chain, Note [Joint backward] in
// closure/autograd_closure.hpp). When a graph task without create_graph reaches two or
// more of them (each needed, none captured and none with callbacks) and none of them
// reaches another through the task's graph (a joint node would then wait on itself),
// they become one node: a Function whose inputs are the members' inputs and whose
// next_functions are the members' next_functions, concatenated in member order. The
// members' records stay in the task (edges into them still say they are needed) but
// forward what is delivered to them into the joint node at their input offset; the
// joint node's dependency count is the sum of theirs. It runs once all the members'
// gradients are in, and calls `apply_joint`, or applies the members one by one. Up to
// `joint_sibling_capacity()` other closures with the runner's `joint_sibling_key()` (calls
// of the last stage made by the same call of the stage before) join as members after the
// chain's (Note [Joint siblings] in passes/joint_siblings.hpp).
//
// Note [Deterministic fan-in]
// Each contribution to an input slot carries a key (producer's discovery index in the
// dependency DFS from the roots, output number). Once all contributions arrived they are
// added in key order, so sums are bit-identical whatever the thread count or timing.
#include <stagejit/autograd/callbacks.hpp>
#include <stagejit/autograd/engine.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/core/aten_dispatch.hpp>
#include <stagejit/core/aten_error.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/memory/host_allocator.hpp>
#include <stagejit/ops/ops.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagejit {
namespace {

// Nodes made ready by one delivery (a handful): inline (Note [Graph task allocations]).
using ReadyList = c10::SmallVector<uint32_t, 8>;

struct Contribution {
  uint64_t key;
  uint32_t slot;
  Variable value;
};

// The graph task's index from Function to node: open addressing with linear probing on
// the pointer, in one array. A compiled stage runs a graph task of a few dozen to a few
// hundred Functions on every call; std::unordered_map paid an allocation per Function and a
// pointer chase per lookup (every delivered edge looks its target up), which showed among
// a small staged step's costs (maml: glibc's malloc and free 8 % of its samples).
class FunctionIndex {
 public:
  using Entry = std::pair<const Function*, uint32_t>;
  /// The entry of `f`, or null.
  const Entry* find(const Function* f) const noexcept {
    if (slots_.empty()) return nullptr;
    for (std::size_t i = slot_of(f);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.first == f) return &e;
      if (!e.first) return nullptr;
    }
  }
  static constexpr const Entry* end() noexcept { return nullptr; }
  /// Adds `f` -> `idx` unless `f` is there; returns its entry and whether it was added.
  std::pair<const Entry*, bool> emplace(const Function* f, uint32_t idx) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    for (std::size_t i = slot_of(f);; i = (i + 1) & mask_) {
      Entry& e = slots_[i];
      if (e.first == f) return {&e, false};
      if (!e.first) {
        e = {f, idx};
        ++size_;
        return {&e, true};
      }
    }
  }
  /// The node of `f`, which must be in the index.
  uint32_t at(const Function* f) const {
    const Entry* e = find(f);
    STAGEJIT_CHECK(e, "engine: a Function reached by an edge is not in its graph task");
    return e->second;
  }
  void clear() noexcept {
    slots_.clear();
    size_ = 0;
    mask_ = 0;
  }
  /// Room for `n` Functions without growing (a task's size is known from the last call
  /// of the same closure, usually the same graph: Note [Graph task allocations]).
  void reserve(std::size_t n) {
    std::size_t want = 64;
    while (want < 2 * n) want *= 2;
    if (want > slots_.size()) {
      std::vector<Entry> old = std::move(slots_);
      slots_.assign(want, Entry{nullptr, 0});
      mask_ = want - 1;
      size_ = 0;
      for (const Entry& e : old)
        if (e.first) emplace(e.first, e.second);
    }
  }

 private:
  std::size_t slot_of(const Function* f) const noexcept {
    const auto h = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(f)) * 0x9E3779B97F4A7C15ull;
    return static_cast<std::size_t>(h >> 32) & mask_;
  }
  void grow() { reserve(std::max<std::size_t>(32, slots_.size())); }
  std::vector<Entry> slots_;
  std::size_t size_ = 0, mask_ = 0;
};

struct Node {
  Function* fn = nullptr;
  int deps = 0;
  bool needed = true;
  bool captured = false;
  // Most inputs get one or two contributions: kept inline (Note [Graph task allocations]).
  c10::SmallVector<Contribution, 2> buffer;
  variable_list inputs;  // summed buffer, filled when the node becomes ready
  std::vector<char> emitted;  // outputs already delivered early (Note [Early outputs])
  // Note [Joint nodes]: the joint node this member's inputs go to, at `input_offset`.
  int64_t joined_into = -1;
  uint32_t input_offset = 0;

  Node() = default;
  // noexcept, so that the node array moves its records when it grows instead of copying
  // them (c10::SmallVector's own move is not declared noexcept).
  Node(Node&&) noexcept = default;
  Node& operator=(Node&&) noexcept = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
};

struct GraphTask {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<Node> nodes;
  FunctionIndex index;
  std::deque<uint32_t> queue;
  int outstanding = 0;
  std::exception_ptr error;
  std::string error_fn;
  std::string error_origin;  // the failing Function's IR node, when known
  bool create_graph = false;
  bool keep_graph = true;
  bool single_threaded = false;
  bool cache_host_memory = false;
  // Started inside a NoHostCacheScope (a compiled stage with cache_host_memory off): its
  // functions run inside one too, on whichever thread.
  bool no_host_cache = false;
  // ExecuteOptions::below_aten_autograd (Note [Below libtorch's autograd keys]).
  bool below_aten_autograd = false;
  TraceHook* hook = nullptr;
  const ExecuteCallbacks* callbacks = nullptr;
  CallState* call_state = nullptr;
  // capture edges: node index -> list of (input_nr, result slot)
  std::unordered_map<uint32_t, std::vector<std::pair<uint32_t, std::size_t>>> capture_of;
  variable_list captured;
  std::vector<std::shared_ptr<Function>> joint_functions;  // Note [Joint nodes]
};

// ------------------------------------------------------------------ worker pool
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // leaked on purpose: workers may outlive static dtors
    return *pool;
  }
  int num_threads() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int>(workers_.size()) + 1;
  }
  void set_num_threads(int n) {
    STAGEJIT_CHECK(n >= 1, "engine::set_num_threads: need at least 1 thread, got ", n);
    std::vector<std::thread> old;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++generation_;
      old.swap(workers_);
      cv_.notify_all();
    }
    for (auto& t : old) t.join();
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < n - 1; ++i)
      workers_.emplace_back([this, g = generation_] { work(g); });
  }
  bool has_workers() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !workers_.empty();
  }
  void announce(const std::shared_ptr<GraphTask>& task, std::size_t count) {
    if (count == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (workers_.empty()) return;
    for (std::size_t i = 0; i < count; ++i) tokens_.push_back(task);
    if (count == 1) cv_.notify_one(); else cv_.notify_all();
  }

 private:
  Pool() {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("STAGEJIT_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v >= 1) n = v;
    }
    if (n < 1) n = 1;
    for (int i = 0; i < n - 1; ++i)
      workers_.emplace_back([this, g = generation_] { work(g); });
  }
  void work(uint64_t generation);

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<GraphTask>> tokens_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
};

// Delivers output `i` of producer `producer` (key base) along edge `e`; appends the node
// index that became ready to `ready`. Caller holds task.mutex.
void deliver_one(GraphTask& task, uint64_t producer, std::size_t i, const Edge& e, Variable value,
                 ReadyList& ready) {
  if (!e.is_valid()) return;
  auto it = task.index.find(e.function.get());
  if (it == task.index.end()) return;
  uint32_t target = it->second;
  uint32_t slot = e.input_nr;
  if (const Node& member = task.nodes[target]; member.joined_into >= 0) {
    slot += member.input_offset;
    target = static_cast<uint32_t>(member.joined_into);
  }
  Node& node = task.nodes[target];
  if (!node.needed && !node.captured) return;
  node.buffer.push_back({(producer << 32) | i, slot, std::move(value)});
  if (--node.deps == 0) ready.push_back(target);
}

// Delivers `outputs` (from producer with key base `producer`) along `edges`, except the
// positions marked in `emitted` (delivered early); appends the node indices that became
// ready to `ready` (in edge order). Caller holds task.mutex.
void deliver(GraphTask& task, uint64_t producer, const std::vector<Edge>& edges,
             variable_list& outputs, ReadyList& ready,
             const std::vector<char>& emitted = {}) {
  for (std::size_t i = 0; i < edges.size(); ++i) {
    if (i < emitted.size() && emitted[i]) continue;
    deliver_one(task, producer, i, edges[i], std::move(outputs[i]), ready);
  }
}

// Sums a ready node's buffer into its inputs (Note [Deterministic fan-in]); stores captures.
void gather(GraphTask& task, uint32_t idx) {
  Node& node = task.nodes[idx];
  // Sums into a compiled stage's inputs follow its host cache setting
  // (ClosureImpl::caches_host_memory): on, they use the cache; off, they stay out of it.
  bool cache = task.cache_host_memory, refuse = task.no_host_cache;
  if (!cache && node.buffer.size() > 1)
    if (const auto* c = std::get_if<ClosureFunction>(&node.fn->kind); c && c->impl) {
      cache = c->impl->caches_host_memory();
      refuse = refuse || !cache;
    }
  memory::HostCacheScope host_cache(cache);
  memory::NoHostCacheScope no_host_cache(refuse && !cache);
  BelowAtenAutograd below_autograd(task.below_aten_autograd);
  std::size_t n = node.fn->num_inputs;
  for (auto& c : node.buffer) n = std::max<std::size_t>(n, c.slot + 1);
  node.inputs.assign(n, Variable());
  if (node.buffer.size() > 1)
    std::sort(node.buffer.begin(), node.buffer.end(), [](const Contribution& a, const Contribution& b) {
      return a.slot != b.slot ? a.slot < b.slot : a.key < b.key;
    });
  for (auto& c : node.buffer) {
    if (!c.value.defined()) continue;
    Variable& acc = node.inputs[c.slot];
    acc = acc.defined() ? stagejit::add(acc, c.value) : std::move(c.value);
  }
  node.buffer.clear();
  if (node.captured) {
    auto it = task.capture_of.find(idx);
    if (it != task.capture_of.end())
      for (auto& [input_nr, slot] : it->second)
        if (input_nr < node.inputs.size()) task.captured[slot] = node.inputs[input_nr];
    if (!node.needed) node.inputs.clear();
  }
}

// The Function the engine is applying on this thread and its graph task, for
// engine::should_compute_output (null outside an engine call). The answer is computed
// on demand: most Functions never ask.
struct Applying {
  const GraphTask* task = nullptr;
  const Function* fn = nullptr;
  const std::shared_ptr<GraphTask>* task_ptr = nullptr;  // for early_output_sink
  uint32_t idx = 0;                                      // fn's node in the task
};
thread_local Applying tl_applying;

struct ApplyingGuard {
  ApplyingGuard(const std::shared_ptr<GraphTask>& task, uint32_t idx, const Function& fn)
      : saved(tl_applying) {
    tl_applying = {task.get(), &fn, &task, idx};
  }
  ~ApplyingGuard() { tl_applying = saved; }
  Applying saved;
};

// Whether output `i` of `fn` leads somewhere `task` needs: with no capture list every
// function of the task runs, so a valid edge is needed. The node records' flags are
// fixed once the task is built, so this reads them without the task's lock.
bool output_needed(const GraphTask& task, const Function& fn, std::size_t i) {
  if (i >= fn.next_functions.size()) return false;
  const Edge& e = fn.next_functions[i];
  if (!e.is_valid()) return false;
  if (task.capture_of.empty()) return true;
  auto it = task.index.find(e.function.get());
  if (it == task.index.end()) return false;
  const Node& t = task.nodes[it->second];
  return t.needed || t.captured;
}

variable_list call_function(const std::shared_ptr<GraphTask>& task_ptr, uint32_t idx, Function& fn,
                            variable_list inputs) {
  GraphTask& task = *task_ptr;
  const std::size_t n = fn.next_functions.size();
  ApplyingGuard applying(task_ptr, idx, fn);
  BelowAtenAutograd below_autograd(task.below_aten_autograd);
  memory::HostCacheScope host_cache(task.cache_host_memory);
  memory::NoHostCacheScope no_host_cache(task.no_host_cache);
  const ExecuteCallbacks* cbs = task.callbacks;
  if (cbs && !cbs->pre.empty()) {
    auto range = cbs->pre.equal_range(&fn);
    for (auto it = range.first; it != range.second; ++it)
      if (!run_callback(it->second, fn, inputs, nullptr, task.call_state)) return variable_list(n);
  }
  using PostRange = std::pair<decltype(cbs->post.cbegin()), decltype(cbs->post.cbegin())>;
  PostRange post;  // one lookup: empty when the Function has no post callback
  if (cbs && !cbs->post.empty()) post = cbs->post.equal_range(&fn);
  const bool has_post = post.first != post.second;
  variable_list outputs;
  if (has_post) {
    outputs = fn.apply(inputs);
    for (auto it = post.first; it != post.second; ++it)
      if (!run_callback(it->second, fn, inputs, &outputs, task.call_state)) return variable_list(n);
  } else {
    outputs = fn.apply(std::move(inputs));
  }
  STAGEJIT_CHECK(outputs.size() == n, "Function '", fn.name(),
                 "' returned an invalid number of outputs - expected ", n, ", but got ",
                 outputs.size());
  if (!task.keep_graph) fn.release_variables();
  return outputs;
}

// Note [Joint nodes]: the Function of a joint node.
class JointImpl final : public ClosureImpl {
 public:
  JointImpl(std::vector<std::shared_ptr<Function>> members, std::shared_ptr<ClosureImpl> runner,
            std::vector<char> present)
      : members_(std::move(members)), runner_(std::move(runner)), present_(std::move(present)) {
    name_ = "JointBackward(";
    for (std::size_t m = 0; m < members_.size(); ++m)
      if (present_[m]) name_ += std::string(name_.back() == '(' ? "" : "+") + members_[m]->name();
    name_ += ")";
  }
  std::string_view name() const override { return name_; }
  bool caches_host_memory() const override { return runner_->caches_host_memory(); }
  variable_list apply(variable_list inputs) override {
    return apply(std::move(inputs), std::vector<char>(total_outputs(), 1));
  }
  variable_list apply(variable_list inputs, const std::vector<char>& needed) override {
    // Split the inputs and the mask by member (present members only, in order).
    std::vector<variable_list> member_inputs(members_.size());
    std::vector<std::vector<char>> member_needed(members_.size());
    std::size_t in = 0, out = 0;
    for (std::size_t m = 0; m < members_.size(); ++m) {
      if (!present_[m]) continue;
      const Function& f = *members_[m];
      member_inputs[m].assign(f.num_inputs, Variable());
      for (std::size_t i = 0; i < f.num_inputs && in < inputs.size(); ++i, ++in)
        member_inputs[m][i] = std::move(inputs[in]);
      member_needed[m].assign(needed.begin() + static_cast<std::ptrdiff_t>(out),
                              needed.begin() + static_cast<std::ptrdiff_t>(out + f.next_functions.size()));
      out += f.next_functions.size();
    }
    std::optional<std::vector<variable_list>> joint;
    {
      std::vector<std::vector<char>> all_needed = member_needed;
      for (std::size_t m = 0; m < members_.size(); ++m)
        if (!present_[m]) all_needed[m].assign(members_[m] ? members_[m]->next_functions.size() : 0, 0);
      std::vector<variable_list> all_inputs = member_inputs;
      joint = runner_->apply_joint(std::move(all_inputs), all_needed, members_);
    }
    variable_list result;
    result.reserve(total_outputs());
    for (std::size_t m = 0; m < members_.size(); ++m) {
      if (!present_[m]) continue;
      Function& f = *members_[m];
      variable_list outs;
      if (joint) {
        outs = std::move((*joint)[m]);
      } else if (auto* c = std::get_if<ClosureFunction>(&f.kind); c && c->impl) {
        outs = c->impl->apply(std::move(member_inputs[m]), member_needed[m]);
      } else {
        outs = f.apply(std::move(member_inputs[m]));
      }
      STAGEJIT_CHECK(outs.size() == f.next_functions.size(), "Function '", f.name(),
                     "' returned an invalid number of outputs in a joint backward - expected ",
                     f.next_functions.size(), ", but got ", outs.size());
      for (auto& o : outs) result.push_back(std::move(o));
    }
    return result;
  }

 private:
  std::size_t total_outputs() const {
    std::size_t n = 0;
    for (std::size_t m = 0; m < members_.size(); ++m)
      if (present_[m]) n += members_[m]->next_functions.size();
    return n;
  }
  std::vector<std::shared_ptr<Function>> members_;
  std::shared_ptr<ClosureImpl> runner_;
  std::vector<char> present_;
  std::string name_;
};

// Note [Joint nodes]: forms the joint nodes of `task` (its dependency counts computed).
void form_joint_nodes(GraphTask& task) {
  const std::size_t original = task.nodes.size();
  auto has_callbacks = [&](const Function* f) {
    return task.callbacks && (task.callbacks->pre.count(f) > 0 || task.callbacks->post.count(f) > 0);
  };
  for (std::size_t idx = 0; idx < original; ++idx) {
    std::shared_ptr<ClosureImpl> runner;
    {
      const Node& node = task.nodes[idx];
      if (!node.needed || node.captured || node.joined_into >= 0) continue;
      const auto* c = std::get_if<ClosureFunction>(&node.fn->kind);
      if (!c || !c->impl) continue;
      runner = c->impl;
    }
    std::vector<std::shared_ptr<Function>> members = runner->joint_members();
    if (members.size() < 2) continue;
    const std::size_t joint_chain = members.size();
    std::vector<char> present(members.size(), 0);
    std::vector<uint32_t> member_idx(members.size(), 0);
    std::size_t count = 0;
    bool self_in = false;
    for (std::size_t m = 0; m < members.size(); ++m) {
      if (!members[m]) continue;
      auto it = task.index.find(members[m].get());
      if (it == task.index.end()) continue;
      const Node& n = task.nodes[it->second];
      if (!n.needed || n.captured || n.joined_into >= 0 || has_callbacks(members[m].get())) continue;
      present[m] = 1;
      member_idx[m] = it->second;
      self_in = self_in || it->second == idx;
      ++count;
    }
    if (!self_in) continue;
    // Note [Joint siblings]: other closures' calls with the same members but the last,
    // which is their own Function (calls of the last stage made by other applications of
    // the chain's call before it), up to the runner's capacity.
    if (const std::size_t capacity = runner->joint_sibling_capacity(); capacity > 0) {
      const void* key = runner->joint_sibling_key();
      for (std::size_t j = 0; j < original && key && members.size() - joint_chain < capacity; ++j) {
        const Node& n = task.nodes[j];
        if (j == idx || !n.needed || n.captured || n.joined_into >= 0 || has_callbacks(n.fn)) continue;
        const auto* c = std::get_if<ClosureFunction>(&n.fn->kind);
        if (!c || !c->impl || c->impl->joint_sibling_key() != key) continue;
        std::vector<std::shared_ptr<Function>> theirs = c->impl->joint_members();
        if (theirs.size() != joint_chain || !theirs.back() || theirs.back().get() != n.fn) continue;
        members.push_back(theirs.back());
        present.push_back(1);
        member_idx.push_back(static_cast<uint32_t>(j));
        ++count;
      }
    }
    // No member may reach another through the task's graph.
    auto members_reach = [&] {
      std::vector<char> is_member(original, 0);
      for (std::size_t m = 0; m < members.size(); ++m)
        if (present[m]) is_member[member_idx[m]] = 1;
      for (std::size_t m = 0; m < members.size(); ++m) {
        if (!present[m]) continue;
        std::vector<char> seen(original, 0);
        std::vector<uint32_t> stack;
        auto push_next = [&](const Function& f) {
          for (const Edge& e : f.next_functions) {
            if (!e.is_valid()) continue;
            auto it = task.index.find(e.function.get());
            if (it == task.index.end() || seen[it->second]) continue;
            seen[it->second] = 1;
            stack.push_back(it->second);
          }
        };
        push_next(*members[m]);
        while (!stack.empty()) {
          const uint32_t n = stack.back();
          stack.pop_back();
          if (is_member[n]) return true;
          push_next(*task.nodes[n].fn);
        }
      }
      return false;
    };
    bool reaches = count >= 2 && members_reach();
    if (reaches && members.size() > joint_chain) {
      // A sibling reaching a member (its grad output computed from u) must not keep the
      // chain from joining: join the chain alone, the siblings run on their own.
      count -= members.size() - joint_chain;
      members.resize(joint_chain);
      present.resize(joint_chain);
      member_idx.resize(joint_chain);
      reaches = count >= 2 && members_reach();
    }
    if (count < 2 || reaches) continue;
    std::vector<Edge> next;
    uint32_t inputs = 0;
    int deps = 0;
    const auto joint_idx = static_cast<int64_t>(task.nodes.size());
    for (std::size_t m = 0; m < members.size(); ++m) {
      if (!present[m]) continue;
      Node& n = task.nodes[member_idx[m]];
      n.joined_into = joint_idx;
      n.input_offset = inputs;
      inputs += members[m]->num_inputs;
      deps += n.deps;
      n.deps = 0;
      next.insert(next.end(), members[m]->next_functions.begin(), members[m]->next_functions.end());
    }
    auto fn = make_function(ClosureFunction{std::make_shared<JointImpl>(members, runner, present)},
                            std::move(next), inputs);
    task.joint_functions.push_back(fn);
    Node joint;
    joint.fn = fn.get();
    joint.deps = deps;
    task.nodes.push_back(std::move(joint));
    task.index.emplace(fn.get(), static_cast<uint32_t>(joint_idx));
  }
}

void record_error(GraphTask& task, const Function& fn) {
  std::lock_guard<std::mutex> lock(task.mutex);
  if (!task.error) {
    task.error = std::current_exception();
    task.error_fn = fn.name();
    task.error_origin = fn.origin;
  }
}

// Gathers the nodes in `ready` and puts those that must run in `to_run` (cleared first).
void gather_ready(GraphTask& task, const ReadyList& ready, ReadyList& to_run) {
  to_run.clear();
  for (uint32_t r : ready) {
    try {
      gather(task, r);
    } catch (...) {
      record_error(task, *task.nodes[r].fn);
      continue;
    }
    if (task.nodes[r].needed) to_run.push_back(r);
  }
}
ReadyList gather_ready(GraphTask& task, const ReadyList& ready) {
  ReadyList to_run;
  gather_ready(task, ready, to_run);
  return to_run;
}

// Runs node `start` and then, on this thread, the first successor each step made ready
// (Note [Engine scheduling]).
void process(const std::shared_ptr<GraphTask>& task_ptr, uint32_t start) {
  GraphTask& task = *task_ptr;
  uint32_t idx = start;
  ReadyList ready, to_run;
  while (true) {
    Node& node = task.nodes[idx];
    bool failed;
    {
      std::lock_guard<std::mutex> lock(task.mutex);
      failed = task.error != nullptr;
    }
    variable_list outputs;
    if (!failed) {
      try {
        outputs = call_function(task_ptr, idx, *node.fn, std::move(node.inputs));
      } catch (...) {
        record_error(task, *node.fn);
        failed = true;
      }
    }
    node.inputs.clear();
    ready.clear();
    if (!failed) {
      std::lock_guard<std::mutex> lock(task.mutex);
      if (!task.error)
        deliver(task, uint64_t{idx} + 1, node.fn->next_functions, outputs, ready, node.emitted);
    }
    outputs.clear();
    gather_ready(task, ready, to_run);
    std::optional<uint32_t> next;
    std::size_t queued = 0;
    bool done;
    {
      std::lock_guard<std::mutex> lock(task.mutex);
      if (task.error) to_run.clear();
      if (!to_run.empty()) {
        next = to_run[0];
        for (std::size_t i = 1; i < to_run.size(); ++i) task.queue.push_back(to_run[i]);
        queued = to_run.size() - 1;
      }
      task.outstanding += static_cast<int>(to_run.size()) - 1;
      done = task.outstanding == 0;
    }
    if (queued > 0 || done) task.cv.notify_all();
    if (queued > 0 && !task.single_threaded) Pool::get().announce(task_ptr, queued);
    if (!next) return;
    idx = *next;
  }
}

void Pool::work(uint64_t generation) {
  while (true) {
    std::shared_ptr<GraphTask> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return generation_ != generation || !tokens_.empty(); });
      if (generation_ != generation) return;
      task = std::move(tokens_.front());
      tokens_.pop_front();
    }
    uint32_t idx;
    {
      std::lock_guard<std::mutex> lock(task->mutex);
      if (task->queue.empty()) continue;
      idx = task->queue.front();
      task->queue.pop_front();
    }
    AutoGradMode grad_mode(task->create_graph);
    TraceHookGuard hook(task->hook);
    process(task, idx);
  }
}

// `error` (not a stagejit class below) as a stagejit error with `prefix`.
[[noreturn]] void rethrow_other(const std::exception_ptr& error, const std::string& prefix) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    rethrow_aten_error(e, prefix);
  } catch (const std::exception& e) {
    throw Error(prefix + e.what());
  } catch (...) {
    throw Error(prefix + "unknown exception");
  }
}

// Rethrows `error` as the first of E, Es... it is, its message prefixed (subclasses must
// come before the classes they derive from); otherwise as `rethrow_other` does.
template <class E, class... Es>
[[noreturn]] void rethrow_prefixed(const std::exception_ptr& error, const std::string& prefix) {
  try {
    std::rethrow_exception(error);
  } catch (const E& e) {
    throw E(prefix + e.what());
  } catch (...) {
  }
  if constexpr (sizeof...(Es) > 0) rethrow_prefixed<Es...>(error, prefix);
  else rethrow_other(error, prefix);
}

// Note [Graph task allocations]
// A compiled stage runs a graph task of its Functions on every call, and at the tests'
// sizes (a PINN of a hundred points) the task's own bookkeeping is a large part of the
// call: glibc's malloc and free took a quarter of a small KdV staged step's samples, and
// the step made about 6 600 heap allocations (heaptrack; deliver_one's contribution
// buffers, the ready lists and the index's regrowth among the largest sources). So an
// input's contributions are kept inline up to two (most inputs get one), the ready lists
// are inline and reused along a chain, the node records move (not copy) when their array
// grows, and the node array and Function index are sized from the task the same callbacks
// (the same compiled stage) ran last on this thread instead of growing by doubling on
// every call. After it: about 5 100 allocations per step, and that step 11-14 % faster
// (bench/higher_order.md, "Session of 2026-12-07, 16:52"). What remains is per Function:
// its inputs and outputs vectors, a Variable and a tensor per output.
struct TaskSizeHints {
  static constexpr std::size_t kEntries = 16;
  std::pair<const void*, std::size_t> entries[kEntries] = {};
  std::pair<const void*, std::size_t>& of(const void* key) noexcept {
    return entries[(reinterpret_cast<uintptr_t>(key) >> 4) % kEntries];
  }
  std::size_t get(const void* key) noexcept {
    const auto& e = of(key);
    return e.first == key ? e.second : 0;
  }
  void set(const void* key, std::size_t n) noexcept { of(key) = {key, n}; }
};
thread_local TaskSizeHints tl_task_sizes;

[[noreturn]] void rethrow_with_name(const GraphTask& task) {
  rethrow_prefixed<ShapeError, DtypeError, TraceError, CompileError, FusionError, IrError,
                   DistributedError>(
      task.error, "Function '" + task.error_fn + "'" +
                      (task.error_origin.empty() ? "" : " (node " + task.error_origin + ")") + ": ");
}

}  // namespace

variable_list execute(const std::vector<Edge>& roots, const variable_list& inputs,
                      const ExecuteOptions& options, const ExecuteCallbacks& callbacks,
                      CallState* state) {
  STAGEJIT_CHECK(roots.size() == inputs.size(), "execute: got ", roots.size(), " roots but ",
                 inputs.size(), " inputs");
  auto task_ptr = std::make_shared<GraphTask>();
  GraphTask& task = *task_ptr;
  task.create_graph = options.create_graph;
  task.keep_graph = options.keep_graph;
  task.single_threaded = options.single_threaded || !Pool::get().has_workers();
  // A graph task started inside an open HostCacheScope (compile()'s trace) keeps it on
  // whichever thread runs its functions.
  task.cache_host_memory = options.cache_host_memory || memory::HostCacheScope::active();
  task.no_host_cache = !task.cache_host_memory && memory::NoHostCacheScope::active();
  task.below_aten_autograd = options.below_aten_autograd;
  task.hook = current_trace_hook();
  task.callbacks = callbacks.empty() ? nullptr : &callbacks;
  task.call_state = state;
  const void* size_key = task.callbacks ? static_cast<const void*>(task.callbacks) : nullptr;
  if (const std::size_t hint = size_key ? tl_task_sizes.get(size_key) : 0; hint > 0) {
    task.nodes.reserve(hint + 4);  // joint nodes come after discovery
    task.index.reserve(hint + 4);
  }

  // Discovery (preorder indices) and post-order, iteratively.
  std::vector<uint32_t> post_order;
  {
    std::vector<std::pair<uint32_t, std::size_t>> stack;
    auto discover = [&](Function* f) {
      auto [it, inserted] = task.index.emplace(f, static_cast<uint32_t>(task.nodes.size()));
      if (inserted) {
        task.nodes.emplace_back();
        task.nodes.back().fn = f;
        stack.emplace_back(it->second, 0);
      }
    };
    for (const Edge& r : roots) {
      if (!r.is_valid()) continue;
      discover(r.function.get());
      while (!stack.empty()) {
        auto& [idx, pos] = stack.back();
        Function* f = task.nodes[idx].fn;
        if (pos < f->next_functions.size()) {
          const Edge& e = f->next_functions[pos++];
          if (e.is_valid()) discover(e.function.get());
        } else {
          post_order.push_back(idx);
          stack.pop_back();
        }
      }
    }
  }
  STAGEJIT_CHECK(!task.nodes.empty(),
                 "execute: there are no graph nodes that require computing gradients");
  if (size_key) tl_task_sizes.set(size_key, task.nodes.size());

  if (!options.capture.empty()) {
    task.captured.resize(options.capture.size());
    for (std::size_t i = 0; i < options.capture.size(); ++i) {
      const Edge& e = options.capture[i];
      if (!e.is_valid()) continue;
      auto it = task.index.find(e.function.get());
      if (it == task.index.end()) continue;
      task.nodes[it->second].captured = true;
      task.capture_of[it->second].emplace_back(e.input_nr, i);
    }
    for (uint32_t idx : post_order) {
      Node& node = task.nodes[idx];
      bool needed = false;
      for (const Edge& e : node.fn->next_functions) {
        if (!e.is_valid()) continue;
        const Node& t = task.nodes[task.index.at(e.function.get())];
        if (t.captured || t.needed) {
          needed = true;
          break;
        }
      }
      node.needed = needed;
    }
  }
  for (const Edge& r : roots)
    if (r.is_valid()) ++task.nodes[task.index.at(r.function.get())].deps;
  for (Node& node : task.nodes) {
    if (!node.needed) continue;
    for (const Edge& e : node.fn->next_functions) {
      if (!e.is_valid()) continue;
      Node& t = task.nodes[task.index.at(e.function.get())];
      if (t.needed || t.captured) ++t.deps;
    }
  }

  if (!options.create_graph) form_joint_nodes(task);

  AutoGradMode grad_mode(options.create_graph);
  ReadyList ready;
  {
    variable_list root_inputs = inputs;
    deliver(task, 0, roots, root_inputs, ready);
  }
  ReadyList to_run = gather_ready(task, ready);
  if (!to_run.empty() && !task.error) {
    {
      std::lock_guard<std::mutex> lock(task.mutex);
      task.outstanding = static_cast<int>(to_run.size());
      for (std::size_t i = 1; i < to_run.size(); ++i) task.queue.push_back(to_run[i]);
    }
    if (!task.single_threaded) Pool::get().announce(task_ptr, to_run.size() - 1);
    process(task_ptr, to_run[0]);
    std::unique_lock<std::mutex> lock(task.mutex);
    while (task.outstanding != 0) {
      if (!task.queue.empty()) {
        uint32_t idx = task.queue.front();
        task.queue.pop_front();
        lock.unlock();
        process(task_ptr, idx);
        lock.lock();
        continue;
      }
      task.cv.wait(lock);
    }
  }
  // Stale pool tokens may keep the task object alive for a moment: drop its contents now.
  variable_list captured = std::move(task.captured);
  {
    std::lock_guard<std::mutex> lock(task.mutex);
    task.nodes.clear();
    task.index.clear();
    task.joint_functions.clear();
  }
  if (task.error) rethrow_with_name(task);
  return captured;
}

namespace engine {
bool should_compute_output(std::size_t i) noexcept {
  const Applying a = tl_applying;
  return !a.fn || output_needed(*a.task, *a.fn, i);
}
bool should_compute_output(const Function& self, std::size_t i) noexcept {
  const Applying a = tl_applying;
  return a.fn != &self || output_needed(*a.task, self, i);
}
OutputSink early_output_sink(const Function& self) {
  const Applying a = tl_applying;
  if (a.fn != &self || !a.task_ptr) return {};
  return [task_ptr = *a.task_ptr, idx = a.idx](std::size_t i, Variable value) {
    GraphTask& task = *task_ptr;
    ReadyList ready;
    {
      std::lock_guard<std::mutex> lock(task.mutex);
      if (task.error || task.nodes.empty()) return;
      Node& node = task.nodes[idx];
      const auto& edges = node.fn->next_functions;
      STAGEJIT_CHECK(i < edges.size(), "Function '", node.fn->name(), "': early output ", i,
                     " of ", edges.size());
      if (node.emitted.empty()) node.emitted.assign(edges.size(), 0);
      STAGEJIT_CHECK(!node.emitted[i], "Function '", node.fn->name(), "': output ", i,
                     " delivered early twice");
      node.emitted[i] = 1;
      deliver_one(task, uint64_t{idx} + 1, i, edges[i], std::move(value), ready);
    }
    ReadyList to_run = gather_ready(task, ready);
    {
      std::lock_guard<std::mutex> lock(task.mutex);
      if (task.error) to_run.clear();
      for (uint32_t r : to_run) task.queue.push_back(r);
      task.outstanding += static_cast<int>(to_run.size());
    }
    if (to_run.empty()) return;
    task.cv.notify_all();
    if (!task.single_threaded) Pool::get().announce(task_ptr, to_run.size());
  };
}
int num_threads() noexcept { return Pool::get().num_threads(); }
void set_num_threads(int n) { Pool::get().set_num_threads(n); }
}  // namespace engine

}  // namespace stagejit
