// The multi-stage tracer and the reference interpreter, checked against libtorch's own
// autograd (test/support/staged_oracle.hpp) on double inputs.
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../support/host_functions.hpp"
#include "../support/models.hpp"
#include "../support/staged_oracle.hpp"

#include <map>

namespace sj = stagejit;
using sj::testing::libtorch_stages;
using sj::testing::max_abs_diff;

namespace {

using sj::testing::Mul;
using sj::testing::MulConstant;

std::map<std::string, int> kind_counts(const sj::ir::Graph& g, std::size_t stage) {
  std::map<std::string, int> out;
  for (auto* n : g.nodes())
    if (n->stage() == stage) ++out[std::string(sj::ir::kind_name(n->kind()))];
  return out;
}

at::Tensor rand_d(std::vector<int64_t> shape) { return at::randn(shape, at::kDouble); }

// Runs `fn` through trace() with k derivatives, checks the eager stage results and the
// reference interpreter's results of the recorded graph against libtorch, stage by stage.
template <class SjFn, class TorchFn>
void check_against_libtorch(SjFn sj_fn, TorchFn torch_fn, const std::vector<at::Tensor>& data,
                            const std::vector<bool>& rg, int k) {
  CAPTURE(k);
  sj::variable_list inputs;
  for (std::size_t i = 0; i < data.size(); ++i) inputs.emplace_back(data[i], rg[i]);
  sj::Trace tr = sj::trace(sj_fn, inputs, {.derivatives = k});
  CHECK_NOTHROW(sj::ir::lint(*tr.graph()));
  CHECK(tr.num_stages() == std::size_t(k + 1));
  CHECK(tr.graph()->num_stages() == std::size_t(k + 1));

  auto oracle = libtorch_stages(torch_fn, data, rg, k);

  // The graph's inputs, all stages: the traced inputs, then each stage's grad outputs.
  sj::variable_list graph_inputs;
  for (std::size_t s = 0; s <= std::size_t(k); ++s)
    for (const auto& v : tr.stage_inputs(s)) graph_inputs.push_back(v);
  REQUIRE(graph_inputs.size() == tr.graph()->inputs().size());
  auto interpreted = sj::interpret(*tr.graph(), graph_inputs);

  std::size_t pos = 0;
  for (std::size_t s = 0; s <= std::size_t(k); ++s) {
    CAPTURE(s);
    const auto& expected = oracle.outputs[s];
    REQUIRE(tr.stage_outputs(s).size() == expected.size());
    REQUIRE(tr.graph()->stage_output_counts()[s] == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      CAPTURE(i);
      CHECK(max_abs_diff(tr.stage_outputs(s)[i].data(), expected[i]) <= 1e-10);
      CHECK(max_abs_diff(interpreted[pos + i].data(), expected[i]) <= 1e-10);
    }
    pos += expected.size();
  }
}

}  // namespace

TEST_SUITE("trace") {
  TEST_CASE("seed example: MulConstant and Mul host functions over three stages") {
    auto x = sj::Variable(at::tensor({1.5, -2.0}, at::kDouble), true);
    auto y = sj::Variable(at::tensor({0.5, 3.0}, at::kDouble), true);
    auto fn = [](const sj::variable_list& in) -> sj::variable_list {
      return {Mul::apply(MulConstant::apply(in[1], 2.0), in[0])};
    };
    sj::Trace tr = sj::trace(fn, {x, y}, {.derivatives = 2});
    const auto& g = *tr.graph();
    REQUIRE_NOTHROW(sj::ir::lint(g));
    CHECK(g.num_stages() == 3);
    CHECK(kind_counts(g, 0) == std::map<std::string, int>{{"HostOp", 2}});
    CHECK(kind_counts(g, 1)["Eval"] == 2);
    CHECK(kind_counts(g, 2)["Eval"] == 3);
    // Every stage-0 HostOp ends with a Handle; one stage-2 Eval consumes a stage-0 Handle.
    int stage0_handle_uses_in_stage2 = 0;
    for (auto* n : g.nodes()) {
      if (n->stage() == 0) CHECK(n->outputs().back()->is_handle());
      if (n->stage() == 2 && n->is<sj::ir::Eval>() &&
          n->inputs().back()->node()->stage() == 0)
        ++stage0_handle_uses_in_stage2;
    }
    CHECK(stage0_handle_uses_in_stage2 == 1);
    // Stage sizes: 2 inputs + 1 grad output + 2 grad outputs; outputs 1, 2, 3.
    CHECK(g.stage_inputs(0).size() == 2);
    CHECK(g.stage_inputs(1).size() == 1);
    CHECK(g.stage_inputs(2).size() == 2);
    CHECK(g.stage_output_counts() == std::vector<std::size_t>{1, 2, 3});
    // The printed graph round-trips.
    std::string text = sj::ir::to_string(g);
    CHECK(sj::ir::to_string(*sj::ir::parse(text)) == text);

    // Values: f = 2xy; stage 1 = (2y, 2x); stage 2 = (2, 2, 2y + 2x) for x, y, G1.
    auto torch_fn = [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
      return {(in[1] * 2.0) * in[0]};
    };
    auto oracle = libtorch_stages(torch_fn, {x.data(), y.data()}, {true, true}, 2);
    for (std::size_t s = 0; s < 3; ++s) {
      REQUIRE(tr.stage_outputs(s).size() == oracle.outputs[s].size());
      for (std::size_t i = 0; i < oracle.outputs[s].size(); ++i)
        CHECK(max_abs_diff(tr.stage_outputs(s)[i].data(), oracle.outputs[s][i]) <= 1e-12);
    }
    sj::variable_list graph_inputs;
    for (std::size_t s = 0; s < 3; ++s)
      for (const auto& v : tr.stage_inputs(s)) graph_inputs.push_back(v);
    auto interpreted = sj::interpret(g, graph_inputs);
    std::size_t pos = 0;
    for (std::size_t s = 0; s < 3; ++s)
      for (std::size_t i = 0; i < oracle.outputs[s].size(); ++i, ++pos)
        CHECK(max_abs_diff(interpreted[pos].data(), oracle.outputs[s][i]) <= 1e-12);
  }

  TEST_CASE("tanh MLP, orders 0..3, against libtorch") {
    at::manual_seed(1);
    std::vector<at::Tensor> data = {rand_d({3, 4}), rand_d({4, 5}), rand_d({5}), rand_d({5, 2})};
    for (int k = 0; k <= 3; ++k)
      check_against_libtorch(sj::testing::tanh_mlp<sj::Variable>,
                             sj::testing::tanh_mlp<torch::Tensor>, data,
                             {false, true, true, true}, k);
  }

  TEST_CASE("LSTM cell, orders 0..3, against libtorch") {
    at::manual_seed(2);
    const int64_t B = 2, I = 3, H = 4;
    std::vector<at::Tensor> data = {rand_d({B, I}), rand_d({B, H}), rand_d({B, H}),
                                    rand_d({4 * H, I}), rand_d({4 * H, H}), rand_d({4 * H})};
    for (int k = 0; k <= 3; ++k)
      check_against_libtorch(sj::testing::lstm_cell<sj::Variable>,
                             sj::testing::lstm_cell<torch::Tensor>, data,
                             {true, true, true, true, true, true}, k);
  }

  TEST_CASE("x^5, orders 0..3, against libtorch") {
    std::vector<at::Tensor> data = {at::tensor({1.0, -0.5, 2.0}, at::kDouble)};
    for (int k = 0; k <= 3; ++k)
      check_against_libtorch(sj::testing::pow5<sj::Variable>, sj::testing::pow5<torch::Tensor>,
                             data, {true}, k);
  }

  TEST_CASE("where, log_softmax and cross_entropy, orders 0..3, against libtorch") {
    at::manual_seed(3);
    auto target = at::tensor({2, 0, 1}, at::kLong);
    std::vector<at::Tensor> data = {rand_d({3, 4}), rand_d({3, 4})};
    auto sj_fn = [target](const sj::variable_list& in) {
      return sj::testing::classifier_loss(in, sj::Variable(target));
    };
    auto torch_fn = [target](const std::vector<torch::Tensor>& in) {
      return sj::testing::classifier_loss(in, target);
    };
    for (int k = 0; k <= 3; ++k) check_against_libtorch(sj_fn, torch_fn, data, {true, true}, k);
  }

  TEST_CASE("constants are cloned: mutating a captured tensor after tracing changes nothing") {
    auto c = at::tensor({2.0, 3.0}, at::kDouble);
    auto fn = [c](const sj::variable_list& in) -> sj::variable_list {
      return {in[0] * sj::Variable(c)};
    };
    auto x = sj::Variable(at::tensor({1.0, 1.0}, at::kDouble), true);
    sj::Trace tr = sj::trace(fn, {x}, {.derivatives = 1});
    int constants = 0;
    for (auto* n : tr.graph()->nodes()) constants += n->is<sj::ir::Constant>();
    CHECK(constants == 1);  // one Constant, shared by stage 0 and stage 1
    c.mul_(100.0);
    auto out = sj::interpret(*tr.graph(), {x, tr.stage_inputs(1)[0]});
    CHECK(at::equal(out[0].data(), at::tensor({2.0, 3.0}, at::kDouble)));
    CHECK(at::equal(out[1].data(), at::tensor({2.0, 3.0}, at::kDouble)));
  }

  TEST_CASE("flags and edges per stage when only some inputs require grad") {
    auto a = sj::Variable(at::tensor({1.0, 2.0}, at::kDouble), true);
    auto b = sj::Variable(at::tensor({3.0, 4.0}, at::kDouble), false);
    auto c = sj::Variable(at::tensor({5.0, 6.0}, at::kDouble), true);
    auto fn = [](const sj::variable_list& in) -> sj::variable_list {
      return {in[0] * in[1], in[1] + 1.0, in[2] * in[2]};
    };
    sj::Trace tr = sj::trace(fn, {a, b, c}, {.derivatives = 2});
    using F = sj::VariableFlags;
    CHECK(tr.flags(0).inputs == std::vector<F>{{true, true}, {true, false}, {true, true}});
    // b + 1 does not require grad.
    CHECK(tr.flags(0).outputs == std::vector<F>{{true, true}, {true, false}, {true, true}});
    // Stage 1: one grad output per stage-0 output requiring grad (2), requiring grad
    // since a stage follows; outputs: gradients of a and c (b does not require grad).
    CHECK(tr.flags(1).inputs == std::vector<F>{{true, true}, {true, true}});
    CHECK(tr.flags(1).outputs == std::vector<F>{{true, true}, {true, true}});
    CHECK(tr.gradient_of(1) == std::vector<std::size_t>{0, 2});
    // Stage 2: gradients of a, c and the two stage-1 grad outputs; the last stage's
    // grad outputs do not require grad.
    CHECK(tr.flags(2).inputs == std::vector<F>{{true, false}, {true, false}});
    CHECK(tr.gradient_of(2) == std::vector<std::size_t>{0, 2, 3, 4});
    // d/da of (g1 * b) is undefined (no dependence): an Undefined output.
    CHECK_FALSE(tr.stage_outputs(2)[0].defined());
    CHECK(tr.graph()->stage_outputs(2)[0]->node()->is<sj::ir::Undefined>());
    // Output edges: the gradient edges of the traced leaves of a and c at stage 1 (the
    // trace runs on fresh leaves sharing the inputs' tensors, so a and c are untouched).
    REQUIRE(tr.output_edges(1).size() == 2);
    CHECK(tr.output_edges(1)[0] == tr.stage_inputs(0)[0].gradient_edge());
    CHECK(tr.output_edges(1)[1] == tr.stage_inputs(0)[2].gradient_edge());
    CHECK(tr.stage_inputs(0)[0].data().is_same(a.data()));
    CHECK_FALSE(a.grad().defined());
    CHECK(tr.output_edges(0).empty());
  }

  TEST_CASE("drop_eager_results frees the recorded autograd graph and keeps what compile() reads") {
    auto x = sj::Variable(at::tensor({1.0, 2.0, 3.0}, at::kDouble), true);
    sj::Trace tr = sj::trace([](const sj::variable_list& in) -> sj::variable_list {
      return {sj::tanh(in[0] * in[0])};
    }, {x}, {.derivatives = 1});
    // The stage-0 output's tensor lives only in the trace's eager results.
    c10::weak_intrusive_ptr<c10::TensorImpl> out(tr.outputs()[0].data().getIntrusivePtr());
    CHECK_FALSE(out.expired());
    const auto text = sj::ir::to_string(*tr.graph());
    CHECK_FALSE(tr.eager_results_dropped());
    tr.drop_eager_results();
    CHECK(tr.eager_results_dropped());
    CHECK(out.expired());
    CHECK(sj::ir::to_string(*tr.graph()) == text);
    CHECK(tr.num_stages() == 2);
    CHECK(tr.gradient_of(1) == std::vector<std::size_t>{0});
    CHECK(tr.flags(1).outputs.size() == 1);
    CHECK_THROWS_WITH_AS(tr.outputs(), doctest::Contains("eager results were dropped"), sj::Error);
    CHECK_THROWS_AS(tr.stage_inputs(0), sj::Error);
    CHECK_THROWS_AS(tr.output_edges(1), sj::Error);
  }

  TEST_CASE("errors: an output with no data dependence on the inputs is a TraceError") {
    auto x = sj::Variable(at::ones({2}, at::kDouble), true);
    auto fn = [](const sj::variable_list&) -> sj::variable_list {
      return {sj::Variable(at::zeros({2}, at::kDouble))};
    };
    CHECK_THROWS_WITH_AS(sj::trace(fn, {x}), doctest::Contains("no observable data dependence"),
                         sj::TraceError);
    // The hook is restored: ops after a failed trace are not recorded anywhere.
    CHECK(sj::current_trace_hook() == nullptr);
  }

  TEST_CASE("errors: a function returning nothing, a negative order") {
    auto x = sj::Variable(at::ones({2}, at::kDouble), true);
    CHECK_THROWS_AS(sj::trace([](const sj::variable_list&) { return sj::variable_list{}; }, {x}),
                    sj::TraceError);
    CHECK_THROWS_AS(sj::trace([](const sj::variable_list& in) { return in; }, {x},
                              {.derivatives = -1}),
                    sj::Error);
  }

  TEST_CASE("tracing is thread-local: another thread's ops are not recorded") {
    auto x = sj::Variable(at::ones({2}, at::kDouble), true);
    std::atomic<bool> go{false}, done{false};
    std::thread other([&] {
      while (!go) std::this_thread::yield();
      auto y = sj::Variable(at::ones({2}, at::kDouble));
      for (int i = 0; i < 100; ++i) y = sj::tanh(y);
      done = true;
    });
    auto fn = [&](const sj::variable_list& in) -> sj::variable_list {
      go = true;
      while (!done) std::this_thread::yield();
      return {sj::exp(in[0])};
    };
    sj::Trace tr = sj::trace(fn, {x});
    other.join();
    CHECK(tr.graph()->nodes().size() == 1);
  }

  TEST_CASE("no-grad inside the traced function: recorded, but stops the derivative") {
    auto x = sj::Variable(at::tensor({0.5}, at::kDouble), true);
    auto fn = [](const sj::variable_list& in) -> sj::variable_list {
      sj::Variable d;
      {
        sj::NoGradGuard g;
        d = in[0] * 3.0;  // a constant factor as far as gradients go
      }
      return {d * in[0]};
    };
    sj::Trace tr = sj::trace(fn, {x}, {.derivatives = 1});
    CHECK(tr.graph()->nodes().size() >= 2);
    CHECK(tr.stage_outputs(1)[0].data().item<double>() == doctest::Approx(1.5));
  }
}
