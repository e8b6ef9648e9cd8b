// stagejit-run FILE.ir [--print] [--passes dce,cse]
//
// Parses an IR file, lints it, applies the requested passes (linting after each) and
// optionally prints the canonical text. Exit status: 0 on success; 2 on a parse or lint
// error, reported on stderr as `FILE:line:col: message` (lint errors without a source
// position report 0:0); 1 on usage or I/O errors.
#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <stagejit/stagejit.hpp>

namespace ir = stagejit::ir;

int main(int argc, char** argv) {
  CLI::App app{"Parse, lint, transform and print a stagejit IR file"};
  std::string file;
  bool print = false;
  std::vector<std::string> passes;
  app.add_option("file", file, "IR file (canonical or seed-era text)")->required();
  app.add_flag("--print", print, "print the (transformed) graph in canonical form");
  app.add_option("--passes", passes, "passes to run in order: dce, cse")
      ->delimiter(',')
      ->check(CLI::IsMember({"dce", "cse"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help: 0; usage errors: 1
  }

  std::ifstream in(file, std::ios::binary);
  if (!in) {
    std::cerr << file << ": cannot open file\n";
    return 1;
  }
  std::ostringstream text;
  text << in.rdbuf();

  try {
    auto graph = ir::parse(text.str());
    ir::lint(*graph);
    for (const auto& p : passes) {
      if (p == "dce") stagejit::passes::eliminate_dead_code(*graph);
      else stagejit::passes::eliminate_common_subexpressions(*graph);
      ir::lint(*graph);
    }
    if (print) std::cout << ir::to_string(*graph);
    else
      std::cerr << file << ": ok (" << graph->num_stages() << " stages, " << graph->nodes().size()
                << " nodes)\n";
  } catch (const stagejit::ParseError& e) {
    std::cerr << file << ":" << e.line() << ":" << e.column() << ": " << e.message() << "\n";
    return 2;
  } catch (const ir::LintError& e) {
    std::cerr << file << ":" << e.location().line << ":" << e.location().column << ": " << e.what() << "\n";
    return 2;
  } catch (const stagejit::Error& e) {
    std::cerr << file << ": " << e.what() << "\n";
    return 2;
  }
  return 0;
}
