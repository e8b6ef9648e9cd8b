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

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

/// Largest world size `WORLD_SIZE` or `ProcessGroupOptions::world_size` may ask for.
inline constexpr int kMaxWorldSize = 1 << 20;
/// Largest `ProcessGroupOptions::timeout` (a year: deadlines stay far from overflow).
inline constexpr std::chrono::milliseconds kMaxTimeout{365LL * 24 * 3600 * 1000};

namespace detail {

/// The integer in environment variable `name`, which must lie in [lo, hi]; `fallback`
/// when it is unset or empty. Throws `DistributedError` naming the variable and its text
/// for anything else: not an integer (signs and digits only, no blanks), or out of range
/// (no wrap-around: RANK=4294967296 is refused, not read as 0).
inline int env_integer(const char* name, int fallback, long long lo, long long hi, const char* range) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const char* digits = (*v == '+' || *v == '-') ? v + 1 : v;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  STAGEJIT_CHECK_AS(DistributedError, *digits >= '0' && *digits <= '9' && end != nullptr && *end == '\0',
                    "distributed: environment variable ", name, "='", v, "' is not an integer");
  STAGEJIT_CHECK_AS(DistributedError, errno != ERANGE && x >= lo && x <= hi, "distributed: environment variable ",
                    name, "='", v, "' is out of range: ", range);
  return static_cast<int>(x);
}

}  // namespace detail

/// Fills the unset fields of `o` from `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
/// `MASTER_PORT` (defaults: rank 0, world size 1, 127.0.0.1, 29500). Throws
/// `DistributedError` naming the variable and its text for a variable that is not an
/// integer or lies out of its range: `RANK` in [0, world size), `WORLD_SIZE` in
/// [1, kMaxWorldSize], `MASTER_PORT` in [1, 65535]. Nothing wraps around.
inline ProcessGroupOptions options_from_env(ProcessGroupOptions o = {}) {
  const bool rank_from_env = o.rank < 0 && std::getenv("RANK") && *std::getenv("RANK");
  const bool world_from_env = o.world_size < 0 && std::getenv("WORLD_SIZE") && *std::getenv("WORLD_SIZE");
  if (o.world_size < 0)
    o.world_size = detail::env_integer("WORLD_SIZE", 1, 1, kMaxWorldSize,
                                       ("a world size must be in [1, " + std::to_string(kMaxWorldSize) + "]").c_str());
  if (o.rank < 0) o.rank = detail::env_integer("RANK", 0, 0, INT32_MAX, "a rank must be in [0, WORLD_SIZE)");
  if (rank_from_env && o.world_size >= 1) {
    STAGEJIT_CHECK_AS(DistributedError, o.rank < o.world_size, "distributed: environment variable RANK='",
                      std::getenv("RANK"), "' is out of range: a rank must be in [0, ", o.world_size, ") (world size ",
                      o.world_size,
                      world_from_env ? std::string(" from WORLD_SIZE='") + std::getenv("WORLD_SIZE") + "'"
                                     : std::string(),
                      ")");
  }
  if (o.master_addr.empty()) {
    const char* a = std::getenv("MASTER_ADDR");
    o.master_addr = (a && *a) ? a : "127.0.0.1";
  }
  if (o.master_port < 0)
    o.master_port = detail::env_integer("MASTER_PORT", 29500, 1, 65535, "a port must be in [1, 65535]");
  return o;
}

namespace detail {

// Note [Store probe]
// c10d's TCPStore client (libtorch 1.13) connects with a timeout, but then waits for
// answers with no timeout at all, and its constructor starts a thread (the watch-key
// daemon) that reads from a second connection and lets any socket error escape it: a
// peer that accepts and never answers blocks the first store call until it closes, and
// when it closes with a reset (RST: a connection still in its accept queue, or unread
// data), that thread throws std::system_error and std::terminate ends the process.
// So before any c10d object touches the address, `probe_tcp_store` connects with a
// socket of its own, asks what a c10d store answers (GETNUMKEYS: one byte, query 6 of
// c10d's protocol since 1.8; the answer is a little-endian int64) and waits for the
// answer with poll() until the deadline. Only a peer that answered like a store is handed
// to c10d; anything else is a DistributedError from this thread, within the timeout.

/// Milliseconds from now until `deadline`, at least 0, rounded up (for poll()).
inline int ms_until(std::chrono::steady_clock::time_point deadline) {
  const auto left = deadline - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) return 0;
  return static_cast<int>(std::min<int64_t>(
      std::chrono::ceil<std::chrono::milliseconds>(left).count(), 1000 * 1000 * 1000));
}

/// Note [Store probe]: empty when a c10d TCPStore answered at `host:port` before
/// `deadline`, else why not (a phrase naming host:port). Retries a refused connection
/// until the deadline (rank 0 may start later). Never throws; blocks at most until the
/// deadline (and for the name look-up, which a numeric address skips).
inline std::string probe_tcp_store(const std::string& host, int port, std::chrono::steady_clock::time_point deadline) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0)
    return "cannot resolve the master address '" + host + "': " + ::gai_strerror(rc);
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> addresses(found, ::freeaddrinfo);
  struct Socket {
    int fd = -1;
    ~Socket() {
      if (fd >= 0) ::close(fd);
    }
  };
  std::string last_error = "no attempt";
  while (true) {
    for (addrinfo* ai = addresses.get(); ai != nullptr; ai = ai->ai_next) {
      Socket s;
      s.fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
      if (s.fd < 0) {
        last_error = std::strerror(errno);
        continue;
      }
      int err = 0;
      if (::connect(s.fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          pollfd p{s.fd, POLLOUT, 0};
          const int ready = ::poll(&p, 1, ms_until(deadline));
          if (ready == 0) {
            last_error = "the connection was not accepted in time";
            continue;
          }
          socklen_t len = sizeof err;
          if (ready < 0 || ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        }
      }
      if (err != 0) {
        last_error = std::strerror(err);
        continue;
      }
      // Connected: one GETNUMKEYS query, then its 8-byte answer before the deadline.
      const unsigned char query = 6;
      if (::send(s.fd, &query, 1, MSG_NOSIGNAL) != 1)
        return where + " closed the connection (" + std::strerror(errno) +
               ") before the store's first query: it is not a c10d store, or rank 0 is shutting down";
      unsigned char answer[8];
      std::size_t got = 0;
      while (got < sizeof answer) {
        pollfd p{s.fd, POLLIN, 0};
        const int ready = ::poll(&p, 1, ms_until(deadline));
        if (ready == 0)
          return where + " accepted the connection but did not answer the store's first query within the "
                         "timeout: it is not a c10d store, or its process (rank 0) is stopped";
        const ssize_t n = ready < 0 ? -1 : ::recv(s.fd, answer + got, sizeof answer - got, 0);
        if (n > 0) {
          got += static_cast<std::size_t>(n);
        } else if (n == 0) {
          return where + " closed the connection without answering the store's first query: it is not a "
                         "c10d store, or rank 0 is shutting down";
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return where + " closed the connection (" + std::strerror(errno) +
                 ") without answering the store's first query: it is not a c10d store, or rank 0 is shutting down";
        }
      }
      uint64_t keys = 0;
      for (int i = 7; i >= 0; --i) keys = keys << 8 | answer[i];
      if (keys >= (uint64_t(1) << 40))
        return where + " answered, but not as a c10d store does (a key count of " + std::to_string(keys) + ")";
      return {};
    }
    if (ms_until(deadline) == 0) break;
    std::this_thread::sleep_for(std::min(std::chrono::milliseconds(50), std::chrono::milliseconds(ms_until(deadline))));
  }
  return "nothing at " + where + " accepted a connection within the timeout (" + last_error + "): is rank 0 running?";
}

/// Whether a process holds TCP port `port` on this host (binding it as c10d's store does
/// fails with EADDRINUSE).
inline bool port_in_use(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool in_use = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == EADDRINUSE;
  ::close(fd);
  return in_use;
}

// Note [Bounded store calls]
// After the probe, the store is built and the rendezvous run on a thread of their own,
// which the constructor waits for until a deadline (twice the timeout, plus a second:
// reaching the store, then waiting for the ranks). c10d's calls have no timeout of their
// own while they wait for an answer, so a store that answered the probe and then stopped
// (rank 0 stopped, a dead link without a reset) would otherwise block the constructor
// forever. On the deadline that thread is detached, not owned: owning it would mean
// joining it, which is the very hang this avoids, and a std::thread still joinable at
// destruction calls std::terminate. The detached thread refers to nothing the caller
// owns: it holds the job (a shared_ptr) and the store (an intrusive_ptr), catches every
// exception, and when c10d returns at last (the peer closed) it frees the store and ends
// quietly. At exit it is simply not waited for (exit() does not join threads); while it
// stays blocked in recv() it touches nothing, so nothing crashes.

/// A job run on its own thread (Note [Bounded store calls]).
struct BoundedJob {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::exception_ptr error;
  std::atomic<int> stage{0};  ///< how far the job got, for the message on the deadline
  c10::intrusive_ptr<::c10d::Store> store;
};

/// Runs `fn(job)` on a thread of its own; returns true when it finished before `deadline`
/// (its exception, if any, is rethrown here), false when the deadline passed (the thread is
/// detached and left to finish on its own).
template <class Fn>
bool run_bounded(const std::shared_ptr<BoundedJob>& job, Fn fn, std::chrono::steady_clock::time_point deadline) {
  std::thread worker([job, fn = std::move(fn)]() mutable noexcept {
    std::exception_ptr error;
    try {
      fn(*job);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(job->mutex);
    job->error = error;
    job->done = true;
    job->done_cv.notify_all();
  });
  bool finished;
  {
    std::unique_lock<std::mutex> lock(job->mutex);
    finished = job->done_cv.wait_until(lock, deadline, [&] { return job->done; });
  }
  if (!finished) {
    worker.detach();
    return false;
  }
  worker.join();
  if (job->error) std::rethrow_exception(job->error);
  return true;
}

}  // namespace detail

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
  /// outside [1, kMaxWorldSize], rank outside [0, world size), a timeout outside
  /// (0, kMaxTimeout] or port outside [1, 65535]; rank 0 cannot host the store (the port is
  /// held by another process: naming the port); no store answers at the master's address
  /// within the timeout (Note [Store probe]: a peer that accepts and never answers, or
  /// closes the connection, is one, never a hang or std::terminate); a rank did not arrive
  /// within the timeout (naming it). Reaching the store and the rendezvous take at most
  /// about twice the timeout, plus a second (Note [Bounded store calls]).
  explicit ProcessGroup(ProcessGroupOptions options = {}) : o_(options_from_env(std::move(options))) {
    STAGEJIT_CHECK_AS(DistributedError, o_.world_size >= 1, "distributed: world size must be >= 1, got ",
                      o_.world_size);
    STAGEJIT_CHECK_AS(DistributedError, o_.world_size <= kMaxWorldSize, "distributed: world size must be <= ",
                      kMaxWorldSize, ", got ", o_.world_size);
    STAGEJIT_CHECK_AS(DistributedError, o_.rank >= 0 && o_.rank < o_.world_size, "distributed: rank ",
                      o_.rank, " is outside [0, ", o_.world_size, ") (world size ", o_.world_size, ")");
    STAGEJIT_CHECK_AS(DistributedError, o_.timeout.count() > 0, "distributed: the timeout must be "
                      "positive, got ", o_.timeout.count(), " ms");
    STAGEJIT_CHECK_AS(DistributedError, o_.timeout <= kMaxTimeout, "distributed: the timeout must be at most ",
                      kMaxTimeout.count(), " ms (a year), got ", o_.timeout.count(), " ms");
    STAGEJIT_CHECK_AS(DistributedError, !o_.file_store.empty() || (o_.master_port >= 1 && o_.master_port <= 65535),
                      "distributed: MASTER_PORT ", o_.master_port, " is outside [1, 65535]");
    address_ = o_.file_store.empty() ? "tcp://" + o_.master_addr + ":" + std::to_string(o_.master_port)
                                     : "file://" + o_.file_store;
    connect_and_rendezvous();
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
    return "distributed: rank " + std::to_string(o_.rank) + " of " + std::to_string(o_.world_size) +
           " (store " + address_ + ", timeout " + seconds_text() + " s): ";
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

  // What a failure can add when the timeout is under a second.
  std::string short_timeout_hint() const {
    return o_.timeout < std::chrono::seconds(1) ? " (a timeout of " + seconds_text() + " s is likely too short)"
                                                : std::string();
  }

  std::string seconds_text() const {
    char t[32];
    std::snprintf(t, sizeof t, "%.3g", std::chrono::duration<double>(o_.timeout).count());
    return t;
  }

  [[noreturn]] void port_in_use_error(const std::string& cause) const {
    ::stagejit::detail::throw_error<DistributedError>(
        prefix(), "cannot host the store: port ", o_.master_port,
        " is in use: another process holds it (another rank 0 given the same MASTER_PORT, or an earlier run still "
        "alive?)",
        cause.empty() ? "" : ": ", cause);
  }

  // Probes the TCPStore (Note [Store probe]), then builds the store and runs the rendezvous
  // on a thread bounded by a deadline (Note [Bounded store calls]): every rank announces
  // itself, then waits for all others; on the timeout the missing ones are named.
  void connect_and_rendezvous() {
    using Clock = std::chrono::steady_clock;
    const bool tcp = o_.file_store.empty();
    if (tcp && o_.rank != 0) {
      const std::string why = detail::probe_tcp_store(o_.master_addr, o_.master_port, Clock::now() + o_.timeout);
      if (!why.empty())
        ::stagejit::detail::throw_error<DistributedError>(prefix(), "cannot reach the master within the timeout: ",
                                                          why, short_timeout_hint());
    }
    // Rank 0: a port another process listens on (even on one address only, which c10d's
    // bind to [::] may not notice) is refused before c10d's client could connect to it.
    if (tcp && o_.rank == 0 && detail::port_in_use(o_.master_port)) port_in_use_error("");
    auto job = std::make_shared<detail::BoundedJob>();
    const ProcessGroupOptions o = o_;
    const std::string prefix_text = prefix(), hint = short_timeout_hint();
    auto work = [o, prefix_text, hint](detail::BoundedJob& j) {
      if (!o.file_store.empty()) {
        j.store = c10::make_intrusive<::c10d::FileStore>(o.file_store, o.world_size);
      } else {
        ::c10d::TCPStoreOptions so;
        so.port = static_cast<uint16_t>(o.master_port);
        so.isServer = o.rank == 0;
        so.numWorkers = o.world_size;
        so.waitWorkers = false;  // the rendezvous below names the ranks that do not arrive
        // c10d truncates its connect timeout to whole seconds (0 s for anything under
        // one, which fails at once): give it at least a second; our deadline bounds it.
        so.timeout = std::max<std::chrono::milliseconds>(std::chrono::ceil<std::chrono::seconds>(o.timeout),
                                                         std::chrono::seconds(1));
        j.store = c10::make_intrusive<::c10d::TCPStore>(o.master_addr, so);
      }
      j.store->setTimeout(o.timeout);
      j.stage = 1;
      const c10::intrusive_ptr<::c10d::Store> store = j.store;
      try {
        store->set(arrive_key(o.rank), std::vector<uint8_t>{1});
        store->add(beat_key(o.rank), 1);
        std::vector<std::string> keys;
        for (int r = 0; r < o.world_size; ++r) keys.push_back(arrive_key(r));
        store->wait(keys, o.timeout);
      } catch (...) {
        const std::exception_ptr cause = std::current_exception();
        std::string missing;
        try {
          for (int r = 0; r < o.world_size; ++r)
            if (!store->check({arrive_key(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        } catch (...) {
          missing = o.rank == 0 || !o.file_store.empty() ? "" : "0 (the store's host)";
        }
        ::stagejit::detail::throw_error<DistributedError>(
            prefix_text, "not every rank arrived within the timeout",
            missing.empty() ? "" : ": missing rank(s) " + missing, hint, ": ", message_of(cause));
      }
      j.stage = 2;
    };
    const auto deadline = Clock::now() + 2 * o_.timeout + std::chrono::seconds(1);
    bool finished = false;
    try {
      finished = detail::run_bounded(job, std::move(work), deadline);
    } catch (const DistributedError&) {
      throw;
    } catch (...) {
      // Building the store failed (stage 0).
      const std::string cause = message_of(std::current_exception());
      if (!tcp)
        ::stagejit::detail::throw_error<DistributedError>(prefix(), "cannot open the file store: ", cause);
      if (o_.rank == 0) {
        if (cause.find("already in use") != std::string::npos || detail::port_in_use(o_.master_port))
          port_in_use_error(cause);
        ::stagejit::detail::throw_error<DistributedError>(prefix(), "cannot host the store on port ", o_.master_port,
                                                          hint, ": ", cause);
      }
      ::stagejit::detail::throw_error<DistributedError>(
          prefix(), "cannot connect to the store (it answered a first query, then failed)", hint, ": ", cause);
    }
    if (!finished) {
      const int stage = job->stage.load();
      ::stagejit::detail::throw_error<DistributedError>(
          prefix(),
          stage == 0 ? (!tcp ? std::string("cannot open the file store")
                        : o_.rank == 0 ? "cannot host the store on port " + std::to_string(o_.master_port)
                                       : std::string("cannot connect to the store"))
                     : std::string("the rendezvous did not finish"),
          " within twice the timeout: the store stopped answering (its thread is left behind, detached)", hint);
    }
    store_ = job->store;
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
