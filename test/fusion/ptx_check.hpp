#pragma once
// The NVRTC check of every fused group of a test run (STAGEJIT_PTX_CHECK=1, set by
// `meson test` for every suite): a `fusion::GroupObserver` that regenerates each group
// the planner fuses in the CUDA dialect, with its non-bool inputs as float, double and
// half (meta tensors of the same sizes and strides), compiles each distinct source to
// PTX with NVRTC and checks that the PTX holds the entry point. main() installs it
// before the run and reports after it: a failure makes the run fail; without NVRTC the
// check reports that it was skipped.

#include <string>

namespace stagejit::testing {

/// Installs the observer when $STAGEJIT_PTX_CHECK is 1 and NVRTC can be loaded. Returns
/// false (and says why on stdout) when it is not installed.
bool install_ptx_check();

/// Prints what the check compiled (and every failure, with the group, the dtype and the
/// NVRTC log) and returns the number of failures.
int report_ptx_check();

/// Counters so far: distinct CUDA sources compiled, and failures.
struct PtxCheckCounts {
  long groups = 0;   ///< distinct (group, input signature) pairs observed
  long sources = 0;  ///< distinct CUDA sources compiled to PTX
  long failures = 0;
};
PtxCheckCounts ptx_check_counts();

}  // namespace stagejit::testing
