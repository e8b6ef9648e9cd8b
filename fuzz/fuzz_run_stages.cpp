// libFuzzer target: graphs that parse and lint are compiled into stage closures and
// their stage 0 is run (`closure::run_stages`, as `stagejit-run --stage 0`) on small
// random inputs of the declared types (fuzz/README.md). The rule of issue 15: lint must
// reject every graph the runner cannot run, and nothing may crash. After lint accepted a
// graph, building and running it may only fail with the errors listed in
// `expected_run_error` (what lint cannot know: values, shapes, the op table, host
// functions); anything else is a finding: __builtin_trap().
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include <ATen/Parallel.h>
#include <stagejit/compiler.hpp>

#include "fuzz_common.hpp"

namespace ir = stagejit::ir;
namespace fz = stagejit::fuzz;

// Graphs may ask ATen for any amount of memory (`zeros[size=[...]]`, broadcasts): an
// allocation over 1 GiB fails (ATen then throws its out-of-memory error) instead of
// being a libFuzzer out-of-memory report; stagejit must turn that error into a
// stagejit::Error like any other ATen error.
extern "C" const char* __asan_default_options() {
  return "allocator_may_return_null=1:max_allocation_size_mb=1024";
}

namespace {

/// Inputs over this many elements in all (storage extents, summed) are not generated.
constexpr int64_t kMaxInputElements = 4096;

/// The storage extent, in elements, of a tensor of `type` (0 for an empty one); -1 when
/// it does not fit in 64 bits.
int64_t storage_extent(const ir::TensorType& type) {
  int64_t extent = 1;
  for (size_t d = 0; d < type.sizes.size(); ++d) {
    if (type.sizes[d] == 0) return 0;
    int64_t stride = d < type.strides.size() ? type.strides[d] : 1, span;
    if (__builtin_mul_overflow(type.sizes[d] - 1, stride, &span) || __builtin_add_overflow(extent, span, &extent))
      return -1;
  }
  return extent;
}

/// Random stage-0 inputs of the declared types, as stagejit-run makes them; false when an
/// input has no tensor type, is not on the CPU, or the inputs are over the size cap.
bool make_inputs(const stagejit::closure::MultiStageClosure& closure, stagejit::variable_list& out) {
  int64_t total = 0;
  for (const ir::Value* v : closure.plan.stage_inputs(0)) {
    const ir::TensorType* type = v->tensor_type();
    if (!type || !type->device.is_cpu()) return false;
    int64_t extent = storage_extent(*type);
    if (extent < 0 || __builtin_add_overflow(total, extent, &total) || total > kMaxInputElements) return false;
  }
  at::manual_seed(0);
  for (const ir::Value* v : closure.plan.stage_inputs(0)) {
    const ir::TensorType& type = *v->tensor_type();
    auto options = at::TensorOptions().dtype(type.dtype);
    at::Tensor t;
    try {
      if (at::isFloatingType(type.dtype)) t = at::randn(type.sizes, options);
      else if (type.dtype == at::kBool) t = at::randint(0, 2, type.sizes, options);
      else t = at::randint(0, 10, type.sizes, options);
      if (!type.strides.empty() && !type.is_contiguous())
        t = at::empty_strided(type.sizes, type.strides, options).copy_(t);
    } catch (const c10::Error&) {
      return false;  // ATen cannot make random tensors of this dtype: the harness skips it
    }
    out.emplace_back(t);
  }
  return true;
}

bool contains(std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; }

/// True for the errors a graph lint accepted may still meet when it is built and run
/// (fuzz/README.md, "What counts as a finding"). Lint checks the IR's structure (stages,
/// Handles, def-before-use, output groups, fixed arities of the built-in kinds, fusion
/// group subgraphs), refuses ops the table lacks, and checks table ops' input and output
/// counts, chunk's and split's sizes and elementwise ops' declared types against the op
/// schema (issue 34); it does not run ops nor look at values. So:
/// - ShapeError, DtypeError: ATen refusing the actual tensors;
/// - the op table refusing a node: an op it lacks, an op's arity or attributes, an output
///   count the op does not produce (chunk's depends on the input's shape);
/// - a HostOp or Eval: text cannot hold host functions, so a parsed HostOp has no callable;
/// - an undefined tensor (Undefined) fed to an op;
/// - ATen out of memory (the 1 GiB cap above).
/// A failed internal assertion, an IrError (an invariant lint should have caught), any
/// other CompileError / FusionError / Error, and anything that is not a stagejit::Error
/// are findings.
bool expected_run_error(const stagejit::Error& e) {
  using namespace stagejit;
  if (dynamic_cast<const ShapeError*>(&e) || dynamic_cast<const DtypeError*>(&e)) return true;
  if (dynamic_cast<const IrError*>(&e)) return false;
  const std::string_view m = e.what();
  auto any_of = [&](std::initializer_list<std::string_view> parts) {
    for (std::string_view p : parts)
      if (contains(m, p)) return true;
    return false;
  };
  if (dynamic_cast<const CompileError*>(&e) || dynamic_cast<const FusionError*>(&e))
    return any_of({
        "calls the unknown op '",          // closure: an op the table lacks
        "unknown op '",                    // ops::def, in a fusion group
        "cannot be passed to a table op",  // an attribute of a kind no table op takes
        "has no callable",                 // closure: a parsed HostOp
        "needs its evaluator's context",   // a HostOp or Eval inside a fusion group
    });
  if (typeid(e) != typeid(Error)) return false;
  return any_of({
      // An op computing: the engine names the Function (OpCall: a table op; AtenCall:
      // Transpose, Reshape, Gemm; FusedKernel: a fusion group run node by node). ATen's
      // shape inference (ATen/InferSize.h: reshape, view) throws std::runtime_error,
      // which the engine reports as a plain Error.
      "Function 'OpCall(", "Function 'AtenCall(", "Function 'FusedKernel(",
      "op '",                                   // ops::run_forward: the op refused its inputs or attributes
      "returned an invalid number of outputs",  // engine: the op's outputs vs the node's
      "is undefined",                           // an Undefined fed to an op
      "not enough memory",                      // ATen out of memory (the 1 GiB cap above)
  });
}

}  // namespace

static bool log_errors = false;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  const char* log = std::getenv("STAGEJIT_FUZZ_LOG_ERRORS");
  log_errors = log && *log == '1';
  // Fusion groups run their nodes one by one: a compiler that cannot be found makes the
  // CPU backend fail fast and `run_fused` fall back (instead of compiling a kernel with
  // the system compiler, seconds per group). The disk cache goes to a private folder.
  setenv("STAGEJIT_CXX", "/nonexistent/stagejit-fuzz-no-compiler", 1);
  auto cache = std::filesystem::temp_directory_path() / ("stagejit-fuzz-cache-" + std::to_string(getpid()));
  setenv("STAGEJIT_FUSION_CACHE_DIR", cache.c_str(), 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::shared_ptr<ir::Graph> graph;
  try {
    graph = ir::parse(text);
    ir::lint(*graph);
  } catch (const stagejit::Error& e) {
    fz::check_not_internal(e, "parse + lint");
    return 0;  // rejected: fuzz_ir_parse checks the rejections themselves
  }
  std::shared_ptr<const stagejit::closure::MultiStageClosure> closure;
  stagejit::variable_list inputs;
  fz::no_foreign_exceptions("build + run stage 0", [&] {
    try {
      closure = std::make_shared<const stagejit::closure::MultiStageClosure>(graph);
      if (!make_inputs(*closure, inputs)) {
        if (log_errors) std::fprintf(stderr, "run skipped: inputs\n");
        return;
      }
      auto outputs = stagejit::closure::run_stages(closure, {inputs});
      if (log_errors) std::fprintf(stderr, "run ok\n");
      if (outputs.size() != 1 || outputs[0].size() != closure->plan.stage_outputs(0).size())
        fz::finding("run_stages returned the wrong number of outputs", ir::to_string(*graph));
    } catch (const stagejit::Error& e) {
      fz::check_not_internal(e, "build + run stage 0");
      if (log_errors) {  // STAGEJIT_FUZZ_LOG_ERRORS=1: which errors the corpus meets (fuzz/README.md)
        const std::string_view m = e.what();
        std::fprintf(stderr, "run error: %s: %.*s\n", typeid(e).name(), int(m.find('\n')), m.data());
      }
      if (!expected_run_error(e))
        fz::finding("lint accepted a graph that the runner refuses with an error lint should have raised",
                    std::string(typeid(e).name()) + ": " + e.what() + "\n" + ir::to_string(*graph));
    }
  });
  return 0;
}
