#pragma once
// The function bodies of a header-only build (core/config.hpp), included once per
// translation unit by bodies_end.hpp; the compiled build includes them in
// src/compiled_bodies.cpp instead.
#include <stagejit/autograd/autograd-inl.hpp>
#include <stagejit/ops/ops-inl.hpp>
#include <stagejit/ops/small_gemm-inl.hpp>
#include <stagejit/closure/compile-inl.hpp>
