#pragma once
/// \file
/// `HostCachingAllocator`: a caching CPU allocator for the outputs of fused kernels.
///
/// A compiled function runs the same shapes call after call. With glibc, every CPU
/// tensor of 32 MiB or more is a fresh `mmap` that the kernel zero-fills page by page on
/// first touch and `munmap`s on free, so a fused kernel writing a 64 MiB output spends
/// most of its time in page faults (bench/fusion.md). This allocator keeps freed blocks
/// of at least `kMinCachedBytes` in per-size free lists and hands them out again, as
/// PyTorch's CUDA caching allocator does for device memory; smaller requests go to the
/// default CPU allocator (glibc already caches them). The cache holds at most
/// `capacity()` bytes of free blocks (default 1 GiB, `$STAGEJIT_HOST_CACHE_MB`, a
/// non-negative integer); beyond it freed blocks go back to the system. `empty_cache()` releases every free block.
///
/// Only tensors stagejit itself allocates (fused kernel outputs) come from here; ATen's
/// own operators keep ATen's allocator. Blocks are 64-byte aligned like c10's. Thread-safe.
/// The allocator object is never destroyed (tensors may outlive static destructors).

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace stagejit::fusion {

class HostCachingAllocator final : public c10::Allocator {
 public:
  /// Requests below this many bytes are served by c10's default CPU allocator.
  static constexpr std::size_t kMinCachedBytes = std::size_t{1} << 20;
  /// Cached sizes are rounded up to a multiple of this (bytes).
  static constexpr std::size_t kGranularity = std::size_t{1} << 16;

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
  c10::DataPtr allocate(std::size_t n) const override {
    if (n < kMinCachedBytes) return c10::GetDefaultCPUAllocator()->allocate(n);
    return const_cast<HostCachingAllocator*>(this)->allocate_cached(n);
  }

  /// Frees every cached free block (blocks in use are unaffected).
  void empty_cache() {
    std::vector<void*> release;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [size, blocks] : free_)
        for (void* p : blocks) release.push_back(p);
      free_.clear();
      stats_.cached_bytes = 0;
    }
    for (void* p : release) std::free(p);
  }

  /// Bytes of free blocks kept at most.
  std::size_t capacity() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
  }
  /// Sets the capacity (bytes) and frees cached blocks until the cache fits in it.
  void set_capacity(std::size_t bytes) {
    std::vector<void*> release;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      capacity_ = bytes;
      for (auto it = free_.begin(); it != free_.end() && stats_.cached_bytes > capacity_;) {
        auto& blocks = it->second;
        while (!blocks.empty() && stats_.cached_bytes > capacity_) {
          release.push_back(blocks.back());
          blocks.pop_back();
          stats_.cached_bytes -= it->first;
        }
        it = blocks.empty() ? free_.erase(it) : std::next(it);
      }
    }
    for (void* p : release) std::free(p);
  }

  Stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  struct Block {
    void* ptr;
    std::size_t size;
  };

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
    const std::size_t size = (n + kGranularity - 1) / kGranularity * kGranularity;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        ptr = it->second.back();
        it->second.pop_back();
        stats_.cached_bytes -= size;
        ++stats_.hits;
      } else {
        ++stats_.misses;
      }
      stats_.in_use_bytes += size;
    }
    Block* block = nullptr;
    try {
      if (!ptr) {
        ptr = std::aligned_alloc(64, size);
        if (!ptr) throw std::bad_alloc();
      }
      block = new Block{ptr, size};
    } catch (...) {
      if (ptr) std::free(ptr);
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.in_use_bytes -= size;
      throw;
    }
    return c10::DataPtr(ptr, block, &HostCachingAllocator::free_block,
                        c10::Device(c10::DeviceType::CPU));
  }

  static void free_block(void* context) {
    auto* block = static_cast<Block*>(context);
    get().recycle(block->ptr, block->size);
    delete block;
  }

  void recycle(void* ptr, std::size_t size) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.in_use_bytes -= size;
      if (stats_.cached_bytes + size <= capacity_) {
        free_[size].push_back(ptr);
        stats_.cached_bytes += size;
        return;
      }
    }
    std::free(ptr);
  }

  mutable std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
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

}  // namespace stagejit::fusion
