#pragma once
/// \file
/// Grad mode: a thread-local switch saying whether ops record a backward graph.
/// Follows libtorch's `GradMode` / `NoGradGuard`. The engine propagates the mode of the
/// thread that calls `execute` to every thread running that graph task's functions.

namespace stagejit {

/// Thread-local grad mode (default: enabled).
struct GradMode {
  /// Whether ops run on this thread record grad_fns for outputs.
  static bool is_enabled() noexcept;
  /// Sets this thread's grad mode.
  static void set_enabled(bool enabled) noexcept;
};

/// RAII: sets grad mode to `enabled` and restores the previous mode on destruction.
class AutoGradMode {
 public:
  explicit AutoGradMode(bool enabled) noexcept : prev_(GradMode::is_enabled()) {
    GradMode::set_enabled(enabled);
  }
  ~AutoGradMode() { GradMode::set_enabled(prev_); }
  AutoGradMode(const AutoGradMode&) = delete;
  AutoGradMode& operator=(const AutoGradMode&) = delete;

 private:
  bool prev_;
};

/// RAII: disables grad mode on this thread for its lifetime (libtorch's `NoGradGuard`).
class NoGradGuard : public AutoGradMode {
 public:
  NoGradGuard() noexcept : AutoGradMode(false) {}
};

}  // namespace stagejit
