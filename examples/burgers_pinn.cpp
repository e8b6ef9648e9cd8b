// Physics-informed neural network for the viscous Burgers equation (Raissi, Perdikaris &
// Karniadakis, J. Comput. Phys. 378 (2019), section 3.1; issue 14):
//
//     u_t + u u_x - (0.01 / pi) u_xx = 0,  x in [-1, 1], t in [0, 1],
//     u(0, x) = -sin(pi x),  u(t, +-1) = 0.
//
// A 2-20x8-1 tanh network is fitted to 100 initial/boundary points and the PDE residual
// at 10 000 Latin-hypercube collocation points (loss = MSE_u + MSE_f), with Adam then
// L-BFGS (libtorch's optimisers). Each step's loss and parameter gradients - a third
// derivative of the network - run in one of four modes from the same weights and points:
// the network compiled with three derivatives (default), the whole loss compiled
// (--compile-loss), stagejit's eager autograd (--eager), libtorch's autograd (--libtorch);
// --compare trains them interleaved. The error is measured against the exact solution
// (Cole-Hopf, computed by quadrature here) on the paper's 100 x 256 grid; --plot draws
// exact, predicted and |error| as heatmaps; --save-weights writes the trained weights
// (bench/pinn_resolution reads them). examples/pinn/burgers.hpp holds the problem.

#include "cli.hpp"
#include "pinn/burgers.hpp"
#include "pinn/plot.hpp"

#include <CLI/CLI.hpp>
#include <stb_image_write.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace sj = stagejit;
using namespace pinn::burgers;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Default budget. Measured on the 2-core development VM (1 ATen thread, float, N_f =
// 10 000; README "Physics-informed neural network"): one loss-and-gradient evaluation
// takes ~50 ms compiled on an idle machine, an L-BFGS iteration ~1.1 evaluations, so the
// default run takes ~3.5 minutes. Adam's short warm-up moves the weights off the Xavier
// start; L-BFGS (strong Wolfe, its iterate in double) does the fitting, as the paper's
// L-BFGS-B alone does (--paper). Relative L2 errors measured after 3 500 L-BFGS
// iterations: 2.4e-3 and 2.1e-3 (seeds 0, 1, this budget) and, without the warm-up, 2.5e-3, 1.1e-3,
// 2.8e-3 (seeds 0, 1, 2); a longer Adam phase first (500 iterations) ended near 1e-2.
constexpr int kDefaultAdam = 100;
constexpr int kDefaultLbfgs = 3500;
// The paper's budget (its code: scipy L-BFGS-B, maxiter 50 000, maxcor 50, ftol = eps).
constexpr int kPaperLbfgs = 50000;
constexpr int kLbfgsHistory = 50;

struct Options {
  int adam = kDefaultAdam;
  int lbfgs = kDefaultLbfgs;
  double lr = 1e-3;
  std::string dtype = "float";
  // One thread: the network is 20 units wide, so its products ([N, 20] x [20, 20]) gain
  // little from threads, and OpenBLAS's spinning threads oversubscribe a small machine
  // (set_blas_threads). 0 leaves ATen's and OpenBLAS's defaults.
  int threads = 1;
  uint64_t seed = 0;
  int64_t n_f = 10000;
  int64_t n_u = 100;
  int report_every = 100;
  std::string metrics, plot, save_weights;
  bool paper = false, compare = false, eager = false, libtorch = false, compile_loss = false;
};

/// One row of the metrics CSV / the progress report.
struct Report {
  int iteration;       // Adam and L-BFGS iterations so far
  const char* phase;   // "adam" or "lbfgs"
  int64_t evaluations; // loss-and-gradient evaluations so far
  double loss, rel_l2, seconds;
};

std::string fmt_duration(double s) {
  char buf[32];
  if (!std::isfinite(s)) return "?";
  if (s >= 60)
    std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  else
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

/// Trains one mode from `init`: Adam iterations first, then L-BFGS, `advance()` running
/// the next chunk of at most `report_every` iterations of the current phase, so that
/// several modes can be interleaved.
class Trainer {
 public:
  Trainer(Mode mode, const Options& o, const TrainingData& data, const Params& init)
      : mode_(mode), o_(o), data_(data), stepper_(mode, data), lbfgs_finished_(o.lbfgs == 0) {
    for (const auto& t : init) p_.push_back(t.detach().clone().requires_grad_(true));
    adam_ = std::make_unique<torch::optim::Adam>(p_, torch::optim::AdamOptions(o.lr));
  }

  const char* name() const { return mode_name(mode_); }
  bool done() const { return adam_done_ >= o_.adam && lbfgs_finished_; }

  /// One untimed evaluation on a copy of the weights: the trace and compile of the
  /// compiled modes (and first-touch memory) stay out of the timings; training is
  /// unchanged.
  void warmup() {
    Params scratch, grads;
    for (const auto& t : p_) scratch.push_back(t.detach().clone());
    const auto t0 = Clock::now();
    (void)stepper_.step(scratch, grads);
    std::printf("[%s] first evaluation: %.0f ms%s\n", name(), 1e3 * seconds_since(t0),
                mode_ == Mode::Compiled || mode_ == Mode::CompileLoss
                    ? " (includes the trace and compile)" : "");
    std::fflush(stdout);
  }

  /// Runs the next chunk; returns its report.
  Report advance() {
    const auto t0 = Clock::now();
    const char* phase;
    if (adam_done_ < o_.adam) {
      phase = "adam";
      const int n = std::min(o_.report_every, o_.adam - adam_done_);
      for (int i = 0; i < n; ++i) {
        adam_->step([this] { return evaluate(adam_evals_, adam_eval_s_); });
        ++adam_done_;
      }
    } else {
      phase = "lbfgs";
      const int n = std::min(o_.report_every, o_.lbfgs - lbfgs_done_);
      const int64_t before = lbfgs_iterations();
      if (n > 0) {
        if (!lbfgs_) start_lbfgs();
        static_cast<torch::optim::LBFGSOptions&>(lbfgs_->param_groups()[0].options()).max_iter(n);
        lbfgs_->step([this] { return evaluate_lbfgs(); });
        // The accepted iterate (the line search's last trial need not be it).
        copy_iterate_to_network();
      }
      const int64_t ran = lbfgs_iterations() - before;
      lbfgs_done_ += int(ran);
      // Fewer iterations than asked: L-BFGS stopped on a tolerance (gradient or change
      // of the loss): converged, or no further progress possible in this precision.
      if (ran < n) converged_ = true;
      lbfgs_finished_ = lbfgs_done_ >= o_.lbfgs || converged_;
    }
    train_s_ += seconds_since(t0);
    Report r{adam_done_ + lbfgs_done_, phase, adam_evals_ + lbfgs_evals_, last_loss_,
             relative_l2_error(p_, data_), train_s_};
    reports_.push_back(r);
    return r;
  }

  /// "[mode] L-BFGS [#####.....]  45%  it 900/2000  loss ...  rel L2 ...  it/s  ETA".
  std::string status_line(const Report& r) const {
    const bool in_adam = std::strcmp(r.phase, "adam") == 0;
    const int done = in_adam ? adam_done_ : lbfgs_done_;
    const int total = in_adam ? o_.adam : o_.lbfgs;
    const double phase_s = in_adam ? adam_s() : train_s_ - adam_s();
    const double its = done > 0 ? double(done) / phase_s : 0;
    // ETA: the rest of this phase at its current rate, the Adam rate for L-BFGS iterations
    // not begun (an L-BFGS iteration costs about one evaluation more than Adam's).
    double eta = its > 0 ? double(total - done) / its : NAN;
    if (in_adam && adam_evals_ > 0) eta += double(o_.lbfgs) * 1.2 * adam_eval_s_ / double(adam_evals_);
    const int width = 20;
    const int filled = total > 0 ? width * done / total : width;
    std::string bar(std::size_t(filled), '#');
    bar.resize(width, '.');
    char buf[256];
    std::snprintf(buf, sizeof buf, "[%s] %-6s [%s] %3d%%  it %d/%d  loss %.3e  rel L2 %.3e  %.1f it/s  ETA %s",
                  name(), in_adam ? "Adam" : "L-BFGS", bar.c_str(), total > 0 ? 100 * done / total : 100,
                  done, total, r.loss, r.rel_l2, its, fmt_duration(eta).c_str());
    return buf;
  }

  const std::vector<Report>& reports() const { return reports_; }
  const Params& params() const { return p_; }
  /// The trained weights in double: L-BFGS's iterate (the accepted point, before its
  /// rounding to --dtype) once L-BFGS ran, else the network's weights.
  Params weights_double() const {
    Params w;
    for (const auto& t : iterate_.empty() ? p_ : iterate_) w.push_back(t.detach().to(at::kDouble).clone());
    return w;
  }
  Mode mode() const { return mode_; }
  int adam_iterations() const { return adam_done_; }
  int lbfgs_done() const { return lbfgs_done_; }
  bool converged() const { return converged_; }
  int64_t lbfgs_evals() const { return lbfgs_evals_; }
  double ms_per_lbfgs_eval() const { return lbfgs_evals_ ? 1e3 * lbfgs_eval_s_ / double(lbfgs_evals_) : NAN; }
  double ms_per_adam_eval() const { return adam_evals_ ? 1e3 * adam_eval_s_ / double(adam_evals_) : NAN; }
  double seconds() const { return train_s_; }
  sj::CompiledFunction::Stats cache_stats() {
    return mode_ == Mode::CompileLoss ? stepper_.compiled_loss().stats() : stepper_.compiled_net().stats();
  }

 private:
  /// The optimisers' closure: loss and gradients at the current weights, the gradients
  /// written into the parameters' .grad(); the time spent here is what "ms per
  /// evaluation" reports.
  at::Tensor evaluate(int64_t& evals, double& eval_s) {
    const auto t0 = Clock::now();
    at::Tensor loss = stepper_.step(p_, grads_);
    for (std::size_t i = 0; i < p_.size(); ++i) p_[i].mutable_grad() = grads_[i].contiguous();
    last_loss_ = loss.item<double>();
    eval_s += seconds_since(t0);
    ++evals;
    if (!std::isfinite(last_loss_))
      throw std::runtime_error(std::string("training diverged: loss ") + std::to_string(last_loss_) +
                               " after " + std::to_string(adam_done_ + lbfgs_done_) +
                               " iterations (try a smaller --lr)");
    return loss;
  }

  /// L-BFGS keeps its iterate, history and line search in double over a double copy of
  /// the weights, as the paper's code did (TensorFlow's ScipyOptimizerInterface hands
  /// scipy's L-BFGS-B float64 copies of the float32 variables); the network still
  /// evaluates in --dtype. Measured (float, --paper, seed 0): with the iterate in float
  /// L-BFGS stopped on its tolerance after 3 988 iterations at a relative L2 error of
  /// 3.4e-3; with it in double, after 4 593 iterations at 1.9e-3.
  void start_lbfgs() {
    for (const auto& t : p_) iterate_.push_back(t.detach().to(at::kDouble).requires_grad_(true));
    // tolerance_change: scipy's ftol = machine epsilon of the paper's code (here as an
    // absolute change, the loss being below 1); max_eval: never the binding limit (the
    // iteration budget is); lr 1 with strong Wolfe line search is the standard setting.
    lbfgs_ = std::make_unique<torch::optim::LBFGS>(
        iterate_, torch::optim::LBFGSOptions(1.0)
                      .max_iter(o_.report_every)
                      .max_eval(int64_t(o_.report_every) * 25)
                      .history_size(kLbfgsHistory)
                      .tolerance_grad(1e-9)
                      .tolerance_change(std::numeric_limits<double>::epsilon())
                      .line_search_fn("strong_wolfe"));
  }

  void copy_iterate_to_network() {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < p_.size(); ++i) p_[i].copy_(iterate_[i]);
  }

  /// L-BFGS's closure: the network's loss and gradients at the iterate (rounded to
  /// --dtype), handed back in double.
  at::Tensor evaluate_lbfgs() {
    copy_iterate_to_network();
    at::Tensor loss = evaluate(lbfgs_evals_, lbfgs_eval_s_);
    for (std::size_t i = 0; i < p_.size(); ++i) iterate_[i].mutable_grad() = p_[i].grad().to(at::kDouble);
    return loss.detach().to(at::kDouble);
  }

  int64_t lbfgs_iterations() const {
    if (!lbfgs_) return 0;
    const auto& state = lbfgs_->state();
    if (state.empty()) return 0;
    return static_cast<const torch::optim::LBFGSParamState&>(*state.begin()->second).n_iter();
  }

  double adam_s() const {
    // Wall time of the Adam phase: the train time of the reports up to the last Adam one.
    double s = 0;
    for (const auto& r : reports_)
      if (std::strcmp(r.phase, "adam") == 0) s = r.seconds;
    return reports_.empty() || std::strcmp(reports_.back().phase, "adam") == 0 ? train_s_ : s;
  }

  Mode mode_;
  const Options& o_;
  const TrainingData& data_;
  Stepper stepper_;
  Params p_, grads_;
  Params iterate_;  // L-BFGS's iterate in double (start_lbfgs)
  std::unique_ptr<torch::optim::Adam> adam_;
  std::unique_ptr<torch::optim::LBFGS> lbfgs_;
  int adam_done_ = 0, lbfgs_done_ = 0;
  bool lbfgs_finished_, converged_ = false;
  int64_t adam_evals_ = 0, lbfgs_evals_ = 0;
  double adam_eval_s_ = 0, lbfgs_eval_s_ = 0, train_s_ = 0, last_loss_ = NAN;
  std::vector<Report> reports_;
};

/// Trains every trainer to the end, chunks interleaved (one chunk of each mode, the order
/// rotating every round), so a machine that speeds up or slows down during the run
/// shifts every mode alike. Progress: a redrawn bar on a terminal, one line per chunk
/// otherwise.
void train_all(std::vector<std::unique_ptr<Trainer>>& trainers) {
  const bool tty = isatty(1);
  for (std::size_t round = 0;; ++round) {
    bool any = false;
    for (std::size_t k = 0; k < trainers.size(); ++k) {
      Trainer& tr = *trainers[(k + round) % trainers.size()];
      if (tr.done()) continue;
      any = true;
      const Report r = tr.advance();
      if (tty)
        std::printf("\r%-150s", tr.status_line(r).c_str());
      else
        std::printf("%s\n", tr.status_line(r).c_str());
      std::fflush(stdout);
    }
    if (!any) break;
  }
  if (tty) std::printf("\n");
}

void write_metrics(std::FILE* f, const std::vector<std::unique_ptr<Trainer>>& trainers) {
  const bool many = trainers.size() > 1;
  std::fprintf(f, "%siteration,phase,evaluations,loss,rel_l2_error,seconds\n", many ? "mode," : "");
  for (const auto& tr : trainers)
    for (const Report& r : tr->reports()) {
      if (many) std::fprintf(f, "%s,", tr->name());
      std::fprintf(f, "%d,%s,%lld,%.9g,%.9g,%.4f\n", r.iteration, r.phase, (long long)r.evaluations,
                   r.loss, r.rel_l2, r.seconds);
    }
}

/// Exact | predicted | |error| on the evaluation grid, each with its colour bar: exact and
/// predicted on the exact solution's range, the error on [0, max |error|].
void write_plot(std::FILE* f, const Params& p, const TrainingData& data, const ReferenceSolution& ref) {
  const int64_t nt = ref.t.size(0), nx = ref.x.size(0);
  at::Tensor u_pred = predict(p, data, data.x_star).to(at::kDouble).reshape({nt, nx});
  at::Tensor err = (u_pred - ref.u).abs();
  const double lo = ref.u.min().item<double>(), hi = ref.u.max().item<double>();
  auto img = pinn::plot::render({{"exact u(t,x)", ref.u, lo, hi},
                                 {"predicted", u_pred, lo, hi},
                                 {"|error|  rel L2 " + pinn::plot::number(relative_l2_error(p, data)), err, 0.0,
                                  err.max().item<double>()}},
                                kTMin, kTMax, kXMin, kXMax);
  auto sink = [](void* ctx, void* bytes, int size) {
    std::fwrite(bytes, 1, std::size_t(size), static_cast<std::FILE*>(ctx));
  };
  if (!stbi_write_png_to_func(sink, f, img.width, img.height, 3, img.rgb.data(), img.width * 3) ||
      std::ferror(f))
    throw std::runtime_error("cannot write the plot");
}

void print_summary(const std::vector<std::unique_ptr<Trainer>>& trainers) {
  std::printf("\nSummary (the paper reports a relative L2 error of 6.7e-4 for N_u 100, N_f 10 000)\n");
  std::printf("%-13s %11s %13s %8s %8s %7s %10s %10s %9s\n", "mode", "final loss", "rel L2 error",
              "Adam it", "L-BFGS it", "evals", "ms/eval", "vs libtorch", "seconds");
  double base = NAN;
  for (const auto& tr : trainers)
    if (tr->mode() == Mode::Libtorch) base = tr->ms_per_lbfgs_eval();
  for (const auto& tr : trainers) {
    const Report& r = tr->reports().back();
    const double ms = tr->lbfgs_evals() ? tr->ms_per_lbfgs_eval() : tr->ms_per_adam_eval();
    char ratio[32] = "";
    if (std::isfinite(base)) std::snprintf(ratio, sizeof ratio, "%.2fx", base / ms);
    std::printf("%-13s %11.4e %13.4e %8d %8d%s %7lld %10.1f %10s %9.1f\n", tr->name(), r.loss, r.rel_l2,
                tr->adam_iterations(), tr->lbfgs_done(), tr->converged() ? "*" : " ",
                (long long)r.evaluations, ms, ratio, tr->seconds());
  }
  std::printf("ms/eval: mean time of one loss-and-gradient evaluation in the L-BFGS phase (Adam if\n"
              "no L-BFGS ran); vs libtorch: libtorch's ms/eval divided by the mode's (> 1: faster).\n");
  if (std::any_of(trainers.begin(), trainers.end(), [](const auto& tr) { return tr->converged(); }))
    std::printf("* L-BFGS stopped before its budget on a tolerance (converged or stalled).\n");
}

/// Option checks with short messages (CLI11's PositiveNumber prints the range up to
/// DBL_MAX in full).
CLI::Validator number_check(bool allow_zero) {
  return CLI::Validator(
      [allow_zero](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v) || !std::isfinite(v)) return "not a number: " + in;
        if (allow_zero ? v < 0 : v <= 0) return std::string("must be ") + (allow_zero ? ">= 0" : "> 0") + ", got " + in;
        return "";
      },
      allow_zero ? ">= 0" : "> 0");
}

/// Opens `path` for writing now, so that a bad path fails before training; nullptr and
/// a message when it cannot be opened.
std::FILE* open_output(const std::string& path, const char* what, const char* mode) {
  std::FILE* f = std::fopen(path.c_str(), mode);
  if (f == nullptr)
    std::fprintf(stderr, "error: cannot write %s file %s: %s\n", what, path.c_str(), std::strerror(errno));
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const CLI::Validator positive = number_check(false), non_negative = number_check(true);
  CLI::App app{
      "Physics-informed neural network for the viscous Burgers equation (Raissi et al., J. Comput.\n"
      "Phys. 2019, section 3.1): a 2-20x8-1 tanh network trained on N_u initial/boundary points and\n"
      "the PDE residual at N_f collocation points with Adam then L-BFGS. The loss and its gradients\n"
      "run through the network compiled with three derivatives (default), the compiled loss\n"
      "(--compile-loss), stagejit's eager autograd (--eager) or libtorch (--libtorch), all from\n"
      "the same weights and points. The error is measured against the exact (Cole-Hopf) solution."};
  auto* adam = app.add_option("--adam", o.adam, "Adam iterations before L-BFGS")
                   ->capture_default_str()->check(non_negative);
  auto* lbfgs = app.add_option("--lbfgs", o.lbfgs, "L-BFGS iterations at most (stops earlier on "
                               "convergence)")->capture_default_str()->check(non_negative);
  app.add_option("--lr", o.lr, "Adam learning rate")->capture_default_str()->check(positive);
  app.add_option("--dtype", o.dtype, "float or double")->capture_default_str()
      ->check(CLI::IsMember({"float", "double"}));
  app.add_option("--threads", o.threads, "ATen intra-op threads and OpenBLAS threads (0: their defaults)")
      ->capture_default_str()->check(non_negative);
  app.add_option("--seed", o.seed, "Seeds the initial weights, the N_u points and the collocation "
                 "points")->capture_default_str();
  app.add_option("--collocation", o.n_f, "N_f: collocation points (Latin hypercube)")
      ->capture_default_str()->check(positive);
  app.add_option("--boundary", o.n_u, "N_u: initial/boundary points (at most 456: the grid's)")
      ->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(2 * kGridT + kGridX)));
  app.add_option("--report-every", o.report_every, "Report (loss, relative L2 error) every K "
                 "iterations")->capture_default_str()->check(positive);
  app.add_option("--metrics", o.metrics, "Write a CSV: [mode,]iteration,phase,evaluations,loss,"
                 "rel_l2_error,seconds, one row per report");
  app.add_option("--plot", o.plot, "Write a PNG: exact, predicted and |error| of u(t, x) as heatmaps");
  app.add_option("--save-weights", o.save_weights, "Write the trained weights W1, b1, ..., W9, b9 in "
                 "double (torch::save of a tensor list; L-BFGS's iterate once it ran) of the first "
                 "mode; bench/pinn_resolution reads them");
  auto* paper = app.add_flag("--paper", o.paper, "The paper's budget: no Adam, L-BFGS up to 50 000 "
                             "iterations (history 50)");
  paper->excludes(adam)->excludes(lbfgs);
  auto* eager = app.add_flag("--eager", o.eager, "Run the step through stagejit's eager autograd");
  auto* lt = app.add_flag("--libtorch", o.libtorch, "Run the step through libtorch's autograd");
  auto* cl = app.add_flag("--compile-loss", o.compile_loss,
                          "Compile the whole loss (with its inner grads), one derivative");
  auto* cmp = app.add_flag("--compare", o.compare, "Train all four modes, interleaved, and compare "
                           "their time per evaluation");
  eager->excludes(lt)->excludes(cl)->excludes(cmp);
  lt->excludes(cl)->excludes(cmp);
  cl->excludes(cmp);
  if (auto status = stagejit_examples::parse_command_line(app, argc, argv)) return *status;
  if (o.paper) o.adam = 0, o.lbfgs = kPaperLbfgs;
  if (o.adam == 0 && o.lbfgs == 0) {
    std::fprintf(stderr, "error: --adam and --lbfgs are both 0: nothing to train (see --help)\n");
    return 2;
  }
  bool blas_set = false;
  if (o.threads > 0) {
    at::set_num_threads(o.threads);
    blas_set = stagejit_examples::set_blas_threads(o.threads);
  }

  // torch::save opens the file itself at the end; a bad path fails here, before
  // training, without truncating a file already there (nor leaving a new empty one).
  if (!o.save_weights.empty()) {
    std::error_code ec;
    const bool existed = std::filesystem::exists(o.save_weights, ec);
    std::FILE* f = open_output(o.save_weights, "weights", "ab");
    if (f == nullptr) return 2;
    std::fclose(f);
    if (!existed) std::filesystem::remove(o.save_weights, ec);
  }

  std::FILE* metrics = nullptr;
  std::FILE* plot = nullptr;
  if (!o.metrics.empty() && !(metrics = open_output(o.metrics, "metrics", "w"))) return 2;
  if (!o.plot.empty() && !(plot = open_output(o.plot, "plot", "wb"))) return 2;

  return stagejit_examples::run_reporting_errors<sj::Error>(1, [&]() -> int {
    const at::ScalarType dtype = o.dtype == "double" ? at::kDouble : at::kFloat;
    auto t0 = Clock::now();
    const ReferenceSolution ref = reference_solution();
    const double ref_s = seconds_since(t0);
    const TrainingData data = make_training_data(ref, o.n_u, o.n_f, o.seed + 1).to(dtype);
    const Params init = xavier_init(paper_layers(), o.seed, dtype);

    std::printf("Burgers PINN (Raissi et al. 2019, section 3.1): nu = 0.01/pi; network 2-20x8-1 tanh, "
                "Xavier (Glorot normal) init; N_u %lld, N_f %lld; %s\n",
                (long long)data.x_u.size(0), (long long)data.x_f.size(0), o.dtype.c_str());
    std::printf("Adam %d iterations (lr %g), then L-BFGS %d iterations at most (strong Wolfe, history "
                "%d); %d ATen thread(s)%s; seed %llu\n",
                o.adam, o.lr, o.lbfgs, kLbfgsHistory, at::get_num_threads(),
                blas_set ? (o.threads == 1 ? ", 1 OpenBLAS thread" : ", as many OpenBLAS threads") : "",
                (unsigned long long)o.seed);
    std::printf("exact solution (Cole-Hopf, trapezoid rule) on the %lld x %lld grid: %.2f s\n",
                (long long)ref.t.size(0), (long long)ref.x.size(0), ref_s);
    std::printf("initial relative L2 error %.4e\n", relative_l2_error(init, data));

    std::vector<Mode> modes;
    if (o.compare)
      modes = {Mode::Compiled, Mode::CompileLoss, Mode::Eager, Mode::Libtorch};
    else
      modes = {o.eager ? Mode::Eager : o.libtorch ? Mode::Libtorch
                                     : o.compile_loss ? Mode::CompileLoss : Mode::Compiled};
    std::vector<std::unique_ptr<Trainer>> trainers;
    for (Mode m : modes) {
      trainers.push_back(std::make_unique<Trainer>(m, o, data, init));
      trainers.back()->warmup();
    }
    train_all(trainers);
    for (auto& tr : trainers)
      if (tr->mode() == Mode::Compiled || tr->mode() == Mode::CompileLoss) {
        auto st = tr->cache_stats();
        std::printf("[%s] compile cache: %zu miss(es) (traces), %zu hit(s)\n", tr->name(), st.misses, st.hits);
      }
    print_summary(trainers);
    if (metrics) {
      write_metrics(metrics, trainers);
      if (std::fclose(metrics) != 0) throw std::runtime_error("cannot write metrics file " + o.metrics);
      metrics = nullptr;
    }
    if (plot) {
      write_plot(plot, trainers.front()->params(), data, ref);
      if (std::fclose(plot) != 0) throw std::runtime_error("cannot write plot file " + o.plot);
      plot = nullptr;
      std::printf("plot (%s run): %s\n", trainers.front()->name(), o.plot.c_str());
    }
    if (!o.save_weights.empty()) {
      torch::save(trainers.front()->weights_double(), o.save_weights);
      std::printf("weights (%s run, double): %s\n", trainers.front()->name(), o.save_weights.c_str());
    }
    return 0;
  });
}
