#pragma once
// Command-line parsing shared by the examples and benches (CLI11), and OpenBLAS's
// thread count.
#include <CLI/CLI.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

namespace stagejit_examples {

/// Parses argv into `app`. Returns the status `main` should exit with (0 after printing
/// the help for --help; 2 after printing a one-line "error: ... (see --help)" to stderr
/// for a bad option), or nullopt to go on.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::fprintf(stderr, "error: %s (see --help)\n", msg.c_str());
    return 2;
  }
  return std::nullopt;
}

/// Runs the body of `main` (`body()` returns its exit status). An exception is printed
/// to stderr, as "stagejit error: ..." for a `LibraryError` (stagejit::Error) and
/// "error: ..." for another std::exception, and `error_status` is returned instead.
template <class LibraryError, class Body>
int run_reporting_errors(int error_status, Body body) {
  try {
    return body();
  } catch (const LibraryError& e) {
    std::fprintf(stderr, "stagejit error: %s\n", e.what());
    return error_status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return error_status;
  }
}

/// Sets OpenBLAS's own thread count (Debian's libtorch calls the system BLAS, OpenBLAS,
/// whose threads at::set_num_threads does not control), if OpenBLAS is the BLAS loaded.
/// Why it matters: OpenBLAS's idle threads spin; when stagejit's engine runs a backward
/// on its worker thread while the caller waits, a 2-core machine is oversubscribed and
/// every product slows many times over (bench/pinn.md). Returns false when OpenBLAS is
/// not loaded.
inline bool set_blas_threads(int n) {
  using SetThreads = void (*)(int);
  auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set == nullptr) return false;
  set(n);
  return true;
}

}  // namespace stagejit_examples
