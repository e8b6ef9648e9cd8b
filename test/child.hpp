#pragma once
// Subprocess entry points of the test executable. A test that needs a fresh process
// (e.g. to see a cache on disk from a second process) spawns the executable itself with
// `STAGEJIT_TEST_CHILD=<name>` in the environment; `main` (test/main.cpp) then runs the
// entry registered under that name instead of doctest and exits with its status. Entries
// are not test cases: they are neither listed nor counted by doctest.
#include <cstdlib>
#include <map>
#include <string>

namespace stagejit::testing {

/// A subprocess entry: returns the process's exit status.
using ChildEntry = int (*)();

inline std::map<std::string, ChildEntry>& child_entries() {
  static std::map<std::string, ChildEntry> entries;
  return entries;
}

/// Registers `entry` under `name` at static initialisation:
/// `static const RegisterChild reg("name", &fn);`
struct RegisterChild {
  RegisterChild(const char* name, ChildEntry entry) { child_entries()[name] = entry; }
};

/// The environment variable naming the entry a child process runs.
inline constexpr const char* child_env = "STAGEJIT_TEST_CHILD";

}  // namespace stagejit::testing
