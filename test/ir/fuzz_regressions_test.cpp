// Inputs that broke the fuzz targets (fuzz/README.md), kept byte for byte in
// test/ir/fuzz/, and what each does now. Every one goes through what the fuzz targets
// check: parse throws ParseError or gives a graph that prints, parses back and prints
// the same; lint throws LintError or accepts; a graph lint accepts builds and runs its
// stage 0 (`closure::run_stages`, as `stagejit-run --stage 0`) to the recorded outcome.
#include <stagejit/compiler.hpp>
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
      // A device index above ATen's 8-bit DeviceIndex wrapped to a negative one, which
      // printed as `cuda:-87` and did not parse back (found after the #15 front end).
      {"device_index_overflow.ir", Outcome::parse_error, 1, 30, "device index 169 is out of range (0 to 127)"},
      // A quoted host op name may not hold control characters: a NUL in it cut the
      // closure compiler's message naming the op (found after the #15 front end).
      {"host_op_name_control_char.ir", Outcome::parse_error, 2, 20, "an op name cannot hold control characters"},
      // The same for a CppOp's raw C++ type name (printed back quoted, it did not parse).
      {"cppop_name_control_char.ir", Outcome::parse_error, 2, 25, "a CppOp's name cannot hold control characters"},
      // `prim::onnx::TranspFusionGroup_0`: one namespace was stripped, the op kept the name
      // `onnx::TranspFusionGroup_0`, printed bare, and lost its second namespace on the
      // way back (round trip differed). Two namespaces are a ParseError now.
      {"op_two_namespaces.ir", Outcome::parse_error, 5, 22, "has two namespaces"},
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

  TEST_CASE("fuzz regressions: a fusion group nested in a fusion group runs (node by node)") {
    // Lint accepts nested groups and the printer and parser keep them, but the fuser's
    // node-by-node fallback refused every node that is not an op ("fusion: node #5
    // (fusion_group) is not an op"): test/ir/graphs/nested_fusion.ir, the first input of
    // fuzz_run_stages' seed corpus, could not run.
    auto g = ir::parse(read_text_file(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs/nested_fusion.ir"));
    ir::lint(*g);
    auto closure = std::make_shared<const stagejit::closure::MultiStageClosure>(g);
    at::Tensor a = at::tensor({1.5f, -2.0f}), b = at::tensor({3.0f, 0.25f});
    auto outputs = stagejit::closure::run_stages(closure, {{stagejit::Variable(a), stagejit::Variable(b)}});
    REQUIRE(outputs.size() == 1);
    REQUIRE(outputs[0].size() == 1);
    // fusion_group_0: (a*b, -(a*b)); fusion_group_1: x - y = 2ab.
    CHECK(at::allclose(outputs[0][0].data(), 2 * a * b));
  }

  TEST_CASE("fuzz regressions: the fuser's fallback runs every kind a group's subgraph may hold") {
    // Constant, Transpose and Reshape in a fusion group (lint accepts them in a
    // subgraph) ran nowhere: the node-by-node fallback took ops only.
    auto g = ir::parse(
        "graph(%x : Float(2, 3)) {\n"
        "  %0 : Float(3, 2) = fusion_group_0(%x);\n"
        "  return (%0);\n"
        "}\n"
        "with fusion_group_0 = graph(%x : Float(2, 3)) {\n"
        "  %0 : Float(1) = Constant[value=Float(1){2.0}]();\n"
        "  %1 : Float(3!, 2!) = Transpose[perm=[1, 0]](%x);\n"
        "  %2 : Float(3, 2) = mul(%1, %0);\n"
        "  %3 : Float(6) = Reshape[shape=[6]](%2);\n"
        "  %4 : Float(3, 2) = Reshape[shape=[3, 2]](%3);\n"
        "  return (%4);\n"
        "}\n");
    ir::lint(*g);
    auto closure = std::make_shared<const stagejit::closure::MultiStageClosure>(g);
    at::Tensor x = at::arange(6, at::kFloat).reshape({2, 3});
    auto outputs = stagejit::closure::run_stages(closure, {{stagejit::Variable(x)}});
    CHECK(at::equal(outputs.at(0).at(0).data(), x.t() * 2));
  }
}
