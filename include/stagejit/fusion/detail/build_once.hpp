#pragma once
/// \file
/// `build_once`: a per-key cache of values built at most once, shared by the CPU and CUDA
/// kernel caches (src/fusion_cpu.cpp, src/fusion_cuda.cpp). The first thread to ask for a
/// key builds the value outside the lock; threads asking for the same key meanwhile wait
/// for it. A build that throws is remembered: every later request for that key rethrows
/// the same exception (a source that failed to compile fails again without recompiling).

#include <future>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace stagejit::fusion {

/// Returns the value for `key` in `cache` (guarded by `mutex`), building it with
/// `build()` when no thread has asked for it before. `*hit` (optional) is set to whether
/// the key was already there. Rethrows what `build` threw.
template <class Key, class Value, class Build>
Value build_once(std::mutex& mutex, std::unordered_map<Key, std::shared_future<Value>>& cache,
                 const Key& key, Build&& build, bool* hit = nullptr) {
  std::promise<Value> promise;
  std::shared_future<Value> future;
  bool builder = false;
  {
    std::lock_guard<std::mutex> guard(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) {
      future = it->second;
    } else {
      future = promise.get_future().share();
      cache.emplace(key, future);
      builder = true;
    }
  }
  if (hit) *hit = !builder;
  if (builder) {
    try {
      promise.set_value(std::forward<Build>(build)());
    } catch (...) {
      promise.set_exception(std::current_exception());
    }
  }
  return future.get();
}

}  // namespace stagejit::fusion
