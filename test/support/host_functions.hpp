#pragma once
// The host functions of the seed's comment example (docs/seed-system.md §2.4, §3.3): MulConstant(c)
// and Mul, both with opaque backwards, shared by the trace and closure suites.

#include <stagejit/stagejit.hpp>

namespace stagejit::testing {

/// y = x * c for a scalar c; backward: grad * c.
struct MulConstant : HostFunction<MulConstant> {
  static Variable forward(HostContext* ctx, Variable x, double c) {
    ctx->saved_data["c"] = c;
    return Variable(x.data() * c);
  }
  static variable_list backward(HostContext* ctx, variable_list grads) {
    return {grads[0] * std::get<double>(ctx->saved_data.at("c"))};
  }
};

/// z = x * y; backward: (grad * y, grad * x) from the saved inputs.
struct Mul : HostFunction<Mul> {
  static Variable forward(HostContext* ctx, Variable x, Variable y) {
    ctx->save_for_backward({x, y});
    return Variable(x.data() * y.data());
  }
  static variable_list backward(HostContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    return {grads[0] * s[1], grads[0] * s[0]};
  }
};

}  // namespace stagejit::testing
