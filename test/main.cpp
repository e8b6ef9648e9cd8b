// The single doctest main of stagejit's test executable. Suites are selected with
// `--test-suite=NAME` (one `meson test` entry per suite).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <stagejit/testing/doctest.hpp>
