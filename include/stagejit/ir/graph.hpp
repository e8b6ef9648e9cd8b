#pragma once
/// \file
/// The multi-stage IR: `Graph`, `Node`, `Value`, `Use` (docs/seed-system.md §1.1-1.4, restated for Values).
///
/// Note [Ownership]: a Graph owns every Node it creates (in its list or not); a Node
/// owns its output Values. Everything else holds raw pointers, valid until the node is
/// destroyed or the graph dies.
///
/// Note [Stages]: every node carries a stage (0 forward, 1 backward, ...). Graph inputs
/// are the outputs of `Param` nodes, kept outside the node list, all stages in one list
/// in stage order. Graph outputs are the inputs of the `Return` sentinel, grouped by
/// stage; the graph stores how many outputs each stage has (`stage_output_counts()`),
/// one entry per stage, so an empty stage keeps its (empty) group.
///
/// Note [Joint stage]: a traced graph of k >= 2 derivatives may end with one more stage,
/// k + 1, the *joint* backward of stages 1..k (`TraceOptions::joint_backward`): the
/// backward of the outputs of stages 0..k-1 together, one sweep where stages 1..k would
/// sweep the forward once each. It reads values of stages 0..k-1, never of stage k,
/// beside which it runs (`Graph::stage_reads`).
///
/// Note [Handles]: a Handle value (an opaque backward closure) is only ever the last
/// output of a HostOp or Eval node and the last input of an Eval node (`ir::lint`).
///
/// This header declares; the bodies of the longer members are in ir/graph-inl.hpp
/// (core/config.hpp).

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <ostream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/memory/cell_pool.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>

namespace stagejit::ir {

class Node;
class Value;
class Graph;

/// One input edge: `user->inputs()[offset]` is the value that has this use.
struct Use {
  Node* user = nullptr;
  size_t offset = 0;
  friend bool operator==(const Use&, const Use&) = default;
};

/// Prints `Use(user #id, offset)` (for test and log messages).
STAGEJIT_FUNC std::ostream& operator<<(std::ostream& os, const Use& u);

/// Note [Inline edge lists]: a node's inputs and outputs and a value's uses live inside
/// the node or value (c10::SmallVector; a heap block only past two inputs, two outputs
/// or one use), so a pass walking the graph touches the node and value cells of the
/// graph's pools and nothing else. The accessors return these lists by const reference;
/// copy one (`auto ins = n->inputs();`) to keep a snapshot while mutating the node.

/// A node's inputs or outputs (`Node::inputs()`, `Node::outputs()`, `Graph::outputs()`).
using ValueList = c10::SmallVector<Value*, 2>;
/// A value's uses (`Value::uses()`).
using UseList = c10::SmallVector<Use, 1>;

/// Element-wise comparison of an inline list with a `std::vector` (found by ADL for
/// lists of `Value*`, `Node*` and `Use`).
template <class T>
bool operator==(const c10::SmallVectorImpl<T>& a, const std::vector<T>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}
template <class T>
bool operator==(const std::vector<T>& a, const c10::SmallVectorImpl<T>& b) {
  return b == a;
}

/// Where a node came from in IR text (1-based; 0 when it was not parsed).
struct SourceLocation {
  size_t line = 0, column = 0;
  bool known() const noexcept { return line != 0; }
};

/// The stage of the Return sentinel: at least every real stage.
inline constexpr size_t return_stage = std::numeric_limits<size_t>::max();

/// True for a valid debug name: `[A-Za-z_][A-Za-z0-9_.]*`. Names starting with a
/// digit are reserved for the printer's numbering.
STAGEJIT_FUNC bool valid_value_name(std::string_view name);

namespace detail {

/// Destroys a node and returns its cell to its graph's pool.
struct NodeDeleter {
  void operator()(Node* n) const noexcept;
};
/// Destroys a value and returns its cell to its graph's pool.
struct ValueDeleter {
  void operator()(Value* v) const noexcept;
};
}  // namespace detail

/// Bytes of freed graph storage kept for the next graphs (Note [Pool block cache]).
inline size_t cached_pool_bytes() { return memory::BlockCache::instance().held(); }
/// Frees every cached pool block (the cache fills again as graphs die).
inline void release_cached_pool_blocks() { memory::BlockCache::instance().clear(); }
/// Sets how many bytes of freed graph storage are kept (default 64 MiB; 0 keeps none)
/// and frees what is over the new limit.
inline void set_pool_cache_limit(size_t bytes) { memory::BlockCache::instance().set_limit(bytes); }
/// The current limit of `set_pool_cache_limit`, in bytes.
inline size_t pool_cache_limit() { return memory::BlockCache::instance().limit(); }

/// A value: one output of one node (graph inputs are outputs of Param nodes).
class Value {
 public:
  Value(const Value&) = delete;
  Value& operator=(const Value&) = delete;

  /// The node producing this value.
  Node* node() const noexcept { return node_; }
  /// Index of this value among its node's outputs.
  size_t offset() const noexcept { return offset_; }
  /// Graph-unique id (stable; not the printed name).
  size_t id() const noexcept { return id_; }
  /// The stage of the producing node.
  size_t stage() const noexcept;
  Graph* owning_graph() const noexcept;

  const Type& type() const noexcept { return type_; }
  Value* set_type(Type type) {
    type_ = std::move(type);
    return this;
  }
  bool is_handle() const noexcept { return std::holds_alternative<HandleType>(type_); }
  /// The tensor type, or nullptr for Handle and unknown values.
  const TensorType* tensor_type() const noexcept { return std::get_if<TensorType>(&type_); }

  /// The debug name (empty when the printer numbers it).
  const std::string& name() const noexcept { return name_; }
  bool has_name() const noexcept { return !name_.empty(); }
  /// Sets the debug name; "" clears it. Throws IrError unless `valid_value_name`.
  /// Uniqueness within the graph is checked by `lint`.
  Value* set_name(std::string name);

  /// The edges that read this value, in the order they were added.
  const UseList& uses() const noexcept { return uses_; }
  bool has_uses() const noexcept { return !uses_.empty(); }
  /// Redirects every use (graph outputs included) to `other`. Throws IrError when
  /// `other` belongs to another graph.
  void replace_all_uses_with(Value* other);

 private:
  friend class Node;
  friend class Graph;
  friend struct detail::ValueDeleter;
  Value(Node* node, size_t offset, size_t id, Type type)
      : node_(node), offset_(offset), id_(id), type_(std::move(type)) {}
  void remove_use(Node* user, size_t offset) {
    // Searched from the back: passes remove nodes latest first (DCE, the fuser), and a
    // later node's use was appended later, so a value with many uses is not rescanned.
    auto rit = std::find(uses_.rbegin(), uses_.rend(), Use{user, offset});
    STAGEJIT_ASSERT(rit != uses_.rend(), "use list out of sync");
    uses_.erase(std::next(rit).base());
  }

  Node* node_;
  size_t offset_;
  size_t id_;
  Type type_;
  std::string name_;
  UseList uses_;
};

/// A node: a kind (`NodeKind`), a stage, ordered inputs and owned outputs.
class Node {
 public:
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  const NodeKind& kind() const noexcept { return kind_; }
  NodeKind& kind() noexcept { return kind_; }
  template <class K>
  bool is() const noexcept { return std::holds_alternative<K>(kind_); }
  template <class K>
  K* get_if() noexcept { return std::get_if<K>(&kind_); }
  template <class K>
  const K* get_if() const noexcept { return std::get_if<K>(&kind_); }
  /// The kind as `K`; throws IrError naming the node when it is another kind.
  template <class K>
  K& get() {
    STAGEJIT_CHECK_AS(IrError, is<K>(), "node #", id_, " is ", describe(), ", not ",
                      ir::kind_name<K>());
    return std::get<K>(kind_);
  }
  /// A short name for messages: the op name for Op, `^name` for HostOp, else the kind.
  std::string describe() const;

  size_t id() const noexcept { return id_; }
  size_t stage() const noexcept { return stage_; }
  /// Sets the stage (and makes the graph have at least `stage + 1` stages).
  Node* set_stage(size_t stage);
  Graph* owning_graph() const noexcept { return graph_; }
  const SourceLocation& location() const noexcept { return location_; }
  Node* set_location(SourceLocation loc) {
    location_ = loc;
    return this;
  }

  // ---- inputs
  const ValueList& inputs() const noexcept { return inputs_; }
  /// Input `i`; throws IrError when out of range.
  Value* input(size_t i) const {
    STAGEJIT_CHECK_AS(IrError, i < inputs_.size(), "node #", id_, " (", describe(), ") has ",
                      inputs_.size(), " inputs, asked for input ", i);
    return inputs_[i];
  }
  /// Appends an input (and its use). Throws IrError for a value of another graph.
  Value* add_input(Value* v) {
    check_same_graph(v);
    v->uses_.push_back(Use{this, inputs_.size()});
    inputs_.push_back(v);
    return v;
  }
  /// Inserts an input at position `i`, renumbering the uses of later inputs.
  Value* insert_input(size_t i, Value* v);
  /// Replaces input `i` by `v`; returns the old value.
  Value* replace_input(size_t i, Value* v);
  /// Replaces every input equal to `from` by `to`.
  void replace_input_with(Value* from, Value* to);
  /// Removes input `i`, renumbering the uses of later inputs.
  void remove_input(size_t i);
  void remove_all_inputs() {
    while (!inputs_.empty()) remove_input(inputs_.size() - 1);
  }

  // ---- outputs
  const ValueList& outputs() const noexcept { return outputs_; }
  /// Output `i`; throws IrError when out of range.
  Value* output(size_t i) const {
    STAGEJIT_CHECK_AS(IrError, i < outputs_.size(), "node #", id_, " (", describe(), ") has ",
                      outputs_.size(), " outputs, asked for output ", i);
    return outputs_[i];
  }
  /// The only output; throws IrError when the node has not exactly one.
  Value* output() const {
    STAGEJIT_CHECK_AS(IrError, outputs_.size() == 1, "node #", id_, " (", describe(), ") has ",
                      outputs_.size(), " outputs, expected exactly one");
    return outputs_[0];
  }
  /// Appends an output of the given type.
  Value* add_output(Type type = UnknownType{});
  /// Removes output `i` (which must have no uses), renumbering later offsets.
  void erase_output(size_t i);
  /// Redirects the uses of each output to the same-index output of `other`.
  void replace_all_uses_with(Node* other);

  // ---- position in the node list
  /// True when the node is in its graph's node list.
  bool in_list() const noexcept { return next_ != nullptr; }
  Node* next() const noexcept { return next_; }
  Node* prev() const noexcept { return prev_; }
  /// Inserts this (unlisted) node before `n` (which is listed, or the Return node).
  Node* insert_before(Node* n);
  /// Inserts this (unlisted) node after the listed node `n`.
  Node* insert_after(Node* n);
  void move_before(Node* n) {
    remove_from_list();
    insert_before(n);
  }
  void move_after(Node* n) {
    remove_from_list();
    insert_after(n);
  }
  /// Takes the node out of the list (it stays owned by the graph).
  void remove_from_list();
  /// True when this listed node comes before the listed node `n`. O(distance).
  bool is_before(const Node* n) const;
  /// Removes the node from the graph and frees it. Its outputs must have no uses
  /// (IrError otherwise); its inputs' uses are dropped.
  void destroy();

  /// See `ir::has_side_effects`.
  bool has_side_effects() const { return ir::has_side_effects(kind_); }

 private:
  friend class Graph;
  friend class Value;
  friend struct detail::NodeDeleter;
  Node(Graph* graph, NodeKind kind, size_t id, size_t stage)
      : graph_(graph), kind_(std::move(kind)), id_(id), stage_(stage) {}
  /// Destroys the outputs (they live in the graph's value pool and die with the node).
  ~Node();
  void check_same_graph(Value* v) const {
    STAGEJIT_CHECK_AS(IrError, v != nullptr, "node #", id_, " (", describe(), "): null input");
    STAGEJIT_CHECK_AS(IrError, v->owning_graph() == graph_, "node #", id_, " (", describe(),
                      "): input value #", v->id(), " belongs to another graph");
  }
  void renumber_use(size_t from, size_t to) {
    for (auto& u : inputs_[from]->uses_)
      if (u.user == this && u.offset == from) {
        u.offset = to;
        return;
      }
  }

  Graph* graph_;
  NodeKind kind_;
  size_t id_;
  size_t stage_;
  ValueList inputs_;
  ValueList outputs_;  // owned: destroyed by ~Node and erase_output
  Node* prev_ = nullptr;
  Node* next_ = nullptr;
  size_t owner_slot_ = 0;  // index in the graph's `owned_`
  SourceLocation location_;
};

/// A multi-stage graph (Note [Stages]). Not copyable: use `clone()`.
class Graph {
 public:
  Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph();

  // ---------------------------------------------------------------- inputs
  /// Adds a graph input of `stage` (a Param node's output), placed after every input
  /// of stage <= `stage` so inputs stay in stage order. Returns the new value.
  Value* add_input(Type type, size_t stage, std::string name = {});
  /// All graph inputs, stage 0 first.
  const std::vector<Value*>& inputs() const noexcept { return inputs_; }
  /// The inputs of one stage, in order.
  std::vector<Value*> stage_inputs(size_t stage) const;
  /// Removes graph input `i`, which must have no uses.
  void erase_input(size_t i);

  // ---------------------------------------------------------------- outputs
  /// Appends `v` to the outputs of `stage` (after that stage's earlier outputs, before
  /// any later stage's). Returns its index in `outputs()`.
  size_t register_output(Value* v, size_t stage);
  /// All graph outputs, grouped by stage (stage 0 first).
  const ValueList& outputs() const noexcept { return return_node_->inputs(); }
  /// How many outputs each stage has; one entry per stage (Note [Stages]).
  const std::vector<size_t>& stage_output_counts() const noexcept { return stage_output_counts_; }
  /// The outputs of one stage.
  std::vector<Value*> stage_outputs(size_t stage) const;
  /// The stage whose group holds output `i`.
  size_t output_stage(size_t i) const;
  /// Removes graph output `i` from its stage group.
  void erase_output(size_t i);
  /// The Return sentinel (its inputs are the outputs). Not in `nodes()`.
  Node* return_node() const noexcept { return return_node_; }

  // ---------------------------------------------------------------- stages
  /// Number of stages (= `stage_output_counts().size()`, at least 1).
  size_t num_stages() const noexcept { return stage_output_counts_.size(); }
  /// Makes the graph have at least `stage + 1` stages (adding empty output groups).
  void ensure_stage(size_t stage);
  /// The stage stamped on nodes made by `create` (docs/seed-system.md §1.1 "new_node_stage").
  size_t current_stage() const noexcept { return current_stage_; }
  void set_current_stage(size_t stage) {
    ensure_stage(stage);
    current_stage_ = stage;
  }
  /// The joint stage (Note [Joint stage]), or 0 when the graph has none.
  size_t joint_stage() const noexcept { return joint_stage_; }
  /// Marks `stage` (>= 3, the last stage) as the joint stage; 0 clears it.
  void set_joint_stage(size_t stage) {
    STAGEJIT_CHECK_AS(IrError, stage == 0 || (stage >= 3 && stage + 1 == num_stages()),
                      "set_joint_stage: stage ", stage, " of a graph of ", num_stages(),
                      " stages (the joint stage is the last one, after at least two backward stages)");
    joint_stage_ = stage;
  }
  /// Note [Joint siblings] (passes/joint_siblings.hpp): how the joint stage's inputs and
  /// outputs are laid out when `passes::add_joint_siblings` gave it copies for sibling
  /// calls. `copies` 0: none (the joint stage's inputs and outputs are the trace's).
  struct JointSiblings {
    size_t copies = 0;     ///< sibling copies of the last stage's backward
    size_t gradients = 0;  ///< per copy: the gradient inputs of the last member (stage k)
    size_t values = 0;     ///< per copy: the stage k-1 values read from the sibling's environment
    size_t outputs = 0;    ///< the joint stage's outputs before the `values` tie outputs
  };
  const JointSiblings& joint_siblings() const noexcept { return joint_siblings_; }
  void set_joint_siblings(const JointSiblings& s) { joint_siblings_ = s; }
  /// Whether a node of stage `reader` may read a value of stage `producer`: an earlier
  /// or the same stage, except that the joint stage does not read the stage before it
  /// (Note [Joint stage]).
  bool stage_reads(size_t reader, size_t producer) const noexcept {
    return producer <= reader && !(joint_stage_ != 0 && reader == joint_stage_ && producer + 1 == reader);
  }

  // ---------------------------------------------------------------- nodes
  /// Makes an unlisted node of `kind` at `current_stage()` with `inputs` and one output
  /// per entry of `output_types`. Param and Return cannot be created (IrError): use
  /// `add_input` / `register_output`.
  Node* create(NodeKind kind, c10::ArrayRef<Value*> inputs = {},
               const std::vector<Type>& output_types = {UnknownType{}});
  /// Appends `n` (unlisted, of this graph) at the end of the node list.
  Node* append(Node* n) { return n->insert_before(return_node_); }
  /// Inserts `n` at the front of the node list.
  Node* prepend(Node* n) { return n->insert_after(return_node_); }
  /// `create` then `append`.
  Node* create_and_append(NodeKind kind, c10::ArrayRef<Value*> inputs = {},
                          const std::vector<Type>& output_types = {UnknownType{}}) {
    return append(create(std::move(kind), inputs, output_types));
  }
  /// An appended Constant node holding `value` (kept as given; its type is taken from
  /// it). Throws IrError for an undefined tensor.
  Value* append_constant(const at::Tensor& value);
  /// An appended Undefined node's output.
  Value* append_undefined() { return create_and_append(Undefined{}, {}, {UnknownType{}})->output(); }

  /// The listed nodes in order (a topological order), as a snapshot safe to mutate
  /// the graph while iterating.
  std::vector<Node*> nodes() const;
  /// Every node the graph owns (listed or not, Params and Return included), unordered.
  std::vector<Node*> all_nodes() const;
  /// One past the largest node or value id made so far: ids are dense and never reused,
  /// so a vector of this size maps every id of the graph (passes use such dense maps).
  size_t id_bound() const noexcept { return next_id_; }
  /// True when `n` (a live node of any graph) is owned by this graph.
  bool owns(const Node* n) const {
    return n && n->graph_ == this && n->owner_slot_ < owned_.size() &&
           owned_[n->owner_slot_].get() == n;
  }

  // ---------------------------------------------------------------- copying
  /// Makes an unlisted copy of `n` in this graph: same kind (FusionGroup subgraphs
  /// deep-copied), stage, output types and (when `copy_names`) names; inputs mapped
  /// through `value_map`.
  Node* create_clone(const Node& n, const std::function<Value*(Value*)>& value_map,
                     bool copy_names = false);
  /// A deep copy: same inputs, nodes, stages, names, outputs and output groups. With
  /// `value_map`, it is set to the copy of each value, indexed by the value's id here
  /// (size `id_bound()`, null for ids of no live value).
  std::shared_ptr<Graph> clone(std::vector<Value*>* value_map = nullptr) const;
  /// Copies the nodes of `sub` before `insert_point` (a listed node of this graph or the
  /// Return node), feeding `sub`'s inputs from `inputs`; the copies get `stage`.
  /// Returns the values that correspond to `sub`'s outputs. (Inlining a FusionGroup.)
  std::vector<Value*> inline_graph(const Graph& sub, c10::ArrayRef<Value*> inputs,
                                   Node* insert_point, size_t stage);

  /// The value whose debug name is `name`, or nullptr.
  Value* find_value(std::string_view name) const;

 private:
  friend class Node;
  Node* new_node(NodeKind kind, size_t stage);
  // Frees `n` (owned by this graph): the last owned node takes its slot.
  void release(Node* n);
  size_t next_value_id() { return next_id_++; }

  friend struct detail::NodeDeleter;
  friend struct detail::ValueDeleter;
  // Declared before owned_, so they outlive the nodes and values in them.
  memory::CellPool<sizeof(Node), alignof(Node)> node_pool_;
  memory::CellPool<sizeof(Value), alignof(Value)> value_pool_;
  // Every node (listed or not, Params and Return included), in creation order until
  // nodes are destroyed; a vector, not a hash map: graphs of 10^4..10^5 nodes are built,
  // cloned and freed on every compile (bench/closure).
  std::vector<std::unique_ptr<Node, detail::NodeDeleter>> owned_;
  Node* return_node_;
  std::vector<Value*> inputs_;
  std::vector<size_t> stage_output_counts_;
  size_t current_stage_ = 0;
  size_t joint_stage_ = 0;  // Note [Joint stage]
  JointSiblings joint_siblings_;  // Note [Joint siblings]
  size_t next_id_ = 0;
};

// ---------------------------------------------------------------- out-of-line members

inline void detail::NodeDeleter::operator()(Node* n) const noexcept {
  Graph* g = n->graph_;
  n->~Node();
  g->node_pool_.deallocate(n);
}

inline void detail::ValueDeleter::operator()(Value* v) const noexcept {
  Graph* g = v->node_->owning_graph();  // the node is alive (values die with or before it)
  v->~Value();
  g->value_pool_.deallocate(v);
}

inline Node::~Node() {
  for (Value* v : outputs_) detail::ValueDeleter{}(v);
}

inline size_t Value::stage() const noexcept { return node_->stage(); }
inline Graph* Value::owning_graph() const noexcept { return node_->owning_graph(); }

}  // namespace stagejit::ir

#ifdef STAGEJIT_HEADER_TEST_CASES
#include <stagejit/testing/doctest.hpp>
TEST_SUITE("ir") {
  TEST_CASE("Graph keeps use lists, input stage order and per-stage output groups") {
    using namespace stagejit::ir;
    Graph g;
    Value* x = g.add_input(TensorType::contiguous(at::kFloat, {3}), 0, "x");
    Value* gy = g.add_input(TensorType::contiguous(at::kFloat, {3}), 1, "gy");
    Value* w = g.add_input(TensorType::contiguous(at::kFloat, {3}), 0, "w");
    CHECK(g.inputs() == std::vector<Value*>{x, w, gy});
    Node* m = g.create_and_append(Op::with("mul"), {x, w}, {x->type()});
    CHECK(x->uses() == std::vector<Use>{{m, 0}});
    g.set_current_stage(1);
    Node* m2 = g.create_and_append(Op::with("mul"), {gy, w}, {x->type()});
    CHECK(m2->stage() == 1);
    g.register_output(m2->output(), 1);
    g.register_output(m->output(), 0);
    CHECK(g.outputs() == std::vector<Value*>{m->output(), m2->output()});
    CHECK(g.stage_output_counts() == std::vector<size_t>{1, 1});
    m->output()->replace_all_uses_with(x);
    CHECK(g.outputs()[0] == x);
    m->destroy();
    CHECK(g.nodes() == std::vector<Node*>{m2});
    CHECK(w->uses() == std::vector<Use>{{m2, 1}});
    CHECK_THROWS_AS(m2->destroy(), stagejit::IrError);
  }
  TEST_CASE("a dying graph's full pool blocks are cached and reused, up to the limit") {
    using namespace stagejit::ir;
    release_cached_pool_blocks();
    CHECK(cached_pool_bytes() == 0);
    auto build = [] {
      auto g = std::make_shared<Graph>();
      Value* x = g->add_input(TensorType::contiguous(at::kDouble, {2, 3}), 0, "x");
      for (int i = 0; i < 1000; ++i) x = g->create_and_append(Op::with("neg"), {x}, {x->type()})->output();
      g->register_output(x, 0);
      return g;
    };
    build().reset();
    const size_t held = cached_pool_bytes();
    CHECK(held > 0);  // 1000 nodes and values fill full-size blocks
    auto g = build();  // takes the cached blocks again
    CHECK(cached_pool_bytes() < held);
    CHECK(g->nodes().size() == 1000);
    CHECK(g->outputs()[0]->tensor_type()->sizes == DimList{2, 3});
    const size_t limit = pool_cache_limit();
    set_pool_cache_limit(0);
    g.reset();
    CHECK(cached_pool_bytes() == 0);  // nothing kept with a limit of 0
    set_pool_cache_limit(limit);
    build().reset();
    CHECK(cached_pool_bytes() == held);
    release_cached_pool_blocks();
    CHECK(cached_pool_bytes() == 0);
  }
}
#endif
