#pragma once
/// \file
/// `ir::to_string`: the canonical text form of a graph (docs/seed-system.md §1.7, Value era).
///
/// ```text
/// graph(%x : Float(3, 4),
///       %w : Float(4, 5),
///       -------- stage 1 --------
///       %gy : Float(3, 5)) {
///   %0 : Float(3, 5) = mm(%x, %w);
///   %1 : Float(3, 5), %2 : Handle = ^Scale[ts](2.0)(%0);
///   ---------------- stage 1 ----------------
///   %3 : Float(3, 5) = Eval(%gy, %2);
///   return (%1 | %3);
/// }
/// ```
/// - Inputs: `%name : Type`, separated by `,` and a newline; `-------- stage K --------`
///   before the first input of each stage after 0.
/// - Nodes: `outputs = op(inputs);` with `---------------- stage K ----------------` when
///   the stage changes (from 0). Ops: `name[attr=value, ...]` for Op; `^name[conv](scalars)`
///   for HostOp; `Eval`; `Undefined`; `Constant[value=<tensor literal>]`;
///   `Transpose[perm=...]`, `Reshape[shape=...]`, `Gemm[alpha=..., beta=...]`;
///   `fusion_group_N` (N counts fusion groups in print order).
/// - `return (...)` lists the outputs with `|` between stage groups (one group per stage).
/// - After `}`, each fusion group's subgraph as `with fusion_group_N = graph(...) {...}`.
/// - Value names: see detail/names.hpp. Literals: see attributes.hpp and detail/literals.hpp.
///
/// This header declares; the printer's bodies are in ir/printer-inl.hpp (core/config.hpp).

#include <cctype>
#include <ostream>
#include <string>
#include <vector>

#include <stagejit/core/config.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/detail/names.hpp>
#include <stagejit/ir/detail/op_words.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>

namespace stagejit::ir {

/// The canonical text of `graph` (see the file comment). Stable: equal graphs print
/// equally, and `to_string(*parse(to_string(g))) == to_string(g)`.
STAGEJIT_FUNC std::string to_string(const Graph& graph);

STAGEJIT_FUNC std::ostream& operator<<(std::ostream& os, const Graph& graph);

/// How `v` prints in its graph (`%x`, `%3`), for messages: the name the printer (and so
/// `stagejit-run --print`) gives it. Linear in the graph's size; meant for error paths.
STAGEJIT_FUNC std::string value_label(const Value* v);

/// The printer's index of fusion group `n` among its graph's fusion groups
/// (`fusion_group_N`), or -1 when `n` is not a listed fusion group.
STAGEJIT_FUNC int64_t fusion_group_index(const Node* n);

/// A node for messages, as `--print` shows it: `%3 = mul`, `%4, %5 = chunk`,
/// `fusion_group_0`, then ` (line 4, column 3)` when it was read from text. Linear in the
/// graph's size; meant for error paths.
/// The same with the graph's names and the node's fusion group index already known (a
/// caller labelling many nodes builds the NameTable once).
STAGEJIT_FUNC std::string node_label(const Node* n, const detail::NameTable& names, int64_t fusion_index);
STAGEJIT_FUNC std::string node_label(const Node* n);

}  // namespace stagejit::ir
