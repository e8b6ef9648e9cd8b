#pragma once
/// \file
/// `distributed::ProcessGroup`: a c10d Gloo process group (PyTorch's
/// `torch.distributed.init_process_group(backend="gloo")`) set up from the environment
/// torchrun sets (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) or from explicit
/// options, over a `c10d::TCPStore` that rank 0 hosts or a `c10d::FileStore`, with one
/// explicit timeout for the rendezvous and for every collective. Every failure is a
/// `DistributedError` naming this rank, the store's address and the timeout, and the
/// ranks that did not arrive or were lost when they can be told (Note [Lost ranks]).
///
/// Optional part of stagejit: it needs c10d's Gloo headers (Debian's libgloo-dev) and is
/// compiled with `-DUSE_C10D_GLOO` (Meson: `stagejit_distributed_dep`), without which
/// the body of `torch/csrc/distributed/c10d/ProcessGroupGloo.hpp` is empty.

#if !defined(USE_C10D_GLOO)
#error "stagejit/distributed needs c10d's Gloo backend: compile with -DUSE_C10D_GLOO (Meson: stagejit_distributed_dep)"
#endif

#include <stagejit/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace stagejit::distributed {

/// How a `ProcessGroup` is set up. Unset fields (-1, empty) come from the environment
/// (`options_from_env`), as torchrun's variables.
struct ProcessGroupOptions {
  int rank = -1;           ///< this process, 0 <= rank < world_size (env RANK)
  int world_size = -1;     ///< number of processes, >= 1 (env WORLD_SIZE)
  /// Address of rank 0, which hosts the TCPStore (env MASTER_ADDR, default 127.0.0.1).
  std::string master_addr;
  int master_port = -1;    ///< port of the TCPStore (env MASTER_PORT, default 29500)
  /// When set, a `c10d::FileStore` at this path (fresh per run, on a file system every
  /// rank sees) replaces the TCPStore.
  std::string file_store;
  /// Limit for the rendezvous (every rank arrived), for each collective and for reaching
  /// the master.
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  /// Address the Gloo transport binds to (`ProcessGroupGloo::createDeviceForHostname`);
  /// empty: `master_addr` when it is a loopback address, else Gloo's default device
  /// (the address this host's name resolves to).
  std::string device_hostname;
};

/// Fills the unset fields of `o` from `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
/// `MASTER_PORT` (defaults: rank 0, world size 1, 127.0.0.1, 29500). Throws
/// `DistributedError` for a variable that is not an integer.
inline ProcessGroupOptions options_from_env(ProcessGroupOptions o = {}) {
  auto integer = [](const char* name, int fallback) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return fallback;
    char* end = nullptr;
    long x = std::strtol(v, &end, 10);
    STAGEJIT_CHECK_AS(DistributedError, end != v && *end == '\0', "environment variable ", name,
                      "='", v, "' is not an integer");
    return static_cast<int>(x);
  };
  if (o.rank < 0) o.rank = integer("RANK", 0);
  if (o.world_size < 0) o.world_size = integer("WORLD_SIZE", 1);
  if (o.master_addr.empty()) {
    const char* a = std::getenv("MASTER_ADDR");
    o.master_addr = (a && *a) ? a : "127.0.0.1";
  }
  if (o.master_port < 0) o.master_port = integer("MASTER_PORT", 29500);
  return o;
}

// Note [Lost ranks]
// Gloo reports a dead peer as a socket error ("Connection reset by peer", "Connection
// closed") or a timeout, without its rank. So every rank bumps its own counter in the store
// ("stagejit/heartbeat/<rank>") several times per timeout from a thread of its own; when a
// collective fails, the ranks whose counters no longer move are the lost ones. When the
// TCPStore itself is gone, its host, rank 0, is the one lost. A rank that lives but hangs
// keeps beating: the error then says that no rank was lost.

/// A Gloo process group over a TCPStore or FileStore (see the file comment). Collectives
/// on CPU tensors; every error is a `DistributedError`.
class ProcessGroup {
 public:
  /// Sets up the group (`options_from_env` fills what `options` leaves unset) and waits,
  /// up to the timeout, for every rank to arrive. Throws `DistributedError`: world size
  /// < 1, rank outside [0, world size), a non-positive timeout or port outside
  /// [1, 65535]; rank 0 cannot host the store (port in use); the master cannot be reached
  /// within the timeout; a rank did not arrive within the timeout (naming it).
  explicit ProcessGroup(ProcessGroupOptions options = {}) : o_(options_from_env(std::move(options))) {
    STAGEJIT_CHECK_AS(DistributedError, o_.world_size >= 1, "distributed: world size must be >= 1, got ",
                      o_.world_size);
    STAGEJIT_CHECK_AS(DistributedError, o_.rank >= 0 && o_.rank < o_.world_size, "distributed: rank ",
                      o_.rank, " is outside [0, ", o_.world_size, ") (world size ", o_.world_size, ")");
    STAGEJIT_CHECK_AS(DistributedError, o_.timeout.count() > 0, "distributed: the timeout must be "
                      "positive, got ", o_.timeout.count(), " ms");
    STAGEJIT_CHECK_AS(DistributedError, !o_.file_store.empty() || (o_.master_port >= 1 && o_.master_port <= 65535),
                      "distributed: MASTER_PORT ", o_.master_port, " is outside [1, 65535]");
    address_ = o_.file_store.empty() ? "tcp://" + o_.master_addr + ":" + std::to_string(o_.master_port)
                                     : "file://" + o_.file_store;
    connect_store();
    rendezvous();
    try {
      auto gloo_options = ::c10d::ProcessGroupGloo::Options::create(o_.timeout);
      gloo_options->devices.push_back(make_device());
      gloo_ = c10::make_intrusive<::c10d::ProcessGroupGloo>(store_, o_.rank, o_.world_size, gloo_options);
    } catch (const std::exception& e) {
      fail("could not connect the Gloo transport", std::current_exception());
    }
    heartbeat_ = std::thread([this] { beat(); });
  }

  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  ~ProcessGroup() {
    {
      std::lock_guard<std::mutex> lock(beat_mutex_);
      stop_ = true;
    }
    beat_cv_.notify_all();
    if (heartbeat_.joinable()) heartbeat_.join();
  }

  int rank() const noexcept { return o_.rank; }
  int world_size() const noexcept { return o_.world_size; }
  std::chrono::milliseconds timeout() const noexcept { return o_.timeout; }
  /// "tcp://ADDR:PORT" or "file://PATH".
  const std::string& store_address() const noexcept { return address_; }
  /// The c10d process group (for collectives this class does not wrap).
  ::c10d::ProcessGroupGloo& gloo() noexcept { return *gloo_; }

  /// Broadcasts `tensor` (CPU, contiguous, same shape and dtype on every rank) in place
  /// from `root`. Blocks; throws `DistributedError` (a lost rank, the timeout).
  void broadcast(at::Tensor& tensor, int root = 0) {
    std::vector<at::Tensor> ts{tensor};
    ::c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = o_.timeout;
    wait(gloo_->broadcast(ts, opts), "broadcast from rank " + std::to_string(root));
  }

  /// Starts an all-reduce (sum, or `op`) of `tensor` in place (CPU, contiguous, same shape
  /// and dtype on every rank; issued in the same order on every rank). Wait with `wait`.
  c10::intrusive_ptr<::c10d::Work> allreduce_async(at::Tensor& tensor,
                                                   ::c10d::ReduceOp op = ::c10d::ReduceOp::SUM) {
    std::vector<at::Tensor> ts{tensor};
    ::c10d::AllreduceOptions opts;
    opts.reduceOp = op;
    opts.timeout = o_.timeout;
    return gloo_->allreduce(ts, opts);
  }

  /// Blocking all-reduce (see `allreduce_async`).
  void allreduce(at::Tensor& tensor, ::c10d::ReduceOp op = ::c10d::ReduceOp::SUM) {
    wait(allreduce_async(tensor, op), "all-reduce");
  }

  /// Waits for `work`; throws `DistributedError` naming `what` when it failed
  /// (Note [Lost ranks]).
  void wait(const c10::intrusive_ptr<::c10d::Work>& work, const std::string& what) {
    try {
      work->wait(o_.timeout);
    } catch (...) {
      fail(what + " failed", std::current_exception());
    }
  }

  /// The ranks other than this one whose heartbeat stopped (Note [Lost ranks]): watches
  /// the counters for about two heartbeat intervals. Rank 0 alone when the TCPStore
  /// cannot be reached. Never throws.
  std::vector<int> lost_ranks() {
    std::vector<int> lost;
    try {
      std::vector<int64_t> before(o_.world_size), after(o_.world_size);
      for (int r = 0; r < o_.world_size; ++r) before[r] = store_->add(beat_key(r), 0);
      std::this_thread::sleep_for(beat_interval() * 5 / 2);
      for (int r = 0; r < o_.world_size; ++r) after[r] = store_->add(beat_key(r), 0);
      for (int r = 0; r < o_.world_size; ++r)
        if (r != o_.rank && after[r] == before[r]) lost.push_back(r);
    } catch (...) {
      lost.clear();
      if (o_.file_store.empty() && o_.rank != 0) lost.push_back(0);
    }
    return lost;
  }

  /// Throws `DistributedError`: "rank R (store ADDR, timeout T s): WHAT: lost rank(s) ...:
  /// CAUSE" with the lost ranks (`lost_ranks`) and the message of `cause`.
  [[noreturn]] void fail(const std::string& what, std::exception_ptr cause) {
    const std::vector<int> lost = gloo_ ? lost_ranks() : std::vector<int>{};
    std::string ranks;
    for (int r : lost) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    std::string why = lost.empty() ? (gloo_ ? "no rank was lost (a rank did not reach the same "
                                              "collective within the timeout?)"
                                            : std::string())
                                   : "lost rank" + std::string(lost.size() > 1 ? "s " : " ") + ranks +
                                         " (no heartbeat)";
    ::stagejit::detail::throw_error<DistributedError>(prefix(), what, why.empty() ? "" : ": ", why, ": ",
                                                      message_of(cause));
  }

 private:
  static std::string beat_key(int r) { return "stagejit/heartbeat/" + std::to_string(r); }
  static std::string arrive_key(int r) { return "stagejit/arrived/" + std::to_string(r); }

  std::chrono::milliseconds beat_interval() const {
    return std::clamp(o_.timeout / 8, std::chrono::milliseconds(20), std::chrono::milliseconds(1000));
  }

  std::string prefix() const {
    char t[32];
    std::snprintf(t, sizeof t, "%.3g", std::chrono::duration<double>(o_.timeout).count());
    return "distributed: rank " + std::to_string(o_.rank) + " of " + std::to_string(o_.world_size) +
           " (store " + address_ + ", timeout " + t + " s): ";
  }

  static std::string message_of(const std::exception_ptr& e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const c10::Error& err) {
      return err.what_without_backtrace();
    } catch (const std::exception& err) {
      return err.what();
    } catch (...) {
    }
    return "unknown error";
  }

  void connect_store() {
    try {
      if (!o_.file_store.empty()) {
        store_ = c10::make_intrusive<::c10d::FileStore>(o_.file_store, o_.world_size);
      } else {
        ::c10d::TCPStoreOptions so;
        so.port = static_cast<uint16_t>(o_.master_port);
        so.isServer = o_.rank == 0;
        so.numWorkers = o_.world_size;
        so.waitWorkers = false;  // the rendezvous below names the ranks that do not arrive
        so.timeout = o_.timeout;
        store_ = c10::make_intrusive<::c10d::TCPStore>(o_.master_addr, so);
      }
      store_->setTimeout(o_.timeout);
    } catch (...) {
      ::stagejit::detail::throw_error<DistributedError>(
          prefix(),
          !o_.file_store.empty() ? "cannot open the file store"
          : o_.rank == 0         ? "cannot host the store (is the port in use?)"
                                 : "cannot reach the master within the timeout (is rank 0 running?)",
          ": ", message_of(std::current_exception()));
    }
  }

  // Every rank announces itself, then waits for all others; on the timeout the missing
  // ones are named.
  void rendezvous() {
    try {
      store_->set(arrive_key(o_.rank), std::vector<uint8_t>{1});
      store_->add(beat_key(o_.rank), 1);
      std::vector<std::string> keys;
      for (int r = 0; r < o_.world_size; ++r) keys.push_back(arrive_key(r));
      store_->wait(keys, o_.timeout);
    } catch (...) {
      std::string missing;
      try {
        for (int r = 0; r < o_.world_size; ++r)
          if (!store_->check({arrive_key(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      } catch (...) {
        missing = o_.rank == 0 || !o_.file_store.empty() ? "" : "0 (the store's host)";
      }
      ::stagejit::detail::throw_error<DistributedError>(
          prefix(), "not every rank arrived within the timeout",
          missing.empty() ? "" : ": missing rank(s) " + missing, ": ",
          message_of(std::current_exception()));
    }
  }

  std::shared_ptr<::gloo::transport::Device> make_device() const {
    std::string host = o_.device_hostname;
    if (host.empty() && (o_.master_addr == "127.0.0.1" || o_.master_addr == "localhost" ||
                         o_.master_addr == "::1" || !o_.file_store.empty()))
      host = o_.file_store.empty() ? o_.master_addr : "127.0.0.1";
    return host.empty() ? ::c10d::ProcessGroupGloo::createDefaultDevice()
                        : ::c10d::ProcessGroupGloo::createDeviceForHostname(host);
  }

  // Note [Lost ranks]: bumps this rank's counter until the destructor; stops quietly when
  // the store is gone.
  void beat() {
    std::unique_lock<std::mutex> lock(beat_mutex_);
    while (!beat_cv_.wait_for(lock, beat_interval(), [this] { return stop_; })) {
      try {
        store_->add(beat_key(o_.rank), 1);
      } catch (...) {
        return;
      }
    }
  }

  ProcessGroupOptions o_;
  std::string address_;
  c10::intrusive_ptr<::c10d::Store> store_;
  c10::intrusive_ptr<::c10d::ProcessGroupGloo> gloo_;
  std::thread heartbeat_;
  std::mutex beat_mutex_;
  std::condition_variable beat_cv_;
  bool stop_ = false;
};

}  // namespace stagejit::distributed
