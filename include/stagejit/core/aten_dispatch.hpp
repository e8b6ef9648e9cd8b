#pragma once
/// \file
/// Guards over libtorch's dispatch keys for stagejit's own ATen calls.
///
/// Note [Below libtorch's autograd keys]
/// A stagejit `Variable` never holds a tensor that requires libtorch's grad (`Variable`
/// detaches one), so libtorch's Autograd and ADInplaceOrView kernels have nothing to record
/// for stagejit's tensors. They still run on every ATen call made with those keys enabled:
/// a redispatch each, and for a view (`narrow`, `view`, `t`, `expand`) the view metadata
/// libtorch allocates for its own autograd. libtorch's autograd kernels skip them the same
/// way (`at::AutoDispatchBelowADInplaceOrView`). stagejit's eager ops run below the keys
/// (`ops::run_forward`), and so does every Function of a compiled stage (`StageCall`,
/// `ExecuteOptions::below_aten_autograd`): at the tests' sizes a staged step of an MLP's
/// Hessian-vector product, a MAML step or a critic ran 6-8 % faster (bench/higher_order.md,
/// session of 2026-12-07 19:06).
/// User code that runs inside a compiled stage or the engine (a `HostFunction`'s forward
/// and backward) gets the keys back (`AtenAutogradKeys`), so a host function that uses
/// libtorch's autograd on its own tensors records as it would eagerly.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <vector>

namespace stagejit {

/// RAII: while alive, ATen calls on this thread skip libtorch's Autograd and
/// ADInplaceOrView kernels when `enabled` (Note [Below libtorch's autograd keys]); does
/// nothing otherwise.
class BelowAtenAutograd {
 public:
  explicit BelowAtenAutograd(bool enabled = true)
      : guard_(enabled ? c10::autograd_dispatch_keyset_with_ADInplaceOrView : c10::DispatchKeySet()) {}
  BelowAtenAutograd(const BelowAtenAutograd&) = delete;
  BelowAtenAutograd& operator=(const BelowAtenAutograd&) = delete;

 private:
  c10::impl::ExcludeDispatchKeyGuard guard_;
};

/// RAII: while alive, libtorch's Autograd and ADInplaceOrView keys are dispatched again on
/// this thread, for user code run from below them (Note [Below libtorch's autograd keys]).
/// The rest of the thread's dispatch key set is kept; the whole set is restored after.
class AtenAutogradKeys {
 public:
  AtenAutogradKeys() : guard_(with_autograd()) {}
  AtenAutogradKeys(const AtenAutogradKeys&) = delete;
  AtenAutogradKeys& operator=(const AtenAutogradKeys&) = delete;

 private:
  static c10::impl::LocalDispatchKeySet with_autograd() {
    c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
    keys.excluded_ = keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    return keys;
  }
  c10::impl::ForceDispatchKeyGuard guard_;
};

/// Gives `out` the version counter of the first of `inputs` it is a view of, as libtorch's
/// ADInplaceOrView kernels do for the views they make (skipped below the keys), so that a
/// saved view sees an in-place change of its base (a stale saved value is an error, not a
/// silent wrong gradient). Does nothing for an undefined or inference tensor, nor for one
/// that views none of `inputs`.
inline void share_version_counter_with_base(at::Tensor& out, const std::vector<at::Tensor>& inputs) {
  if (!out.defined() || out.is_inference()) return;
  for (const auto& in : inputs) {
    if (!in.defined() || in.unsafeGetTensorImpl() == out.unsafeGetTensorImpl() || in.is_inference() ||
        !out.is_alias_of(in))
      continue;
    out.unsafeGetTensorImpl()->set_version_counter(in.unsafeGetTensorImpl()->version_counter());
    return;
  }
}

}  // namespace stagejit
