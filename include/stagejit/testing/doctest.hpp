#pragma once
/// \file
/// Includes doctest for stagejit's tests. Debian's ATen pulls in glog, whose `CHECK`,
/// `CHECK_EQ`, ... macros would silently replace doctest's (a failed check would then
/// abort instead of being counted). ATen is included first, glog's macros are removed,
/// and doctest is included last; include guards keep glog from coming back.
///
/// In-header test cases are written inside `#ifdef STAGEJIT_HEADER_TEST_CASES` blocks
/// that include this header. One translation unit of the test executable defines it
/// (test/headers/header_cases.cpp), so each case compiles once; users never define it,
/// so they pay nothing.

#include <ATen/ATen.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#undef CHECK_NOTNULL
#undef CHECK_STREQ
#undef CHECK_STRNE
#undef CHECK_OP
#undef DCHECK
#undef DCHECK_EQ

#include <doctest/doctest.h>
