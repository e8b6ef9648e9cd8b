#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

namespace ir = stagejit::ir;

namespace {
struct Bad {
  const char* text;
  size_t line, column;
  const char* message_part;
};


const std::vector<Bad>& cases() {
  static const std::vector<Bad> all = {
      {"", 1, 1, "expected 'graph', found end of input"},
      {"grph() {}", 1, 1, "expected 'graph'"},
      {"graph(%x : Float(2) {\n", 1, 21, "expected ',' or ')' after a graph input"},
      {"graph(%x : Flot(2)) {", 1, 12, "unknown type 'Flot'"},
      {"graph(%x : Float(2, -1)) {", 1, 21, "size -1 is negative"},
      {"graph(%x Float(2)) {", 1, 10, "expected ':' after the input name"},
      {"graph(%x : Float(2 3)) {", 1, 20, "expected ',' or ')' in the sizes"},
      {"graph(%.x : Float(2)) {", 1, 7, "invalid value name %.x"},
      {"graph(%x : Float(2, device=gpu)) {", 1, 28, "invalid device 'gpu'"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = neg(%y);\n  return (%0);\n}\n", 2, 23, "undefined value %y"},
      // Since 2018 a node may end without ';': what follows must start the next statement.
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = neg(%x) %1\n  return (%0);\n}\n", 3, 3,
       "expected ':' after the output name, found 'return'"},
      {"graph(%x : Float(2)) {\n  %x : Float(2) = neg(%x);\n  return (%x);\n}\n", 2, 3, "value %x is already defined"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = neg(%x);\n}\n", 3, 1, "expected an op name, found '}'"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = neg(%x);\n", 3, 1, "expected a node or 'return', found end of input"},
      {"graph() {\n  %0 : Float(1) = f[s=\"abc](); \n", 2, 23, "unterminated string"},
      {"graph(%x : Float(2),\n      -------- stage 1 --------\n      -------- stage 1 --------\n      %y : Float(2)) {",
       3, 22, "expected a stage after 1 (stages only increase)"},
      {"graph() {\n  ---------------- stage x ----------------\n", 2, 26, "expected a stage number (an integer)"},
      {"graph() {\n  @\n", 2, 3, "unexpected character '@'"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = ^F[tx](%x);\n", 2, 22, "may only contain 't' and 's'"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = ^F[t](%x)(%x);\n", 2, 25, "expected a value (number, string, list or tensor literal)"},
      {"graph() {\n  %0 : Float(2) = Param();\n", 2, 19, "Param nodes cannot appear in a graph body"},
      {"graph() {\n  %0 : Float(2) = Constant();\n", 2, 19, "Constant needs attribute 'value'"},
      {"graph() {\n  %0 : Float(2) = Gemm[alpha=\"x\", beta=1.0]();\n", 2, 24,
       "attribute 'alpha' of Gemm must be of kind f, found s"},
      {"graph() {\n  %0 : Float(2) = Constant[value=Float(2){1.0}]();\n", 2, 42, "tensor literal of 2 elements has 1 values"},
      {"graph() {\n  %0 : Long(1) = Constant[value=Long(1){1.5}]();\n", 2, 41, "expected a Long value, found '1.5'"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = neg(%x), uses = [%0.i0, %0.i1];\n  return (%0);\n}\n", 2, 28,
       "uses of output 0 list 2 uses but it has 1"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = neg(%x), uses = [%1.i1];\n  %1 : Float(2) = neg(%0);\n  return (%1);\n}\n",
       2, 36, "use %1.i1 does not match any use of this value"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = neg(%x), uses = [%1];\n", 2, 36, "expected a use such as %5.i0"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = fusion_group_0(%x);\n  return (%0);\n}\n", 5, 1,
       "expected 'with fusion_group_0 = graph(...)', found end of input"},
      {"graph(%x : Float(2)) {\n  %0 : Float(2) = fusion_group_0(%x);\n  return (%0);\n}\nwith fusion_group_1 = graph() {\n",
       5, 6, "no node uses fusion_group_1"},
      {"graph() {\n  return ();\n}\nxyz", 4, 1, "expected end of input after the graph, found 'xyz'"},
      {"graph(%x : Float(2),\n      -------- stage 1 --------\n      %g : Float(2)) {\n  return (%g, %x);\n}\n", 4, 15,
       "output %x of stage 0 comes after an output of stage 1"},
      {"graph(%x : Float(2),\n      -------- stage 2 --------\n      %g : Float(2)) {\n  return (%x | %g);\n}\n", 4, 3,
       "return lists 2 stage groups but the graph has 3 stages"},
      {"graph() {\n  %0 : Float(2) = f[a=1x]();\n", 2, 24, "malformed number"},
      {"graph() {\n  %0 : Float(2) = f[a=<Tensor>]();\n", 2, 23, "elided values such as <Tensor> or <Graph> cannot be parsed"},
      {"graph() {\n  %0 : Float(2) = f[a=[[1]]]();\n", 2, 24, "nested lists are not supported"},
      {"graph() {\n  %0 : Float(2) = f[a=1, a=2]();\n", 2, 26, "attribute 'a' is given twice"},
      {"graph() {\n  %0 : Float(2) = Undefined[x=1]();\n", 2, 28, "Undefined takes no attributes"},
      {"graph() {\n  %0 : Float(2) = f[a=[1, \"s\"]]();\n", 2, 27, "list elements must all be numbers, strings or tensors"},
      {"graph() {\n  return (%0 | %1);\n}\n", 2, 11, "undefined value %0"},
      // Tensor literals: sizes, value count and device are checked before allocating.
      {"graph() {\n  %0 : Float(1) = Constant[value=Float(100000000000){1.0}]();\n", 2, 53,
       "tensor literal of 100000000000 elements has 1 values"},
      {"graph() {\n  %0 : Float(1) = Constant[value=Float(9223372036854775807, 9223372036854775807){1.0}]();\n", 2,
       34, "tensor literal sizes [9223372036854775807, 9223372036854775807] overflow"},
      {"graph() {\n  %0 : Float(1) = Constant[value=Float(0, 4611686018427387904, 4){}]();\n", 2, 34,
       "tensor literal sizes [0, 4611686018427387904, 4] overflow"},
      {"graph() {\n  %0 : Float(1) = Constant[value=Float(1){1.0, 2.0}]();\n", 2, 48,
       "tensor literal has more than 1 values"},
      {"graph() {\n  %0 : Float(2) = Constant[value=Float(2, device=meta){1.0, 2.0}]();\n", 2, 34,
       "tensor literal on meta: literals hold CPU or CUDA tensors only"},
      // A stage number beyond the limit, at the number.
      {"graph() {\n  -------- stage 1048576 --------\n", 2, 18, "stage number 1048576 is out of range"},
      {"graph(%x : Float(2),\n      -------- stage 1048576 --------\n      %g : Float(2)) {\n", 2, 22,
       "stage number 1048576 is out of range"},
  };
  return all;
}
}  // namespace

TEST_SUITE("ir") {
  TEST_CASE("a tensor literal on a device this build cannot hold is a ParseError at the literal") {
    // Issue 20, item 7: not ATen's dispatcher dump. On a machine with CUDA devices, one
    // past the last is refused instead.
    const std::string device =
        at::hasCUDA() ? "cuda:" + std::to_string(at::getNumGPUs()) : std::string("cuda:0");
    const std::string text =
        "graph() {\n  %0 : Float(2) = Constant[value=Float(2, device=" + device + "){1.0, 2.0}]();\n";
    CAPTURE(text);
    try {
      ir::parse(text);
      FAIL("parsed without error");
    } catch (const stagejit::ParseError& e) {
      CHECK(e.line() == 2);
      CHECK(e.column() == 34);
      CHECK_MESSAGE(e.message().rfind("tensor literal on " + device + ": ", 0) == 0, e.what());
      CHECK_MESSAGE(e.message().find('\n') == std::string::npos, e.what());
    }
  }

  TEST_CASE("malformed IR text throws ParseError at the expected line:column") {
    REQUIRE(cases().size() >= 25);
    for (const Bad& b : cases()) {
      CAPTURE(b.text);
      try {
        ir::parse(b.text);
        FAIL("parsed without error");
      } catch (const stagejit::ParseError& e) {
        CHECK(e.line() == b.line);
        CHECK(e.column() == b.column);
        CHECK_MESSAGE(e.message().find(b.message_part) != std::string::npos, e.what());
      }
    }
  }
}
