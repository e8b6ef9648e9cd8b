#pragma once
/// \file
/// `ir::parse`: reads the canonical text form (printer.hpp) and the seed-era form of
/// docs/seed-system.md §1.7 back into a Graph.
///
/// The seed-era (2017) and 2018 dialects, their op aliases (Note [Op aliases]) and
/// special syntax, are read through ir/detail/parser_dialects.hpp: its file comment lists
/// what they accept; the grammar (ir/parser-inl.hpp) dispatches to its tables and routines.
///
/// Value names that start with a digit are not kept (the printer renumbers them; messages
/// use the printer's names, see `ir::value_label`).
/// Any malformed text throws `ParseError` (1-based line:column, and what was expected).
/// A tensor literal's sizes, value count and device are checked before it is allocated
/// (sizes that overflow, a device this machine cannot hold: a ParseError at the literal).
///
/// This header declares `parse`; the grammar (`detail::Parser`) is in ir/parser-inl.hpp
/// (core/config.hpp), compiled once with the other function bodies.

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <string_view>

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>

namespace stagejit::ir {

/// Parses IR text (canonical or seed-era, see the file comment) into a new graph.
/// Does not lint: call `ir::lint` for the invariants text cannot break by itself.
/// Throws ParseError with the 1-based line:column of the first problem.
STAGEJIT_FUNC std::shared_ptr<Graph> parse(std::string_view text);

}  // namespace stagejit::ir
