#pragma once
// Command-line parsing shared by the examples and benches (CLI11).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
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

}  // namespace stagejit_examples
