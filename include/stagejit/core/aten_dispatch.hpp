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
/// Hessian-vector product, a MAML step or a critic ran 5-9 % faster (bench/higher_order.md,
/// session of 2026-12-07 19:06).
/// User code that runs inside a compiled stage or the engine (a `HostFunction`'s forward
/// and backward) gets back the keys stagejit excluded (`AtenAutogradKeys`), so a host
/// function that uses libtorch's autograd on its own tensors records as it would eagerly;
/// keys excluded by the caller (`c10::InferenceMode`, a libtorch kernel) stay excluded.
/// Views made below the keys share their base's version counter by hand
/// (`share_version_counter_with_base`), as libtorch's ADInplaceOrView kernels make them.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <vector>

namespace stagejit {

namespace detail {
// The dispatch keys the live `BelowAtenAutograd` scopes of this thread excluded (those
// that were not excluded already): what `AtenAutogradKeys` gives back.
inline c10::DispatchKeySet& keys_excluded_by_stagejit() noexcept {
  thread_local c10::DispatchKeySet keys;
  return keys;
}
}  // namespace detail

/// RAII: while alive, ATen calls on this thread skip libtorch's Autograd and
/// ADInplaceOrView kernels when `enabled` (Note [Below libtorch's autograd keys]); does
/// nothing otherwise.
class BelowAtenAutograd {
 public:
  explicit BelowAtenAutograd(bool enabled = true)
      : added_(enabled ? c10::autograd_dispatch_keyset_with_ADInplaceOrView -
                             c10::impl::tls_local_dispatch_key_set().excluded_
                       : c10::DispatchKeySet()),
        saved_(detail::keys_excluded_by_stagejit()),
        guard_(added_) {
    detail::keys_excluded_by_stagejit() = saved_ | added_;
  }
  ~BelowAtenAutograd() { detail::keys_excluded_by_stagejit() = saved_; }
  BelowAtenAutograd(const BelowAtenAutograd&) = delete;
  BelowAtenAutograd& operator=(const BelowAtenAutograd&) = delete;

 private:
  c10::DispatchKeySet added_;  // the keys this scope excluded
  c10::DispatchKeySet saved_;  // keys_excluded_by_stagejit() before it
  c10::impl::ExcludeDispatchKeyGuard guard_;
};

/// RAII: while alive, the keys the live `BelowAtenAutograd` scopes of this thread excluded
/// are dispatched again, for user code run from below them (Note [Below libtorch's
/// autograd keys]); nothing else of the thread's dispatch key set changes, and the whole
/// set is restored after. Outside such scopes it changes nothing.
class AtenAutogradKeys {
 public:
  AtenAutogradKeys() : saved_(detail::keys_excluded_by_stagejit()), guard_(given_back(saved_)) {
    detail::keys_excluded_by_stagejit() = c10::DispatchKeySet();
  }
  ~AtenAutogradKeys() { detail::keys_excluded_by_stagejit() = saved_; }
  AtenAutogradKeys(const AtenAutogradKeys&) = delete;
  AtenAutogradKeys& operator=(const AtenAutogradKeys&) = delete;

 private:
  static c10::impl::LocalDispatchKeySet given_back(c10::DispatchKeySet keys_of_stagejit) {
    c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
    keys.excluded_ = keys.excluded_ - keys_of_stagejit;
    return keys;
  }
  c10::DispatchKeySet saved_;  // keys_excluded_by_stagejit() before it
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
