// Memory: saved tensors do not outlive the graph (no reference cycles), also after
// create_graph and after a backward that threw.
#include "oracle.hpp"

namespace {

using VL = sj::variable_list;

// Weak references to the storages of tensors created inside `body`.
struct Tracker {
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> weak;
  void track(const at::Tensor& t) { weak.emplace_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl())); }
  int alive() const {
    int n = 0;
    for (auto& w : weak) n += !w.expired();
    return n;
  }
};

// Runs `body(x, tr)` on x = randn(5) (requiring grad); once it has returned (its
// variables dropped), no tensor it tracked in `tr` is alive.
template <class Body>
void check_freed_after(Body body) {
  Tracker tr;
  sj::Variable x(at::randn({5}, at::kDouble), true);
  body(x, tr);
  CHECK(tr.alive() == 0);
}

}  // namespace

TEST_SUITE("autograd") {
  TEST_CASE("no saved tensor stays alive after dropping the outputs") {
    check_freed_after([](const sj::Variable& x, Tracker& tr) {
      sj::Variable a = sj::exp(x);      // saves its output
      sj::Variable b = sj::tanh(a);     // saves its output
      sj::Variable c = sj::mul(a, b);   // saves both inputs
      sj::Variable y = sj::sum(sj::sigmoid(c));
      for (auto& v : {a, b, c, y}) tr.track(v.data());
      CHECK(tr.alive() == 4);
      y.backward();
    });
  }

  TEST_CASE("no saved tensor stays alive after create_graph") {
    check_freed_after([](const sj::Variable& x, Tracker& tr) {
      sj::Variable a = sj::sin(x);
      sj::Variable y = sj::sum(sj::exp(a) * a);
      tr.track(a.data());
      auto g = sj::grad({y}, {x}, {}, true);
      tr.track(g[0].data());
      auto gg = sj::grad({sj::sum(g[0] * g[0])}, {x}, {}, true);
      tr.track(gg[0].data());
      CHECK(gg[0].requires_grad());
    });
  }

  TEST_CASE("no saved tensor stays alive after a backward that threw") {
    check_freed_after([](const sj::Variable& x, Tracker& tr) {
      struct Boom : sj::HostFunction<Boom> {
        static sj::Variable forward(sj::HostContext* ctx, sj::Variable v) {
          ctx->save_for_backward({v});
          return sj::Variable(v.data() * 2);
        }
        static VL backward(sj::HostContext*, VL) { throw std::runtime_error("no backward"); }
      };
      sj::Variable a = sj::exp(x);
      sj::Variable b = Boom::apply(a);
      sj::Variable y = sj::sum(sj::tanh(b) * a);
      tr.track(a.data());
      tr.track(b.data());
      CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("no backward"), sj::Error);
    });
  }

  TEST_CASE("a host function saving its own output does not keep itself alive") {
    Tracker tr;
    sj::Variable x(at::randn({3}, at::kDouble), true);
    struct Exp : sj::HostFunction<Exp> {
      static sj::Variable forward(sj::HostContext* ctx, sj::Variable v) {
        sj::Variable out(v.data().exp());
        ctx->save_for_backward({out});
        return out;
      }
      static VL backward(sj::HostContext* ctx, VL g) { return {g[0] * ctx->get_saved_variables()[0]}; }
    };
    std::weak_ptr<sj::Function> fn;
    {
      sj::Variable y = Exp::apply(x);
      fn = y.grad_fn();
      tr.track(y.data());
      auto g = sj::grad({sj::sum(y)}, {x});
      CHECK(oracle::max_diff(g[0].data(), x.data().exp()) == 0.0);
    }
    CHECK(fn.expired());
    CHECK(tr.alive() == 0);
  }
}
