// Reliability of the process group's set-up (issue 34, items 4, 7 and 9b): a store
// address where something accepts and never answers, or closes the connection, gives a
// DistributedError within the timeout (never a hang, never std::terminate); environment
// numbers are range checked instead of wrapping; a port held by another process and a
// timeout too short are named as such.
#include <stagejit/distributed/process_group.hpp>
#include <stagejit/testing/doctest.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include "../child.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace sj = stagejit;
namespace dist = stagejit::distributed;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Sets environment variables for a scope and restores the previous values after it.
class EnvGuard {
 public:
  void set(const char* name, const char* value) {
    remember(name);
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~EnvGuard() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second)
        setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        unsetenv(it->first.c_str());
    }
  }

 private:
  void remember(const char* name) {
    const char* v = std::getenv(name);
    saved_.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// A clean environment for the torchrun variables: every test starts from none set.
struct CleanDistEnv : EnvGuard {
  CleanDistEnv() {
    for (const char* n : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) set(n, nullptr);
  }
};

// A TCP listener on 127.0.0.1 that is not a store. `accept_connections`: accept each
// connection (else leave it in the accept queue); then hold it without reading or
// answering until `close_after` from the first accepted connection (or until the peer is
// destroyed), closing it with a reset (SO_LINGER 0) when `reset`, else with a FIN.
// `answer_first_query`: answer the first connection's first query as a store does.
class FakePeer {
 public:
  FakePeer(bool accept_connections, std::optional<std::chrono::milliseconds> close_after, bool reset,
           bool answer_first_query = false)
      : accept_(accept_connections), close_after_(close_after), reset_(reset), answer_first_(answer_first_query) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    REQUIRE(getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    REQUIRE(listen(fd_, 16) == 0);
    if (accept_) thread_ = std::thread([this] { serve(); });
  }
  ~FakePeer() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);  // wakes accept()
    if (thread_.joinable()) thread_.join();
    close_all();
    close(fd_);
  }
  int port() const { return port_; }
  int accepted() const { return accepted_.load(); }

 private:
  void serve() {
    std::optional<Clock::time_point> start;  // the first accepted connection: `close_after` counts from it
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 10) > 0 && !stop_) {
        int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0) {
          if (answer_first_ && accepted_ == 0) {
            // Answer the first connection's first query (the probe's GETNUMKEYS) as a
            // c10d store does: 8 bytes, "0 keys". Nothing else is ever answered.
            unsigned char q = 0;
            pollfd pq{c, POLLIN, 0};
            if (poll(&pq, 1, 2000) > 0 && recv(c, &q, 1, 0) == 1) {
              const unsigned char zero[8] = {};
              send(c, zero, sizeof zero, MSG_NOSIGNAL);
            }
          }
          conns_.push_back(c);
          ++accepted_;
          if (!start) start = Clock::now();
        }
      }
      if (close_after_ && start && Clock::now() - *start >= *close_after_) close_all();
    }
  }
  void close_all() {
    for (int c : conns_) {
      if (reset_) {
        linger l{1, 0};
        setsockopt(c, SOL_SOCKET, SO_LINGER, &l, sizeof l);
      }
      close(c);
    }
    conns_.clear();
  }

  int fd_ = -1, port_ = 0;
  bool accept_;
  std::optional<std::chrono::milliseconds> close_after_;
  bool reset_;
  bool answer_first_;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::vector<int> conns_;
  std::thread thread_;
};

int unused_port() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  close(s);
  return ntohs(a.sin_port);
}

// The options of `rank` of a world of 2 on 127.0.0.1 at an unused port, with `timeout`.
dist::ProcessGroupOptions two_ranks_on_loopback(int rank, std::chrono::milliseconds timeout) {
  dist::ProcessGroupOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.master_addr = "127.0.0.1";
  o.master_port = unused_port();
  o.timeout = timeout;
  return o;
}

// The child: a ProcessGroup from torchrun's variables with the timeout REL_TIMEOUT_MS.
// Exit 3 with "elapsed_ms=N" and the error on stderr for a DistributedError, 4 for any
// other exception, 0 when the group came up. It returns from main (static destructors
// run), so a thread that crashes the process at exit would show as a signal.
int connect_child() {
  const char* t = std::getenv("REL_TIMEOUT_MS");
  dist::ProcessGroupOptions o;
  o.timeout = std::chrono::milliseconds(t ? std::atoll(t) : 3000);
  const auto start = Clock::now();
  try {
    dist::ProcessGroup group(o);
    return 0;
  } catch (const sj::DistributedError& e) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    std::fprintf(stderr, "elapsed_ms=%lld\n%s\n", static_cast<long long>(ms), e.what());
    // Stay a moment: a reset by the peer now must not terminate this process either.
    if (const char* linger = std::getenv("REL_LINGER_MS"))
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(linger)));
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "not a DistributedError: %s\n", e.what());
    return 4;
  }
}
const stagejit::testing::RegisterChild register_connect_child("reliability-connect", &connect_child);

struct ChildResult {
  int status = -1;  // exit status, 128 + signal, or -1 when killed past the deadline
  std::string err;
  long long elapsed_ms = -1;
};

// Runs this executable's "reliability-connect" child with `env` added (the torchrun
// variables of the parent dropped); kills it past `limit`.
ChildResult run_connect_child(const std::vector<std::string>& env, std::chrono::milliseconds limit) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::vector<std::string> strings = stagejit::testing::child_environment("reliability-connect", "REL_");
  strings.push_back("OMP_NUM_THREADS=1");
  for (const auto& e : env) strings.push_back(e);
  std::vector<char*> envp = stagejit::testing::env_pointers(strings);
  const fs::path err_path =
      fs::temp_directory_path() / ("stagejit-reliability-" + std::to_string(getpid()) + ".stderr");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::string arg0 = exe;
  char* argv[] = {arg0.data(), nullptr};
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data()) == 0);
  posix_spawn_file_actions_destroy(&fa);
  ChildResult r;
  const auto deadline = Clock::now() + limit;
  int status = 0;
  while (true) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (Clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream in(err_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  fs::remove(err_path);
  if (auto at = r.err.find("elapsed_ms="); at != std::string::npos)
    r.elapsed_ms = std::atoll(r.err.c_str() + at + 11);
  return r;
}

std::vector<std::string> rank1_env(int port, int timeout_ms) {
  return {"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
          "REL_TIMEOUT_MS=" + std::to_string(timeout_ms)};
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const sj::DistributedError& e) {
    return e.what();
  }
  return "(no DistributedError)";
}

}  // namespace

TEST_SUITE("distributed") {
  TEST_CASE("a store address that accepts and never answers: a DistributedError within the timeout") {
    const int timeout_ms = 1500;
    for (bool accept_connections : {true, false}) {
      CAPTURE(accept_connections);
      // The peer holds the connection, then resets it while the child lingers after its
      // error: no c10d thread may be left to die of that reset.
      FakePeer peer(accept_connections, std::chrono::milliseconds(timeout_ms + 500), /*reset=*/true);
      std::vector<std::string> env = rank1_env(peer.port(), timeout_ms);
      env.push_back("REL_LINGER_MS=1500");
      const ChildResult r = run_connect_child(env, std::chrono::milliseconds(3 * timeout_ms + 15000));
      INFO("child stderr: ", r.err);
      CHECK(r.status == 3);  // a DistributedError: not a hang (-1), not std::terminate (134)
      CHECK(r.elapsed_ms >= timeout_ms * 9 / 10);
      CHECK(r.elapsed_ms <= 3 * timeout_ms);
      CHECK(r.err.find("rank 1 of 2 (store tcp://127.0.0.1:" + std::to_string(peer.port()) + ", timeout 1.5 s)") !=
            std::string::npos);
      CHECK(r.err.find("127.0.0.1:" + std::to_string(peer.port()) +
                       " accepted the connection but did not answer") != std::string::npos);
      if (accept_connections) CHECK(peer.accepted() >= 1);
    }
  }

  TEST_CASE("a store address that closes the connection: a DistributedError, not std::terminate") {
    const int timeout_ms = 3000;
    for (bool reset : {false, true}) {
      for (int after_ms : {0, 300}) {
        CAPTURE(reset);
        CAPTURE(after_ms);
        FakePeer peer(true, std::chrono::milliseconds(after_ms), reset);
        const ChildResult r =
            run_connect_child(rank1_env(peer.port(), timeout_ms), std::chrono::milliseconds(3 * timeout_ms + 15000));
        INFO("child stderr: ", r.err);
        CHECK(r.status == 3);
        CHECK(r.elapsed_ms >= 0);
        CHECK(r.elapsed_ms <= 3 * timeout_ms);
        CHECK(r.err.find("rank 1 of 2 (store tcp://127.0.0.1:" + std::to_string(peer.port()) + ", timeout 3 s)") !=
              std::string::npos);
        CHECK(r.err.find("127.0.0.1:" + std::to_string(peer.port()) + " closed the connection") != std::string::npos);
      }
    }
  }

  TEST_CASE("a store that answers the first query, then stops: the bounded set-up fails, its thread left behind") {
    // c10d's own calls have no timeout once connected: the set-up thread is abandoned
    // (detached) at 2 x timeout + 1 s. The peer then closes while the child still runs
    // (the detached thread wakes and ends quietly), or only after the child has returned
    // from main (the thread is still blocked in c10d at exit): either way a clean exit 3.
    const int timeout_ms = 800;
    for (bool close_while_alive : {true, false}) {
      CAPTURE(close_while_alive);
      FakePeer peer(true, close_while_alive ? std::optional(std::chrono::milliseconds(2 * timeout_ms + 2000))
                                            : std::nullopt,
                    /*reset=*/false, /*answer_first_query=*/true);
      std::vector<std::string> env = rank1_env(peer.port(), timeout_ms);
      env.push_back(close_while_alive ? "REL_LINGER_MS=2500" : "REL_LINGER_MS=0");
      const ChildResult r = run_connect_child(env, std::chrono::milliseconds(3 * timeout_ms + 20000));
      INFO("child stderr: ", r.err);
      CHECK(r.status == 3);  // not a hang (-1), not a crash at exit (128 + signal)
      CHECK(r.elapsed_ms >= 2 * timeout_ms);
      CHECK(r.elapsed_ms <= 2 * timeout_ms + 1000 + 2000);
      CHECK(r.err.find("rank 1 of 2 (store tcp://127.0.0.1:" + std::to_string(peer.port()) + ", timeout 0.8 s)") !=
            std::string::npos);
      CHECK(r.err.find("within twice the timeout: the store stopped answering") != std::string::npos);
      CHECK(peer.accepted() >= 2);  // the probe, then c10d's own connection(s)
    }
  }

  TEST_CASE("no store at the address: rank 1 fails within the timeout, naming address, rank and timeout") {
    CleanDistEnv env;
    dist::ProcessGroupOptions o = two_ranks_on_loopback(1, std::chrono::milliseconds(800));
    const auto t0 = Clock::now();
    const std::string what = what_of([&] { dist::ProcessGroup g(o); });
    const auto took = Clock::now() - t0;
    INFO(what);
    CHECK(what.find("rank 1 of 2 (store tcp://127.0.0.1:" + std::to_string(o.master_port) + ", timeout 0.8 s)") !=
          std::string::npos);
    CHECK(what.find("nothing at 127.0.0.1:" + std::to_string(o.master_port) + " accepted a connection") !=
          std::string::npos);
    CHECK(what.find("Connection refused") != std::string::npos);
    CHECK(took >= std::chrono::milliseconds(700));  // it retried (rank 0 may start late)
    CHECK(took <= std::chrono::milliseconds(3 * 800));
  }

  TEST_CASE("environment numbers are range checked, not wrapped") {
    CleanDistEnv env;
    struct Case {
      const char *name, *value, *expected;
    };
    const Case cases[] = {
        {"RANK", "4294967296", "RANK='4294967296' is out of range: a rank must be in [0, WORLD_SIZE)"},
        {"RANK", "-1", "RANK='-1' is out of range"},
        {"RANK", "99999999999999999999", "RANK='99999999999999999999' is out of range"},
        {"RANK", "1", "RANK='1' is out of range: a rank must be in [0, 1) (world size 1)"},
        {"RANK", " 0", "RANK=' 0' is not an integer"},
        {"RANK", "0x1", "RANK='0x1' is not an integer"},
        {"WORLD_SIZE", "4294967297", "WORLD_SIZE='4294967297' is out of range: a world size must be in [1, 1048576]"},
        {"WORLD_SIZE", "0", "WORLD_SIZE='0' is out of range"},
        {"WORLD_SIZE", "2.5", "WORLD_SIZE='2.5' is not an integer"},
        {"MASTER_PORT", "4294967296", "MASTER_PORT='4294967296' is out of range: a port must be in [1, 65535]"},
        {"MASTER_PORT", "65536", "MASTER_PORT='65536' is out of range"},
        {"MASTER_PORT", "0", "MASTER_PORT='0' is out of range"},
        {"MASTER_PORT", "-29500", "MASTER_PORT='-29500' is out of range"},
    };
    for (const Case& c : cases) {
      CAPTURE(c.name);
      CAPTURE(c.value);
      EnvGuard one;
      one.set(c.name, c.value);
      CHECK_THROWS_WITH_AS(dist::options_from_env(), doctest::Contains(c.expected), sj::DistributedError);
      // The constructor reads the same variables: the same error, before any socket.
      CHECK_THROWS_WITH_AS(dist::ProcessGroup{}, doctest::Contains(c.expected), sj::DistributedError);
    }
    {
      EnvGuard two;
      two.set("WORLD_SIZE", "2");
      two.set("RANK", "2");
      CHECK_THROWS_WITH_AS(dist::options_from_env(),
                           doctest::Contains("RANK='2' is out of range: a rank must be in [0, 2) (world size 2 from "
                                             "WORLD_SIZE='2')"),
                           sj::DistributedError);
      dist::ProcessGroupOptions explicit_world;
      explicit_world.world_size = 3;  // WORLD_SIZE is not read: RANK is checked against 3
      CHECK(dist::options_from_env(explicit_world).rank == 2);
      explicit_world.world_size = 2;
      CHECK_THROWS_WITH_AS(dist::options_from_env(explicit_world),
                           doctest::Contains("RANK='2' is out of range: a rank must be in [0, 2) (world size 2)"),
                           sj::DistributedError);
    }
    // In range, the numbers come through unchanged.
    EnvGuard good;
    good.set("RANK", "3");
    good.set("WORLD_SIZE", "1048576");
    good.set("MASTER_PORT", "65535");
    const dist::ProcessGroupOptions o = dist::options_from_env();
    CHECK(o.rank == 3);
    CHECK(o.world_size == 1048576);
    CHECK(o.master_port == 65535);
    // Explicit options are checked the same way.
    dist::ProcessGroupOptions big;
    big.rank = 0;
    big.world_size = dist::kMaxWorldSize + 1;
    big.master_port = 1;
    CHECK_THROWS_WITH_AS(dist::ProcessGroup{big}, doctest::Contains("world size must be <= 1048576, got 1048577"),
                         sj::DistributedError);
    big.world_size = 1;
    big.timeout = dist::kMaxTimeout + std::chrono::milliseconds(1);
    CHECK_THROWS_WITH_AS(dist::ProcessGroup{big}, doctest::Contains("the timeout must be at most"),
                         sj::DistributedError);
  }

  TEST_CASE("two processes given rank 0: the second names the port held by another process") {
    CleanDistEnv env;
    dist::ProcessGroupOptions o = two_ranks_on_loopback(0, std::chrono::milliseconds(2000));
    // The first rank 0 hosts the store and waits for rank 1, which never comes.
    std::string first;
    std::thread first_rank0([&] { first = what_of([&] { dist::ProcessGroup g(o); }); });
    // Wait until it listens.
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (!dist::detail::port_in_use(o.master_port) && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const std::string second = what_of([&] { dist::ProcessGroup g(o); });
    first_rank0.join();
    INFO("second: ", second);
    INFO("first: ", first);
    CHECK(second.find("rank 0 of 2 (store tcp://127.0.0.1:" + std::to_string(o.master_port) + ", timeout 2 s)") !=
          std::string::npos);
    CHECK(second.find("cannot host the store: port " + std::to_string(o.master_port) +
                      " is in use: another process holds it (another rank 0") != std::string::npos);
    CHECK(first.find("not every rank arrived within the timeout: missing rank(s) 1") != std::string::npos);
    // A process that is no store, listening on 127.0.0.1 only, holds the port: the same
    // error at once (c10d alone would host on [::] and connect its client to that process).
    FakePeer other(true, std::nullopt, false);
    o.master_port = other.port();
    const auto t0 = Clock::now();
    const std::string held = what_of([&] { dist::ProcessGroup g(o); });
    INFO("held: ", held);
    CHECK(held.find("cannot host the store: port " + std::to_string(o.master_port) +
                    " is in use: another process holds it") != std::string::npos);
    CHECK(Clock::now() - t0 < std::chrono::milliseconds(2000));
  }

  TEST_CASE("a timeout too short is named as such") {
    CleanDistEnv env;
    // Rank 0 hosts the store (c10d's connect timeout, whole seconds, is no longer 0 s), then
    // rank 1 does not arrive within 1 ms.
    dist::ProcessGroupOptions o = two_ranks_on_loopback(0, std::chrono::milliseconds(1));
    std::string what = what_of([&] { dist::ProcessGroup g(o); });
    INFO(what);
    CHECK(what.find("timeout 0.001 s)") != std::string::npos);
    CHECK(what.find("not every rank arrived within the timeout: missing rank(s) 1 (a timeout of 0.001 s is "
                    "likely too short)") != std::string::npos);
    CHECK(what.find("cannot host") == std::string::npos);
    // Rank 1 with nothing listening: not reached within 1 ms, and the same hint.
    o.rank = 1;
    what = what_of([&] { dist::ProcessGroup g(o); });
    INFO(what);
    CHECK(what.find("cannot reach the master within the timeout") != std::string::npos);
    CHECK(what.find("(a timeout of 0.001 s is likely too short)") != std::string::npos);
  }
}
