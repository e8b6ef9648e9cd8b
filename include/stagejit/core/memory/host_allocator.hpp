#pragma once
/// \file
/// `HostCachingAllocator`: a caching CPU allocator for the tensors compiled code makes,
/// and `HostCacheScope`, which routes ATen's own CPU allocations through it.
///
/// A compiled function runs the same shapes call after call. With glibc, a CPU tensor
/// above the mmap threshold (128 KiB at first, adapting up to 32 MiB) is a fresh `mmap`
/// that the kernel zero-fills page by page on first touch and `munmap`s on free; memory
/// returned to the heap top is trimmed and faulted in again. Where a page fault costs
/// microseconds (virtual machines with nested paging), an LSTM step of libtorch eager can
/// spend most of its time faulting (bench/closure.md). This allocator keeps freed blocks of at least
/// `kMinCachedBytes` in per-size free lists and hands them out again, as PyTorch's CUDA
/// caching allocator does for device memory (and c10's mobile `CPUCachingAllocator` with
/// its thread-local guard does for CPU); smaller requests go to c10's default CPU
/// allocator (glibc's heap serves them well). The cache holds at most `capacity()` bytes of
/// free blocks (default 1 GiB, `$STAGEJIT_HOST_CACHE_MB`, a non-negative integer); a block
/// freed into a full cache makes room by releasing the free blocks of the sizes used least
/// recently (Note [Least recently used sizes]), and goes back to the system itself only
/// when those are not enough. `empty_cache()` releases every free block.
///
/// Note [Least recently used sizes]: a process that ran large shapes first (a big
/// evaluation batch, or another model: bench/higher_order runs nine in one process) fills
/// the cache with blocks of sizes it no longer asks for. Releasing the newly freed block
/// instead, as the cache first did, then unmapped and mapped again every tensor of the
/// shapes in use, call after call: the MAML step in double ran at 0.44x libtorch after the
/// other workloads and 1.35x alone (bench/higher_order.md). Each size keeps the tick of its
/// last hit or free; a full cache releases whole sizes, oldest tick first.
///
/// Who allocates from it: `empty_cached` (always), and, once `install_host_cache()` has
/// run (`compile()` does it unless `CompileOptions::cache_host_memory` is off), every CPU
/// tensor that ATen allocates on a thread while a `HostCacheScope` is open there (fused
/// kernel outputs included). The engine opens one around each function of a compiled
/// stage, and stagejit's ops open one around their ATen call (`ops::run_forward`, Note
/// [Eager ops allocate from the host cache]), unless a `NoHostCacheScope` is open on the
/// thread: a compiled stage with `cache_host_memory` off runs inside one. Code outside a
/// scope (libtorch eager, the user's own ATen calls) keeps the allocator that was
/// installed before, unchanged.
/// Blocks are 64-byte aligned like c10's. Thread-safe. The allocator objects are never
/// destroyed (tensors may outlive static destructors).

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <stagejit/core/torch_compat.hpp>

#include <sys/mman.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <iterator>
#include <limits>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagejit::memory {

class HostCachingAllocator final : public c10::Allocator {
 public:
  /// Requests below this many bytes (64 KiB) are served by c10's default CPU allocator.
  static constexpr std::size_t kMinCachedBytes = std::size_t{1} << 16;
  /// Cached sizes are rounded up to a multiple of this (bytes: one 4 KiB page).
  static constexpr std::size_t kGranularity = std::size_t{1} << 12;

  struct Stats {
    std::size_t hits = 0;          ///< requests served from a free block
    std::size_t misses = 0;        ///< cached-size requests that allocated a new block
    std::size_t cached_bytes = 0;  ///< bytes in free blocks now
    std::size_t in_use_bytes = 0;  ///< bytes in blocks handed out and not yet freed
  };

  /// The process-wide instance.
  static HostCachingAllocator& get() {
    static HostCachingAllocator* instance = new HostCachingAllocator();  // never destroyed
    return *instance;
  }

  /// `n` bytes, 64-byte aligned. Throws `c10::Error` (via c10's allocator) or
  /// `std::bad_alloc` when the system is out of memory.
  c10::DataPtr allocate(std::size_t n) STAGEJIT_ALLOCATE_CONST override {
    if (n < kMinCachedBytes) return c10::GetDefaultCPUAllocator()->allocate(n);
    return const_cast<HostCachingAllocator*>(this)->allocate_cached(n);
  }
  STAGEJIT_ALLOCATOR_COPY_DATA
  /// Frees a pointer from `raw_allocate` (ours or, below the threshold, c10's).
  c10::DeleterFnPtr raw_deleter() const override { return &HostCachingAllocator::free_raw; }

  /// Frees every cached free block (blocks in use are unaffected).
  void empty_cache() {
    std::vector<std::pair<void*, std::size_t>> release;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [size, cls] : free_)
        for (void* p : cls.blocks) release.emplace_back(p, size);
      free_.clear();
      stats_.cached_bytes = 0;
    }
    for (auto [p, size] : release) release_block(p, size);
  }

  /// Bytes of free blocks kept at most.
  std::size_t capacity() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
  }
  /// Sets the capacity (bytes) and frees cached blocks until the cache fits in it.
  void set_capacity(std::size_t bytes) {
    std::vector<std::pair<void*, std::size_t>> release;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      capacity_ = bytes;
      evict_until(0, nullptr, release);
    }
    for (auto [p, size] : release) release_block(p, size);
  }

  Stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  HostCachingAllocator() {
    // A non-negative number of MiB; anything else (or an overflowing value) is ignored.
    if (const char* env = std::getenv("STAGEJIT_HOST_CACHE_MB"); env && *env >= '0' && *env <= '9') {
      char* end = nullptr;
      errno = 0;
      const unsigned long long mb = std::strtoull(env, &end, 10);
      if (errno == 0 && *end == '\0' && mb <= (std::numeric_limits<std::size_t>::max() >> 20))
        capacity_ = static_cast<std::size_t>(mb) << 20;
    }
  }

  c10::DataPtr allocate_cached(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() - kGranularity) throw std::bad_alloc();
    const std::size_t size = (n + kGranularity - 1) / kGranularity * kGranularity;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.blocks.empty()) {
        // Recorded as live before it leaves the free list: a throwing insert loses nothing.
        live_.insert_or_assign(it->second.blocks.back(), size);
        ptr = it->second.blocks.back();
        it->second.blocks.pop_back();
        it->second.last_use = ++tick_;
        stats_.cached_bytes -= size;
        ++stats_.hits;
        stats_.in_use_bytes += size;
      } else {
        ++stats_.misses;
      }
    }
    if (!ptr) {
      ptr = new_block(size);
      try {
        std::lock_guard<std::mutex> lock(mutex_);
        // insert_or_assign: an address unmapped and mapped again must get its new size.
        live_.insert_or_assign(ptr, size);
        stats_.in_use_bytes += size;
      } catch (...) {
        release_block(ptr, size);
        throw;
      }
    }
    // The context is the pointer itself, so `raw_allocate` works (c10 requires it).
    return c10::DataPtr(ptr, ptr, &HostCachingAllocator::free_block,
                        c10::Device(c10::DeviceType::CPU));
  }

  // A new block of `size` bytes (a multiple of the page size): its own anonymous mapping,
  // populated in one system call (MAP_POPULATE) instead of one page fault per 4 KiB page
  // on first touch, which cost a full-size trace half its time in the kernel
  // (bench/first_call.md); 4 MiB and more also ask for transparent huge pages.
  static void* new_block(std::size_t size) {
    if (size >= (std::size_t{4} << 20)) {
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
      (void)::madvise(p, size, MADV_HUGEPAGE);  // advice only: refused where THP is off
#endif
#ifdef MADV_POPULATE_WRITE
      (void)::madvise(p, size, MADV_POPULATE_WRITE);  // Linux 5.14+; else faulted on touch
#endif
      return p;
    }
#ifdef MAP_POPULATE
    constexpr int populate = MAP_POPULATE;  // Linux
#else
    constexpr int populate = 0;
#endif
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | populate, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }
  static void release_block(void* ptr, std::size_t size) noexcept { ::munmap(ptr, size); }

  static void free_block(void* ptr) { get().recycle(ptr); }

  // raw_deallocate of either kind of block: ours are found in `live_`.
  static void free_raw(void* ptr) {
    if (!ptr) return;
    if (!get().recycle(ptr)) c10::GetDefaultCPUAllocator()->raw_deallocate(ptr);
  }

  // Returns false when `ptr` is not a block of this allocator.
  bool recycle(void* ptr) {
    std::size_t size = 0;
    bool kept = false;
    std::vector<std::pair<void*, std::size_t>> release;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(ptr);
      if (it == live_.end()) return false;
      size = it->second;
      live_.erase(it);
      stats_.in_use_bytes -= size;
      if (size <= capacity_) {
        try {
          // Room first (Note [Least recently used sizes]), then the block.
          if (stats_.cached_bytes + size > capacity_) evict_until(size, &size, release);
          if (stats_.cached_bytes + size <= capacity_) {
            SizeClass& cls = free_[size];
            cls.blocks.push_back(ptr);
            cls.last_use = ++tick_;
            stats_.cached_bytes += size;
            kept = true;
          }
        } catch (...) {
          // No memory for the free list: release the block instead.
        }
      }
    }
    for (auto [p, n] : release) release_block(p, n);
    if (!kept) release_block(ptr, size);
    return true;
  }

  // Moves free blocks to `release` until `room` more bytes fit in the capacity, whole
  // sizes at a time, the least recently used size first (Note [Least recently used
  // sizes]); never the size `*keep` (the one being freed). Caller holds mutex_.
  void evict_until(std::size_t room, const std::size_t* keep, std::vector<std::pair<void*, std::size_t>>& release) {
    while (stats_.cached_bytes + room > capacity_) {
      auto oldest = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if ((!keep || it->first != *keep) && !it->second.blocks.empty() &&
            (oldest == free_.end() || it->second.last_use < oldest->second.last_use))
          oldest = it;
      if (oldest == free_.end()) return;
      auto& blocks = oldest->second.blocks;
      while (!blocks.empty() && stats_.cached_bytes + room > capacity_) {
        release.emplace_back(blocks.back(), oldest->first);
        blocks.pop_back();
        stats_.cached_bytes -= oldest->first;
      }
      if (blocks.empty()) free_.erase(oldest);
    }
  }

  mutable std::mutex mutex_;
  struct SizeClass {
    std::vector<void*> blocks;  // free blocks of this size
    uint64_t last_use = 0;      // tick_ of the last hit or free of this size
  };
  std::unordered_map<std::size_t, SizeClass> free_;  // size -> free blocks
  uint64_t tick_ = 0;
  std::unordered_map<void*, std::size_t> live_;               // handed out -> size
  std::size_t capacity_ = std::size_t{1} << 30;
  Stats stats_;
};

/// A contiguous CPU tensor of `sizes` and `dtype` whose storage comes from
/// `HostCachingAllocator` (uninitialised, like `at::empty`).
inline at::Tensor empty_cached(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_generic(sizes, &HostCachingAllocator::get(),
                                              c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                              c10::nullopt));
}

namespace detail {
/// A scope counted per thread: while alive (and constructed with `true`), `active()` is
/// true on this thread; scopes nest. `Tag` names the counter (one per scope class).
template <class Tag>
class ThreadScope {
 public:
  explicit ThreadScope(bool enable = true) noexcept : enabled_(enable) {
    if (enabled_) ++depth();
  }
  ~ThreadScope() {
    if (enabled_) --depth();
  }
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;
  /// True when a scope of this kind is open on this thread.
  static bool active() noexcept { return depth() > 0; }
  /// The number open on this thread.
  static int& depth() noexcept {
    static thread_local int open = 0;  // constant-initialised: no guard on access
    return open;
  }

 private:
  bool enabled_;
};
}  // namespace detail

/// While alive, CPU tensors of at least `HostCachingAllocator::kMinCachedBytes` that ATen
/// allocates on this thread come from `HostCachingAllocator` (once `install_host_cache()`
/// has run; before, the scope changes nothing). Scopes nest; `HostCacheScope(false)` is a
/// no-op, for conditional use. Tensors may be freed anywhere, inside a scope or not.
class HostCacheScope : public detail::ThreadScope<HostCacheScope> {
 public:
  using ThreadScope::ThreadScope;
};

/// While alive, no CPU allocation on this thread goes to the cache: the `HostCacheScope`s
/// open around it are set aside until it closes (the innermost scope wins), and
/// stagejit's ops do not open their own (`ops::run_forward`). The functions of a stage
/// compiled with `CompileOptions::cache_host_memory` off run inside one, also when that
/// stage runs inside another function's cached stage; the engine carries it to the
/// threads that run a graph task started inside one. A `HostCacheScope` opened inside it
/// routes again until it closes. Scopes nest; `NoHostCacheScope(false)` is a no-op.
class NoHostCacheScope : public detail::ThreadScope<NoHostCacheScope> {
 public:
  explicit NoHostCacheScope(bool enable = true) noexcept : ThreadScope(enable), enabled_(enable) {
    if (!enabled_) return;
    int& open = detail::ThreadScope<HostCacheScope>::depth();
    set_aside_ = open;
    open = 0;
  }
  ~NoHostCacheScope() {
    if (enabled_) detail::ThreadScope<HostCacheScope>::depth() = set_aside_;
  }

 private:
  bool enabled_;
  int set_aside_ = 0;
};

namespace detail {
/// c10's CPU allocator once installed: inside a HostCacheScope, large requests go to
/// HostCachingAllocator; everything else to the allocator installed before it.
class ScopedHostAllocator final : public c10::Allocator {
 public:
  explicit ScopedHostAllocator(c10::Allocator* previous) : previous_(previous) {}
  c10::DataPtr allocate(std::size_t n) STAGEJIT_ALLOCATE_CONST override {
    if (n >= HostCachingAllocator::kMinCachedBytes && HostCacheScope::active())
      return HostCachingAllocator::get().allocate(n);
    return previous_->allocate(n);
  }
  // Raw blocks come from either allocator; `free_raw` tells them apart.
  c10::DeleterFnPtr raw_deleter() const override { return HostCachingAllocator::get().raw_deleter(); }
  STAGEJIT_ALLOCATOR_COPY_DATA

 private:
  c10::Allocator* previous_;
};
}  // namespace detail

/// Makes c10's CPU allocator honour `HostCacheScope`: replaces c10's default CPU
/// allocator by a router that forwards to it outside scopes (once per process; later calls
/// do nothing). Returns true when the router is c10's CPU allocator afterwards; false when
/// the program had set another CPU allocator (`c10::SetCPUAllocator`), which is left
/// alone (scopes then change nothing). Call it before starting threads that allocate.
inline bool install_host_cache() {
  static detail::ScopedHostAllocator* router = []() -> detail::ScopedHostAllocator* {
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != c10::GetDefaultCPUAllocator()) return nullptr;
    auto* r = new detail::ScopedHostAllocator(current);  // never destroyed
    c10::SetCPUAllocator(r, /*priority=*/0);
    return r;
  }();
  return router && c10::GetCPUAllocator() == router;
}

}  // namespace stagejit::memory
