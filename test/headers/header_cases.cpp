// The in-header doctest cases (`#ifdef STAGEJIT_HEADER_TEST_CASES` blocks), compiled
// once: only this translation unit defines the macro, before any stagejit header.
#define STAGEJIT_HEADER_TEST_CASES
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/detail/literals.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies
