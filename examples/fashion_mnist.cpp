// The main job: train a Fashion-MNIST classifier (MLP 784-256-128-10, ReLU, cross-entropy,
// SGD with momentum; or with --model cnn the CNN of examples/cnn.hpp, issue 19) with the
// training step - forward, loss and backward - run through stagejit::compile(),
// stagejit's eager autograd (--eager) or libtorch's autograd (--libtorch), from the same
// initial weights and the same batches (issue 7). The CNN's dropout masks are drawn from
// ATen's default generator seeded per step, so every mode draws the same masks.
//
// With --world-size N (or torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as
// scripts/launch sets them) it trains data-parallel on c10d Gloo (issue 16): every rank
// takes its shard of each global batch, the gradients are averaged by
// stagejit::distributed::DataParallel while the backward runs, and rank 0 prints.
//
// Data: the gzipped IDX files of Debian's `dataset-fashion-mnist` package.

#include <stagejit/compiler.hpp>
#if defined(STAGEJIT_HAVE_DISTRIBUTED)
#include <stagejit/distributed/data_parallel.hpp>
#endif

#include "cli.hpp"
#include "cnn.hpp"
#include "mlp.hpp"

#include <ATen/record_function.h>
#include <CLI/CLI.hpp>
#include <zlib.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace sj = stagejit;

namespace {

constexpr const char* kPackage = "dataset-fashion-mnist";
constexpr int kSkipExitCode = 77;  // Meson's "test skipped"

// ------------------------------------------------------------------ IDX files

/// A dataset file is missing, unreadable or malformed.
struct DatasetError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Split {
  at::Tensor images;  // [n, 784] float, normalised
  at::Tensor labels;  // [n] int64 in [0, 10)
};

/// Reads a whole gzip file (zlib reads plain files transparently too).
std::vector<uint8_t> read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr)
    throw DatasetError("cannot open " + path + ": " + std::strerror(errno));
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> chunk(1 << 20);
  for (;;) {
    int n = gzread(f, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) {
      int code = 0;
      std::string msg = gzerror(f, &code);
      gzclose(f);
      throw DatasetError("cannot decompress " + path + ": " + msg);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + n);
  }
  gzclose(f);
  return bytes;
}

uint32_t be32(const std::vector<uint8_t>& b, std::size_t at) {
  return (uint32_t(b[at]) << 24) | (uint32_t(b[at + 1]) << 16) | (uint32_t(b[at + 2]) << 8) |
         uint32_t(b[at + 3]);
}

/// Parses an IDX file: checks the magic number, the dimension sizes and that the payload
/// has exactly the size the header announces. Returns the payload.
std::vector<uint8_t> read_idx(const std::string& path, uint32_t magic,
                              const std::vector<uint32_t>& inner_dims, uint32_t& count) {
  std::vector<uint8_t> b = read_gzip(path);
  const std::size_t header = 4 + 4 * (1 + inner_dims.size());
  auto bad = [&](const std::string& why) {
    return DatasetError(path + " is not a valid IDX file: " + why);
  };
  if (b.size() < header) throw bad("only " + std::to_string(b.size()) + " bytes");
  if (be32(b, 0) != magic)
    throw bad("magic number " + std::to_string(be32(b, 0)) + ", expected " +
              std::to_string(magic));
  count = be32(b, 4);
  std::size_t item = 1;
  for (std::size_t i = 0; i < inner_dims.size(); ++i) {
    uint32_t d = be32(b, 8 + 4 * i);
    if (d != inner_dims[i])
      throw bad("dimension " + std::to_string(i + 1) + " is " + std::to_string(d) +
                ", expected " + std::to_string(inner_dims[i]));
    item *= d;
  }
  const std::size_t expected = header + std::size_t(count) * item;
  if (b.size() != expected)
    throw bad(std::to_string(b.size()) + " bytes, the header announces " +
              std::to_string(expected) + " (" + std::to_string(count) + " items)");
  return std::vector<uint8_t>(b.begin() + header, b.end());
}

Split load_split(const std::string& dir, const std::string& prefix) {
  const std::string img_path = dir + "/" + prefix + "-images-idx3-ubyte.gz";
  const std::string lbl_path = dir + "/" + prefix + "-labels-idx1-ubyte.gz";
  uint32_t n_img = 0, n_lbl = 0;
  auto pixels = read_idx(img_path, 2051, {28, 28}, n_img);
  auto labels = read_idx(lbl_path, 2049, {}, n_lbl);
  if (n_img != n_lbl)
    throw DatasetError(img_path + " holds " + std::to_string(n_img) + " images but " + lbl_path +
                       " holds " + std::to_string(n_lbl) + " labels");
  if (n_img == 0) throw DatasetError(img_path + " holds no images");
  for (uint8_t l : labels)
    if (l >= 10)
      throw DatasetError(lbl_path + " holds label " + std::to_string(l) + ", expected 0..9");
  Split s;
  auto raw = at::from_blob(pixels.data(), {int64_t(n_img), 784}, at::kByte);
  // Scale to [0, 1], then standardise with the training set's mean and std (0.2860, 0.3530).
  s.images = ((raw.to(at::kFloat) / 255.0) - 0.2860) / 0.3530;
  s.labels = at::from_blob(labels.data(), {int64_t(n_lbl)}, at::kByte).to(at::kLong);
  return s;
}

// ------------------------------------------------------------------ the models

// The MLP, its initialisation, the step and SGD: examples/mlp.hpp; the CNN:
// examples/cnn.hpp.
using mlp::Params;
using mlp::Sgd;

/// Which network is trained: the MLP, or the CNN (with batch norm when `cnn.batch_norm`).
struct Model {
  bool is_cnn = false;
  cnn::Config cnn;

  std::string describe() const {
    if (!is_cnn) return "MLP 784-256-128-10";
    return std::string("CNN conv5x5(32)") + (cnn.batch_norm ? "-BN" : "") + "-pool-conv5x5(64)" +
           (cnn.batch_norm ? "-BN" : "") + "-pool-fc256-dropout" + std::to_string(cnn.dropout).substr(0, 4) +
           "-fc10";
  }
  Params init_params(uint64_t seed) const {
    return is_cnn ? cnn::init_params(seed, cnn.batch_norm) : mlp::init_params(seed);
  }
  std::vector<std::string> param_names() const {
    if (!is_cnn) return {"W1", "b1", "W2", "b2", "W3", "b3"};
    if (cnn.batch_norm)
      return {"conv1.W", "conv1.b", "bn1.W", "bn1.b", "conv2.W", "conv2.b", "bn2.W", "bn2.b", "fc1.W", "fc1.b", "fc2.W", "fc2.b"};
    return {"conv1.W", "conv1.b", "conv2.W", "conv2.b", "fc1.W", "fc1.b", "fc2.W", "fc2.b"};
  }
};

at::Tensor mlp_torch_loss(const std::vector<at::Tensor>& in) {
  auto h1 = at::relu(at::addmm(in[3], in[0], in[2].t()));
  auto h2 = at::relu(at::addmm(in[5], h1, in[4].t()));
  auto logits = at::addmm(in[7], h2, in[6].t());
  return at::cross_entropy_loss(logits, in[1]);
}

double test_accuracy(const Model& m, const Params& p, cnn::RunningStats& stats, const Split& test) {
  if (m.is_cnn) return cnn::accuracy(m.cnn, p, stats, test.images, test.labels);
  at::NoGradGuard no_grad;
  auto h1 = at::relu(at::addmm(p[1], test.images, p[0].t()));
  auto h2 = at::relu(at::addmm(p[3], h1, p[2].t()));
  auto logits = at::addmm(p[5], h2, p[4].t());
  auto correct = logits.argmax(1).eq(test.labels).sum().item<int64_t>();
  return double(correct) / double(test.labels.size(0));
}

/// The seed of ATen's default generator before step `step` of epoch `epoch` (every mode
/// seeds the same way, so the CNN's dropout draws the same masks in every mode).
uint64_t step_seed(uint64_t seed, int epoch, int64_t step) {
  return seed * 1000003u + uint64_t(epoch) * 100003u + uint64_t(step) + 1;
}

// ------------------------------------------------------------------ steppers

enum class Mode { Compiled, Eager, Libtorch };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::Compiled: return "compiled";
    case Mode::Eager: return "eager";
    case Mode::Libtorch: return "libtorch";
  }
  return "?";
}

/// Computes the loss and the parameter gradients of one batch in one of the three ways.
/// The CNN's training step updates the batch norms' running statistics `*stats` in place
/// (in every mode, the compiled one included: ATen's rule).
class Stepper {
 public:
  Stepper(Mode mode, const Model& model, cnn::RunningStats* stats)
      : mode_(mode), model_(model), stats_(stats),
        compiled_(sj::compile([this](const sj::variable_list& in) { return step_fn(in); }, {.derivatives = 1})) {}
  Stepper(const Stepper&) = delete;
  Stepper& operator=(const Stepper&) = delete;

  /// The traced training step: in = {x [B,784] float, target [B] int64, params...};
  /// returns {mean cross-entropy loss}.
  sj::variable_list step_fn(const sj::variable_list& in) const {
    if (!model_.is_cnn) return mlp::step_fn(in);
    const sj::variable_list w(in.begin() + 2, in.end());
    return {sj::cross_entropy(cnn::logits(model_.cnn, in[0], w, *stats_, /*train=*/true), in[1])};
  }

  /// Returns the loss; `grads` receives dloss/dparam in the order of Params.
  double step(const at::Tensor& x, const at::Tensor& y, const Params& p, Params& grads) {
    if (mode_ == Mode::Libtorch) {
      std::vector<at::Tensor> in = {x, y};
      std::vector<at::Tensor> leaves;
      for (const auto& t : p) leaves.push_back(t.detach().requires_grad_(true));
      in.insert(in.end(), leaves.begin(), leaves.end());
      auto loss = model_.is_cnn
                      ? at::cross_entropy_loss(cnn::logits(model_.cnn, x, leaves, *stats_, /*train=*/true), y)
                      : mlp_torch_loss(in);
      auto g = torch::autograd::grad({loss}, leaves);
      grads.assign(g.begin(), g.end());
      return loss.item<double>();
    }
    sj::variable_list in = {sj::Variable(x), sj::Variable(y)};
    sj::variable_list leaves;
    for (const auto& t : p) leaves.emplace_back(t, /*requires_grad=*/true);
    in.insert(in.end(), leaves.begin(), leaves.end());
    sj::variable_list out = mode_ == Mode::Compiled ? compiled_(in) : step_fn(in);
    auto g = sj::grad({out[0]}, leaves);
    grads.clear();
    for (const auto& v : g) grads.push_back(v.data());
    return out[0].data().item<double>();
  }

  std::string graph(const at::Tensor& x, const at::Tensor& y, const Params& p) {
    return sj::ir::to_string(*graph_for(x, y, p));
  }

  sj::CompiledFunction::Stats stats() const { return compiled_.stats(); }

  /// The compiled step's optimised graph for these inputs (fusion groups and all).
  std::shared_ptr<const sj::ir::Graph> graph_for(const at::Tensor& x, const at::Tensor& y, const Params& p) {
    sj::variable_list in = {sj::Variable(x), sj::Variable(y)};
    for (const auto& t : p) in.emplace_back(t, true);
    return compiled_.graph_for(in);
  }

  /// The data-parallel step: this rank's loss on its shard, `backward()` into the
  /// parameters' grads, whose buckets DataParallel all-reduces while the backward runs,
  /// then `finish()`; `grads` receives the averaged gradients.
  template <class DataParallel>
  double step_data_parallel(const at::Tensor& x, const at::Tensor& y, const sj::variable_list& leaves,
                            DataParallel& dp, Params& grads) {
    sj::variable_list in = {sj::Variable(x), sj::Variable(y)};
    in.insert(in.end(), leaves.begin(), leaves.end());
    sj::Variable loss = (mode_ == Mode::Compiled ? compiled_(in) : step_fn(in))[0];
    loss.backward();
    dp.finish();
    grads.clear();
    for (const auto& v : leaves) {
      grads.push_back(v.grad().data());
      v.set_grad(sj::Variable());
    }
    return loss.data().item<double>();
  }

 private:
  Mode mode_;
  const Model& model_;
  cnn::RunningStats* stats_;
  sj::CompiledFunction compiled_;
};

#if defined(STAGEJIT_HAVE_DISTRIBUTED)
namespace dist = sj::distributed;
#endif

/// The data-parallel side of a run (--world-size > 1): the process group and, per
/// trainer, the DataParallel over its parameters.
struct Distributed {
  int rank = 0, world_size = 1;
#if defined(STAGEJIT_HAVE_DISTRIBUTED)
  std::shared_ptr<dist::ProcessGroup> group;
#endif
  bool active() const { return world_size > 1; }
};

// ------------------------------------------------------------------ training loop

struct Options {
  std::string model = "mlp";
  bool batch_norm = false;
  int epochs = 2;
  int64_t batch_size = 128;
  double lr = 0.05;
  std::string lr_schedule = "constant";
  double momentum = 0.9;
  int threads = 0;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  uint64_t seed = 0;
  std::string metrics;
  bool print_graph = false;
  int64_t limit = 0;
  int warmup = 5;
  bool eager = false, libtorch = false, compare = false;
  int check_gradients = 0;
  bool skip_missing = false;
  int world_size = 0;   // 0: WORLD_SIZE, else 1
  int rank = -1;        // -1: RANK, else 0
  double timeout = 30;  // seconds, for the process group
  double bucket_cap_mb = 25, first_bucket_cap_mb = 1;
};

struct EpochResult {
  int epoch;
  double train_loss, test_accuracy, images_per_s, seconds;
};

struct RunResult {
  Mode mode;
  std::vector<EpochResult> epochs;
  // Data-parallel runs: per-step means over the run (seconds) and buckets per step.
  int64_t dp_steps = 0;
  double dp_backward = 0, dp_comm = 0, dp_hidden = 0, dp_wait = 0;
  std::size_t dp_buckets = 0;
};

std::string fmt_duration(double s) {
  char buf[32];
  if (s >= 60)
    std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  else
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

void progress_bar(const char* mode, int epoch, int epochs, int64_t done, int64_t total,
                  double loss, double ips, double eta) {
  const int width = 30;
  int filled = total ? int(width * done / total) : width;
  std::string bar(filled, '#');
  bar.resize(width, '.');
  std::printf("\r[%s] epoch %d/%d [%s] %3d%%  loss %.4f  %7.0f img/s  ETA %s   ", mode, epoch,
              epochs, bar.c_str(), int(100 * done / std::max<int64_t>(total, 1)), loss, ips,
              fmt_duration(eta).c_str());
  std::fflush(stdout);
}

/// The learning rate of step `k` (from 0) of `total`: --lr throughout, or with
/// `--lr-schedule linear` decayed linearly from --lr to --lr / total over the run.
double scheduled_lr(const Options& o, int64_t k, int64_t total) {
  if (o.lr_schedule != "linear" || total <= 0) return o.lr;
  return o.lr * double(total - k) / double(total);
}

/// Trains from `init` in `mode`, one epoch per call of `epoch()`; the batch order depends
/// only on the seed, so every mode sees the same batches in the same order.
class Trainer {
 public:
  Trainer(Mode mode, const Options& o, const Model& model, const Params& init, const Split& train_set,
          const Split& test_set, const Distributed& d)
      : mode_(mode), o_(o), model_(model), train_(train_set), test_(test_set), sgd_{o.lr, o.momentum, {}},
        stats_(cnn::RunningStats::initial(model.is_cnn && model.cnn.batch_norm)),
        stepper_(mode, model_, &stats_), rng_(o.seed), result_{mode, {}}, d_(d) {
    for (const auto& t : init) p_.push_back(t.clone());
    // The last partial batch of each epoch is dropped (as DataLoader(drop_last=True)):
    // every step then has one shape, so compile() traces once.
    steps_ = train_.images.size(0) / o.batch_size;
    order_.resize(static_cast<std::size_t>(train_.images.size(0)));
    // Data-parallel: this rank's shard of every global batch (the same shuffle on every
    // rank: the order depends only on the seed).
    shard_ = o.batch_size / d.world_size;
    x_ = at::empty({shard_, train_.images.size(1)}, train_.images.options());
    y_ = at::empty({shard_}, train_.labels.options());
#if defined(STAGEJIT_HAVE_DISTRIBUTED)
    if (d.active()) {
      for (const auto& t : p_) leaves_.emplace_back(t, /*requires_grad=*/true);  // share p_'s storage
      dist::DataParallelOptions dpo;
      dpo.bucket_cap_mb = o.bucket_cap_mb;
      dpo.first_bucket_cap_mb = o.first_bucket_cap_mb;
      dp_ = std::make_unique<dist::DataParallel>(d.group, leaves_, dpo);
    }
#endif
  }

  bool printer() const { return d_.rank == 0; }

  /// Untimed steps on a scratch copy of the weights: one-time costs (the trace and kernel
  /// compile of the compiled step, first-touch memory) stay out of images/s, and the
  /// weights and optimizer state are untouched.
  void warmup() {
    if (printer())
      std::printf("[%s] %lld steps of %lld images per epoch%s\n", mode_name(mode_), (long long)steps_,
                  (long long)o_.batch_size,
                  d_.active() ? (" (" + std::to_string(d_.world_size) + " ranks x " + std::to_string(shard_) + ")").c_str()
                              : "");
    if (o_.warmup <= 0 || steps_ <= 0) return;
    // Local steps only (on scratch leaves, no DataParallel hooks): every rank pays its own
    // trace and compile here.
    Params scratch, scratch_grads;
    for (const auto& t : p_) scratch.push_back(t.clone());
    auto x = train_.images.narrow(0, 0, shard_).clone();
    auto y = train_.labels.narrow(0, 0, shard_).clone();
    // The running statistics are updated in place by the steps: restored afterwards.
    const cnn::RunningStats saved = stats_.clone();
    auto w0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o_.warmup; ++i) stepper_.step(x, y, scratch, scratch_grads);
    for (std::size_t i = 0; i < saved.tensors.size(); ++i) stats_.tensors[i].copy_(saved.tensors[i]);
    if (!printer()) return;
    std::printf("[%s] %d warm-up step(s): %.0f ms%s\n", mode_name(mode_), o_.warmup,
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count(),
                mode_ == Mode::Compiled ? " (includes the trace and compile)" : "");
  }

  /// Trains one epoch (the next one) and evaluates on the test set.
  void epoch() {
    const int epoch = static_cast<int>(result_.epochs.size()) + 1;
    const bool tty = isatty(1) && printer();
    const int64_t n = train_.images.size(0);
    std::iota(order_.begin(), order_.end(), 0);
    std::shuffle(order_.begin(), order_.end(), rng_);
    auto perm = at::from_blob(order_.data(), {n}, at::kLong).clone();
    double loss_sum = 0;
    Params grads;
    auto t0 = std::chrono::steady_clock::now();
    auto last_draw = t0;
    for (int64_t s = 0; s < steps_; ++s) {
      auto idx = perm.narrow(0, s * o_.batch_size + d_.rank * shard_, shard_);
      // Gathered into the same two buffers every step (all modes), as a data loader with
      // reused batch memory does: no fresh 400 KB allocation per step.
      at::index_select_out(x_, train_.images, 0, idx);
      at::index_select_out(y_, train_.labels, 0, idx);
      if (model_.is_cnn) at::manual_seed(step_seed(o_.seed, epoch, s) + uint64_t(d_.rank) * 7919u);
      double loss = step(grads);
      if (!std::isfinite(loss))
        throw std::runtime_error("training diverged: loss " + std::to_string(loss) +
                                 " at epoch " + std::to_string(epoch) + " step " +
                                 std::to_string(s) + " (try a smaller --lr)");
      loss_sum += loss;
      sgd_.lr = scheduled_lr(o_, (epoch - 1) * steps_ + s, o_.epochs * steps_);
      sgd_.apply(p_, grads);
      auto now = std::chrono::steady_clock::now();
      if (tty && (now - last_draw > std::chrono::milliseconds(100) || s + 1 == steps_)) {
        last_draw = now;
        double el = std::chrono::duration<double>(now - t0).count();
        double ips = double((s + 1) * o_.batch_size) / el;
        double eta = el / double(s + 1) * double(steps_ - s - 1);
        progress_bar(mode_name(mode_), epoch, o_.epochs, s + 1, steps_, loss_sum / double(s + 1),
                     ips, eta);
      }
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (tty) std::printf("\n");
    // Data-parallel: the train loss is rank 0's shard's; every rank holds the same
    // weights, so rank 0 alone measures the test accuracy.
    EpochResult r{epoch, loss_sum / double(std::max<int64_t>(steps_, 1)),
                  printer() ? test_accuracy(model_, p_, stats_, test_) : 0.0, double(steps_ * o_.batch_size) / secs, secs};
    result_.epochs.push_back(r);
    if (!printer()) return;
    std::printf("[%s] epoch %d/%d  train loss %.4f  test accuracy %.2f%%  %.0f images/s  %.2fs\n",
                mode_name(mode_), epoch, o_.epochs, r.train_loss, 100 * r.test_accuracy,
                r.images_per_s, r.seconds);
    std::fflush(stdout);
  }

  /// The epochs so far (and, for the compiled step, its compile-cache counts printed).
  RunResult finish() {
#if defined(STAGEJIT_HAVE_DISTRIBUTED)
    if (dp_) {
      const auto t = dp_->totals();
      result_.dp_steps = dp_->steps();
      result_.dp_backward = t.backward_seconds;
      result_.dp_comm = t.comm_seconds;
      result_.dp_hidden = t.hidden_seconds;
      result_.dp_wait = t.wait_seconds;
      result_.dp_buckets = dp_->bucket_indices().size();
    }
#endif
    if (mode_ == Mode::Compiled && printer()) {
      auto st = stepper_.stats();
      std::printf("[compiled] compile cache: %zu miss(es), %zu hit(s)\n", st.misses, st.hits);
    }
    return result_;
  }

 private:
  Mode mode_;
  const Options& o_;
  const Model& model_;
  const Split& train_;
  const Split& test_;
  Params p_;
  Sgd sgd_;
  cnn::RunningStats stats_;
  Stepper stepper_;
  std::mt19937_64 rng_;
  RunResult result_;
  const Distributed& d_;
  int64_t steps_ = 0, shard_ = 0;
  std::vector<int64_t> order_;
  at::Tensor x_, y_;
  sj::variable_list leaves_;
#if defined(STAGEJIT_HAVE_DISTRIBUTED)
  std::unique_ptr<dist::DataParallel> dp_;
#endif

  double step(Params& grads) {
#if defined(STAGEJIT_HAVE_DISTRIBUTED)
    if (dp_) return stepper_.step_data_parallel(x_, y_, leaves_, *dp_, grads);
#endif
    return stepper_.step(x_, y_, p_, grads);
  }
};

/// Trains every mode of `modes` for `o.epochs` epochs. With several modes the epochs are
/// interleaved (epoch 1 of each mode, then epoch 2 of each, the order rotating by one
/// every epoch), so a machine that gets faster or slower during the run (frequency,
/// other load) shifts every mode alike instead of whichever mode ran last.
std::vector<RunResult> train_all(const std::vector<Mode>& modes, const Options& o, const Model& model,
                                 const Params& init, const Split& train_set, const Split& test_set,
                                 const Distributed& d) {
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (Mode m : modes) {
    trainers.push_back(std::make_unique<Trainer>(m, o, model, init, train_set, test_set, d));
    trainers.back()->warmup();
  }
  for (int epoch = 0; epoch < o.epochs; ++epoch)
    for (std::size_t k = 0; k < trainers.size(); ++k)
      trainers[(k + static_cast<std::size_t>(epoch)) % trainers.size()]->epoch();
  std::vector<RunResult> runs;
  for (const auto& t : trainers) runs.push_back(t->finish());
  return runs;
}

void write_metrics(const std::string& path, const std::vector<RunResult>& runs) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write metrics file " + path);
  const bool many = runs.size() > 1;
  f << (many ? "mode," : "") << "epoch,train_loss,test_accuracy,images_per_s,seconds\n";
  for (const auto& run : runs)
    for (const auto& e : run.epochs) {
      if (many) f << mode_name(run.mode) << ',';
      f << e.epoch << ',' << e.train_loss << ',' << e.test_accuracy << ',' << e.images_per_s
        << ',' << e.seconds << '\n';
    }
}

void print_summary(const std::vector<RunResult>& runs) {
  std::printf("\nSummary\n");
  std::printf("%-10s %5s %11s %14s %12s %9s\n", "mode", "epoch", "train loss", "test accuracy",
              "images/s", "seconds");
  for (const auto& run : runs)
    for (const auto& e : run.epochs)
      std::printf("%-10s %5d %11.4f %13.2f%% %12.0f %9.2f\n", mode_name(run.mode), e.epoch,
                  e.train_loss, 100 * e.test_accuracy, e.images_per_s, e.seconds);
  for (const auto& run : runs) {
    if (run.dp_steps == 0) continue;
    // Data-parallel: per-step means on rank 0 (Note [Gradient buckets] and DataParallelStepStats).
    const double n = double(run.dp_steps), comm = run.dp_comm / n;
    std::printf("\n%-10s %9s %13s %13s %12s %13s %8s\n", "mode", "buckets", "backward ms", "all-reduce ms",
                "hidden ms", "finish() ms", "overlap");
    std::printf("%-10s %9zu %13.3f %13.3f %12.3f %13.3f %7.0f%%\n", mode_name(run.mode), run.dp_buckets,
                1e3 * run.dp_backward / n, 1e3 * comm, 1e3 * run.dp_hidden / n, 1e3 * run.dp_wait / n,
                comm > 0 ? 100 * run.dp_hidden / run.dp_comm : 0.0);
  }
  if (runs.size() > 1) {
    // Throughput over all epochs (total images / total seconds), relative to libtorch.
    double base = 0;
    std::vector<double> ips;
    for (const auto& run : runs) {
      double imgs = 0, secs = 0;
      for (const auto& e : run.epochs) {
        imgs += e.images_per_s * e.seconds;
        secs += e.seconds;
      }
      ips.push_back(imgs / secs);
      if (run.mode == Mode::Libtorch) base = ips.back();
    }
    std::printf("\n%-10s %12s %12s\n", "mode", "images/s", "vs libtorch");
    for (std::size_t i = 0; i < runs.size(); ++i)
      std::printf("%-10s %12.0f %11.2fx\n", mode_name(runs[i].mode), ips[i],
                  base > 0 ? ips[i] / base : 0.0);
  }
}

// ------------------------------------------------------------------ where the time goes

// ATen RecordFunction callbacks for the --compare profile: ATen calls per step and the
// time inside convolutions (forward and backward, the outermost call of nested ones).
std::atomic<int64_t> g_aten_calls{0}, g_conv_ns{0};
thread_local int t_conv_depth = 0;

struct ConvContext : at::ObserverContext {
  std::chrono::steady_clock::time_point start;
};

bool is_convolution(const char* name) { return std::strstr(name, "conv") != nullptr; }

std::unique_ptr<at::ObserverContext> profile_start(const at::RecordFunction& fn) {
  ++g_aten_calls;
  if (!is_convolution(fn.name()) || t_conv_depth++ > 0) return nullptr;
  auto ctx = std::make_unique<ConvContext>();
  ctx->start = std::chrono::steady_clock::now();
  return ctx;
}

void profile_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (!is_convolution(fn.name())) return;
  --t_conv_depth;
  if (auto* c = static_cast<ConvContext*>(ctx))
    g_conv_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - c->start).count();
}

/// After --compare: a few untimed steps of each mode with ATen's RecordFunction on (it
/// adds a little to every ATen call): time per step, the share inside convolution kernels
/// (the floor no compiler of this step removes: the same ATen convolutions run in every
/// mode), ATen calls per step, and what the compiled step fused.
void print_profile(const std::vector<Mode>& modes, const Options& o, const Model& model, const Params& init,
                   const Split& train_set) {
  constexpr int kSteps = 8;
  const auto x = train_set.images.narrow(0, 0, o.batch_size).clone();
  const auto y = train_set.labels.narrow(0, 0, o.batch_size).clone();
  std::printf("\nWhere the time goes (%d untimed steps per mode, ATen RecordFunction on)\n", kSteps);
  std::printf("%-10s %10s %16s %7s %16s\n", "mode", "ms/step", "convolution ms", "share", "ATen calls/step");
  std::shared_ptr<const sj::ir::Graph> graph;
  for (Mode m : modes) {
    cnn::RunningStats stats = cnn::RunningStats::initial(model.is_cnn && model.cnn.batch_norm);
    Stepper stepper(m, model, &stats);
    Params p = init, g;
    for (int i = 0; i < 2; ++i) stepper.step(x, y, p, g);  // trace, compile, first touch
    if (m == Mode::Compiled) graph = stepper.graph_for(x, y, p);
    g_aten_calls = 0;
    g_conv_ns = 0;
    auto handle = at::addGlobalCallback(at::RecordFunctionCallback(profile_start, profile_end));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kSteps; ++i) {
      at::manual_seed(step_seed(o.seed, 0, i));
      stepper.step(x, y, p, g);
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / kSteps;
    at::removeCallback(handle);
    const double conv_ms = double(g_conv_ns.load()) * 1e-6 / kSteps;
    std::printf("%-10s %10.2f %16.2f %6.1f%% %16lld\n", mode_name(m), ms, conv_ms, 100 * conv_ms / ms,
                (long long)(g_aten_calls.load() / kSteps));
  }
  if (!graph) return;
  int groups = 0, fused_ops = 0, other_ops = 0;
  for (const auto* node : graph->nodes()) {
    if (const auto* group = node->get_if<sj::ir::FusionGroup>()) {
      ++groups;
      fused_ops += static_cast<int>(group->subgraph->nodes().size());
    } else if (node->is<sj::ir::Op>()) {
      ++other_ops;
    }
  }
  std::printf("compiled step (forward and backward in one graph): %d fusion groups run %d elementwise ops as %d "
              "kernels (bias, ReLU and its mask%s%s), %d other ops; no autograd Function is recorded per op, the "
              "backward is one compiled stage%s\n",
              groups, fused_ops, groups, model.is_cnn && model.cnn.batch_norm ? ", batch-norm arithmetic" : "",
              model.is_cnn ? ", dropout scaling" : "", other_ops,
              model.is_cnn ? "; stagejit's ops (eager and compiled) take a convolution's input gradient from ATen's "
                             "convolution_backward and pool 8 or more channels with ATen's channels-last kernel"
                           : "");
}

/// Compares the compiled step's gradients with libtorch's on the first `steps` batches
/// (both at the same parameters; the libtorch gradients drive the update). A gradient
/// passes when it agrees with libtorch's float one within 1e-5 relative (max |a - b| /
/// max |b|), or, failing that, when it is as close to libtorch's double-precision
/// gradient (the oracle: the same step on the same values in double) as libtorch's float
/// gradient is, to a factor of 2, and within 1e-4 relative of it: a float convolution's
/// weight gradient sums thousands of products per entry, and on some CPUs libtorch's own
/// float result is 5e-5 relative from the exact one, so two correct float results can
/// differ by more than 1e-5.
/// Returns true when every gradient, loss and running statistic passes.
bool check_gradients(const Options& o, const Model& model, const Params& init, const Split& train_set) {
  Params p;
  for (const auto& t : init) p.push_back(t.clone());
  // Each side updates its own running statistics (they stay equal while the steps agree).
  cnn::RunningStats stats_c = cnn::RunningStats::initial(model.is_cnn && model.cnn.batch_norm);
  cnn::RunningStats stats_r = stats_c.clone();
  cnn::RunningStats stats_d = stats_c.clone();
  for (auto& t : stats_d.tensors) t = t.to(at::kDouble);
  Stepper compiled(Mode::Compiled, model, &stats_c), reference(Mode::Libtorch, model, &stats_r),
      oracle(Mode::Libtorch, model, &stats_d);
  Sgd sgd{o.lr, o.momentum, {}};
  const std::vector<std::string> names = model.param_names();
  const int64_t n = train_set.images.size(0);
  bool ok = true;
  for (int s = 0; s < o.check_gradients; ++s) {
    if ((s + 1) * o.batch_size > n) break;
    auto x = train_set.images.narrow(0, s * o.batch_size, o.batch_size);
    auto y = train_set.labels.narrow(0, s * o.batch_size, o.batch_size);
    Params gc, gr;
    // The same dropout masks on both sides.
    at::manual_seed(step_seed(o.seed, 0, s));
    double lc = compiled.step(x, y, p, gc);
    at::manual_seed(step_seed(o.seed, 0, s));
    double lr = reference.step(x, y, p, gr);
    // The oracle, run at most once per batch and only when a gradient needs it: libtorch
    // in double on the same values, seeded alike (ATen's CPU bernoulli draws the same
    // mask for a double tensor as for a float one). An oracle whose loss differs
    // (another mask) cannot vouch for anything. `p` stays as it is until the update below,
    // and training-mode batch norm reads only the batch's statistics, so a late run sees
    // the step the others saw.
    Params gd;
    bool oracle_ran = false, oracle_ok = false;
    auto run_oracle = [&] {
      if (oracle_ran) return;
      oracle_ran = true;
      Params pd;
      for (const auto& t : p) pd.push_back(t.to(at::kDouble));
      at::manual_seed(step_seed(o.seed, 0, s));
      const double ld = oracle.step(x.to(at::kDouble), y, pd, gd);
      oracle_ok = std::abs(ld - lr) <= 1e-5 * std::max(std::abs(ld), 1e-30);
    };
    double lrel = std::abs(lc - lr) / std::max(std::abs(lr), 1e-30);
    std::printf("step %d: loss compiled %.8f libtorch %.8f (rel %.2e)%s\n", s, lc, lr, lrel,
                lrel <= 1e-5 ? "" : "  MISMATCH");
    ok = ok && lrel <= 1e-5;
    // A gradient 1e4 times smaller than the step's largest is zero in exact arithmetic (a
    // convolution's bias followed by batch norm, which removes per-channel constants): both
    // sides hold float rounding noise of a sum over the batch and the positions, so the
    // check is that the compiled one is zero to the same precision.
    double step_scale = 0;
    for (const auto& g : gr) step_scale = std::max(step_scale, g.abs().max().item<double>());
    if (gc.size() != gr.size()) {
      std::printf("  MISMATCH: %zu compiled gradients, %zu libtorch ones\n", gc.size(), gr.size());
      ok = false;
      break;
    }
    for (std::size_t i = 0; i < gr.size(); ++i) {
      if (gc[i].sizes() != gr[i].sizes()) {
        std::printf("  d%-7s MISMATCH: compiled shape %s, libtorch %s\n", names[i].c_str(),
                    c10::str(gc[i].sizes()).c_str(), c10::str(gr[i].sizes()).c_str());
        ok = false;
        continue;
      }
      double scale = gr[i].abs().max().item<double>();
      double err = (gc[i] - gr[i]).abs().max().item<double>();
      double rel = err / std::max(scale, 1e-30);
      bool good = true;
      if (scale <= 1e-4 * step_scale) {
        const double compiled = gc[i].abs().max().item<double>();
        good = good && compiled <= 1e-4 * step_scale;
        std::printf("  d%-7s max|grad| compiled %.3e libtorch %.3e: zero to float precision (step's largest "
                    "gradient %.3e)%s\n", names[i].c_str(), compiled, scale, step_scale, good ? "" : "  MISMATCH");
      } else if (rel <= 1e-5) {
        std::printf("  d%-7s max|diff| %.3e  max|grad| %.3e  rel %.2e\n", names[i].c_str(), err, scale, rel);
      } else {
        // As close to the double gradient as libtorch's float one, to a factor of 2, and
        // never further than 1e-4 relative to it.
        run_oracle();
        const double err_c = (gc[i].to(at::kDouble) - gd[i]).abs().max().item<double>();
        const double err_r = (gr[i].to(at::kDouble) - gd[i]).abs().max().item<double>();
        const double exact = gd[i].abs().max().item<double>();
        good = oracle_ok && err_c <= 2 * err_r && err_c <= 1e-4 * exact;
        std::printf("  d%-7s max|diff| %.3e  max|grad| %.3e  rel %.2e; from double libtorch: compiled %.3e, "
                    "libtorch float %.3e%s\n", names[i].c_str(), err, scale, rel, err_c, err_r,
                    good        ? " (as close as libtorch's float)"
                    : oracle_ok ? "  MISMATCH"
                                : "  MISMATCH (the double oracle's loss differs)");
      }
      ok = ok && good;
    }
    for (std::size_t i = 0; i < stats_r.tensors.size(); ++i) {
      const double d = (stats_c.tensors[i] - stats_r.tensors[i]).abs().max().item<double>();
      const bool good = d <= 1e-5 * std::max(1.0, stats_r.tensors[i].abs().max().item<double>());
      std::printf("  running %s %d max|diff| %.3e%s\n", i % 2 ? "var " : "mean", int(i / 2) + 1, d,
                  good ? "" : "  MISMATCH");
      ok = ok && good;
    }
    sgd.apply(p, gr);
  }
  std::printf("gradient check %s\n", ok ? "passed" : "FAILED");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Trains an MLP (784-256-128-10, ReLU, cross-entropy, SGD with momentum) or, with --model cnn,\n"
      "a CNN (two 5x5 convolutions with max pooling, optional batch norm, dropout) on Fashion-MNIST.\n"
      "The training step (forward, loss, backward) runs through stagejit::compile() by\n"
      "default, through stagejit's eager autograd with --eager, or libtorch's autograd with\n"
      "--libtorch; all start from the same weights and see the same batches.\n"
      "Data: Debian package dataset-fashion-mnist."};
  // An option that takes a number >= 0 (a count, or an index).
  auto non_negative_option = [&app](const char* name, auto& value, const std::string& help) {
    return app.add_option(name, value, help)->check(CLI::NonNegativeNumber);
  };
  app.add_option("--model", o.model, "The network: mlp (784-256-128-10) or cnn (examples/cnn.hpp)")
      ->capture_default_str()->check(CLI::IsMember({"mlp", "cnn"}));
  app.add_flag("--batch-norm", o.batch_norm, "With --model cnn: batch norm after each convolution");
  app.add_option("--epochs", o.epochs, "Passes over the training set")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-size", o.batch_size, "Images per step (the last partial batch of an "
                 "epoch is dropped); default 128 for the MLP, 32 for the CNN")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "SGD learning rate; default 0.05 for the MLP, 0.03 for the CNN")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr-schedule", o.lr_schedule, "constant, or linear: decayed linearly over all steps of "
                 "all epochs, from --lr at the first to --lr / steps at the last; default constant for the "
                 "MLP, linear for the CNN")
      ->check(CLI::IsMember({"constant", "linear"}));
  app.add_option("--momentum", o.momentum, "SGD momentum (PyTorch's convention)")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  non_negative_option("--threads", o.threads, "ATen intra-op threads (0: ATen's default)")->capture_default_str();
  app.add_option("--data-dir", o.data_dir, "Directory holding the four *-ubyte.gz IDX files")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "Seeds the initial weights and the batch order")
      ->capture_default_str();
  app.add_option("--metrics", o.metrics,
                 "Write per-epoch CSV: epoch,train_loss,test_accuracy,images_per_s,seconds "
                 "(with --compare a leading mode column)");
  app.add_flag("--print-graph", o.print_graph,
               "Print the optimised IR of the compiled training step and exit");
  non_negative_option("--warmup", o.warmup,
                      "Untimed steps on a scratch copy of the weights before training (the compiled "
                      "step's trace and kernel compile, first-touch memory): training is unchanged");
  non_negative_option("--limit", o.limit, "Use only the first N training images (0: all)");
  auto* eager = app.add_flag("--eager", o.eager, "Run the step through stagejit's eager autograd");
  auto* lt = app.add_flag("--libtorch", o.libtorch, "Run the step through libtorch's autograd");
  auto* cmp = app.add_flag("--compare", o.compare,
                           "Train compiled, eager and libtorch (epochs interleaved) and compare throughput");
  eager->excludes(lt)->excludes(cmp);
  lt->excludes(cmp);
  non_negative_option("--check-gradients", o.check_gradients,
                      "Compare the compiled step's gradients with libtorch's on the first N batches "
                      "(1e-5 relative), exit 1 on a mismatch");
  app.add_flag("--skip-if-missing", o.skip_missing,
               "Exit 77 (a skipped test for Meson) instead of 1 when the data cannot be read");
  app.add_option("--world-size", o.world_size,
                 "Data-parallel processes (c10d Gloo; default WORLD_SIZE, else 1): each trains on "
                 "its shard of every --batch-size batch; start them with scripts/launch -n N")
      ->check(CLI::PositiveNumber);
  non_negative_option("--rank", o.rank, "This process's rank in [0, world size) (default RANK, else 0)");
  app.add_option("--timeout", o.timeout, "Seconds to wait for a peer (rendezvous, each all-reduce)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            // 1 ms to a year (the process group's limits); NaN and infinities refused.
            double t = 0;
            if (!CLI::detail::lexical_cast(text, t) || !std::isfinite(t) || t < 0.001 || t > 31536000.0)
              return "--timeout " + text + " is outside [0.001, 31536000] seconds (1 ms to a year)";
            return {};
          },
          "SECONDS in [0.001, 31536000]"));
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "Data-parallel gradient bucket cap (MiB, DDP's)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--first-bucket-cap-mb", o.first_bucket_cap_mb, "Cap of the first bucket (MiB)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  // The CNN's defaults (what reaches >= 91 % test accuracy in 2 epochs, README); an
  // option given on the command line wins.
  if (o.model == "cnn") {
    if (app.count("--batch-size") == 0) o.batch_size = 32;
    if (app.count("--lr") == 0) o.lr = 0.03;
    if (app.count("--lr-schedule") == 0) o.lr_schedule = "linear";
  }
  Model model;
  model.is_cnn = o.model == "cnn";
  model.cnn.batch_norm = o.batch_norm;
  if (o.batch_norm && !model.is_cnn) {
    std::fprintf(stderr, "error: --batch-norm needs --model cnn\n");
    return 2;
  }

  Distributed dist_run;
  {
    // torchrun's variables, range checked (no wrap-around: WORLD_SIZE=4294967297 is not 1).
    auto env_int = [](const char* name, int fallback, long long lo, long long hi) -> std::optional<int> {
      const char* v = std::getenv(name);
      if (v == nullptr || *v == '\0') return fallback;
      const char* digits = (*v == '+' || *v == '-') ? v + 1 : v;
      char* end = nullptr;
      errno = 0;
      const long long x = std::strtoll(v, &end, 10);
      if (*digits < '0' || *digits > '9' || *end != '\0' || errno == ERANGE || x < lo || x > hi) {
        std::fprintf(stderr, "error: environment variable %s='%s' is not an integer in [%lld, %lld]\n", name, v, lo,
                     hi);
        return std::nullopt;
      }
      return static_cast<int>(x);
    };
    const std::optional<int> ws = o.world_size > 0 ? o.world_size : env_int("WORLD_SIZE", 1, 1, 1 << 20);
    if (!ws) return 2;
    dist_run.world_size = *ws;
    const std::optional<int> rk = o.rank >= 0 ? o.rank : env_int("RANK", 0, 0, dist_run.world_size - 1);
    if (!rk) return 2;
    dist_run.rank = *rk;
  }
  if (dist_run.active()) {
#if defined(STAGEJIT_HAVE_DISTRIBUTED)
    if (o.libtorch || o.compare || o.print_graph || o.check_gradients > 0) {
      std::fprintf(stderr, "error: --world-size > 1 trains the compiled or --eager step only\n");
      return 2;
    }
    if (o.batch_norm) {
      std::fprintf(stderr, "error: --world-size > 1 with --batch-norm: the running statistics are not "
                   "synchronised across ranks\n");
      return 2;
    }
    if (o.batch_size % dist_run.world_size != 0) {
      std::fprintf(stderr, "error: --batch-size %lld is not a multiple of the world size %d\n",
                   (long long)o.batch_size, dist_run.world_size);
      return 2;
    }
    try {
      dist::ProcessGroupOptions po;
      po.rank = dist_run.rank;
      po.world_size = dist_run.world_size;
      po.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.timeout * 1000)));
      dist_run.group = std::make_shared<dist::ProcessGroup>(po);
    } catch (const sj::Error& e) {
      std::fprintf(stderr, "stagejit error: %s\n", e.what());
      return 2;
    }
#else
    std::fprintf(stderr, "error: --world-size %d: this build has no distributed support (c10d Gloo "
                 "headers, libgloo-dev, were not found when it was configured)\n", dist_run.world_size);
    return 2;
#endif
  }

  if (o.threads > 0) at::set_num_threads(o.threads);

  Split train_set, test_set;
  try {
    train_set = load_split(o.data_dir, "train");
    test_set = load_split(o.data_dir, "t10k");
  } catch (const DatasetError& e) {
    std::fprintf(stderr,
                 "%s: %s\nThe Fashion-MNIST data comes from the Debian package %s "
                 "(apt-get install %s, or scripts/setup); --data-dir selects another "
                 "directory.\n",
                 o.skip_missing ? "SKIP" : "error", e.what(), kPackage, kPackage);
    return o.skip_missing ? kSkipExitCode : 1;
  }
  if (o.limit > 0 && o.limit < train_set.images.size(0)) {
    train_set.images = train_set.images.narrow(0, 0, o.limit).contiguous();
    train_set.labels = train_set.labels.narrow(0, 0, o.limit).contiguous();
  }
  if (o.batch_size > train_set.images.size(0)) {
    std::fprintf(stderr, "error: --batch-size %lld exceeds the %lld training images\n",
                 (long long)o.batch_size, (long long)train_set.images.size(0));
    return 1;
  }

  return stagejit_examples::run_reporting_errors<sj::Error>(2, [&]() -> int {
    const Params init = model.init_params(o.seed);
    if (o.print_graph) {
      cnn::RunningStats stats = cnn::RunningStats::initial(model.is_cnn && model.cnn.batch_norm);
      Stepper s(Mode::Compiled, model, &stats);
      auto x = train_set.images.narrow(0, 0, o.batch_size);
      auto y = train_set.labels.narrow(0, 0, o.batch_size);
      std::cout << s.graph(x, y, init);
      return 0;
    }
    if (o.check_gradients > 0) return check_gradients(o, model, init, train_set) ? 0 : 1;

    if (dist_run.rank == 0)
      std::printf("Fashion-MNIST: %lld training, %lld test images; %s; "
                  "SGD lr %g%s momentum %g; batch %lld; %d ATen thread(s); seed %llu%s\n",
                  (long long)train_set.images.size(0), (long long)test_set.images.size(0),
                  model.describe().c_str(), o.lr, o.lr_schedule == "linear" ? " (linear decay)" : "",
                  o.momentum, (long long)o.batch_size, at::get_num_threads(),
                  (unsigned long long)o.seed,
                  dist_run.active() ? ("; data-parallel over " + std::to_string(dist_run.world_size) +
                                       " ranks (c10d Gloo)").c_str()
                                    : "");
    std::vector<Mode> modes;
    if (o.compare)
      modes = {Mode::Compiled, Mode::Eager, Mode::Libtorch};
    else
      modes = {o.eager ? Mode::Eager : o.libtorch ? Mode::Libtorch : Mode::Compiled};
    // Touch every training image once, so the first mode does not pay the first-touch
    // page faults of the 188 MB dataset inside its timed epoch.
    if (o.warmup > 0) (void)train_set.images.sum().item<double>();
    std::vector<RunResult> runs = train_all(modes, o, model, init, train_set, test_set, dist_run);
    if (dist_run.rank == 0) {
      print_summary(runs);
      if (o.compare) print_profile(modes, o, model, init, train_set);
      if (!o.metrics.empty()) write_metrics(o.metrics, runs);
    }
    return 0;
  });
}
