// Issue #15: the printouts of the seed era (2017) and of one year later (2018) parse,
// print back canonically (print, parse, print: identical), and run where their ops are
// known; messages name values and fusion groups as `--print` does, and runtime errors
// name the line and column of the failing node.
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include <cmath>
#include <filesystem>

#include "ir_test_util.hpp"

namespace ir = stagejit::ir;
namespace sj = stagejit;

namespace {

std::shared_ptr<ir::Graph> round_trip(const std::string& text) {
  auto g = ir::parse(text);
  // Printouts call ops the table lacks (T, TensorTest, Frobnicate): kept for printing.
  ir::lint(*g, {.allow_unknown_ops = true});
  const std::string printed = ir::to_string(*g);
  auto again = ir::parse(printed);
  ir::lint(*again, {.allow_unknown_ops = true});
  CHECK(ir::to_string(*again) == printed);
  return g;
}

std::shared_ptr<ir::Graph> graph_file(const std::string& name) {
  return round_trip(read_text_file(std::filesystem::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs" / name));
}

std::vector<sj::variable_list> run(const std::shared_ptr<ir::Graph>& g, const std::vector<sj::variable_list>& in) {
  return sj::closure::run_stages(std::make_shared<const sj::closure::MultiStageClosure>(g), in);
}

bool same(const sj::Variable& a, const at::Tensor& b, double tol = 0) {
  return a.defined() && a.sizes() == b.sizes() && (a.data() - b).abs().max().item<double>() <= tol;
}

const ir::Node* node_at(const ir::Graph& g, size_t i) { return g.nodes()[i]; }

}  // namespace

TEST_SUITE("ir") {
  TEST_CASE("seed era: uses naming the hidden id of a single-output node") {
    auto g = graph_file("seed_era_hidden_ids.ir");
    REQUIRE(g->nodes().size() == 2);
    // The use lists are checked, not ignored: a hidden id that names no user fails.
    CHECK_THROWS_WITH_AS(ir::parse("graph(%1 : Float(2)) {\n"
                                   "  %3 : Float(2) = ^Neg()(%1), uses = [[%7.i0]];\n"
                                   "  %5 : Float(2) = ^Neg()(%3), uses = [[%0.i0]];\n"
                                   "  return (%5);\n}\n"),
                         doctest::Contains("use %7.i0 does not match any use"), sj::ParseError);
    // Both nodes are the table's neg (Python's autograd Neg of the seed era), and run.
    CHECK(node_at(*g, 0)->get_if<ir::Op>()->id() == sj::OpId::neg);
    at::Tensor x = at::randn({2});
    CHECK(same(run(g, {{sj::Variable(x)}})[0][0], x));
  }

  TEST_CASE("seed era: a use list naming the wrong node, or an ambiguous seed function, is not taken on trust") {
    // %8 is Baz's hidden id (its first output is %9), and Baz does not use %3.
    CHECK_THROWS_WITH_AS(ir::parse("graph(%1 : Float(2)) {\n"
                                   "  %3 : Float(2), %4 : Handle = ^Foo()(%1), uses = [[%8.i0], []];\n"
                                   "  %6 : Float(2), %7 : Handle = ^Bar()(%3), uses = [[%0.i0], []];\n"
                                   "  %9 : Float(2), %10 : Handle = ^Baz()(%1), uses = [[%0.i1], []];\n"
                                   "  return (%6, %9);\n}\n"),
                         doctest::Contains("use %8.i0 does not match any use"), sj::ParseError);
    // A hidden id below an intervening node (the seed's test_conv: the CppOp is %3, an
    // Undefined made after it is %4, its outputs %5 and %6).
    auto conv = round_trip("graph(%1 : Double(1, 2, 5, 5)\n      %2 : Double(3, 2, 3, 3)) {\n"
                           "  %4 : UNKNOWN_TYPE = Undefined(), uses = [%3.i2];\n"
                           "  %5 : Double(1, 3, 3, 3), %6 : Handle = CppOp[ConvForward](%1, %2, %4), uses = [[%0.i0], []];\n"
                           "  return (%5);\n}\n");
    CHECK(conv->nodes()[1]->get_if<ir::HostOp>()->name == "ConvForward");
    // `2 - x` and `x - 2` printed alike: SubConstant / DivConstant stay host ops.
    auto sub = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = ^SubConstant(2)(%1);\n  return (%2);\n}\n");
    CHECK(sub->nodes()[0]->is<ir::HostOp>());
    // An alias with the wrong number of inputs is a ParseError naming the arity.
    CHECK_THROWS_WITH_AS(ir::parse("graph(%1 : Float(2)) {\n  %2 : Float(2) = Add(%1);\n  return (%2);\n}\n"),
                         "2:19: Add (the table's add) takes 2 inputs (or 1 with the attribute 'other'), found 1",
                         sj::ParseError);
    // ... and a CppOp class of the wrong arity stays a host op.
    auto cpp = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = CppOp[N5torch8autograd3AddE](%1);\n  return (%2);\n}\n");
    CHECK(cpp->nodes()[0]->is<ir::HostOp>());
  }

  TEST_CASE("tensor dumps as TH printed them: nan and inf read, other layouts and overflowing sizes kept as text") {
    auto nan = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = T[a=\n nan\n-inf\n[ CPUFloatTensor{2} ]\n](%1);\n"
                          "  return (%2);\n}\n");
    const auto& a = std::get<at::Tensor>(*nan->nodes()[0]->get_if<ir::Op>()->attribute("a"));
    CHECK(std::isnan(a[0].item<float>()));
    CHECK(a[1].item<float>() == -INFINITY);
    auto scaled = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = T[a=\n1e-02 *\n  1.5\n  2.5\n[ CPUFloatTensor{2} ]\n](%1);\n"
                             "  return (%2);\n}\n");
    CHECK(std::holds_alternative<std::string>(*scaled->nodes()[0]->get_if<ir::Op>()->attribute("a")));
    auto huge = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = T[a= 1 [ CPUDoubleTensor{7623851,13526403,357761} ]](%1);\n"
                           "  return (%2);\n}\n");
    CHECK(std::get<std::string>(*huge->nodes()[0]->get_if<ir::Op>()->attribute("a")) ==
          "1 [ CPUDoubleTensor{7623851,13526403,357761} ]");
  }

  TEST_CASE("a stage output whose declared type its op does not compute is an error naming the node") {
    auto lie = round_trip("graph(%x : Float(2, 3)) {\n  %1 : Float(2, 3) = Transpose[perm=[1, 0]](%x);\n  return (%1);\n}\n");
    CHECK_THROWS_WITH_AS(run(lie, {{sj::Variable(at::randn({2, 3}))}}),
                         "stage 0 output 0, %0 (node %0 = Transpose (line 2, column 3)), is a Float tensor of sizes "
                         "[3, 2] but is declared Float(2, 3)",
                         sj::ShapeError);
    // An elementwise op's lie is caught by lint (rule declared-type, issue 34); an mm's
    // when it runs.
    CHECK_THROWS_WITH_AS(ir::lint(*ir::parse("graph(%x : Float(2)) {\n  %1 : Double(2) = neg(%x);\n  return (%1);\n}\n")),
                         doctest::Contains("rule 'declared-type': output %0 is declared Double(2)"), ir::LintError);
    auto dtype = round_trip("graph(%x : Float(2, 2)) {\n  %1 : Double(2, 2) = mm(%x, %x);\n  return (%1);\n}\n");
    CHECK_THROWS_AS(run(dtype, {{sj::Variable(at::randn({2, 2}))}}), sj::DtypeError);
  }

  TEST_CASE("seed era: the three-stage MulConstant/Mul printout runs every stage") {
    auto g = graph_file("seed_era_three_stages.ir");
    CHECK(g->num_stages() == 3);
    at::Tensor x = at::randn({2, 2}, at::kDouble), y = at::randn({2, 2}, at::kDouble);
    at::Tensor gz = at::randn({2, 2}, at::kDouble), ggx = at::randn({2, 2}, at::kDouble),
               ggy = at::randn({2, 2}, at::kDouble);
    auto out = run(g, {{sj::Variable(x), sj::Variable(y)}, {sj::Variable(gz)}, {sj::Variable(ggx), sj::Variable(ggy)}});
    // z = (2y) * x; stage 1: dz/dx = gz * 2y, dz/dy = 2 (gz * x); stage 2 per the printout.
    CHECK(same(out[0][0], 2 * y * x));
    CHECK(same(out[1][0], gz * (2 * y)));
    CHECK(same(out[1][1], 2 * (gz * x)));
    CHECK(same(out[2][0], ggx * (2 * y) + (2 * ggy) * x));
    CHECK(same(out[2][1], (2 * ggy) * gz));
    CHECK(same(out[2][2], 2 * (ggx * gz)));
  }

  TEST_CASE("seed era: host op scalars as Python printed them") {
    auto g = graph_file("seed_era_host_scalars.ir");
    const auto& nodes = g->nodes();
    REQUIRE(nodes.size() == 4);
    CHECK(nodes[0]->get_if<ir::Op>()->id() == sj::OpId::add);  // AddConstant(2, True)
    CHECK(nodes[1]->get_if<ir::Op>()->id() == sj::OpId::view);  // View((2, 3))
    const auto* pool = nodes[2]->get_if<ir::HostOp>();
    REQUIRE(pool != nullptr);
    REQUIRE(pool->scalars.size() == 4);
    CHECK(std::holds_alternative<sj::NoneScalar>(pool->scalars[0]));
    CHECK(pool->scalars[1] == sj::Scalar(false));
    CHECK(pool->scalars[2] == sj::Scalar(std::vector<int64_t>{3}));
    CHECK(pool->scalars[3] == sj::Scalar(std::string("mean")));
    CHECK(nodes[3]->get_if<ir::Op>()->id() == sj::OpId::view);  // View((6,))
    CHECK(ir::to_string(*g).find("^Pool[tssss](None, false, [3], \"mean\")") != std::string::npos);
    // None is a host op scalar only.
    CHECK_THROWS_WITH_AS(ir::parse("graph(%x : Float(2)) {\n  %0 : Float(2) = neg[a=None](%x);\n  return (%0);\n}\n"),
                         doctest::Contains("attribute 'a' is None"), sj::ParseError);
  }

  TEST_CASE("seed era: unquoted strings, tensor dumps, Transpose without perm, C++ type names") {
    auto g = graph_file("seed_era_attributes.ir");
    const auto& nodes = g->nodes();
    REQUIRE(nodes.size() == 6);
    const auto* neg = nodes[0]->get_if<ir::Op>();
    REQUIRE(neg != nullptr);
    CHECK(neg->id() == sj::OpId::neg);
    CHECK(std::get<std::string>(*neg->attribute("note")) == "from_pyop");
    const auto* dump = nodes[1]->get_if<ir::Op>()->attribute("a");
    CHECK(ir::attribute_equal(*dump, at::ones({2, 2}, at::kDouble)));
    CHECK(nodes[2]->get_if<ir::Transpose>()->perm.empty());
    CHECK(nodes[3]->get_if<ir::Op>()->id() == sj::OpId::neg);  // struct torch::autograd::Neg
    CHECK(nodes[4]->get_if<ir::Op>()->id() == sj::OpId::add);  // N5torch8autograd3AddE
    CHECK(ir::attribute_equal(*nodes[5]->get_if<ir::Op>()->attribute("d"),
                              at::tensor({0.5, 1.25, -2.0}, at::kDouble)));
    // A CppOp whose class is not an op stays a host op under its printed name.
    auto h = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = CppOp[class my::ns::Thing](%1);\n  return (%2);\n}\n");
    CHECK(h->nodes()[0]->get_if<ir::HostOp>()->name == "class my::ns::Thing");
    // A dump whose values do not fill its sizes keeps its text.
    auto d = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = T[a= 1 2 3 [ CPUFloatTensor{2,2} ]](%1);\n  return (%2);\n}\n");
    CHECK(std::get<std::string>(*d->nodes()[0]->get_if<ir::Op>()->attribute("a")) == "1 2 3 [ CPUFloatTensor{2,2} ]");
    // Transpose without perm reverses the axes (ONNX's default) when run.
    auto t = round_trip("graph(%x : Float(2, 3, 4)) {\n  %0 : Float(4, 3, 2) = Transpose(%x);\n  return (%0);\n}\n");
    at::Tensor x = at::randn({2, 3, 4});
    CHECK(same(run(t, {{sj::Variable(x)}})[0][0], x.permute({2, 1, 0})));
  }

  TEST_CASE("seed era: an LSTM cell printed with Gemm, Split and a FusionGroup_0 of seed op names runs") {
    auto g = graph_file("seed_era_lstm_cell.ir");
    at::Tensor x = at::randn({3, 10}), h = at::randn({3, 20}), c = at::randn({3, 20});
    at::Tensor w_ih = at::randn({80, 10}), w_hh = at::randn({80, 20}), b_ih = at::randn({80}), b_hh = at::randn({80});
    auto gates = (at::addmm(b_ih, x, w_ih.t()) + at::addmm(b_hh, h, w_hh.t())).chunk(4, 1);
    at::Tensor cy = gates[1].sigmoid() * c + gates[0].sigmoid() * gates[2].tanh();
    at::Tensor hy = gates[3].sigmoid() * cy.tanh();
    sj::variable_list in;
    for (const at::Tensor& t : {x, h, c, w_ih, w_hh, b_ih, b_hh}) in.emplace_back(t);
    auto out = run(g, {in})[0];
    CHECK(same(out[0], hy, 1e-5));
    CHECK(same(out[1], cy, 1e-5));
  }

  TEST_CASE("2018: namespaces, no ';', scopes, scalar tensors, fusion group devices, Dynamic and Tensor") {
    auto g = graph_file("seed_era_2018.ir");
    std::string printed = ir::to_string(*g);
    CHECK(printed.find("add[alpha=1](%0, %1);") != std::string::npos);
    CHECK(printed.find("split[split_size=2, dim=1]") != std::string::npos);
    CHECK(printed.find("fusion_group_0(%3, %4)") != std::string::npos);
    CHECK(printed.find("UNKNOWN_TYPE = threshold[threshold=0, value=0]") != std::string::npos);
    CHECK(printed.find("scope") == std::string::npos);
    at::Tensor a = at::randn({4, 4}), b = at::randn({4, 4});
    auto parts = (a + b).split(2, 1);
    at::Tensor expected = at::threshold(parts[0] * parts[1], 0, 0).t() * 2.5;
    CHECK(same(run(g, {{sj::Variable(a), sj::Variable(b)}})[0][0], expected));
  }

  TEST_CASE("2018: one namespace per kind; ops named like a parser word print quoted and read back") {
    auto graph_with = [](const std::string& kind) {
      return "graph(%a : Float(2),\n      %b : Float(2)) {\n  %1 : Float(2) = " + kind + "(%a, %b)\n  return (%1);\n}\n";
    };
    CHECK_THROWS_WITH_AS(ir::parse(graph_with("prim::onnx::Add")),
                         "3:19: 'prim::onnx::Add' has two namespaces; expected one of aten::, prim::, onnx:: before a kind",
                         sj::ParseError);
    CHECK_THROWS_WITH_AS(ir::parse(graph_with("aten::FusionGroup_0")),
                         doctest::Contains("FusionGroup_0 takes no namespace (a fusion group is prim::FusionGroup_N)"),
                         sj::ParseError);
    CHECK_THROWS_WITH_AS(ir::parse(graph_with("onnx::CppOp")), doctest::Contains("CppOp takes no namespace"),
                         sj::ParseError);
    // Another namespace is kept: an unknown op of that name.
    auto other = ir::parse(graph_with("mylib::Add"));
    CHECK(ir::to_string(*other).find("= mylib::Add(%a, %b)") != std::string::npos);
    // An op whose name the parser would read as an alias, a kind, a fusion group or a
    // namespace prints quoted, so it reads back as the same unknown op.
    for (std::string name : {"Add", "Transpose", "Constant", "FusionGroup_3", "fusion_group_0", "CppOp", "If",
                             "aten::mul", "onnx::Foo"}) {
      CAPTURE(name);
      auto g = ir::parse(graph_with("\"" + name + "\""));
      const std::string printed = ir::to_string(*g);
      CHECK(printed.find("= \"" + name + "\"(%a, %b)") != std::string::npos);
      CHECK(ir::to_string(*ir::parse(printed)) == printed);
      CHECK(g->nodes().front()->get<ir::Op>().name() == name);
    }
  }

  TEST_CASE("2018: control flow and non-tensor types are refused naming the construct") {
    CHECK_THROWS_WITH_AS(ir::parse("graph(%a : Dynamic\n      %c : Dynamic) {\n  %1 : Dynamic = prim::If(%c)\n"
                                   "    block0() {\n      -> (%a)\n    }\n  return (%1);\n}\n"),
                         doctest::Contains("control flow ('prim::If' with blocks) is not supported"), sj::ParseError);
    CHECK_THROWS_WITH_AS(ir::parse("graph(%a : Dynamic) {\n  %1 : Dynamic = Foo(%a)\n    block0() {\n    }\n  return (%1);\n}\n"),
                         doctest::Contains("control flow blocks ('block0')"), sj::ParseError);
    CHECK_THROWS_WITH_AS(ir::parse("graph(%a : Dynamic) {\n  %1 : int = prim::Constant[value=1]()\n  return (%a);\n}\n"),
                         "2:8: non-tensor type 'int' is not supported: stagejit graphs hold tensors and handles only",
                         sj::ParseError);
    CHECK_THROWS_WITH_AS(ir::parse("graph(%a : float[]) {\n  return (%a);\n}\n"),
                         doctest::Contains("non-tensor type 'float'"), sj::ParseError);
  }

  TEST_CASE("op names of the seed era run as their ATen twins, and fuse like them") {
    auto g = round_trip(
        "graph(%a : Float(4, 6)\n      %b : Float(4, 6)\n      %w : Float(6, 3)\n      %c : Float(4, 3)) {\n"
        "  %1 : Float(4, 6) = Add[broadcast=1](%a, %b);\n"
        "  %2 : Float(4, 6) = Mul(%1, %b);\n"
        "  %3 : Float(4, 6) = Sub(%2, %a);\n"
        "  %4 : Float(4, 6) = Tanh(%3);\n"
        "  %5 : Float(4, 6) = Sigmoid(%4);\n"
        "  %6 : Float(4, 6) = Exp(%5);\n"
        "  %7 : Float(4, 6) = Log(%6);\n"
        "  %8 : Float(4, 6) = Neg(%7);\n"
        "  %9 : Float(4, 3), %10 : Float(4, 3) = Chunk[chunks=2, axis=1](%8);\n"
        "  %11 : Float(4, 2), %12 : Float(4, 4) = Split[split=[2, 4], axis=1](%8);\n"
        "  %13 : Float(4, 9) = Concat[axis=1](%9, %10, %10);\n"
        "  %14 : Float(4, 3) = Gemm[alpha=1.0, beta=1.0](%8, %w, %c);\n"
        "  %15 : Float(3, 4) = Transpose[perm=[1, 0]](%14);\n"
        "  %16 : Float(4, 3) = cross[dim=1](%9, %10);\n"
        "  %17 : Float(4, 3) = threshold[threshold=0.1, value=-1.0](%16);\n"
        "  %18 : Float(3) = select[dim=0, index=1](%17);\n"
        "  %19 : Float(4, 1), %20 : Float(4, 1), %21 : Float(4, 1) = split[split_size=1, dim=1](%17);\n"
        "  return (%11, %12, %13, %15, %18, %21);\n}\n");
    at::Tensor a = at::randn({4, 6}), b = at::randn({4, 6}), w = at::randn({6, 3}), c = at::randn({4, 3});
    at::Tensor t8 = -at::log(at::exp(at::sigmoid(at::tanh((a + b) * b - a))));
    auto ch = t8.chunk(2, 1);
    auto sp = t8.split_with_sizes({2, 4}, 1);
    at::Tensor t17 = at::threshold(at::cross(ch[0], ch[1], 1), 0.1, -1.0);
    std::vector<at::Tensor> expected = {sp[0], sp[1], at::cat({ch[0], ch[1], ch[1]}, 1), at::addmm(c, t8, w).t(),
                                        t17.select(0, 1), t17.split(1, 1)[2]};
    sj::variable_list inputs = {sj::Variable(a), sj::Variable(b), sj::Variable(w), sj::Variable(c)};
    auto unfused = run(g, {inputs})[0];
    REQUIRE(unfused.size() == expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      CAPTURE(i);
      CHECK(same(unfused[i], expected[i], 1e-5));
    }
    // The aliases are the table's ops: the elementwise chain Add..Neg fuses into one group.
    sj::passes::fuse(*g);
    ir::lint(*g);
    size_t groups = 0;
    for (const ir::Node* n : g->nodes()) groups += n->is<ir::FusionGroup>();
    CHECK(groups >= 1);
    CHECK(ir::to_string(*g).find("with fusion_group_0 = graph") != std::string::npos);
    auto fused = run(g, {inputs})[0];
    for (size_t i = 0; i < expected.size(); ++i) {
      CAPTURE(i);
      CHECK(same(fused[i], expected[i], 1e-5));
    }
    // Legacy ONNX axis broadcasting is refused, not run differently.
    CHECK_THROWS_WITH_AS(ir::parse("graph(%a : Float(2, 3)\n      %b : Float(2)) {\n"
                                   "  %1 : Float(2, 3) = Add[broadcast=1, axis=0](%a, %b);\n  return (%1);\n}\n"),
                         doctest::Contains("'axis' is not supported"), sj::ParseError);
  }

  TEST_CASE("messages name values and fusion groups as --print does, runtime errors name line and column") {
    // An unknown op is reported as unknown (at compile time and by the kernel generator).
    auto u = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = Frobnicate(%1);\n  return (%2);\n}\n");
    CHECK_THROWS_WITH_AS(sj::closure::MultiStageClosure{u},
                         "closure: node %1 = Frobnicate (line 2, column 3) calls the unknown op 'Frobnicate' "
                         "(not in the op table, ops/op_schema.hpp)",
                         sj::CompileError);
    auto fg = round_trip("graph(%1 : Float(2)) {\n  %2 : Float(2) = neg(%1);\n  %3 : Float(2) = fusion_group_0(%2);\n"
                         "  return (%3);\n}\nwith fusion_group_0 = graph(%4 : Float(2)) {\n"
                         "  %5 : Float(2) = Frobnicate(%4);\n  return (%5);\n}\n");
    CHECK_THROWS_WITH_AS(run(fg, {{sj::Variable(at::randn({2}))}}),
                         doctest::Contains("unknown op 'Frobnicate'"), sj::Error);
    try {
      run(fg, {{sj::Variable(at::randn({2}))}});
    } catch (const sj::Error& e) {
      CHECK(std::string(e.what()).find("fusion_group_0") != std::string::npos);
      CHECK(std::string(e.what()).find("not elementwise") == std::string::npos);
    }
    // A shape the declared types did not reveal fails at run time, naming the node.
    auto mm = round_trip("graph(%a : Float(2, 3)\n      %b : Float(4, 5)) {\n  %c : Float(2, 5) = mm(%a, %b);\n"
                         "  return (%c);\n}\n");
    CHECK_THROWS_WITH_AS(run(mm, {{sj::Variable(at::randn({2, 3})), sj::Variable(at::randn({4, 5}))}}),
                         doctest::Contains("(node %c = mm (line 3, column 3))"), sj::Error);
    // Unnamed values are named by their print numbering, not their ids.
    auto seed = graph_file("seed_era_hidden_ids.ir");
    CHECK(ir::value_label(seed->nodes()[1]->output()) == "%2");
    CHECK(ir::node_label(seed->nodes()[1]) == "%2 = neg (line 3, column 3)");
  }
}
