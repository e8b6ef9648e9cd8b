// Data-parallel training over c10d Gloo (issue 16): processes of this executable on
// loopback (children: test/child.hpp) train the main job's MLP, and their parameters are
// compared, after every step, with one process training on the whole batch.
#include <stagejit/distributed/data_parallel.hpp>
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../../examples/mlp.hpp"
#include "../child.hpp"

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace sj = stagejit;
namespace dist = stagejit::distributed;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kSteps = 4;
constexpr int64_t kBatch = 64;  // global batch; each of 2 ranks trains on 32
constexpr double kLr = 0.05, kMomentum = 0.9, kPenalty = 0.01;

// Small buckets so the MLP's gradients fill several (the defaults, 1 + 25 MiB, would put
// all 0.9 MiB in one).
dist::DataParallelOptions small_buckets() {
  dist::DataParallelOptions o;
  o.first_bucket_cap_mb = 0.004;
  o.bucket_cap_mb = 0.1;
  return o;
}

// The synthetic data of step s (the same on every rank): the global batch.
std::pair<at::Tensor, at::Tensor> batch(int s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
  at::Tensor x = at::randn({kBatch, 784}, gen, at::kFloat);
  at::Tensor y = at::randint(0, 10, {kBatch}, gen, at::kLong);
  return {x, y};
}

// One training step's loss on (x, y) for `mode`: "eager" and "compiled" the main job's
// step; "penalty" adds kPenalty * mean over the batch of |d sum(logits) / dx|^2 through a
// network compiled with two derivatives (the gradient-penalty sample's pattern), so the
// weights' gradient comes from the compiled double backward (stage 2) and stage 1.
struct Step {
  std::string mode;
  sj::CompiledFunction step = sj::compile(mlp::step_fn, {.derivatives = 1});
  sj::CompiledFunction net = sj::compile(
      [](const sj::variable_list& in) -> sj::variable_list {
        return {mlp::logits(in[0], sj::variable_list(in.begin() + 1, in.end()))};
      },
      {.derivatives = 2});

  sj::Variable loss(const at::Tensor& x, const at::Tensor& y, const sj::variable_list& w) {
    if (mode == "penalty") {
      sj::variable_list in{sj::Variable(x, /*requires_grad=*/true)};
      in.insert(in.end(), w.begin(), w.end());
      sj::Variable logits = net(in)[0];
      sj::Variable ones(at::ones_like(logits.data()));
      sj::Variable g = sj::grad({logits}, {in[0]}, {ones}, /*create_graph=*/true)[0];
      sj::Variable pen = sj::mul(sj::sum(sj::mul(g, g)), kPenalty / double(x.size(0)));
      return sj::add(sj::cross_entropy(logits, sj::Variable(y)), pen);
    }
    sj::variable_list in{sj::Variable(x), sj::Variable(y)};
    in.insert(in.end(), w.begin(), w.end());
    return mode == "eager" ? mlp::step_fn(in)[0] : step(in)[0];
  }
};

// Trains kSteps steps on rows [begin, begin + rows) of every global batch; after each
// step appends the parameters (float, in order) to `out` when open. With `dp`, the
// gradients are averaged over the ranks before the optimiser step.
void train(const std::string& mode, sj::variable_list& w, int64_t begin, int64_t rows,
           dist::DataParallel* dp, std::ofstream* out, int exit_after = -1, int hang_after = -1) {
  Step step{mode};
  mlp::Sgd sgd{kLr, kMomentum, {}};
  mlp::Params p;
  for (auto& v : w) p.push_back(v.data());
  for (int s = 0; s < kSteps; ++s) {
    if (s == exit_after) {
      std::fflush(nullptr);
      _exit(0);  // a rank that leaves early, without any goodbye
    }
    if (s == hang_after) {
      std::this_thread::sleep_for(std::chrono::seconds(30));  // alive, but never reaches the step
      _exit(0);
    }
    auto [x, y] = batch(s);
    step.loss(x.narrow(0, begin, rows).contiguous(), y.narrow(0, begin, rows).contiguous(), w).backward();
    if (dp) dp->finish();
    mlp::Params g;
    for (auto& v : w) {
      g.push_back(v.grad().data());
      v.set_grad(sj::Variable());
    }
    sgd.apply(p, g);
    if (out)
      for (const auto& t : p) out->write(reinterpret_cast<const char*>(t.data_ptr<float>()), t.numel() * 4);
  }
}

sj::variable_list leaves(const mlp::Params& p) {
  sj::variable_list w;
  for (const auto& t : p) w.emplace_back(t.clone(), /*requires_grad=*/true);
  return w;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// The child: rank RANK of WORLD_SIZE (torchrun's variables) trains its shard; rank 1
// starts from other weights, which the broadcast from rank 0 must replace. Exit status 0,
// or 3 with the error on stderr.
int dp_worker() {
  try {
    at::set_num_threads(1);
    dist::ProcessGroupOptions po;
    po.timeout = std::chrono::milliseconds(env_int("DP_TIMEOUT_MS", 20000));
    auto group = std::make_shared<dist::ProcessGroup>(po);
    mlp::Params init = mlp::init_params(7);
    if (group->rank() != 0)
      for (auto& t : init) t.add_(1.0);
    sj::variable_list w = leaves(init);
    dist::DataParallel dp(group, w, small_buckets());
    const int64_t rows = kBatch / group->world_size();
    std::ofstream out(std::getenv("DP_OUT"), std::ios::binary);
    train(std::getenv("DP_MODE"), w, group->rank() * rows, rows, &dp, &out, env_int("DP_EXIT_AFTER", -1),
          env_int("DP_HANG_AFTER", -1));
    const auto totals = dp.totals();
    // Every bucket of every step was started by the hooks, during the backward.
    const int expected = kSteps * static_cast<int>(dp.bucket_indices().size());
    if (totals.buckets_before_finish != expected) {
      std::fprintf(stderr, "rank %d: %d of %d buckets started during the backward\n", group->rank(),
                   totals.buckets_before_finish, expected);
      return 4;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 3;
  }
}
const stagejit::testing::RegisterChild register_dp_worker("dp-worker", &dp_worker);

int free_port() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  close(s);
  return ntohs(a.sin_port);
}

struct Child {
  pid_t pid = 0;
  fs::path err;
};

// Spawns this executable as the dp-worker of `rank` with `env` added; stderr to a file.
Child spawn_worker(int rank, int world, int port, const fs::path& dir, std::vector<std::string> env) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::vector<std::string> env_strings = stagejit::testing::child_environment("dp-worker", "DP_");
  env_strings.push_back("RANK=" + std::to_string(rank));
  env_strings.push_back("WORLD_SIZE=" + std::to_string(world));
  env_strings.push_back("MASTER_ADDR=127.0.0.1");
  env_strings.push_back("MASTER_PORT=" + std::to_string(port));
  env_strings.push_back("DP_OUT=" + (dir / ("params." + std::to_string(rank))).string());
  env_strings.push_back("OMP_NUM_THREADS=1");
  for (auto& e : env) env_strings.push_back(e);
  std::vector<char*> envp = stagejit::testing::env_pointers(env_strings);
  std::string arg0 = exe;
  char* argv[] = {arg0.data(), nullptr};
  Child c;
  c.err = dir / ("stderr." + std::to_string(rank));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, c.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(posix_spawn(&c.pid, exe.c_str(), &fa, nullptr, argv, envp.data()) == 0);
  posix_spawn_file_actions_destroy(&fa);
  return c;
}

// Ranks 0 and 1 training in `mode` with the given timeout; `rank1_env` (e.g.
// "DP_EXIT_AFTER=2") for rank 1 only.
std::vector<Child> spawn_pair(const fs::path& dir, int port, const std::string& mode, int timeout_ms,
                              const std::string& rank1_env) {
  std::vector<Child> kids;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> env{"DP_MODE=" + mode, "DP_TIMEOUT_MS=" + std::to_string(timeout_ms)};
    if (r == 1) env.push_back(rank1_env);
    kids.push_back(spawn_worker(r, 2, port, dir, env));
  }
  return kids;
}

// Waits for `c` until `deadline`; kills it past that (a hang) and returns -1.
int wait_until(const Child& c, Clock::time_point deadline) {
  int status = 0;
  while (true) {
    pid_t r = waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (Clock::now() > deadline) {
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("stagejit-dp-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A process group of this process alone, over a FileStore in `dir`.
std::shared_ptr<dist::ProcessGroup> single_rank_group(const fs::path& dir) {
  dist::ProcessGroupOptions f;
  f.rank = 0;
  f.world_size = 1;
  f.file_store = (dir / "store").string();
  f.timeout = std::chrono::milliseconds(2000);
  return std::make_shared<dist::ProcessGroup>(f);
}

// 2 ranks with batch kBatch/2 each against one process with kBatch, after every step.
void check_two_ranks_equal_one(const std::string& mode) {
  CAPTURE(mode);
  const fs::path dir = fresh_dir(mode);
  const int port = free_port();
  std::vector<Child> kids;
  for (int r = 0; r < 2; ++r) kids.push_back(spawn_worker(r, 2, port, dir, {"DP_MODE=" + mode}));

  // The reference, meanwhile: one process, the whole batch, no process group.
  sj::variable_list w = leaves(mlp::init_params(7));
  std::ofstream ref_out(dir / "params.ref", std::ios::binary);
  train(mode, w, 0, kBatch, nullptr, &ref_out);
  ref_out.close();

  const auto deadline = Clock::now() + std::chrono::seconds(120);
  for (int r = 0; r < 2; ++r) {
    const int status = wait_until(kids[r], deadline);
    INFO("rank ", r, " stderr: ", read_text(kids[r].err));
    REQUIRE(status == 0);
  }
  std::vector<int64_t> numels;
  for (const auto& t : mlp::init_params(7)) numels.push_back(t.numel());
  int64_t per_step = 0;
  for (auto n : numels) per_step += n;
  auto load = [&](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    at::Tensor t = at::empty({kSteps * per_step}, at::kFloat);
    in.read(reinterpret_cast<char*>(t.data_ptr<float>()), t.numel() * 4);
    REQUIRE(in.gcount() == t.numel() * 4);
    return t;
  };
  const at::Tensor ref = load(dir / "params.ref");
  double worst = 0;
  for (int r = 0; r < 2; ++r) {
    const at::Tensor got = load(dir / ("params." + std::to_string(r)));
    for (int s = 0; s < kSteps; ++s) {
      int64_t off = s * per_step;
      for (std::size_t k = 0; k < numels.size(); ++k) {
        const at::Tensor a = got.narrow(0, off, numels[k]), b = ref.narrow(0, off, numels[k]);
        const double err = (a - b).abs().max().item<double>(), scale = b.abs().max().item<double>();
        CAPTURE(r);
        CAPTURE(s);
        CAPTURE(k);
        CHECK(err <= 1e-6 * scale);  // 1e-6 relative (max |a - b| / max |b|), float
        worst = std::max(worst, err / scale);
        off += numels[k];
      }
    }
  }
  MESSAGE(mode, ": largest relative difference from the 1-process run over ", kSteps, " steps: ", worst);
  fs::remove_all(dir);
}

}  // namespace

TEST_SUITE("distributed") {
  TEST_CASE("2 ranks with half batches equal 1 process with the whole batch: eager steps") {
    check_two_ranks_equal_one("eager");
  }
  TEST_CASE("2 ranks with half batches equal 1 process with the whole batch: compiled steps") {
    check_two_ranks_equal_one("compiled");
  }
  TEST_CASE("2 ranks with half batches equal 1 process: compiled double backward (gradient penalty)") {
    check_two_ranks_equal_one("penalty");
  }

  TEST_CASE("a rank that exits early makes the other fail within the timeout, naming it") {
    const fs::path dir = fresh_dir("lost");
    const int port = free_port();
    const int timeout_ms = 3000;
    std::vector<Child> kids = spawn_pair(dir, port, "compiled", timeout_ms, "DP_EXIT_AFTER=2");
    const auto start = Clock::now();
    const int status1 = wait_until(kids[1], start + std::chrono::seconds(60));
    CHECK(status1 == 0);
    const auto lost_at = Clock::now();
    const int status0 = wait_until(kids[0], lost_at + std::chrono::milliseconds(2 * timeout_ms + 2000));
    const double after = std::chrono::duration<double>(Clock::now() - lost_at).count();
    const std::string err = read_text(kids[0].err);
    INFO("rank 0 stderr: ", err, " (exited ", after, " s after rank 1)");
    CHECK(status0 == 3);  // an error, not a hang (-1) or a crash
    CHECK(err.find("lost rank 1") != std::string::npos);
    CHECK(err.find("rank 0 of 2") != std::string::npos);
    CHECK(err.find("tcp://127.0.0.1:" + std::to_string(port)) != std::string::npos);
    CHECK(err.find("timeout 3 s") != std::string::npos);
    fs::remove_all(dir);
  }

  TEST_CASE("a rank that hangs makes the other fail after the timeout, not hang") {
    const fs::path dir = fresh_dir("hang");
    const int timeout_ms = 2000;
    std::vector<Child> kids = spawn_pair(dir, free_port(), "eager", timeout_ms, "DP_HANG_AFTER=1");
    const int status0 = wait_until(kids[0], Clock::now() + std::chrono::seconds(25));
    kill(kids[1].pid, SIGKILL);
    wait_until(kids[1], Clock::now() + std::chrono::seconds(5));
    const std::string err = read_text(kids[0].err);
    INFO("rank 0 stderr: ", err);
    CHECK(status0 == 3);  // an error within the timeout (plus set-up), not a hang (-1)
    CHECK(err.find("no rank was lost") != std::string::npos);
    CHECK(err.find("timeout 2 s") != std::string::npos);
    fs::remove_all(dir);
  }

  TEST_CASE("bad process-group input is a DistributedError naming what is wrong") {
    dist::ProcessGroupOptions o;
    o.master_addr = "127.0.0.1";
    o.master_port = free_port();
    o.timeout = std::chrono::milliseconds(1000);
    o.rank = 0;
    o.world_size = 0;
    CHECK_THROWS_WITH_AS(dist::ProcessGroup{o}, doctest::Contains("world size must be >= 1, got 0"),
                         sj::DistributedError);
    o.world_size = 2;
    o.rank = 2;
    CHECK_THROWS_WITH_AS(dist::ProcessGroup{o}, doctest::Contains("rank 2 is outside [0, 2)"), sj::DistributedError);
    o.rank = -1;  // from RANK, which must be an integer
    setenv("RANK", "one", 1);
    CHECK_THROWS_WITH_AS(dist::ProcessGroup{o}, doctest::Contains("RANK='one' is not an integer"),
                         sj::DistributedError);
    unsetenv("RANK");
    // Rank 1 with no master listening: the address and timeout are named.
    o.rank = 1;
    const auto t0 = Clock::now();
    const std::string unreachable = "rank 1 of 2 (store tcp://127.0.0.1:" + std::to_string(o.master_port) +
                                    ", timeout 1 s): cannot reach the master";
    CHECK_THROWS_WITH_AS(dist::ProcessGroup{o}, doctest::Contains(unreachable.c_str()), sj::DistributedError);
    CHECK(Clock::now() - t0 < std::chrono::seconds(10));
    // Rank 0 hosts the store, rank 1 never arrives.
    o.rank = 0;
    CHECK_THROWS_WITH_AS(dist::ProcessGroup{o}, doctest::Contains("not every rank arrived within the timeout: missing rank(s) 1"),
                         sj::DistributedError);
    // A FileStore works too; world size 1 needs no peer.
    const fs::path dir = fresh_dir("file");
    auto group = single_rank_group(dir);
    CHECK(group->store_address() == "file://" + (dir / "store").string());
    at::Tensor t = at::arange(4, at::kFloat);
    group->allreduce(t);
    CHECK(at::equal(t, at::arange(4, at::kFloat)));
    // DataParallel's own checks.
    sj::Variable w(at::ones({3}), true);
    CHECK_THROWS_WITH_AS(dist::DataParallel(group, {}), doctest::Contains("no parameters"), sj::DistributedError);
    CHECK_THROWS_WITH_AS(dist::DataParallel(group, {w, w}), doctest::Contains("parameter 1 is parameter 0 again"),
                         sj::DistributedError);
    CHECK_THROWS_WITH_AS(dist::DataParallel(group, {sj::Variable(at::ones({3}))}),
                         doctest::Contains("not a leaf Variable requiring grad"), sj::DistributedError);
    fs::remove_all(dir);
  }

  TEST_CASE("buckets follow DDP: reverse order, a small first bucket, then the cap") {
    const fs::path dir = fresh_dir("buckets");
    auto group = single_rank_group(dir);
    sj::variable_list w = leaves(mlp::init_params(7));  // W1 784 KiB, W2 128 KiB, W3 5 KiB
    {
      dist::DataParallel dp(group, w);  // defaults: 1 MiB first, then 25 MiB: one bucket
      CHECK(dp.bucket_indices() == std::vector<std::vector<std::size_t>>{{5, 4, 3, 2, 1, 0}});
    }
    dist::DataParallel dp(group, w, small_buckets());  // 4 KiB first, then 100 KiB
    CHECK(dp.bucket_indices() == std::vector<std::vector<std::size_t>>{{5, 4}, {3, 2}, {1, 0}});
    fs::remove_all(dir);
  }

  TEST_CASE("unused parameters: refused by default, zero contribution with find_unused_parameters") {
    const fs::path dir = fresh_dir("unused");
    auto group = single_rank_group(dir);
    sj::Variable a(at::ones({2}), true), b(at::ones({3}), true);
    {
      dist::DataParallel dp(group, {a, b});
      sj::sum(sj::mul(a, a)).backward();
      CHECK_THROWS_WITH_AS(dp.finish(), doctest::Contains("no gradient this step for parameter(s) 1 [3]"),
                           sj::DistributedError);
      a.set_grad(sj::Variable());
      // A parameter that receives two gradients in one step is refused in the backward.
      sj::sum(sj::mul(a, a)).backward();
      CHECK_THROWS_WITH_AS(sj::sum(a).backward(), doctest::Contains("second gradient in one step"),
                           sj::DistributedError);
    }
    a.set_grad(sj::Variable());
    dist::DataParallelOptions o;
    o.find_unused_parameters = true;
    dist::DataParallel dp(group, {a, b}, o);
    sj::sum(sj::mul(a, a)).backward();
    dp.finish();
    CHECK(at::equal(a.grad().data(), at::full({2}, 2.0f)));
    CHECK_FALSE(b.grad().defined());  // no rank used b: its grad stays untouched
    CHECK(dp.steps() == 1);
    fs::remove_all(dir);
  }
}
