// Data-parallel training of the main job's MLP on c10d Gloo (issue 16): step time,
// images/s, all-reduce time per step and the part of it hidden behind the backward, for
// world sizes 1, 2 and 4 on this machine (more ranks than cores are reported as
// oversubscribed). The driver starts each world size's ranks as copies of itself
// (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, as scripts/launch does); rank 0
// writes its measurements to a file the driver reads. Synthetic data (random images,
// the real job's shapes), so the bench needs no dataset. bench/data_parallel.md holds
// the numbers and what limits them.
//
// Usage: OPENBLAS_NUM_THREADS=1 build/bench/data_parallel [--steps N] [--batch-size B]
//        [--threads T] [--world-sizes 1,2,4]
#include <stagejit/distributed/data_parallel.hpp>
#include <stagejit/compiler.hpp>

#include "../examples/cli.hpp"
#include "../examples/mlp.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

namespace sj = stagejit;
namespace dist = stagejit::distributed;
using Clock = std::chrono::steady_clock;

struct Config {
  int steps = 200, warmup = 10;
  int threads = 1;  // ATen intra-op threads per rank
  int64_t batch = 128;
  std::vector<int> world_sizes = {1, 2, 4};
};

struct Layout {
  const char* name;
  double first_mb, cap_mb;
};
// DDP's defaults put the MLP's 0.9 MiB of gradients in one bucket, which can only start
// when the whole backward is done; small caps split it in three (last layer, middle,
// first layer), the first two can overlap the rest of the backward.
const Layout kLayouts[] = {{"default", 1.0, 25.0}, {"small", 0.004, 0.1}};
const char* kModes[] = {"compiled", "eager"};

// One rank: trains `steps` timed steps per mode and layout after `warmup` untimed ones;
// rank 0 appends one line per (mode, layout) to `out`.
int worker(const Config& c, const std::string& out_path) {
  at::set_num_threads(c.threads);
  auto group = std::make_shared<dist::ProcessGroup>();
  const int rank = group->rank(), world = group->world_size();
  const int64_t shard = c.batch / world;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  const at::Tensor images = at::randn({c.batch * 16, 784}, gen, at::kFloat);
  const at::Tensor labels = at::randint(0, 10, {c.batch * 16}, gen, at::kLong);
  std::ofstream out;
  if (rank == 0) out.open(out_path, std::ios::app);
  for (const char* mode : kModes) {
    for (const Layout& layout : kLayouts) {
      mlp::Params p = mlp::init_params(0);
      sj::variable_list w;
      for (const auto& t : p) w.emplace_back(t, true);
      dist::DataParallelOptions o;
      o.first_bucket_cap_mb = layout.first_mb;
      o.bucket_cap_mb = layout.cap_mb;
      dist::DataParallel dp(group, w, o);
      auto compiled = sj::compile(mlp::step_fn, {.derivatives = 1});
      mlp::Sgd sgd{0.01, 0.9, {}};
      const bool is_compiled = std::string(mode) == "compiled";
      auto step = [&](int s) {
        const int64_t begin = (s % 16) * c.batch + rank * shard;
        sj::variable_list in = {sj::Variable(images.narrow(0, begin, shard)),
                                sj::Variable(labels.narrow(0, begin, shard))};
        in.insert(in.end(), w.begin(), w.end());
        sj::Variable loss = (is_compiled ? compiled(in) : mlp::step_fn(in))[0];
        loss.backward();
        dp.finish();
        mlp::Params g;
        for (auto& v : w) {
          g.push_back(v.grad().data());
          v.set_grad(sj::Variable());
        }
        sgd.apply(p, g);
      };
      for (int s = 0; s < c.warmup; ++s) step(s);
      const auto before = dp.totals();
      const int64_t steps_before = dp.steps();
      const auto t0 = Clock::now();
      for (int s = 0; s < c.steps; ++s) step(s);
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      const auto after = dp.totals();
      const double n = double(dp.steps() - steps_before);
      if (rank == 0) {
        const double comm = (after.comm_seconds - before.comm_seconds) / n;
        const double hidden = (after.hidden_seconds - before.hidden_seconds) / n;
        out << world << ' ' << mode << ' ' << layout.name << ' ' << dp.bucket_indices().size() << ' '
            << 1e3 * secs / c.steps << ' ' << double(c.batch) * c.steps / secs << ' ' << 1e3 * comm << ' '
            << 1e3 * hidden << ' ' << 1e3 * (after.wait_seconds - before.wait_seconds) / n << ' '
            << 1e3 * (after.backward_seconds - before.backward_seconds) / n << '\n';
        out.flush();
      }
    }
  }
  return 0;
}

int free_port() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  close(s);
  return ntohs(a.sin_port);
}

// Runs `world` ranks of this program; false when one failed.
bool run_world(int world, char** argv, const std::string& out_path) {
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (kv.rfind("RANK=", 0) && kv.rfind("WORLD_SIZE=", 0) && kv.rfind("MASTER_", 0) &&
          kv.rfind("DP_BENCH_OUT=", 0))
        env.push_back(kv);
    }
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back("DP_BENCH_OUT=" + out_path);
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()) != 0) return false;
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  std::string sizes = "1,2,4";
  CLI::App app{"Data-parallel MLP training on c10d Gloo: step time, images/s, all-reduce time and overlap"};
  app.add_option("--steps", c.steps, "Timed steps per mode and bucket layout")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--batch-size", c.batch, "Global batch (split across the ranks)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", c.threads, "ATen intra-op threads per rank")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--world-sizes", sizes, "Comma-separated world sizes")->capture_default_str();
  if (auto status = stagejit_examples::parse_command_line(app, argc, argv)) return *status;
  c.world_sizes.clear();
  std::stringstream ss(sizes);
  for (std::string item; std::getline(ss, item, ',');) {
    // Each a whole number of ranks in [1, 256] (processes of this machine): no stoi
    // exception, no wrap-around, no world size 0 (a division by zero below).
    char* end = nullptr;
    errno = 0;
    const long long w = item.empty() || item[0] < '0' || item[0] > '9' ? 0 : std::strtoll(item.c_str(), &end, 10);
    if (end == nullptr || *end != '\0' || errno == ERANGE || w < 1 || w > 256) {
      std::fprintf(stderr, "error: --world-sizes '%s': '%s' is not a world size in [1, 256]\n", sizes.c_str(),
                   item.c_str());
      return 2;
    }
    c.world_sizes.push_back(static_cast<int>(w));
  }
  if (c.world_sizes.empty()) {
    std::fprintf(stderr, "error: --world-sizes '%s' names no world size\n", sizes.c_str());
    return 2;
  }

  try {
    if (const char* out = std::getenv("DP_BENCH_OUT")) return worker(c, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %s: %s\n", std::getenv("RANK"), e.what());
    return 1;
  }

  const unsigned cores = std::thread::hardware_concurrency();
  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("MLP 784-256-128-10, global batch %lld, %d timed steps (+%d warm-up) per row; %u cores; "
              "ATen threads per rank %d; OPENBLAS_NUM_THREADS=%s\n",
              (long long)c.batch, c.steps, c.warmup, cores, c.threads, blas ? blas : "(unset)");
  const std::string out_path = (std::filesystem::temp_directory_path() /
                                ("stagejit-dp-bench-" + std::to_string(getpid()) + ".txt")).string();
  std::printf("%5s %-9s %-8s %7s %9s %10s %14s %10s %9s %12s %12s\n", "ranks", "mode", "buckets", "n", "step ms",
              "images/s", "all-reduce ms", "hidden ms", "hidden", "finish() ms", "backward ms");
  for (int world : c.world_sizes) {
    if (c.batch % world != 0) {
      std::fprintf(stderr, "skipping world size %d: batch %lld is not a multiple\n", world, (long long)c.batch);
      continue;
    }
    std::filesystem::remove(out_path);
    if (!run_world(world, argv, out_path)) {
      std::fprintf(stderr, "world size %d failed\n", world);
      return 1;
    }
    std::ifstream in(out_path);
    std::string mode, layout;
    int ws = 0;
    std::size_t nb = 0;
    double step_ms, ips, comm, hidden, wait, backward;
    while (in >> ws >> mode >> layout >> nb >> step_ms >> ips >> comm >> hidden >> wait >> backward) {
      std::printf("%5d %-9s %-8s %7zu %9.3f %10.0f %14.3f %10.3f %8.0f%% %12.3f %12.3f%s\n", ws, mode.c_str(),
                  layout.c_str(), nb, step_ms, ips, comm, hidden, comm > 0 ? 100 * hidden / comm : 0.0, wait,
                  backward, unsigned(ws) > cores ? "  (oversubscribed)" : "");
    }
  }
  std::filesystem::remove(out_path);
  return 0;
}
