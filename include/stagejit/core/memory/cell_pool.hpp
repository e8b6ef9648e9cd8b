#pragma once
/// \file
/// Cell pools: the storage of an IR graph's nodes and values (ir/graph.hpp). `CellPool`
/// carves fixed-size cells out of blocks and reuses them through a free list;
/// `BlockCache` keeps the full-size blocks of dying graphs for the next ones (Note [Pool
/// block cache]). Memory utilities only: they know nothing of the IR.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace stagejit::memory {

/// Every pool block is aligned to a cache line (and so suits any cell alignment <= 64).
inline constexpr size_t pool_block_align = 64;
inline void* new_pool_block(size_t bytes) {
  return ::operator new(bytes, std::align_val_t(pool_block_align));
}
inline void delete_pool_block(void* block) noexcept {
  ::operator delete(block, std::align_val_t(pool_block_align));
}

/// Process-wide cache of freed full-size pool blocks (Note [Pool block cache]).
///
/// Note [Pool block cache]: a compile builds and frees graphs of 10^4..10^5 nodes (the
/// trace's graph, its clone, the fused graph and the subgraphs of its groups). Freed
/// with glibc's `free`, their pool blocks coalesce at the top of the heap and are
/// trimmed back to the system, so the next graph takes every page again as a fresh page
/// fault (8-15 us per 4 KiB page on the VM of bench/closure.md: most of the fuser's time
/// in steady state). Full-size blocks of a dying graph are therefore kept here, up to
/// `set_pool_cache_limit` bytes in all (64 MiB by default), and handed to the next
/// graph's pools.
/// `release_cached_pool_blocks()` frees them (like a caching allocator's `empty_cache`).
class BlockCache {
 public:
  static BlockCache& instance() {
    static BlockCache* cache = new BlockCache;  // never destroyed: graphs may die at exit
    return *cache;
  }
  /// A cached block of exactly `bytes`, or nullptr.
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [size, blocks] : by_size_)
      if (size == bytes && !blocks.empty()) {
        void* p = blocks.back();
        blocks.pop_back();
        held_ -= bytes;
        return p;
      }
    return nullptr;
  }
  /// Keeps `p` (a block of `bytes`) when the cache has room; false means the caller frees it.
  bool give(void* p, size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_ + bytes > limit_) return false;
    try {
      for (auto& [size, blocks] : by_size_)
        if (size == bytes) {
          blocks.push_back(p);
          held_ += bytes;
          return true;
        }
      by_size_.emplace_back(bytes, std::vector<void*>{p});
      held_ += bytes;
      return true;
    } catch (...) {  // no room for the pointer: let the caller free the block
      return false;
    }
  }
  /// Bytes held now.
  size_t held() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }
  /// Sets the most bytes kept (0 disables the cache) and frees what is over it.
  void set_limit(size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
    for (auto& [size, blocks] : by_size_)
      while (held_ > limit_ && !blocks.empty()) {
        delete_pool_block(blocks.back());
        blocks.pop_back();
        held_ -= size;
      }
  }
  size_t limit() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }
  /// Frees every cached block (the limit stays).
  void clear() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [size, blocks] : by_size_) {
      for (void* block : blocks) delete_pool_block(block);
      held_ -= size * blocks.size();
      blocks.clear();
    }
  }

 private:
  BlockCache() = default;
  mutable std::mutex mutex_;
  std::vector<std::pair<size_t, std::vector<void*>>> by_size_;  // a few block sizes
  size_t held_ = 0;
  size_t limit_ = size_t(64) << 20;
};

/// Storage for one graph's nodes: cells of `Size` bytes carved from blocks (4 cells, then
/// twice as many per block up to `MaxPerBlock`: small graphs such as fusion subgraphs
/// stay small), reused through an intrusive free list. A graph's nodes then sit together
/// in memory in creation order (passes walk them in that order) and cost no malloc each.
/// Full-size blocks come from and go back to the `BlockCache`.
template <size_t Size, size_t Align, size_t MaxPerBlock = 256>
class CellPool {
  static_assert(Size >= sizeof(void*));
  static_assert(Align <= pool_block_align);

 public:
  CellPool() = default;
  CellPool(const CellPool&) = delete;
  CellPool& operator=(const CellPool&) = delete;
  ~CellPool() {
    for (const Block& b : blocks_)
      if (b.cells != MaxPerBlock || !BlockCache::instance().give(b.data, block_bytes(b.cells)))
        delete_pool_block(b.data);
  }
  /// Uninitialised storage for one object; throws std::bad_alloc.
  void* allocate() {
    if (free_) {
      void* p = free_;
      std::memcpy(&free_, p, sizeof(void*));  // the link stored in the free cell
      return p;
    }
    if (used_ == block_size_) {
      const size_t next = blocks_.empty() ? 4 : std::min(2 * block_size_, MaxPerBlock);
      // Room first (growing geometrically), so that nothing throws once we hold a block.
      if (blocks_.size() == blocks_.capacity()) blocks_.reserve(2 * blocks_.size() + 1);
      void* data = next == MaxPerBlock ? BlockCache::instance().take(block_bytes(next)) : nullptr;
      if (!data) data = new_pool_block(block_bytes(next));
      blocks_.push_back(Block{static_cast<Cell*>(data), next});
      block_size_ = next;
      used_ = 0;
    }
    return &blocks_.back().data[used_++];
  }
  /// Returns storage from `allocate` whose object has been destroyed.
  void deallocate(void* p) noexcept {
    std::memcpy(p, &free_, sizeof(void*));
    free_ = p;
  }
  /// `make(cell)` placement-constructs an object in a fresh cell and returns it; the cell
  /// goes back to the pool when `make` throws.
  template <class Make>
  auto construct(Make&& make) {
    void* cell = allocate();
    try {
      return make(cell);
    } catch (...) {
      deallocate(cell);
      throw;
    }
  }

 private:
  struct alignas(Align) Cell {
    std::byte bytes[Size];
  };
  struct Block {
    Cell* data;
    size_t cells;
  };
  static constexpr size_t block_bytes(size_t cells) { return cells * sizeof(Cell); }
  std::vector<Block> blocks_;
  size_t block_size_ = 0;  // cells in the last block
  size_t used_ = 0;        // cells of the last block handed out
  void* free_ = nullptr;
};

}  // namespace stagejit::memory
