// Laws every node kind and every Function kind obeys, checked over the whole closed set
// (as Boost.Hana tests its concepts): the test cases are instantiated from the variants
// themselves, so a new kind is covered (a node kind fails until a graph in
// test/ir/graphs holds one).
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <tuple>
#include <variant>

namespace ir = stagejit::ir;
namespace sj = stagejit;

namespace {

template <class V>
struct as_tuple;
template <class... K>
struct as_tuple<std::variant<K...>> {
  using type = std::tuple<K...>;
};

// How many kinds of the variant V `name_of.template operator()<K>()` names `name`.
template <class V>
struct count_named;
template <class... K>
struct count_named<std::variant<K...>> {
  template <class NameOf>
  static int of(const NameOf& name_of, std::string_view name) {
    return ((name_of.template operator()<K>() == name ? 1 : 0) + ...);
  }
};

// The canonical hand-written graphs (test/ir/graphs, not the seed-era ones, which print
// back in today's form): together they hold a node of every kind.
std::vector<std::string> canonical_graphs() {
  std::vector<std::string> texts;
  for (auto& e : std::filesystem::directory_iterator(std::filesystem::path(STAGEJIT_SOURCE_DIR) / "test/ir/graphs")) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".ir" || name.rfind("seed_era_", 0) == 0) continue;
    std::ifstream in(e.path());
    texts.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return texts;
}

template <class K>
bool graph_has_kind(const ir::Graph& g) {
  if constexpr (std::is_same_v<K, ir::Param>) return !g.inputs().empty() && g.inputs()[0]->node()->is<K>();
  else if constexpr (std::is_same_v<K, ir::Return>) return g.return_node()->is<K>();
  else {
    for (const ir::Node* n : g.nodes())
      if (n->is<K>()) return true;
    return false;
  }
}

}  // namespace

TEST_SUITE("ir") {
  TEST_CASE_TEMPLATE_DEFINE("node kind laws: named, printed, parsed, cloned, linted", K, node_kind_laws) {
    const std::string_view name = ir::kind_name<K>();
    CHECK_FALSE(name.empty());
    // The name table is a bijection: no other kind has this name.
    auto kind_name_of = []<class X>() { return ir::kind_name<X>(); };
    CHECK(count_named<ir::NodeKind>::of(kind_name_of, name) == 1);
    int graphs_with_kind = 0;
    for (const std::string& text : canonical_graphs()) {
      auto g = ir::parse(text);
      if (!graph_has_kind<K>(*g)) continue;
      ++graphs_with_kind;
      CHECK_NOTHROW(ir::lint(*g, {.allow_unknown_ops = true}));  // some_op: not in the op table       // arity and types as the kind requires
      CHECK(ir::to_string(*g) == text);  // print(parse(t)) == t for canonical text
      auto c = g->clone();
      CHECK(ir::to_string(*c) == text);  // clone is faithful
      CHECK_NOTHROW(ir::lint(*c, {.allow_unknown_ops = true}));
      // A node's kind equals itself as CSE compares kinds, unless opaque or unique.
      constexpr bool comparable = !(std::is_same_v<K, ir::HostOp> || std::is_same_v<K, ir::Eval> ||
                                    std::is_same_v<K, ir::FusionGroup> || std::is_same_v<K, ir::Param> ||
                                    std::is_same_v<K, ir::Return>);
      for (const ir::Node* n : g->nodes()) {
        if (!n->is<K>()) continue;
        bool reflexive = comparable;
        if constexpr (std::is_same_v<K, ir::Constant>)  // NaN != NaN: CSE keeps such constants apart
          if (const at::Tensor& v = n->get_if<ir::Constant>()->value; v.is_floating_point())
            reflexive = !v.isnan().any().item<bool>();
        CHECK(ir::kind_equal(n->kind(), n->kind()) == reflexive);
      }
    }
    CHECK_MESSAGE(graphs_with_kind > 0, "no graph in test/ir/graphs has a ", name, " node: add one");
  }
  TEST_CASE_TEMPLATE_APPLY(node_kind_laws, as_tuple<ir::NodeKind>::type);

  TEST_CASE("op identity is typed: every table op interns to its own schema, unknown names to one each") {
    std::set<const sj::OpSchema*> seen;
    for (const sj::OpSchema& s : sj::op_schemas) {
      CHECK(sj::intern_op(s.name) == &s);
      CHECK(sj::op_id(s.name) == s.id);
      CHECK(&sj::ops::def(s.id) == sj::ops::find(s.name));
      CHECK(sj::ops::def(s.id).name == s.name);
      CHECK(seen.insert(&s).second);
      ir::Op op(s.name);
      CHECK(op.id() == s.id);
    }
    const sj::OpSchema* unknown = sj::intern_op("no_such_op_for_laws");
    CHECK(unknown->id == sj::OpId::unknown);
    CHECK(sj::intern_op("no_such_op_for_laws") == unknown);
    CHECK_FALSE(unknown->side_effects);
    CHECK(sj::intern_op("no_such_op_for_laws_")->side_effects);
    CHECK_THROWS_WITH_AS(sj::ops::def(*unknown), "unknown op 'no_such_op_for_laws'", sj::Error);
  }
}

TEST_SUITE("autograd") {
  // Every Function kind is an aggregate whose default (empty) value names itself.
  TEST_CASE_TEMPLATE_DEFINE("Function kind laws: held by the variant, named, released safely", K, function_kind_laws) {
    auto fn = sj::make_function(K{}, {}, 1);
    CHECK(fn->template is<K>());
    const std::string name = fn->name();
    CHECK_FALSE(name.empty());
    // Names tell kinds apart: no other kind's empty value has this name.
    auto function_name_of = []<class X>() { return sj::make_function(X{}, {}, 1)->name(); };
    CHECK(count_named<sj::FunctionKind>::of(function_name_of, name) == 1);
    CHECK_NOTHROW(fn->release_variables());
    CHECK(fn->template is<K>());
  }
  TEST_CASE_TEMPLATE_APPLY(function_kind_laws, as_tuple<sj::FunctionKind>::type);
}
