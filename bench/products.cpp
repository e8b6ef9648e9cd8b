// bench/products: matrix products of the shapes higher-order workloads run, through ATen
// (OpenBLAS in Debian's libtorch) and through stagejit's `ops::small_mm` (LIBXSMM row or
// K blocks, ops/small_gemm.hpp), in GFLOP/s on one ATen thread. Each shape in three
// layouts: NN (h W), NT (g W^T, W^T a transposed view) and TN (h^T g, a weight
// gradient). "refused" means small_mm leaves the product to ATen (Note [Medium products]
// sets the bounds; this bench is how they were measured). Run with
// OPENBLAS_NUM_THREADS=1 on an idle machine.
//
// Options: --dtype float|double|both, --reps N (timed runs per product, median).
#include "../examples/cli.hpp"
#include "bench_util.hpp"

#include <stagejit/ops/small_gemm.hpp>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

struct Shape {
  int64_t M, K, N;
  const char* where;
};

// M x K times K x N, with the workload that runs it (bench/workloads.md).
const Shape kShapes[] = {
    {10000, 20, 20, "burgers layer (tall)"},  {20, 10000, 20, "burgers weight grad (reduction)"},
    {1000, 40, 40, "maml layer"},             {2000, 32, 128, "critic128 input layer"},
    {2000, 128, 128, "critic128 layer"},      {128, 2000, 128, "critic128 weight grad"},
    {2000, 512, 512, "critic512 layer"},      {512, 2000, 512, "critic512 weight grad"},
    {512, 64, 256, "hvp input layer"},        {512, 256, 256, "hvp layer"},
    {256, 512, 256, "hvp weight grad"},       {512, 256, 10, "hvp output layer"},
    {256, 512, 10, "hvp output weight grad"}, {100, 20, 20, "under 128 rows"},
    {32, 256, 10, "cnn classifier (reduction)"},
    // The same narrow layer feature-major (W^T H^T: the rows along the vector), the layout
    // a row-tiled region could keep for layers of a few dozen units (bench/higher_order.md,
    // "Session of 2026-12-07, 16:52"), whole and at a tile's rows.
    {20, 20, 10000, "burgers layer, feature-major"},   {256, 20, 20, "burgers tile (256 rows)"},
    {20, 20, 256, "burgers tile, feature-major"},      {256, 32, 32, "kdv tile (256 rows)"},
    {32, 32, 256, "kdv tile, feature-major"},          {40, 40, 1000, "maml layer, feature-major"},
    {4000, 50, 50, "poisson layer (tall)"},            {50, 50, 4000, "poisson layer, feature-major"},
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Matrix products through ATen and through stagejit's small_mm (LIBXSMM), GFLOP/s"};
  std::string dtype_opt = "both";
  int reps = 50;
  app.add_option("--dtype", dtype_opt, "float, double or both")
      ->capture_default_str()
      ->check(CLI::IsMember({"float", "double", "both"}));
  app.add_option("--reps", reps, "Timed runs per product (median)")->capture_default_str()->check(CLI::PositiveNumber);
  if (auto status = stagejit_examples::parse_command_line(app, argc, argv)) return *status;

  at::set_num_threads(1);
  const char* blas_env = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("ATen threads %d; OPENBLAS_NUM_THREADS=%s; small_mm %s; median of %d runs, GFLOP/s\n",
              at::get_num_threads(), blas_env ? blas_env : "(unset)",
              stagejit::ops::small_mm_enabled() ? "on" : "off (no LIBXSMM, or STAGEJIT_SMALL_GEMM=0)", reps);
  std::printf("  %-6s %-20s %-34s %-6s %8s %9s %7s\n", "dtype", "M x K x N", "workload", "layout", "ATen",
              "small_mm", "ratio");
  for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
    if ((dt == at::kFloat && dtype_opt == "double") || (dt == at::kDouble && dtype_opt == "float")) continue;
    for (const Shape& s : kShapes)
      for (const char* layout : {"NN", "NT", "TN"}) {
        at::manual_seed(0);
        const std::string l = layout;
        const at::Tensor a = l == "TN" ? at::randn({s.K, s.M}, dt).t() : at::randn({s.M, s.K}, dt);
        const at::Tensor b = l == "NT" ? at::randn({s.N, s.K}, dt).t() : at::randn({s.K, s.N}, dt);
        const double gflop = 2.0 * double(s.M) * double(s.K) * double(s.N) * 1e-9;
        const double aten_ms = stagejit::bench::median_ms([&] { (void)at::mm(a, b); }, reps);
        const bool taken = stagejit::ops::small_mm(a, b).has_value();
        const std::string size = std::to_string(s.M) + " x " + std::to_string(s.K) + " x " + std::to_string(s.N);
        std::printf("  %-6s %-20s %-34s %-6s %8.1f", dt == at::kFloat ? "float" : "double", size.c_str(), s.where,
                    layout, gflop / aten_ms * 1e3);
        if (!taken) {
          std::printf(" %9s %7s\n", "refused", "");
          continue;
        }
        const double sj_ms = stagejit::bench::median_ms([&] { (void)stagejit::ops::small_mm(a, b); }, reps);
        std::printf(" %9.1f %6.2fx\n", gflop / sj_ms * 1e3, aten_ms / sj_ms);
      }
  }
  return 0;
}
