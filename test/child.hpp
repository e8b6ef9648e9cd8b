#pragma once
// Subprocess entry points of the test executable. A test that needs a fresh process
// (e.g. to see a cache on disk from a second process) spawns the executable itself with
// `STAGEJIT_TEST_CHILD=<name>` in the environment; `main` (test/main.cpp) then runs the
// entry registered under that name instead of doctest and exits with its status. Entries
// are not test cases: they are neither listed nor counted by doctest.
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

extern char** environ;

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

/// The environment of a child process that runs the entry `name`: this process's
/// variables less the torchrun ones (RANK, WORLD_SIZE, MASTER_*), those starting with
/// `own_prefix` (the test's own) and child_env, then `child_env=name`.
inline std::vector<std::string> child_environment(const std::string& name, const std::string& own_prefix) {
  std::vector<std::string> strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (kv.rfind("RANK=", 0) && kv.rfind("WORLD_SIZE=", 0) && kv.rfind("MASTER_", 0) && kv.rfind(own_prefix, 0) &&
        kv.rfind(std::string(child_env) + "=", 0))
      strings.push_back(kv);
  }
  strings.push_back(std::string(child_env) + "=" + name);
  return strings;
}

/// `strings` as a null-terminated array for posix_spawn's envp (pointing into `strings`).
inline std::vector<char*> env_pointers(std::vector<std::string>& strings) {
  std::vector<char*> envp;
  for (auto& kv : strings) envp.push_back(kv.data());
  envp.push_back(nullptr);
  return envp;
}

}  // namespace stagejit::testing
