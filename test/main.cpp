// The single doctest main of stagejit's test executable. Suites are selected with
// `--test-suite=NAME` (one `meson test` entry per suite). With STAGEJIT_TEST_CHILD set,
// the process is a child spawned by a test and runs that entry instead (test/child.hpp).
// With STAGEJIT_PTX_CHECK=1 every fused group of the run is also compiled in the CUDA
// dialect with NVRTC (test/fusion/ptx_check.hpp). Fusion groups wait for their kernels
// (fusion::set_wait_for_kernels), so every call of a test runs the same code; the
// deferred path is tested on its own (test/fusion/batch_compile_test.cpp), and
// STAGEJIT_FUSION_WAIT=0 runs the whole suite with it.
#define DOCTEST_CONFIG_IMPLEMENT
#include <stagejit/testing/doctest.hpp>

#include "child.hpp"
#include <stagejit/fusion/codegen.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies
#include "fusion/ptx_check.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (const char* w = std::getenv("STAGEJIT_FUSION_WAIT"); !w || std::string(w) != "0")
    stagejit::fusion::set_wait_for_kernels(true);
  if (const char* name = std::getenv(stagejit::testing::child_env)) {
    const auto& entries = stagejit::testing::child_entries();
    auto it = entries.find(name);
    if (it == entries.end()) {
      std::fprintf(stderr, "stagejit-tests: no child entry '%s'\n", name);
      return 2;
    }
    return it->second();
  }
  doctest::Context context(argc, argv);
  stagejit::testing::install_ptx_check();  // STAGEJIT_PTX_CHECK=1: fusion/ptx_check.hpp
  int rc = context.run();
  if (stagejit::testing::report_ptx_check() > 0 && rc == 0) rc = 1;
  return rc;
}
