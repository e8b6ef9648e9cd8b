#pragma once
/// \file
/// `passes::fuse`: the graph fuser (docs/seed-system.md §5.1, restated for our multi-output Value IR).
///
/// Groups maximal connected sets of fusable nodes of ONE stage into `ir::FusionGroup`
/// nodes whose subgraph holds copies of the grouped nodes (same Op kinds and attributes,
/// same types). A fusable node is an `Op` whose table entry is `elementwise` (or
/// `zeros_like`, a literal in the kernel), with one
/// output, no side effects, and not `to` (a dtype cast would break the single compute
/// type of a kernel, see fusion/codegen.hpp).
///
/// Algorithm: consumers are visited from the last node to the first; a group grows by
/// absorbing producers of its members, latest first (a heap: O(n log n) overall), when
/// the producer is fusable, of the same stage,
/// not yet in another group, and every use of its output outside the group comes after
/// the group's anchor (its last node, where the FusionGroup node is placed; a use by a
/// member of an earlier-made group counts at that group's anchor). Values used
/// outside the group (by another node, a later stage or a graph output) become group
/// outputs, named as the values they replace. Shape rule: a value that becomes a group
/// output must have the anchor's sizes when both types are known, so all outputs of one
/// group share the iteration shape (values used only inside may be smaller and are
/// broadcast). Groups of one node are left unfused.
///
/// Note [Merging fusion groups]: growing from anchors through producers leaves apart
/// groups that a value flows between when that value has another reader before the
/// consumer's anchor (a backward's `dc` read by the gradients of both `a` and `b`), and
/// sibling groups reading the same tensors. After grouping, an earlier group joins a
/// later group of its stage (placed at the later anchor) when it feeds it or shares an
/// input with it, every other reader of its values runs after that anchor, and both have
/// one known iteration shape, device and non-bool input dtype, with at most 24 tensors
/// between them (short argument lists; a CUDA launch takes up to 128). Each merge saves a pass over memory: the
/// merged kernel reads the shared inputs once and never writes or re-reads the values
/// that flowed between the groups, unless something else reads them.
///
/// Chunk distribution (before grouping, to a fixpoint): `chunk(op(x, y, ...))` where `op`
/// is fusable, its output is used only by the chunk, and every chunk output is used only
/// by fusable nodes of the chunk's stage, becomes `op(chunk(x)_k, chunk(y)_k, ...)` per
/// chunk; an operand broadcast along the chunked dimension (missing or size 1) is used
/// whole by every chunk. Needs the sizes of `op`'s output and operands (TensorType);
/// skipped otherwise. This puts an LSTM cell's gate math into one group per stage.

#include <stagejit/core/config.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ops/op_schema.hpp>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <vector>

namespace stagejit::passes {

namespace detail {

/// True for nodes the fuser may put into a FusionGroup (see the file comment).
STAGEJIT_FUNC bool is_fusable(const ir::Node& n);

/// True for a fusable node worth a kernel of its own: a float `tanh` on the CPU, which the
/// CPU backend computes in less than half of ATen's time (Cephes' form over SLEEF's expf
/// in place of SLEEF's tanhf, src/fusion_cpu_prelude.cpp). A tanh network's forward is a
/// chain of addmm and tanh, where no tanh has a neighbour to fuse with (bench/pinn.md).
STAGEJIT_FUNC bool worth_a_kernel_alone(const ir::Node& n);

/// Chunk distribution for one `chunk` node (file comment). Returns true when rewritten.
STAGEJIT_FUNC bool distribute_chunk(ir::Graph& graph, ir::Node* chunk);

/// Same sizes, or unknown on either side.
inline bool compatible_sizes(const ir::Value* a, const ir::Value* b) {
  const ir::TensorType* ta = a->tensor_type();
  const ir::TensorType* tb = b->tensor_type();
  return !ta || !tb || ta->sizes == tb->sizes;
}

/// Scratch state of `make_group`, allocated once per `fuse` and reused by every group:
/// dense arrays indexed by value id instead of a hash map and set per group (those cost
/// an allocation per member and dominated the pass on large graphs).
struct GroupScratch {
  std::vector<ir::Value*> inner;  // outer value id -> its subgraph value (this group)
  std::vector<ir::Value*> mapped;  // outer values set in `inner`, to clear after the group
  ir::ValueList args;
};

/// Replaces the listed `members` (in node order; the last is the anchor) by one
/// FusionGroup node placed before the anchor. `is_member(node)` tells whether a node is
/// one of `members`. Returns the group node.
template <class IsMember>
ir::Node* make_group(ir::Graph& graph, const std::vector<ir::Node*>& members,
                     const IsMember& is_member, GroupScratch& scratch) {
  ir::Node* anchor = members.back();
  auto sub = std::make_shared<ir::Graph>();
  // Covers every value that exists now (earlier groups added values to the graph); the
  // values this group makes are never looked up.
  auto& inner = scratch.inner;
  inner.resize(graph.id_bound(), nullptr);
  auto map = [&](ir::Value* outer, ir::Value* in_sub) {
    inner[outer->id()] = in_sub;
    scratch.mapped.push_back(outer);
  };
  auto lookup = [&](ir::Value* outer) { return inner[outer->id()]; };
  std::vector<ir::Value*> group_inputs;
  std::vector<ir::Value*> escaping;  // member outputs used outside
  for (ir::Node* m : members) {
    scratch.args.clear();
    for (ir::Value* v : m->inputs()) {
      ir::Value* in_sub = lookup(v);
      if (!in_sub) {
        in_sub = sub->add_input(v->type(), 0);
        map(v, in_sub);
        group_inputs.push_back(v);
      }
      scratch.args.push_back(in_sub);
    }
    ir::Node* c = sub->append(sub->create(m->kind(), scratch.args, {m->output()->type()}));
    c->set_location(m->location());
    map(m->output(), c->output());
    bool outside = false;
    for (const ir::Use& u : m->output()->uses()) outside = outside || !is_member(u.user);
    if (outside) escaping.push_back(m->output());
  }
  for (ir::Value* v : escaping) sub->register_output(lookup(v), 0);
  for (ir::Value* v : scratch.mapped) inner[v->id()] = nullptr;
  scratch.mapped.clear();
  std::vector<ir::Type> types;
  types.reserve(escaping.size());
  for (ir::Value* v : escaping) types.push_back(v->type());
  const size_t saved_stage = graph.current_stage();
  graph.set_current_stage(anchor->stage());
  ir::Node* group = graph.create(ir::FusionGroup{sub}, group_inputs, types);
  graph.set_current_stage(saved_stage);
  group->insert_before(anchor);
  group->set_location(anchor->location());
  for (size_t i = 0; i < escaping.size(); ++i) {
    std::string name = escaping[i]->name();
    escaping[i]->replace_all_uses_with(group->output(i));
    escaping[i]->set_name("");
    group->output(i)->set_name(name);
  }
  for (auto it = members.rbegin(); it != members.rend(); ++it) (*it)->destroy();
  return group;
}

}  // namespace detail

/// Fuses `graph` in place (see the file comment): distributes chunks, then replaces each
/// maximal group of two or more fusable nodes of one stage by a FusionGroup node (or of
/// one, when it is worth a kernel alone: `detail::worth_a_kernel_alone`). Nodes
/// inside existing FusionGroups are left alone. Returns the number of groups made.
/// The result passes `ir::lint` when the input does. Throws `IrError` only for a graph
/// that violates the IR's invariants.
STAGEJIT_FUNC size_t fuse(ir::Graph& graph);

}  // namespace stagejit::passes
