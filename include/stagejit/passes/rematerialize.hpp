#pragma once
/// \file
/// `passes::rematerialize_cross_stage`: a later stage recomputes cheap elementwise values
/// of earlier stages from values it reads anyway, instead of reading them saved.
///
/// Note [Cross-stage rematerialisation]
/// A value made in stage s and read by a node of stage t > s crosses stages: the call of
/// stage s saves it and the call of stage t reads it back (closure/plan.hpp, captures).
/// On tall tensors both are trips through memory (a PINN's [10 000, 20] values, 800 KB
/// each: bench/pinn.md), and CSE makes more of them, since it keeps the earlier stage's
/// copy of a value both stages compute (passes/cse.hpp). So, for each stage t >= 1, in
/// node order, each value v of an earlier stage that a node of stage t reads is
/// recomputed in stage t when v's node is *cheap*: an Op whose schema is elementwise,
/// with no logarithm, erf or expm1 inside (softplus, log, erf, gelu, elu: their
/// recomputation costs more than the read it saves), not silu, sin or cos (their
/// derivatives are written in their input), and not an exp, sigmoid or tanh within two
/// elementwise steps of a costly op's input (what that op's backward builds from it):
/// every later stage would pay a SLEEF exp or sin per element again
/// (passes/rematerialize-inl.hpp);
/// without side effects (nothing random or in place), with one output of at least
/// `min_elements` elements, no Handle input or output; and each of its inputs is
/// - a value stage t reads anyway (an earlier value or graph input with a stage-t use),
///   or one recomputed in stage t before,
/// - a Constant (copied too), or
/// - the output of another cheap node whose inputs qualify in turn (up to 8 nodes deep:
///   `1 - h * h` when stage t reads h and the saved `1 - h * h` but not `h * h`).
/// Not copied: a value stage t returns (it crosses anyway) or that a stage-t node with
/// side effects reads (an in-place op must write the value later stages see). The
/// copies are placed before stage t's first node and stage t's uses of v read the copy.
/// No value is added to what stage t reads and v is removed, and when no other stage
/// reads v, its own stage stops saving it (DCE removes it when nothing reads it).
/// The cost is the recomputation, a few fused elementwise ops per element in stage t's
/// kernels, against a write and a read of v. This is a greedy form of the
/// recompute-over-save choice of AOTAutograd's min-cut partitioner (functorch's
/// `min_cut_rematerialization_partition`) that never makes a new value cross stages.
/// Measured on the Burgers PINN step (bench/pinn.md, float, N_f = 10 000): the row
/// values the staged step's stages write drop from 58 to 26 MB and those they read back
/// from 108 to 64 MB; the step goes from 1.79x to 2.03-2.12x libtorch eager.
///
/// Requires the node list in stage order (every stage's nodes after the earlier
/// stages'); a graph not in that order is left as it is (returns 0).

#include <stagejit/core/config.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/passes/dce.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace stagejit::passes {

/// Copies cheap elementwise values of earlier stages into the later stages that read
/// them (Note [Cross-stage rematerialisation]), then removes dead nodes. Returns how
/// many (value, later stage) pairs now read a copy instead of the saved value. Only values of at least `min_elements` elements (by their
/// traced sizes) are copied: a small one costs less to save than an extra op per call
/// where no kernel takes it in.
STAGEJIT_FUNC std::size_t rematerialize_cross_stage(ir::Graph& g, int64_t min_elements = 16384);

}  // namespace stagejit::passes
