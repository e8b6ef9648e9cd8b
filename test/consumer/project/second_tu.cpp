// The header-only consumer's second translation unit: includes one autograd header and
// one ops header (not the umbrella), so its inline bodies come in through them.
#include <stagejit/autograd/grad.hpp>
#include <stagejit/ops/ops.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

const stagejit::OpDef* tanh_entry_from_second_tu() { return &stagejit::ops::def(stagejit::OpId::tanh); }

stagejit::Variable eager_gradient_from_second_tu(const stagejit::Variable& x) {
  stagejit::Variable t = stagejit::tanh(x);
  return stagejit::grad({stagejit::sum(t * t)}, {x})[0];
}
