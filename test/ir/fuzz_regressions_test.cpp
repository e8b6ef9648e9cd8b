// Inputs that broke the fuzz targets (fuzz/README.md), kept byte for byte in
// test/ir/fuzz/, and what each does now. Every one goes through what the fuzz targets
// check: parse throws ParseError or gives a graph that prints, parses back and prints
// the same; lint throws LintError or accepts; a graph lint accepts builds and runs its
// stage 0 (`closure::run_stages`, as `stagejit-run --stage 0`) to the recorded outcome.
#include <stagejit/stagejit.hpp>
#include <stagejit/testing/doctest.hpp>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "ir_test_util.hpp"

namespace ir = stagejit::ir;
namespace fs = std::filesystem;

namespace {

enum class Outcome { parse_error, lint_error, runs };

struct Regression {
  const char* file;        // in test/ir/fuzz/
  Outcome outcome;
  size_t line, column;     // of the ParseError (parse_error)
  const char* message_part;  // of the ParseError or LintError; "" for runs
};

const std::vector<Regression>& regressions() {
  static const std::vector<Regression> all = {
      // parse_strides multiplied sizes by strides without an overflow check (signed
      // overflow, UBSan) for sizes whose strides do not fit in 64 bits.
      {"type_stride_overflow.ir", Outcome::parse_error, 1, 12,
       "tensor type sizes [4611686018427387904, 4611686018427387904, 4] overflow"},
      {"type_marked_stride_overflow.ir", Outcome::parse_error, 1, 12,
       "tensor type sizes [3, 4611686018427387904, 2] overflow"},
  };
  return all;
}

fs::path fuzz_dir() { return fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/fuzz"; }

/// Random stage-0 inputs of the declared types (as stagejit-run makes them).
stagejit::variable_list stage0_inputs(const stagejit::closure::MultiStageClosure& c) {
  at::manual_seed(0);
  stagejit::variable_list out;
  for (const ir::Value* v : c.plan.stage_inputs(0)) {
    const ir::TensorType* type = v->tensor_type();
    REQUIRE(type);
    auto options = at::TensorOptions().dtype(type->dtype);
    out.emplace_back(at::isFloatingType(type->dtype) ? at::randn(type->sizes, options)
                                                     : at::randint(0, 10, type->sizes, options));
  }
  return out;
}

}  // namespace

TEST_SUITE("ir") {
  TEST_CASE("fuzz regressions: every input in test/ir/fuzz has its recorded outcome") {
    std::vector<std::string> on_disk;
    for (auto& e : fs::directory_iterator(fuzz_dir())) on_disk.push_back(e.path().filename().string());
    std::vector<std::string> listed;
    for (const auto& r : regressions()) listed.push_back(r.file);
    std::sort(on_disk.begin(), on_disk.end());
    std::sort(listed.begin(), listed.end());
    CHECK(on_disk == listed);  // every kept input has an expectation, and every expectation its input

    for (const auto& r : regressions()) {
      CAPTURE(r.file);
      const std::string text = read_text_file(fuzz_dir() / r.file);
      REQUIRE_FALSE(text.empty());
      std::shared_ptr<ir::Graph> g;
      try {
        g = ir::parse(text);
      } catch (const stagejit::ParseError& e) {
        CHECK_MESSAGE(r.outcome == Outcome::parse_error, e.what());
        CHECK(e.line() == r.line);
        CHECK(e.column() == r.column);
        CHECK_MESSAGE(e.message().find(r.message_part) != std::string::npos, e.what());
        continue;
      }
      REQUIRE_MESSAGE(r.outcome != Outcome::parse_error, "parsed without error");
      const std::string printed = ir::to_string(*g);
      CHECK(ir::to_string(*ir::parse(printed)) == printed);
      try {
        ir::lint(*g);
      } catch (const ir::LintError& e) {
        CHECK_MESSAGE(r.outcome == Outcome::lint_error, e.what());
        CHECK_MESSAGE(std::string(e.what()).find(r.message_part) != std::string::npos, e.what());
        continue;
      }
      REQUIRE_MESSAGE(r.outcome == Outcome::runs, "lint accepted the graph");
      auto closure = std::make_shared<const stagejit::closure::MultiStageClosure>(g);
      auto outputs = stagejit::closure::run_stages(closure, {stage0_inputs(*closure)});
      REQUIRE(outputs.size() == 1);
      CHECK(outputs[0].size() == closure->plan.stage_outputs(0).size());
    }
  }
}
