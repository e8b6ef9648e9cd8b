#pragma once
/// \file
/// The whole IR: types, attributes, node kinds, Graph/Node/Value, lint, printer, parser.

#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/lint.hpp>
#include <stagejit/ir/parser.hpp>
#include <stagejit/ir/printer.hpp>
#include <stagejit/ir/type.hpp>
