// Post-accumulate-grad hooks on leaves and early outputs (Note [Post-accumulate-grad
// hooks] in autograd/function-inl.hpp, Note [Early outputs] in autograd/engine.hpp): what
// data-parallel training builds on.
#include "oracle.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace {

using VL = sj::variable_list;

using oracle::ThreadCount;

// 2-layer tanh MLP step: in = {x [8,5], W1 [6,5], b1 [6], W2 [3,6], b2 [3]} -> {sum of squares}.
VL mlp(const VL& in) {
  sj::Variable h = sj::tanh(sj::addmm(in[2], in[0], sj::t(in[1])));
  sj::Variable y = sj::addmm(in[4], h, sj::t(in[3]));
  return {sj::sum(sj::mul(y, y))};
}

VL mlp_inputs() {
  at::manual_seed(3);
  return {sj::Variable(at::randn({8, 5}, at::kDouble)), sj::Variable(at::randn({6, 5}, at::kDouble), true),
          sj::Variable(at::randn({6}, at::kDouble), true), sj::Variable(at::randn({3, 6}, at::kDouble), true),
          sj::Variable(at::randn({3}, at::kDouble), true)};
}

}  // namespace

TEST_SUITE("autograd") {
  TEST_CASE("post-accumulate-grad hooks see the accumulated grad, once per backward, in order") {
    sj::Variable w(at::tensor({1.0, 2.0}, at::kDouble), true);
    std::vector<std::string> calls;
    auto h1 = w.register_post_accumulate_grad_hook([&](const sj::Variable& leaf) {
      CHECK(leaf.impl_id() == w.impl_id());
      calls.push_back("a" + std::to_string(leaf.grad().data()[0].item<double>()));
    });
    w.register_post_accumulate_grad_hook([&](const sj::Variable&) { calls.push_back("b"); });
    // w used twice: the engine sums both uses first, the hooks run once.
    sj::Variable loss = sj::sum(sj::add(sj::mul(w, w), w));
    loss.backward();
    REQUIRE(calls.size() == 2);
    CHECK(calls[0] == "a3.000000");  // 2 * 1 + 1
    CHECK(calls[1] == "b");
    loss.backward();  // accumulates: 3 + 3
    REQUIRE(calls.size() == 4);
    CHECK(calls[2] == "a6.000000");
    CHECK(w.remove_post_accumulate_grad_hook(h1));
    CHECK_FALSE(w.remove_post_accumulate_grad_hook(h1));
    loss.backward();
    REQUIRE(calls.size() == 5);
    CHECK(calls[4] == "b");
    // grad() accumulates nothing and runs no hook.
    (void)sj::grad({loss}, {w});
    CHECK(calls.size() == 5);
  }

  TEST_CASE("post-accumulate-grad hooks: bad registrations and a throwing hook") {
    sj::Variable w(at::ones({2}, at::kDouble), true);
    CHECK_THROWS_WITH_AS(sj::Variable(at::ones({2})).register_post_accumulate_grad_hook([](const sj::Variable&) {}),
                         doctest::Contains("does not require grad"), sj::Error);
    sj::Variable y = sj::mul(w, w);
    CHECK_THROWS_WITH_AS(y.register_post_accumulate_grad_hook([](const sj::Variable&) {}),
                         doctest::Contains("only leaves"), sj::Error);
    CHECK_THROWS_WITH_AS(w.register_post_accumulate_grad_hook({}), doctest::Contains("empty hook"), sj::Error);
    w.register_post_accumulate_grad_hook([](const sj::Variable&) { throw sj::ShapeError("hook refused"); });
    CHECK_THROWS_WITH_AS(sj::sum(y).backward(), doctest::Contains("hook refused"), sj::ShapeError);
  }

  TEST_CASE("an early output runs its AccumulateGrad and hook while the Function still runs") {
    ThreadCount threads(2);
    sj::Variable a(at::ones({3}, at::kDouble), true), b(at::ones({3}, at::kDouble), true);
    std::mutex m;
    std::condition_variable cv;
    bool a_accumulated = false;
    a.register_post_accumulate_grad_hook([&](const sj::Variable&) {
      std::lock_guard<std::mutex> lock(m);
      a_accumulated = true;
      cv.notify_all();
    });
    bool seen_while_running = false;
    struct Streaming : sj::ClosureImpl {
      std::function<VL(VL, const sj::OutputSink&)> f;
      VL apply(VL in) override { return f(std::move(in), {}); }
      VL apply(VL in, const std::vector<char>&, const sj::OutputSink& early) override {
        return f(std::move(in), early);
      }
      std::string_view name() const override { return "Streaming"; }
    };
    auto impl = std::make_shared<Streaming>();
    impl->f = [&](VL in, const sj::OutputSink& early) -> VL {
      REQUIRE(early);
      early(0, sj::Variable(in[0].data() * 2));
      std::unique_lock<std::mutex> lock(m);
      seen_while_running = cv.wait_for(lock, std::chrono::seconds(10), [&] { return a_accumulated; });
      // What is returned at the delivered position is ignored.
      return {sj::Variable(at::full({3}, 100.0, at::kDouble)), sj::Variable(in[0].data() * 3)};
    };
    auto fn = sj::make_function(sj::ClosureFunction{impl}, {a.gradient_edge(), b.gradient_edge()}, 1);
    sj::execute({sj::Edge{fn, 0}}, {sj::Variable(at::ones({3}, at::kDouble))});
    CHECK(seen_while_running);
    CHECK(at::equal(a.grad().data(), at::full({3}, 2.0, at::kDouble)));
    CHECK(at::equal(b.grad().data(), at::full({3}, 3.0, at::kDouble)));
    // Outside an engine call there is no sink; delivering one output twice throws.
    CHECK_FALSE(sj::engine::early_output_sink(*fn));
    impl->f = [&](VL in, const sj::OutputSink& early) -> VL {
      early(1, in[0]);
      early(1, in[0]);
      return {sj::Variable(), sj::Variable()};
    };
    CHECK_THROWS_WITH_AS(sj::execute({sj::Edge{fn, 0}}, {sj::Variable(at::ones({3}, at::kDouble))}),
                         doctest::Contains("delivered early twice"), sj::Error);
  }

  TEST_CASE("a compiled backward stage hands each gradient over before it returns") {
    // Untiled (tile_rows 0): a row-tiled region hands its outputs over together, when it
    // ends; the order checked below is that of the stage's nodes run one by one.
    auto f = sj::compile(mlp, {.derivatives = 1, .tile_rows = 0});
    VL in = mlp_inputs();
    sj::Variable loss = f(in)[0];
    auto* closure = std::get_if<sj::ClosureFunction>(&loss.grad_fn()->kind);
    REQUIRE(closure);
    std::vector<std::pair<std::size_t, at::Tensor>> early;
    sj::OutputSink sink = [&](std::size_t i, sj::Variable v) { early.emplace_back(i, v.data()); };
    const std::size_t n = loss.grad_fn()->next_functions.size();
    VL returned;
    {
      // In grad mode the outputs need the next stage as grad_fn, so they leave at the end.
      VL late = closure->impl->apply({sj::Variable(at::ones({}, at::kDouble))}, std::vector<char>(n, 1), sink);
      CHECK(early.empty());
      sj::NoGradGuard no_grad;  // as a backward without create_graph runs it
      returned = closure->impl->apply({sj::Variable(at::ones({}, at::kDouble))}, std::vector<char>(n, 1), sink);
      for (std::size_t i = 0; i < n; ++i) CHECK(at::equal(late[i].data(), returned[i].data()));
    }
    REQUIRE(early.size() == n);
    std::vector<char> seen(n, 0);
    for (auto& [i, t] : early) {
      REQUIRE(i < n);
      CHECK_FALSE(seen[i]);
      seen[i] = 1;
      CHECK(at::equal(t, returned[i].data()));
    }
    // The last layer's gradients leave before the first layer's (the order of the backward).
    auto pos = [&](std::size_t output) {
      for (std::size_t k = 0; k < early.size(); ++k)
        if (early[k].first == output) return k;
      return early.size();
    };
    const auto& edges = loss.grad_fn()->next_functions;
    std::size_t out_w1 = n, out_w2 = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (edges[i].function == in[1].gradient_edge().function) out_w1 = i;
      if (edges[i].function == in[3].gradient_edge().function) out_w2 = i;
    }
    REQUIRE(out_w1 < n);
    REQUIRE(out_w2 < n);
    CHECK(pos(out_w2) < pos(out_w1));

    // Through the engine: the gradients and hooks are those of eager autograd.
    VL eager_in = mlp_inputs();
    mlp(eager_in)[0].backward();
    int hooks = 0;
    for (std::size_t k = 1; k < in.size(); ++k) in[k].register_post_accumulate_grad_hook([&](const sj::Variable&) { ++hooks; });
    loss.backward();
    CHECK(hooks == 4);
    for (std::size_t k = 1; k < in.size(); ++k) CHECK(oracle::max_diff(in[k].grad().data(), eager_in[k].grad().data()) <= 1e-12);
  }
}
