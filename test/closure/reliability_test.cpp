// Issue 34 ("Nothing silent, round 3"), item 2: random ops draw in program order in a
// compiled function (Note [Program order of random ops] in closure/plan.hpp), checked
// against the eager stagejit call at the same seed, values and gradients.
#include <stagejit/stagejit.hpp>
#include <stagejit/testing/doctest.hpp>

#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace sj = stagejit;

namespace {

using Body = std::function<sj::variable_list(const sj::variable_list&)>;

struct ThreadCount {
  int saved = sj::engine::num_threads();
  explicit ThreadCount(int n) { sj::engine::set_num_threads(n); }
  ~ThreadCount() { sj::engine::set_num_threads(saved); }
};

// Runs `body` eagerly and compiled (options) after at::manual_seed(seed), on leaves of
// `data`: the outputs' dropped positions must be equal, the values equal to 1e-12
// (double), and with derivatives >= 1 the gradients of sum(out_i * w_i) equal eager's.
void check_against_eager(const Body& body, const std::vector<at::Tensor>& data, sj::CompileOptions options,
                         const std::string& what) {
  INFO(what, " derivatives=", options.derivatives, " fuse=", options.fuse, " inter_op=", options.inter_op_parallel,
       " threads=", sj::engine::num_threads());
  auto leaves = [&] {
    sj::variable_list v;
    for (const auto& t : data) v.push_back(sj::Variable(t.clone(), true));
    return v;
  };
  auto e_in = leaves();
  at::manual_seed(8);
  auto eager = body(e_in);
  auto f = sj::compile(body, options);
  auto c_in = leaves();
  for (int call = 0; call < 2; ++call) {  // the tracing call, then a cached one
    at::manual_seed(8);
    auto compiled = f(c_in);
    REQUIRE(compiled.size() == eager.size());
    std::vector<at::Tensor> weights;
    for (std::size_t i = 0; i < eager.size(); ++i) {
      const at::Tensor e = eager[i].data(), c = compiled[i].data();
      CHECK_MESSAGE(at::equal(e == 0, c == 0), "output ", i, " call ", call);
      CHECK_MESSAGE(at::allclose(e, c, 1e-12, 1e-14), "output ", i, " call ", call);
      weights.push_back(at::arange(e.numel(), at::kDouble).reshape(e.sizes()).sin());
    }
    if (options.derivatives < 1) continue;
    auto loss = [&](const sj::variable_list& outs) {
      sj::Variable l = sj::sum(outs[0] * sj::Variable(weights[0]));
      for (std::size_t i = 1; i < outs.size(); ++i) l = l + sj::sum(outs[i] * sj::Variable(weights[i]));
      return l;
    };
    auto ge = sj::grad({loss(eager)}, e_in, {}, /*create_graph=*/false, /*allow_unused=*/true);
    auto gc = sj::grad({loss(compiled)}, c_in, {}, false, true);
    for (std::size_t i = 0; i < ge.size(); ++i) {
      REQUIRE(ge[i].defined() == gc[i].defined());
      if (ge[i].defined())
        CHECK_MESSAGE(at::allclose(ge[i].data(), gc[i].data(), 1e-12, 1e-14), "gradient ", i, " call ", call);
    }
  }
}

void check_all_ways(const Body& body, const std::vector<at::Tensor>& data, const std::string& what,
                    int64_t tile_rows = 512) {
  const int default_threads = sj::engine::num_threads();
  for (int threads : {1, default_threads}) {
    ThreadCount tc(threads);
    for (int k = 0; k <= 2; ++k)
      for (bool fuse : {true, false})
        for (bool inter_op : {false, true})
          check_against_eager(body, data,
                              {.derivatives = k, .fuse = fuse, .inter_op_parallel = inter_op, .tile_rows = tile_rows},
                              what);
  }
}

}  // namespace

TEST_SUITE("closure") {

TEST_CASE("issue 34, item 2: two dropouts draw in eager order (the reported case)") {
  at::manual_seed(1);
  std::vector<at::Tensor> data = {at::randn({8}, at::kDouble), at::randn({8}, at::kDouble)};
  check_all_ways([](const sj::variable_list& in) -> sj::variable_list {
    return {sj::dropout(sj::exp(sj::tanh(in[0])), .5, true), sj::dropout(in[1], .5, true)};
  }, data, "reported");
}

TEST_CASE("issue 34, item 2: four dropouts interleaved with fusible chains") {
  at::manual_seed(2);
  std::vector<at::Tensor> data = {at::randn({6, 5}, at::kDouble), at::randn({6, 5}, at::kDouble),
                                  at::randn({6, 5}, at::kDouble)};
  check_all_ways([](const sj::variable_list& in) -> sj::variable_list {
    auto x1 = sj::dropout(sj::sigmoid(in[0] * 2.0 + 1.0), .3, true);
    auto y = sj::tanh(x1 + in[1]);
    auto x2 = sj::dropout(in[1] * in[1], .6, true);
    auto x3 = sj::dropout(sj::exp(-in[0]) * y, .5, true);
    auto x4 = sj::dropout(in[2], .4, true);
    return {x4 * x2 + 1.0, x3, sj::exp(x1), x2};
  }, data, "interleaved");
}

TEST_CASE("issue 34, item 2: a dropout whose input is produced late, first or second") {
  at::manual_seed(3);
  std::vector<at::Tensor> data = {at::randn({7}, at::kDouble), at::randn({7}, at::kDouble),
                                  at::randn({7}, at::kDouble)};
  auto late = [](sj::Variable x) {
    for (int i = 0; i < 6; ++i) x = sj::tanh(x * 1.5 + 0.25) * sj::exp(x * 0.1);
    return x;
  };
  check_all_ways([late](const sj::variable_list& in) -> sj::variable_list {
    return {sj::dropout(in[2], .5, true), sj::dropout(late(in[0]), .5, true), sj::dropout(in[1], .5, true)};
  }, data, "late second");
  check_all_ways([late](const sj::variable_list& in) -> sj::variable_list {
    return {sj::dropout(late(in[0]), .5, true), sj::dropout(in[1], .5, true), sj::dropout(in[2] * 3.0, .5, true)};
  }, data, "late first");
}

TEST_CASE("issue 34, item 2: dropouts between row-tiled layers keep their order") {
  // Tall tensors make row-tiled regions (where LIBXSMM is available): the dropouts sit
  // between regions and beside them, and the order gates must make no cycle.
  at::manual_seed(4);
  std::vector<at::Tensor> data = {at::randn({4096, 4}, at::kDouble), at::randn({4, 8}, at::kDouble),
                                  at::randn({8, 8}, at::kDouble), at::randn({4096, 8}, at::kDouble)};
  auto body = [](const sj::variable_list& in) -> sj::variable_list {
    auto h1 = sj::tanh(sj::mm(in[0], in[1]));
    auto h2 = sj::tanh(sj::mm(sj::tanh(h1 * 2.0), in[2]));
    auto z = sj::dropout(sj::exp(in[3] * 0.5) + 1.0, .5, true);
    auto d = sj::dropout(h2, .3, true);
    auto h3 = sj::tanh(sj::mm(sj::tanh(d + h1), in[2]));
    return {sj::sum(h3 * z), d};
  };
  for (int k = 0; k <= 2; ++k)
    for (bool inter_op : {false, true})
      check_against_eager(body, data, {.derivatives = k, .inter_op_parallel = inter_op, .tile_rows = 512}, "tiled");
}

}  // TEST_SUITE
