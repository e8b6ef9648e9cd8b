#pragma once
// GEMM profiling of bench/pinn and bench/higher_order: ATen RecordFunction callbacks on
// the matrix products (aten::mm, addmm, bmm, matmul, and stagejit::small_mm, the LIBXSMM
// products of ops/small_gemm.hpp; the outermost call only: matmul -> mm counts once).
// They measure the wall time during which at least one product runs (the compiled
// stages may run products on two threads at once), the time summed over products, the
// number of products and, with operands, their FLOPs 2 M K N and a breakdown by operand
// shapes. Not part of the library.
#include <ATen/record_function.h>

#include "../test/support/record_function.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace stagejit::bench {

/// What one profiled run saw.
struct GemmProfile {
  double wall_ms = 0;   // wall time with at least one product running
  double sum_ms = 0;    // summed over products (and threads)
  int64_t calls = 0;    // outermost products
  double flops = 0;     // 2 M K N over the products with operands (with_inputs only)
  int64_t unknown = 0;  // products reported without operands (row-tiled LIBXSMM calls)
  // "op [a,b] [c,d]" -> (ns, calls), with_inputs only.
  std::map<std::string, std::pair<int64_t, int64_t>> by_shape;
};

namespace gemm_detail {

struct State {
  std::mutex mutex;
  bool with_inputs = false;
  int busy_active = 0;
  std::chrono::steady_clock::time_point busy_start;
  int64_t busy_ns = 0;
  std::atomic<int64_t> sum_ns{0};
  std::atomic<int64_t> calls{0};
  double flops = 0;
  int64_t unknown = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> by_shape;
};

inline State& state() {
  static State s;
  return s;
}
inline thread_local int t_depth = 0;  // nested products (matmul -> mm) are counted once

struct Context : at::ObserverContext {
  std::chrono::steady_clock::time_point start;
  std::string shape;
};

inline bool is_gemm(const char* name) {
  for (const char* g : {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "stagejit::small_mm"})
    if (std::strcmp(name, g) == 0) return true;
  return false;
}

inline std::string dims(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

inline std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!is_gemm(fn.name())) return nullptr;
  if (t_depth++ > 0) return nullptr;
  State& s = state();
  auto ctx = std::make_unique<Context>();
  if (s.with_inputs) {
    std::vector<at::Tensor> ts;
    ctx->shape = fn.name();
    for (const c10::IValue& v : fn.inputs())
      if (v.isTensor()) {
        ts.push_back(v.toTensor());
        ctx->shape += " " + dims(ts.back());
      }
    std::lock_guard<std::mutex> lock(s.mutex);
    if (ts.size() < 2) {
      ++s.unknown;
    } else {
      // addmm (c, a, b): the last two operands; mm, bmm, matmul, small_mm (a, b).
      const at::Tensor& a = ts[ts.size() - 2];
      const at::Tensor& b = ts[ts.size() - 1];
      s.flops += 2.0 * double(a.numel()) * double(b.dim() >= 2 ? b.size(-1) : 1);
    }
  }
  ctx->start = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.busy_active++ == 0) s.busy_start = ctx->start;
  return ctx;
}

inline void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (!is_gemm(fn.name())) return;
  --t_depth;
  auto* c = static_cast<Context*>(ctx);
  if (!c) return;
  const auto now = std::chrono::steady_clock::now();
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - c->start).count();
  State& s = state();
  s.sum_ns += ns;
  ++s.calls;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (--s.busy_active == 0)
    s.busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now - s.busy_start).count();
  if (s.with_inputs) {
    auto& e = s.by_shape[c->shape];
    e.first += ns;
    ++e.second;
  }
}

}  // namespace gemm_detail

/// Profiles the products `run` performs. One profiled run at a time (process-wide
/// counters). `with_inputs`: read the operands (FLOPs, by_shape; a little more overhead).
inline GemmProfile profile_gemm(const std::function<void()>& run, bool with_inputs) {
  gemm_detail::State& s = gemm_detail::state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.with_inputs = with_inputs;
    s.busy_active = 0;
    s.busy_ns = 0;
    s.sum_ns = 0;
    s.calls = 0;
    s.flops = 0;
    s.unknown = 0;
    s.by_shape.clear();
  }
  stagejit::testing::with_global_callback(
      at::RecordFunctionCallback(gemm_detail::on_start, gemm_detail::on_end).needsInputs(with_inputs), run);
  std::lock_guard<std::mutex> lock(s.mutex);
  GemmProfile p;
  p.wall_ms = double(s.busy_ns) * 1e-6;
  p.sum_ms = double(s.sum_ns.load()) * 1e-6;
  p.calls = s.calls.load();
  p.flops = s.flops;
  p.unknown = s.unknown;
  p.by_shape = s.by_shape;
  return p;
}

}  // namespace stagejit::bench
