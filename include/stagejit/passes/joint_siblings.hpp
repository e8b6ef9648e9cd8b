#pragma once
/// \file
/// `passes::add_joint_siblings`: gives the joint stage copies of the last stage's
/// backward, so that one compiled sweep also serves *sibling* calls of the last stage.
///
/// Note [Joint siblings]
/// A Laplacian written as one `grad` per input column (`u_xx` from `grad(u_x[:, 0], x)`,
/// `u_yy` from `grad(u_x[:, 1], x)`) applies the call of stage k-1 (u_x's grad_fn) once
/// per column, and each application makes a call of stage k of its own: siblings that
/// share the chain's calls of stages 1..k-1 and differ in the stage k-1 values their
/// environments hold (each application's own) and in their incoming gradients. The joint
/// stage (Note [Joint stage] in ir/graph.hpp) serves one chain: without copies, the
/// second sibling runs its stage on its own, differentiating the forward and the
/// stages before once more (the final backward of a 2-D Laplacian took twice the joint
/// sweep; bench/higher_order.md).
///
/// The joint stage J = k + 1 is a backward, linear in its gradient inputs. Its nodes fall
/// in three sets, by what they depend on:
/// - *sibling nodes* T: they depend on the last member's gradient inputs (the gradients of
///   stage k-1's outputs) or on stage k-1 values that depend on stage k-1's inputs, and
///   on no other gradient input. They are the backward of stage k-1's ops.
/// - the other nodes that depend on T: they also read the other members' gradients
///   (the backward of the stages before, and the sums of gradient contributions), and
///   read T's values as gradient contributions, linearly.
/// - the rest (values of the earlier stages only): the same for every sibling.
/// A sibling's contribution is then T run on the sibling's gradients and stage k-1
/// values, summed into the values the other nodes read from T. Each copy j gets new
/// inputs of stage J (the sibling's gradients, then the stage k-1 values T reads, taken
/// from the sibling's environment at run time), a clone of T reading them, and each read
/// of a T value by another node (or by a graph output) reads the sum of the original
/// and its copies. The stage k-1 values T reads are also appended to J's outputs (*tie
/// outputs*): the passes after this one keep graph outputs up to date, so the closure
/// finds each value's cross-stage slot there after fusion (the values cross stages
/// anyway: T reads them). Outputs that are gradients of stage k-1's inputs (the seed of
/// u_x's backward) stay the chain's own: a sibling that needs its own runs apart.
///
/// When a copy's inputs are undefined (no sibling, or fewer than copies), the stage
/// variant makes them symbolic zeros (Note [Stage variants] in closure/specialize.hpp):
/// the copies and the sums fold away and the variant is the joint stage of one chain.
///
/// Checked, else the graph is left as it is (returns 0): a node outside T that reads a
/// value of T must read one that depends on the last member's gradients (a gradient
/// contribution, where the sum is exact); every node that reads a value depending on
/// those gradients is linear in the gradients it reads, by a table of ops (`add` of two
/// tensors, `mul` or `mm` with one gradient factor, `where` with a constant condition,
/// views, sums...; an op outside it, or `x + c`, stops the pass); T holds only ops.
///
/// Runs after the passes that change which values cross stages (CSE,
/// rematerialisation) and before fusion, on primitive ops.

#include <stagejit/core/config.hpp>
#include <stagejit/ir/graph.hpp>

#include <cstddef>
#include <vector>

namespace stagejit::passes {

/// Adds `copies` sibling copies to the joint stage of `graph` (Note [Joint siblings]).
/// `last_gradients`: how many of the joint stage's inputs (the last ones) are the
/// gradients of stage k-1's outputs; `seed_outputs`: per joint-stage output, whether it
/// is the gradient of an input of stage k-1 (kept the chain's own). Records the layout
/// with `Graph::set_joint_siblings`. Returns the copies added (0: none, the graph
/// unchanged: no joint stage, nothing to copy, or a check failed).
STAGEJIT_FUNC std::size_t add_joint_siblings(ir::Graph& graph, std::size_t last_gradients,
                                             const std::vector<char>& seed_outputs, std::size_t copies);

}  // namespace stagejit::passes
