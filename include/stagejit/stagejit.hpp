#pragma once
/// \file
/// One include for users: everything in API.md. Users write `namespace sj = stagejit;`.

#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/core/version.hpp>
#include <stagejit/ir/ir.hpp>
#include <stagejit/passes/cse.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/fusion/cuda_backend.hpp>
