#pragma once
/// \file
/// `distributed::DataParallel`: data-parallel training of a set of parameter Variables
/// over a `ProcessGroup`, as PyTorch's `DistributedDataParallel` and its c10d reducer do
/// it (Note [Gradient buckets]):
///
/// - at construction the parameters are broadcast from rank 0 and every rank checks that
///   all ranks hold the same parameter shapes and dtypes;
/// - the gradients are packed into buckets (reverse parameter order, a first bucket of
///   `first_bucket_cap_mb`, then `bucket_cap_mb`, one dtype per bucket);
/// - a bucket is all-reduced (average) as soon as the running backward has accumulated all
///   of its gradients (post-accumulate-grad hooks: Note [Post-accumulate-grad hooks] in
///   autograd/function-inl.hpp; a compiled stage hands its outputs over as it computes
///   them: Note [Early outputs] in autograd/engine.hpp), so communication overlaps the
///   rest of the backward, eager or compiled, first and higher-order stages alike; buckets
///   are started in bucket order on every rank;
/// - `finish()`, called after the backward and before the optimiser step, waits for every
///   bucket and replaces each parameter's `grad()` by the average over the ranks.
///
/// Optional part of stagejit: needs `-DUSE_C10D_GLOO` (process_group.hpp).

#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/distributed/process_group.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagejit::distributed {

struct DataParallelOptions {
  /// Cap of every bucket after the first, in MiB (DDP's `bucket_cap_mb`).
  double bucket_cap_mb = 25.0;
  /// Cap of the first bucket (the last layers' gradients, ready first), in MiB (DDP's
  /// first bucket, `dist._DEFAULT_FIRST_BUCKET_BYTES`).
  double first_bucket_cap_mb = 1.0;
  /// A parameter without a gradient in a step (not used by this rank's loss) counts as
  /// a zero contribution, its bucket is started by `finish()`, and a parameter no rank
  /// used keeps its `grad()` untouched (DDP's `find_unused_parameters`). When false,
  /// `finish()` refuses such a step with a `DistributedError` naming the parameters.
  bool find_unused_parameters = false;
};

/// Timing of one step (seconds, steady clock). The communication is the union of the
/// buckets' intervals from start to completion; the part of it before `finish()` was
/// called ran while the backward did ("hidden").
struct DataParallelStepStats {
  double backward_seconds = 0;   ///< first gradient accumulated -> finish() called
  double comm_seconds = 0;       ///< buckets in flight (union of intervals)
  double hidden_seconds = 0;     ///< of comm_seconds, before finish() was called
  double wait_seconds = 0;       ///< finish(): waiting for the buckets and writing back
  int buckets_before_finish = 0; ///< buckets started while the backward ran
};

/// Data-parallel gradients over a process group; see the file comment.
class DataParallel {
 public:
  /// Broadcasts `parameters` (leaf Variables requiring grad, CPU, distinct) from rank 0
  /// in place, checks that every rank passed the same shapes and dtypes, assigns the
  /// buckets and registers a post-accumulate-grad hook on every parameter. Throws
  /// `DistributedError` for no parameters, a parameter that is not a CPU leaf requiring
  /// grad, one given twice, non-positive bucket caps, parameters that differ between ranks
  /// (every rank throws), and what the collectives throw.
  DataParallel(std::shared_ptr<ProcessGroup> group, variable_list parameters,
               DataParallelOptions options = {})
      : group_(std::move(group)), params_(std::move(parameters)), o_(options) {
    STAGEJIT_CHECK_AS(DistributedError, group_, "DataParallel: null process group");
    STAGEJIT_CHECK_AS(DistributedError, !params_.empty(), "DataParallel: no parameters");
    STAGEJIT_CHECK_AS(DistributedError, o_.bucket_cap_mb > 0 && o_.first_bucket_cap_mb > 0,
                      "DataParallel: bucket caps must be positive (got ", o_.first_bucket_cap_mb,
                      " and ", o_.bucket_cap_mb, " MiB)");
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Variable& p = params_[i];
      STAGEJIT_CHECK_AS(DistributedError, p.defined() && p.is_leaf() && p.requires_grad(),
                        "DataParallel: parameter ", i, " is not a leaf Variable requiring grad");
      STAGEJIT_CHECK_AS(DistributedError, p.data().device().is_cpu(), "DataParallel: parameter ", i,
                        " is on ", p.data().device(), "; the Gloo process group reduces CPU tensors");
      for (std::size_t j = 0; j < i; ++j)
        STAGEJIT_CHECK_AS(DistributedError, params_[j].impl_id() != p.impl_id(), "DataParallel: parameter ",
                          i, " is parameter ", j, " again");
    }
    check_same_parameters();
    broadcast_parameters();
    assign_buckets();
    ready_.assign(params_.size(), 0);
    for (std::size_t i = 0; i < params_.size(); ++i)
      hooks_.push_back(params_[i].register_post_accumulate_grad_hook(
          [this, i](const Variable&) { mark_ready(i); }));
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// Removes the hooks. Buckets still in flight (a step abandoned by an error) are not
  /// waited for: their Work holds its own tensors, and the process group drains them.
  ~DataParallel() {
    for (std::size_t i = 0; i < params_.size() && i < hooks_.size(); ++i)
      params_[i].remove_post_accumulate_grad_hook(hooks_[i]);
  }

  /// Ends the step: starts the buckets not started yet (a parameter without a gradient
  /// per `find_unused_parameters`), waits for all of them and sets each parameter's
  /// `grad()` to the average of the ranks' gradients (a fresh tensor of the parameter's
  /// shape and dtype). Call it once per step, after the backward (which must have
  /// returned: `backward()` returning does not imply it) and before the optimiser step;
  /// every rank calls it. A step in which no gradient arrived at all is averaged like any
  /// other (all zeros, `grad()` untouched where no rank had one). Throws
  /// `DistributedError`: a parameter without a gradient when `find_unused_parameters` is
  /// off (naming it; the step is abandoned on this rank, the other ranks then fail with
  /// this rank lost), a failed or timed-out bucket (naming the lost rank: Note [Lost
  /// ranks] in distributed/process_group.hpp).
  void finish() {
    const auto finish_at = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!step_started_) step_start_ = finish_at;
      std::string unused;
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (!ready_[i]) unused += (unused.empty() ? "" : ", ") + describe(i);
      if (!unused.empty() && !o_.find_unused_parameters) {
        reset_step_locked();
        ::stagejit::detail::throw_error<DistributedError>(
            "DataParallel (rank ", group_->rank(), "): no gradient this step for parameter(s) ", unused,
            " (not used by the loss); construct with find_unused_parameters = true to count them "
            "as zero");
      }
      last_.buckets_before_finish = static_cast<int>(next_bucket_);
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (!ready_[i]) ready_locked(i, /*used=*/false);
      if (o_.find_unused_parameters) {
        used_ = at::empty({static_cast<int64_t>(params_.size())}, at::kFloat);
        auto acc = used_.accessor<float, 1>();
        for (std::size_t i = 0; i < params_.size(); ++i) acc[static_cast<int64_t>(i)] = used_locally_[i] ? 1.f : 0.f;
        used_work_ = group_->allreduce_async(used_);
      }
    }
    // Every bucket is started now; wait for them in order.
    try {
      for (std::size_t b = 0; b < buckets_.size(); ++b)
        group_->wait(buckets_[b].work, "DataParallel: all-reduce of gradient bucket " + std::to_string(b) +
                                           " (" + std::to_string(buckets_[b].params.size()) + " parameters)");
      if (used_work_) group_->wait(used_work_, "DataParallel: all-reduce of the used-parameter map");
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      reset_step_locked();
      throw;
    }
    std::vector<char> used_anywhere(params_.size(), 1);
    if (used_work_) {
      auto acc = used_.accessor<float, 1>();
      for (std::size_t i = 0; i < params_.size(); ++i) used_anywhere[i] = acc[static_cast<int64_t>(i)] > 0;
    }
    for (auto& b : buckets_) {
      int64_t offset = 0;
      for (std::size_t i : b.params) {
        const Variable& p = params_[i];
        const int64_t n = p.numel();
        if (used_anywhere[i]) p.set_grad(Variable(b.flat.narrow(0, offset, n).view(p.sizes())));
        offset += n;
      }
    }
    const auto done = Clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    record_step_locked(finish_at, done);
    reset_step_locked();
  }

  /// The buckets as parameter indices, in the order they are all-reduced.
  std::vector<std::vector<std::size_t>> bucket_indices() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.params);
    return out;
  }
  /// The timing of the last finished step.
  DataParallelStepStats last_step() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_;
  }
  /// The sums over every finished step (`buckets_before_finish` summed too).
  DataParallelStepStats totals() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return totals_;
  }
  /// Number of finished steps.
  int64_t steps() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return steps_;
  }
  ProcessGroup& group() noexcept { return *group_; }

 private:
  using Clock = std::chrono::steady_clock;

  struct Bucket {
    std::vector<std::size_t> params;  ///< parameter indices, in bucket order
    std::size_t pending = 0;          ///< parameters not ready yet this step
    at::Tensor flat;                  ///< this step's packed gradients (reduced in place)
    c10::intrusive_ptr<::c10d::Work> work;
    Clock::time_point started;
    /// Completion time (steady clock ticks; 0: not yet), written by the Work's future
    /// callback on a Gloo thread, which may outlive the step and this object.
    std::shared_ptr<std::atomic<int64_t>> completed;
  };

  std::string describe(std::size_t i) const {
    std::ostringstream os;
    os << i << " " << params_[i].sizes();
    return os.str();
  }

  // Every rank must pass the same parameters: a count, the sizes and dtypes hashed, as
  // [x, -x] all-reduced with MAX, so every rank sees whether all agree.
  void check_same_parameters() {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (const auto& p : params_) {
      mix(static_cast<uint64_t>(p.scalar_type()));
      mix(static_cast<uint64_t>(p.dim()));
      for (int64_t s : p.sizes()) mix(static_cast<uint64_t>(s));
    }
    const int64_t count = static_cast<int64_t>(params_.size());
    const int64_t hash = static_cast<int64_t>(h >> 2);
    at::Tensor t = at::tensor({count, hash, -count, -hash}, at::kLong);
    group_->wait(group_->allreduce_async(t, ::c10d::ReduceOp::MAX), "DataParallel: parameter check");
    auto a = t.accessor<int64_t, 1>();
    STAGEJIT_CHECK_AS(DistributedError, a[0] == -a[2] && a[1] == -a[3], "DataParallel (rank ",
                      group_->rank(), "): the ranks passed different parameters (count, shapes or "
                      "dtypes differ; this rank: ", count, " parameters)");
  }

  void broadcast_parameters() {
    std::map<at::ScalarType, std::vector<std::size_t>> by_dtype;
    for (std::size_t i = 0; i < params_.size(); ++i) by_dtype[params_[i].scalar_type()].push_back(i);
    for (auto& [dtype, idx] : by_dtype) {
      std::vector<at::Tensor> flat;
      for (std::size_t i : idx) flat.push_back(params_[i].data().reshape(-1));
      at::Tensor buffer = at::cat(flat);
      group_->broadcast(buffer, 0);
      int64_t offset = 0;
      for (std::size_t i : idx) {
        const at::Tensor& d = params_[i].data();
        d.copy_(buffer.narrow(0, offset, d.numel()).view(d.sizes()));
        offset += d.numel();
      }
    }
  }

  // Note [Gradient buckets]
  // As DDP's bucket assignment: parameters are taken in reverse order (the backward
  // produces the last layers' gradients first), one open bucket per dtype; a parameter
  // joins its dtype's open bucket, which closes once it holds at least its cap (the first
  // bucket of each dtype `first_bucket_cap_mb`, later ones `bucket_cap_mb`). Buckets are
  // ordered by their first parameter, so every rank (same parameters) has the same
  // buckets in the same order, and a bucket is started only when every bucket before it
  // was: the ranks issue the same collectives in the same order, whatever order their
  // gradients arrive in.
  void assign_buckets() {
    struct Open {
      std::vector<std::size_t> params;
      int64_t bytes = 0;
      int closed = 0;
    };
    std::map<at::ScalarType, Open> open;
    std::vector<std::vector<std::size_t>> done;
    auto cap = [&](int closed) {
      return static_cast<int64_t>((closed == 0 ? o_.first_bucket_cap_mb : o_.bucket_cap_mb) * 1024 * 1024);
    };
    for (std::size_t k = params_.size(); k-- > 0;) {
      Open& b = open[params_[k].scalar_type()];
      b.params.push_back(k);
      b.bytes += params_[k].numel() * static_cast<int64_t>(params_[k].data().element_size());
      if (b.bytes >= cap(b.closed)) {
        done.push_back(std::move(b.params));
        b.params.clear();
        b.bytes = 0;
        ++b.closed;
      }
    }
    for (auto& [dtype, b] : open)
      if (!b.params.empty()) done.push_back(std::move(b.params));
    // Bucket order: by first parameter in reverse parameter order.
    std::sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a[0] > b[0]; });
    bucket_of_.assign(params_.size(), 0);
    for (std::size_t b = 0; b < done.size(); ++b) {
      Bucket bucket;
      bucket.params = done[b];
      bucket.pending = bucket.params.size();
      for (std::size_t i : bucket.params) bucket_of_[i] = b;
      buckets_.push_back(std::move(bucket));
    }
    used_locally_.assign(params_.size(), 0);
  }

  // The post-accumulate-grad hook of parameter `i` (an engine thread).
  void mark_ready(std::size_t i) {
    std::lock_guard<std::mutex> lock(mutex_);
    STAGEJIT_CHECK_AS(DistributedError, !ready_[i], "DataParallel (rank ", group_->rank(), "): parameter ",
                      describe(i), " received a second gradient in one step (call finish() after "
                      "each backward)");
    if (!step_started_) {
      step_started_ = true;
      step_start_ = Clock::now();
    }
    ready_locked(i, /*used=*/true);
  }

  void ready_locked(std::size_t i, bool used) {
    ready_[i] = 1;
    used_locally_[i] = used ? 1 : 0;
    if (--buckets_[bucket_of_[i]].pending == 0)
      while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) start_locked(next_bucket_++);
  }

  // Packs the bucket's gradients (zeros for a parameter without one), divided by the
  // world size, and starts its all-reduce (sum).
  void start_locked(std::size_t b) {
    Bucket& bucket = buckets_[b];
    std::vector<at::Tensor> flat;
    flat.reserve(bucket.params.size());
    for (std::size_t i : bucket.params) {
      const Variable g = params_[i].grad();
      const at::Tensor& p = params_[i].data();
      flat.push_back(g.defined() && used_locally_[i] ? g.data().reshape(-1) : at::zeros({p.numel()}, p.options()));
    }
    bucket.flat = at::cat(flat);
    bucket.flat.div_(group_->world_size());
    bucket.started = Clock::now();
    bucket.completed = std::make_shared<std::atomic<int64_t>>(0);
    bucket.work = group_->allreduce_async(bucket.flat);
    bucket.work->getFuture()->addCallback([completed = bucket.completed](c10::ivalue::Future&) {
      completed->store(Clock::now().time_since_epoch().count());
    });
  }

  void record_step_locked(Clock::time_point finish_at, Clock::time_point done) {
    auto secs = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    DataParallelStepStats s;
    s.buckets_before_finish = last_.buckets_before_finish;
    s.backward_seconds = secs(finish_at - step_start_);
    s.wait_seconds = secs(done - finish_at);
    // Union of the buckets' intervals (started in order), and its part before finish().
    std::vector<std::pair<Clock::time_point, Clock::time_point>> iv;
    for (const auto& b : buckets_) {
      const int64_t c = b.completed ? b.completed->load() : 0;
      iv.emplace_back(b.started, c != 0 ? Clock::time_point(Clock::duration(c)) : done);
    }
    std::sort(iv.begin(), iv.end());
    Clock::time_point cur_begin{}, cur_end{};
    bool open = false;
    auto close = [&] {
      if (!open) return;
      s.comm_seconds += secs(cur_end - cur_begin);
      if (finish_at > cur_begin) s.hidden_seconds += secs(std::min(cur_end, finish_at) - cur_begin);
    };
    for (const auto& [b, e] : iv) {
      if (open && b <= cur_end) {
        cur_end = std::max(cur_end, e);
        continue;
      }
      close();
      cur_begin = b;
      cur_end = e;
      open = true;
    }
    close();
    last_ = s;
    totals_.backward_seconds += s.backward_seconds;
    totals_.comm_seconds += s.comm_seconds;
    totals_.hidden_seconds += s.hidden_seconds;
    totals_.wait_seconds += s.wait_seconds;
    totals_.buckets_before_finish += s.buckets_before_finish;
    ++steps_;
  }

  void reset_step_locked() {
    std::fill(ready_.begin(), ready_.end(), 0);
    std::fill(used_locally_.begin(), used_locally_.end(), 0);
    for (auto& b : buckets_) {
      b.pending = b.params.size();
      b.work.reset();
      b.flat = at::Tensor();
      b.completed.reset();
    }
    next_bucket_ = 0;
    step_started_ = false;
    used_work_.reset();
  }

  std::shared_ptr<ProcessGroup> group_;
  variable_list params_;
  DataParallelOptions o_;
  std::vector<uint64_t> hooks_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  mutable std::mutex mutex_;
  std::vector<char> ready_, used_locally_;
  std::size_t next_bucket_ = 0;
  bool step_started_ = false;
  Clock::time_point step_start_;
  at::Tensor used_;
  c10::intrusive_ptr<::c10d::Work> used_work_;
  DataParallelStepStats last_, totals_;
  int64_t steps_ = 0;
};

}  // namespace stagejit::distributed
