// A user's program: includes stagejit, compiles a function with its backward and checks
// it against stagejit's eager autograd. Built twice by test/consumer/project/meson.build:
// against stagejit_dep (compiled bodies) and stagejit_header_only_dep (with second_tu.cpp,
// a second translation unit holding its own inline copies of the bodies).
#include <stagejit/stagejit.hpp>

#include <cstdio>
#include <cstring>

namespace sj = stagejit;

#if defined(STAGEJIT_HEADER_ONLY)
const sj::OpDef* tanh_entry_from_second_tu();
sj::Variable eager_gradient_from_second_tu(const sj::Variable& x);
#endif

int main() {
  // The shim and the headers must come from the same release.
  if (std::strcmp(sj::version_string(), STAGEJIT_VERSION_STRING) != 0) return 1;
  auto f = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
    sj::Variable t = sj::tanh(in[0]);
    return {sj::sum(t * t)};
  });
  sj::Variable x(at::tensor({0.3, -1.2, 2.0}, at::kDouble), true);
  sj::Variable compiled = sj::grad(f({x}), {x})[0];
  sj::Variable t = sj::tanh(x);
  sj::Variable eager = sj::grad({sj::sum(t * t)}, {x})[0];
  if (!at::allclose(compiled.data(), eager.data(), 1e-12, 1e-12)) return 2;
#if defined(STAGEJIT_HEADER_ONLY)
  // One op table and one set of bodies per program, whichever translation unit asks.
  if (&sj::ops::def(sj::OpId::tanh) != tanh_entry_from_second_tu()) return 3;
  if (!at::allclose(eager_gradient_from_second_tu(x).data(), eager.data(), 1e-12, 1e-12)) return 4;
  std::printf("consumer (header-only) built against stagejit %s\n", sj::version_string());
#else
  std::printf("consumer built against stagejit %s\n", sj::version_string());
#endif
  return 0;
}
