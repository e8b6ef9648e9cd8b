// libFuzzer target: ir::parse, ir::lint and the canonical print round trip
// (fuzz/README.md). For any input:
// - parse either returns a graph or throws ParseError (its documented error);
// - lint either accepts the graph or throws LintError;
// - a parsed graph prints, its print parses, and that graph prints identically;
//   lint gives the reprinted graph the same verdict; clone() prints as the graph.
// Anything else (a crash, a sanitizer report, another exception type, a failed internal
// assertion, a round-trip mismatch) is a finding: __builtin_trap().
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <ATen/Parallel.h>
#include <stagejit/ir/ir.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include "fuzz_common.hpp"

namespace ir = stagejit::ir;
namespace fz = stagejit::fuzz;

namespace {

std::shared_ptr<ir::Graph> parse_or_null(std::string_view text, const char* what) {
  std::shared_ptr<ir::Graph> g;
  fz::no_foreign_exceptions(what, [&] {
    try {
      g = ir::parse(text);
    } catch (const stagejit::ParseError& e) {
      fz::check_not_internal(e, what);
    } catch (const stagejit::Error& e) {
      fz::finding(std::string(what) + ": parse threw a stagejit::Error that is not a ParseError", e.what());
    }
  });
  return g;
}

/// The lint verdicts, by default and keeping unknown ops (`LintOptions`): for each, ""
/// when accepted, else the rule that failed.
std::string lint_verdict(const ir::Graph& g, const char* what) {
  std::string verdict;
  for (bool allow_unknown_ops : {false, true}) {
    std::string rule;
    fz::no_foreign_exceptions(what, [&] {
      try {
        ir::lint(g, {.allow_unknown_ops = allow_unknown_ops});
      } catch (const ir::LintError& e) {
        fz::check_not_internal(e, what);
        rule = e.rule();
      } catch (const stagejit::Error& e) {
        fz::finding(std::string(what) + ": lint threw a stagejit::Error that is not a LintError", e.what());
      }
    });
    verdict += (allow_unknown_ops ? " / " : "") + rule;
  }
  return verdict;
}

std::string print(const ir::Graph& g, const char* what) {
  std::string out;
  fz::no_foreign_exceptions(what, [&] {
    try {
      out = ir::to_string(g);
    } catch (const stagejit::Error& e) {
      fz::finding(std::string(what) + ": to_string threw", e.what());
    }
  });
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto g = parse_or_null(text, "parse(input)");
  if (!g) return 0;
  const std::string verdict = lint_verdict(*g, "lint(parse(input))");
  const std::string p1 = print(*g, "to_string(parse(input))");
  std::shared_ptr<ir::Graph> copy;
  fz::no_foreign_exceptions("clone", [&] { copy = g->clone(); });
  if (print(*copy, "to_string(clone)") != p1) fz::finding("clone() prints differently from the graph", p1);
  auto g2 = parse_or_null(p1, "parse(to_string(parse(input)))");
  if (!g2) fz::finding("the canonical print of a parsed graph does not parse", p1);
  const std::string p2 = print(*g2, "to_string(parse(print))");
  if (p1 != p2) fz::finding("round trip: print, parse, print differs", "first print:\n" + p1 + "\nsecond print:\n" + p2);
  const std::string verdict2 = lint_verdict(*g2, "lint(parse(print))");
  if (verdict != verdict2)
    fz::finding("lint verdicts differ before and after the round trip",
                "input: '" + verdict + "', reparsed print: '" + verdict2 + "'\n" + p1);
  return 0;
}
