#pragma once
/// \file
/// One include for users: everything in API.md. Users write `namespace sj = stagejit;`.

#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/core/version.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/passes/cse.hpp>
#include <stagejit/passes/dce.hpp>
