// Forced into every translation unit of the fuzz build (-include, top-level
// meson.build). ATen 1.13's headers use std::vector<c10::IValue> while IValue is still
// incomplete (ATen/core/List.h). In C++20, libstdc++ 12 makes vector's members
// constexpr, and clang (unlike GCC) instantiates them where they are used, so
// `#include <ATen/ATen.h>` does not compile with clang++ -std=c++20 (pytorch/pytorch
// issue 97689). This header turns libstdc++'s C++20 constexpr containers off (their C++17
// behaviour; constexpr does not change their ABI, so libtorch links as before):
// - _GLIBCXX20_CONSTEXPR empty: vector, allocator and algorithms are not constexpr;
// - no _GLIBCXX_HAVE_IS_CONSTANT_EVALUATED: string is not constexpr either (its
//   constexpr form needs the constexpr allocator), which also removes the declaration
//   of std::is_constant_evaluated, declared again below for <memory>'s assume_aligned.
#pragma once
#if defined(__clang__) && __cplusplus >= 202002L
#define _GLIBCXX20_CONSTEXPR
#include <bits/c++config.h>
#undef _GLIBCXX_HAVE_IS_CONSTANT_EVALUATED
#include <type_traits>
namespace std {
constexpr inline bool is_constant_evaluated() noexcept { return __builtin_is_constant_evaluated(); }
}  // namespace std
#endif
