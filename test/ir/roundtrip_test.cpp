#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include <algorithm>
#include <filesystem>
#include <cstring>
#include <random>

#include "ir_test_util.hpp"

namespace ir = stagejit::ir;
namespace fs = std::filesystem;

namespace {
std::vector<fs::path> graph_files() {
  std::vector<fs::path> out;
  for (auto& e : fs::directory_iterator(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs"))
    if (e.path().extension() == ".ir") out.push_back(e.path());
  out.push_back(fs::path(STAGEJIT_SOURCE_DIR) / "examples/tanh_mlp.ir");
  std::sort(out.begin(), out.end());
  return out;
}
bool is_seed_era(const fs::path& p) { return p.filename().string().rfind("seed_era_", 0) == 0; }
}  // namespace

TEST_SUITE("ir") {
  TEST_CASE("every hand-written graph parses, lints and round-trips") {
    auto files = graph_files();
    REQUIRE(files.size() >= 15);
    for (const auto& f : files) {
      CAPTURE(f.filename().string());
      std::string text = read_text_file(f);
      auto g = ir::parse(text);
      // Some files call ops the table lacks (some_op, TensorTest): kept for printing.
      CHECK_NOTHROW(ir::lint(*g, {.allow_unknown_ops = true}));
      std::string printed = ir::to_string(*g);
      // Canonical files print back to exactly what was written by hand.
      if (!is_seed_era(f)) CHECK(printed == text);
      auto g2 = ir::parse(printed);
      CHECK_NOTHROW(ir::lint(*g2, {.allow_unknown_ops = true}));
      CHECK(ir::to_string(*g2) == printed);
      // clone() is a faithful deep copy.
      CHECK(ir::to_string(*g->clone()) == printed);
    }
  }

  TEST_CASE("the seed's MulConstant/Mul example keeps its stages, handles and groups") {
    auto g = ir::parse(read_text_file(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs/seed_mulconstant.ir"));
    CHECK(g->num_stages() == 3);
    CHECK(g->stage_output_counts() == std::vector<size_t>{1, 2, 3});
    CHECK(g->stage_inputs(2).size() == 2);
    auto nodes = g->nodes();
    REQUIRE(nodes.size() == 7);
    auto& host = nodes[0]->get<ir::HostOp>();
    CHECK(host.name == "MulConstant");
    CHECK(host.calling_convention == "ts");
    REQUIRE(host.scalars.size() == 1);
    CHECK(std::get<double>(host.scalars[0]) == 2.0);
    ir::Value* handle = nodes[0]->output(1);
    CHECK(handle->is_handle());
    // The stage-0 handle is run by a stage-1 Eval and by a stage-2 Eval.
    REQUIRE(handle->uses().size() == 2);
    CHECK(handle->uses()[0].user->stage() == 1);
    CHECK(handle->uses()[1].user->stage() == 2);
    CHECK(handle->uses()[1].user->is<ir::Eval>());
    CHECK(handle->uses()[1].offset == 1);
  }

  TEST_CASE("seed-era text reads as the equivalent canonical graph") {
    auto g = ir::parse(read_text_file(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs/seed_era_backward.ir"));
    CHECK(ir::to_string(*g) ==
          "graph(%0 : Float(3, 4),\n"
          "      %1 : Float(4, 5),\n"
          "      -------- stage 1 --------\n"
          "      %2 : Float(3, 5)) {\n"
          "  %3 : Float(3, 5) = mm(%0, %1);\n"
          "  %4 : Float(3, 5) = tanh(%3);\n"
          "  ---------------- stage 1 ----------------\n"
          "  %5 : Float(3, 5) = mul(%4, %4);\n"
          "  %6 : Float(3, 5) = rsub[other=1, alpha=1](%5);\n"
          "  %7 : Float(3, 5) = mul(%2, %6);\n"
          "  %8 : Float(5, 4) = t(%1);\n"
          "  %9 : Float(3, 4) = mm(%7, %8);\n"
          "  %10 : Float(4, 3) = t(%0);\n"
          "  %11 : Float(4, 5) = mm(%10, %7);\n"
          "  return (%4 | %9, %11);\n"
          "}\n");
    auto c = ir::parse(read_text_file(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs/seed_era_cppop_eval.ir"));
    auto nodes = c->nodes();
    REQUIRE(nodes.size() == 2);
    CHECK(nodes[0]->get<ir::HostOp>().name == "Square");
    CHECK(nodes[0]->get<ir::HostOp>().calling_convention == "t");
    CHECK(nodes[1]->is<ir::Eval>());
    auto f = ir::parse(read_text_file(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs/seed_era_fusion.ir"));
    auto& fg = f->nodes()[2]->get<ir::FusionGroup>();
    REQUIRE(fg.subgraph);
    CHECK(fg.subgraph->nodes().size() == 3);
    // The seed's op names are the table's ops (Note [Op aliases], ir/detail/parser_dialects.hpp).
    CHECK(fg.subgraph->nodes()[2]->get<ir::Op>().id() == stagejit::OpId::mul);
  }

  TEST_CASE("parsed constants and attributes hold exactly the written values") {
    auto g = ir::parse(read_text_file(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs/constants.ir"));
    auto nodes = g->nodes();
    auto c0 = nodes[0]->get<ir::Constant>().value;
    CHECK(bool(c0.scalar_type() == at::kFloat));
    CHECK(at::equal(c0, at::tensor({1.0f, -2.5f, 0.1f, 3.0f}).reshape({2, 2})));
    auto c1 = nodes[1]->get<ir::Constant>().value;
    CHECK(std::isinf(c1[0].item<double>()));
    CHECK(std::isnan(c1[2].item<double>()));
    CHECK(c1[3].item<double>() == 1e-300);
    CHECK(nodes[2]->get<ir::Constant>().value.item<int64_t>() == -7);
    auto a = ir::parse(read_text_file(fs::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs/attrs.ir"));
    auto& op = a->nodes()[0]->get<ir::Op>();
    CHECK(std::get<double>(*op.attribute("f")) == 0.1);
    CHECK(std::get<std::vector<double>>(*op.attribute("fs")) == std::vector<double>{1.0, -2.5e-8});
    CHECK(std::get<std::string>(*op.attribute("s")) == "a \"q\"\n");
    CHECK(std::get<std::vector<at::Tensor>>(*op.attribute("ts")).size() == 2);
    CHECK(std::get<std::vector<std::string>>(*op.attribute("e3")).empty());
  }

  TEST_CASE("doubles in attributes and scalars print so they parse back bit-exactly") {
    std::mt19937_64 rng(7);
    std::uniform_int_distribution<uint64_t> bits;
    ir::Graph g;
    ir::Value* x = g.add_input(ir::TensorType::contiguous(at::kFloat, {2}), 0, "x");
    std::vector<double> values;
    for (int i = 0; i < 200; ++i) {
      uint64_t b = bits(rng);
      double d;
      std::memcpy(&d, &b, sizeof d);
      if (std::isnan(d)) continue;
      values.push_back(d);
    }
    ir::Node* n = g.create_and_append(ir::Op{"f", {{"v", values}, {"one", values[0]}}}, {x}, {x->type()});
    g.create_and_append(ir::HostOp{"H", "tss", {values[1], values}, nullptr}, {x}, {x->type()});
    g.register_output(n->output(), 0);
    auto back = ir::parse(ir::to_string(g));
    auto& op = back->nodes()[0]->get<ir::Op>();
    CHECK(std::get<std::vector<double>>(*op.attribute("v")) == values);
    CHECK(std::get<double>(*op.attribute("one")) == values[0]);
    auto& h = back->nodes()[1]->get<ir::HostOp>();
    CHECK(std::get<double>(h.scalars[0]) == values[1]);
    CHECK(std::get<std::vector<double>>(h.scalars[1]) == values);
  }

  TEST_CASE("a graph built through the API round-trips, with random float constants") {
    ir::Graph g;
    auto t = at::randn({3, 2}, at::kFloat);
    ir::Value* x = g.add_input(ir::TensorType::contiguous(at::kFloat, {3, 2}), 0);
    ir::Value* c = g.append_constant(t);
    ir::Value* y = g.create_and_append(ir::Op::with("mul"), {x, c}, {x->type()})->output();
    g.register_output(y, 0);
    auto back = ir::parse(ir::to_string(g));
    CHECK(at::equal(back->nodes()[0]->get<ir::Constant>().value, t));
    CHECK(ir::to_string(*back) == ir::to_string(g));
  }

  TEST_CASE("mutated and truncated texts parse or throw ParseError, never anything else") {
    std::mt19937 rng(1234);
    const std::string alphabet = "%()[]{},:=;^!|<>-\"#0123456789.eEFloatHandle graph return with stage\n";
    size_t parsed = 0, rejected = 0;
    for (const auto& f : graph_files()) {
      std::string text = read_text_file(f);
      auto attempt = [&](const std::string& s) {
        try {
          auto g = ir::parse(s);
          ++parsed;
          try {
            ir::lint(*g);
            CHECK(ir::to_string(*ir::parse(ir::to_string(*g))) == ir::to_string(*g));
          } catch (const stagejit::IrError&) {
          }
        } catch (const stagejit::ParseError& e) {
          ++rejected;
          CHECK(e.line() >= 1);
          CHECK(e.column() >= 1);
        }
      };
      for (size_t cut = 0; cut < text.size(); cut += 3) attempt(text.substr(0, cut));
      for (int k = 0; k < 150; ++k) {
        std::string s = text;
        int edits = 1 + int(rng() % 3);
        for (int e = 0; e < edits; ++e) {
          size_t pos = rng() % s.size();
          switch (rng() % 3) {
            case 0: s[pos] = alphabet[rng() % alphabet.size()]; break;
            case 1: s.erase(pos, 1 + rng() % 4); break;
            default: s.insert(pos, 1, alphabet[rng() % alphabet.size()]);
          }
          if (s.empty()) s = "g";
        }
        attempt(s);
      }
    }
    CHECK(rejected > 1000);
    MESSAGE("fuzz: " << parsed << " parsed, " << rejected << " rejected with ParseError");
  }
}
