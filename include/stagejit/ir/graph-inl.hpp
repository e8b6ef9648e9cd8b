#pragma once
/// \file
/// Bodies of ir/graph.hpp (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/core/error.hpp>

#include <algorithm>
#include <cctype>
#include <functional>
#include <memory>
#include <new>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace stagejit::ir {

STAGEJIT_FUNC bool valid_value_name(std::string_view name) {
  if (name.empty() || !(std::isalpha(static_cast<unsigned char>(name[0])) || name[0] == '_'))
    return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.')) return false;
  return true;
}

STAGEJIT_FUNC Value* Value::set_name(std::string name) {
  STAGEJIT_CHECK_AS(IrError, name.empty() || valid_value_name(name), "invalid value name '",
                    name, "': expected [A-Za-z_][A-Za-z0-9_.]*");
  name_ = std::move(name);
  return this;
}

STAGEJIT_FUNC std::string Node::describe() const {
  if (auto op = get_if<Op>()) return std::string(op->name());
  if (auto h = get_if<HostOp>()) return "^" + h->name;
  return std::string(ir::kind_name(kind_));
}

STAGEJIT_FUNC Value* Node::insert_input(size_t i, Value* v) {
  check_same_graph(v);
  STAGEJIT_CHECK_AS(IrError, i <= inputs_.size(), "insert_input position ", i, " past ",
                    inputs_.size(), " inputs");
  for (size_t j = i; j < inputs_.size(); ++j) renumber_use(j, j + 1);
  inputs_.insert(inputs_.begin() + i, v);
  v->uses_.push_back(Use{this, i});
  return v;
}

STAGEJIT_FUNC Value* Node::replace_input(size_t i, Value* v) {
  check_same_graph(v);
  Value* old = input(i);
  old->remove_use(this, i);
  inputs_[i] = v;
  v->uses_.push_back(Use{this, i});
  return old;
}

STAGEJIT_FUNC void Node::replace_input_with(Value* from, Value* to) {
  for (size_t i = 0; i < inputs_.size(); ++i)
    if (inputs_[i] == from) replace_input(i, to);
}

STAGEJIT_FUNC void Node::remove_input(size_t i) {
  input(i)->remove_use(this, i);
  for (size_t j = i + 1; j < inputs_.size(); ++j) renumber_use(j, j - 1);
  inputs_.erase(inputs_.begin() + i);
}

STAGEJIT_FUNC void Node::erase_output(size_t i) {
  Value* v = output(i);
  STAGEJIT_CHECK_AS(IrError, !v->has_uses(), "cannot erase output ", i, " of node #", id_,
                    " (", describe(), "): it still has ", v->uses().size(), " uses");
  outputs_.erase(outputs_.begin() + i);
  for (size_t j = i; j < outputs_.size(); ++j) outputs_[j]->offset_ = j;
  detail::ValueDeleter{}(v);
}

STAGEJIT_FUNC void Node::replace_all_uses_with(Node* other) {
  STAGEJIT_CHECK_AS(IrError, other->outputs_.size() == outputs_.size(), "node #", id_,
                    " has ", outputs_.size(), " outputs but its replacement #", other->id_,
                    " has ", other->outputs_.size());
  for (size_t i = 0; i < outputs_.size(); ++i) outputs_[i]->replace_all_uses_with(other->outputs_[i]);
}

STAGEJIT_FUNC void Node::remove_from_list() {
  STAGEJIT_CHECK_AS(IrError, in_list() && !is<Return>(), "node #", id_,
                    " is not in the node list");
  prev_->next_ = next_;
  next_->prev_ = prev_;
  prev_ = next_ = nullptr;
}

STAGEJIT_FUNC Graph::Graph() {
  return_node_ = new_node(Return{}, return_stage);
  return_node_->prev_ = return_node_->next_ = return_node_;
  stage_output_counts_.push_back(0);
}

STAGEJIT_FUNC Graph::~Graph() {
  // Drop every edge first so destruction order does not matter; free the nodes while
  // their pool is alive.
  for (auto& n : owned_) n->inputs_.clear();
  owned_.clear();
}

STAGEJIT_FUNC Value* Graph::add_input(Type type, size_t stage, std::string name) {
  ensure_stage(stage);
  Node* param = new_node(Param{}, stage);
  Value* v = param->add_output(std::move(type));
  v->set_name(std::move(name));
  // Inputs are sorted by stage: the first input of a later stage is found by binary
  // search (appending, the common case, stays O(log n)).
  auto pos = std::upper_bound(inputs_.begin(), inputs_.end(), stage,
                              [](size_t s, const Value* in) { return s < in->stage(); });
  inputs_.insert(pos, v);
  return v;
}

STAGEJIT_FUNC std::vector<Value*> Graph::stage_inputs(size_t stage) const {
  std::vector<Value*> out;
  for (Value* v : inputs_)
    if (v->stage() == stage) out.push_back(v);
  return out;
}

STAGEJIT_FUNC void Graph::erase_input(size_t i) {
  STAGEJIT_CHECK_AS(IrError, i < inputs_.size(), "graph has ", inputs_.size(),
                    " inputs, cannot erase input ", i);
  Value* v = inputs_[i];
  STAGEJIT_CHECK_AS(IrError, !v->has_uses(), "cannot erase graph input ", i, ": it has ",
                    v->uses().size(), " uses");
  inputs_.erase(inputs_.begin() + i);
  release(v->node());
}

STAGEJIT_FUNC size_t Graph::register_output(Value* v, size_t stage) {
  ensure_stage(stage);
  size_t pos = 0;
  for (size_t s = 0; s <= stage; ++s) pos += stage_output_counts_[s];
  return_node_->insert_input(pos, v);
  ++stage_output_counts_[stage];
  return pos;
}

STAGEJIT_FUNC std::vector<Value*> Graph::stage_outputs(size_t stage) const {
  STAGEJIT_CHECK_AS(IrError, stage < stage_output_counts_.size(), "graph has ",
                    stage_output_counts_.size(), " stages, asked for outputs of stage ", stage);
  size_t begin = 0;
  for (size_t s = 0; s < stage; ++s) begin += stage_output_counts_[s];
  const auto& outs = outputs();
  return {outs.begin() + begin, outs.begin() + begin + stage_output_counts_[stage]};
}

STAGEJIT_FUNC size_t Graph::output_stage(size_t i) const {
  STAGEJIT_CHECK_AS(IrError, i < outputs().size(), "graph has ", outputs().size(),
                    " outputs, asked for output ", i);
  for (size_t s = 0;; ++s) {
    if (i < stage_output_counts_[s]) return s;
    i -= stage_output_counts_[s];
  }
}

STAGEJIT_FUNC void Graph::erase_output(size_t i) {
  size_t stage = output_stage(i);
  return_node_->remove_input(i);
  --stage_output_counts_[stage];
}

STAGEJIT_FUNC void Graph::ensure_stage(size_t stage) {
  STAGEJIT_CHECK_AS(IrError, stage != return_stage && stage < (size_t(1) << 20),
                    "stage ", stage, " is out of range");
  if (stage_output_counts_.size() <= stage) stage_output_counts_.resize(stage + 1, 0);
}

STAGEJIT_FUNC Node* Graph::create(NodeKind kind, c10::ArrayRef<Value*> inputs,
             const std::vector<Type>& output_types) {
  STAGEJIT_CHECK_AS(IrError,
                    !std::holds_alternative<Param>(kind) && !std::holds_alternative<Return>(kind),
                    "Graph::create cannot make ", ir::kind_name(kind),
                    " nodes (use add_input / register_output)");
  Node* n = new_node(std::move(kind), current_stage_);
  n->inputs_.reserve(inputs.size());  // one block each instead of growing by doubling
  n->outputs_.reserve(output_types.size());
  for (Value* v : inputs) n->add_input(v);
  for (const Type& t : output_types) n->add_output(t);
  return n;
}

STAGEJIT_FUNC Value* Graph::append_constant(const at::Tensor& value) {
  STAGEJIT_CHECK_AS(IrError, value.defined(), "a Constant needs a defined tensor");
  return create_and_append(Constant{value}, {}, {TensorType::of(value)})->output();
}

STAGEJIT_FUNC std::vector<Node*> Graph::nodes() const {
  std::vector<Node*> out;
  for (Node* n = return_node_->next_; n != return_node_; n = n->next_) out.push_back(n);
  return out;
}

STAGEJIT_FUNC std::vector<Node*> Graph::all_nodes() const {
  std::vector<Node*> out;
  out.reserve(owned_.size());
  for (auto& n : owned_) out.push_back(n.get());
  return out;
}

STAGEJIT_FUNC Node* Graph::create_clone(const Node& n, const std::function<Value*(Value*)>& value_map,
                   bool copy_names) {
  NodeKind kind = n.kind_;
  if (auto fg = std::get_if<FusionGroup>(&kind); fg && fg->subgraph) fg->subgraph = fg->subgraph->clone();
  STAGEJIT_CHECK_AS(IrError, !std::holds_alternative<Param>(kind) && !std::holds_alternative<Return>(kind),
                    "create_clone cannot copy a ", ir::kind_name(kind), " node");
  Node* c = new_node(std::move(kind), n.stage_);
  ensure_stage(n.stage_);
  c->inputs_.reserve(n.inputs_.size());
  c->outputs_.reserve(n.outputs_.size());
  for (Value* v : n.inputs_) c->add_input(value_map(v));
  for (Value* v : n.outputs_) {
    Value* o = c->add_output(v->type_);
    if (copy_names) o->name_ = v->name_;
  }
  c->location_ = n.location_;
  return c;
}

STAGEJIT_FUNC std::shared_ptr<Graph> Graph::clone(std::vector<Value*>* value_map) const {
  auto g = std::make_shared<Graph>();
  g->owned_.reserve(owned_.size());
  // Value ids are dense (< next_id_): the map is a vector indexed by id.
  std::vector<Value*> map(next_id_, nullptr);
  for (Value* in : inputs_) map[in->id()] = g->add_input(in->type_, in->stage(), in->name_);
  auto lookup = [&](Value* v) {
    Value* to = v->id() < map.size() ? map[v->id()] : nullptr;
    STAGEJIT_CHECK_AS(IrError, to != nullptr, "clone: value #", v->id(),
                      " is used before it is defined");
    return to;
  };
  for (Node* n = return_node_->next_; n != return_node_; n = n->next_) {
    Node* c = g->append(g->create_clone(*n, lookup, true));
    for (size_t i = 0; i < n->outputs_.size(); ++i) map[n->outputs_[i]->id()] = c->outputs_[i];
  }
  g->stage_output_counts_.assign(stage_output_counts_.size(), 0);
  for (size_t i = 0; i < outputs().size(); ++i)
    g->register_output(lookup(outputs()[i]), output_stage(i));
  g->current_stage_ = current_stage_;
  g->joint_stage_ = joint_stage_;
  g->joint_siblings_ = joint_siblings_;
  if (value_map) *value_map = std::move(map);
  return g;
}

STAGEJIT_FUNC std::vector<Value*> Graph::inline_graph(const Graph& sub, c10::ArrayRef<Value*> inputs,
                                 Node* insert_point, size_t stage) {
  STAGEJIT_CHECK_AS(IrError, inputs.size() == sub.inputs_.size(), "inline_graph: subgraph has ",
                    sub.inputs_.size(), " inputs, given ", inputs.size());
  std::vector<Value*> map(sub.next_id_, nullptr);  // by id of `sub`'s values
  for (size_t i = 0; i < inputs.size(); ++i) map[sub.inputs_[i]->id()] = inputs[i];
  auto lookup = [&](Value* v) {
    Value* to = v->id() < map.size() ? map[v->id()] : nullptr;
    STAGEJIT_CHECK_AS(IrError, to != nullptr, "inline_graph: value #", v->id(),
                      " is used before it is defined");
    return to;
  };
  for (Node* n = sub.return_node_->next_; n != sub.return_node_; n = n->next_) {
    Node* c = create_clone(*n, lookup)->set_stage(stage);
    c->insert_before(insert_point);
    for (size_t i = 0; i < n->outputs_.size(); ++i) map[n->outputs_[i]->id()] = c->outputs_[i];
  }
  std::vector<Value*> outs;
  for (Value* v : sub.outputs()) outs.push_back(lookup(v));
  return outs;
}

STAGEJIT_FUNC Value* Graph::find_value(std::string_view name) const {
  for (auto& n : owned_)
    for (Value* v : n->outputs_)
      if (v->name_ == name) return v;
  return nullptr;
}

STAGEJIT_FUNC Node* Graph::new_node(NodeKind kind, size_t stage) {
  Node* raw = node_pool_.construct(
      [&](void* cell) { return new (cell) Node(this, std::move(kind), next_id_++, stage); });
  std::unique_ptr<Node, detail::NodeDeleter> n(raw);
  n->owner_slot_ = owned_.size();
  owned_.push_back(std::move(n));
  return raw;
}

STAGEJIT_FUNC void Graph::release(Node* n) {
  const size_t slot = n->owner_slot_;
  std::unique_ptr<Node, detail::NodeDeleter> dead = std::move(owned_[slot]);
  if (slot + 1 != owned_.size()) {
    owned_[slot] = std::move(owned_.back());
    owned_[slot]->owner_slot_ = slot;
  }
  owned_.pop_back();
}

STAGEJIT_FUNC std::ostream& operator<<(std::ostream& os, const Use& u) {
  return os << "Use(user #" << (u.user ? u.user->id() : 0) << ", offset " << u.offset << ")";
}

STAGEJIT_FUNC void Value::replace_all_uses_with(Value* other) {
  STAGEJIT_CHECK_AS(IrError, other && other->owning_graph() == owning_graph(),
                    "replace_all_uses_with: replacement of value #", id_,
                    " must belong to the same graph");
  if (other == this) return;
  auto uses = uses_;
  for (const Use& u : uses) u.user->replace_input(u.offset, other);
}

STAGEJIT_FUNC Node* Node::set_stage(size_t stage) {
  STAGEJIT_CHECK_AS(IrError, !is<Return>(), "the Return node's stage is fixed");
  graph_->ensure_stage(stage);
  stage_ = stage;
  return this;
}

STAGEJIT_FUNC Value* Node::add_output(Type type) {
  // Room first (doubling), so that nothing throws once the value is made.
  if (outputs_.size() == outputs_.capacity()) outputs_.reserve(std::max<size_t>(1, 2 * outputs_.size()));
  Value* raw = graph_->value_pool_.construct([&](void* cell) {
    return new (cell) Value(this, outputs_.size(), graph_->next_value_id(), std::move(type));
  });
  outputs_.push_back(raw);
  return raw;
}

STAGEJIT_FUNC Node* Node::insert_before(Node* n) {
  STAGEJIT_CHECK_AS(IrError, !in_list() && !is<Param>() && !is<Return>(), "node #", id_, " (",
                    describe(), ") cannot be inserted: it is already listed or a Param/Return");
  STAGEJIT_CHECK_AS(IrError, n && n->graph_ == graph_ && n->in_list(),
                    "insertion point of node #", id_, " is not a listed node of its graph");
  prev_ = n->prev_;
  next_ = n;
  n->prev_->next_ = this;
  n->prev_ = this;
  return this;
}

STAGEJIT_FUNC Node* Node::insert_after(Node* n) {
  STAGEJIT_CHECK_AS(IrError, n && n->graph_ == graph_ && n->in_list(),
                    "insertion point of node #", id_, " is not a listed node of its graph");
  return insert_before(n->next_);
}

STAGEJIT_FUNC bool Node::is_before(const Node* n) const {
  for (const Node* p = next_; p && !p->is<Return>(); p = p->next_)
    if (p == n) return true;
  return false;
}

STAGEJIT_FUNC void Node::destroy() {
  STAGEJIT_CHECK_AS(IrError, !is<Return>(), "the Return node cannot be destroyed");
  STAGEJIT_CHECK_AS(IrError, !is<Param>(), "destroy a graph input with Graph::erase_input");
  for (Value* v : outputs_)
    STAGEJIT_CHECK_AS(IrError, !v->has_uses(), "cannot destroy node #", id_, " (", describe(),
                      "): output ", v->offset(), " still has ", v->uses().size(), " uses");
  remove_all_inputs();
  if (in_list()) remove_from_list();
  graph_->release(this);  // frees this node
}

}  // namespace stagejit::ir
