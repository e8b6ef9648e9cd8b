// stagejit-run FILE.ir [--print] [--passes dce,cse,fuse] [--stage K [--seed N]]
//
// Parses an IR file, lints it, applies the requested passes (linting after each) and
// optionally prints the canonical text. With `--stage K` it then compiles the graph into
// stage closures and runs stages 0..K through them: stage 0 on random inputs of the
// declared types (standard normal for floating dtypes, integers in [0, 10) otherwise,
// from `--seed`), every later stage on grad outputs of ones; it prints each stage's
// outputs. Exit status: 0 on success; 2 on a parse, lint, compile or run error, reported
// on stderr as `FILE:line:col: message` (errors without a source position report 0:0,
// or just `FILE: message`); 1 on usage or I/O errors.
#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <stagejit/stagejit.hpp>

namespace ir = stagejit::ir;

namespace {

/// A tensor of `v`'s declared type: random (seeded by the caller) or ones.
at::Tensor input_for(const ir::Value* v, std::size_t stage, bool random) {
  const ir::TensorType* type = v->tensor_type();
  if (!type)
    stagejit::detail::throw_error<stagejit::Error>(
        "stage ", stage, " input ", ir::value_label(v),
        " has no tensor type (", ir::to_string(v->type()),
        "); --stage needs declared types such as Float(4, 3)");
  auto options = at::TensorOptions().dtype(type->dtype);
  at::Tensor t;
  if (!random) t = at::ones(type->sizes, options);
  else if (at::isFloatingType(type->dtype)) t = at::randn(type->sizes, options);
  else if (type->dtype == at::kBool) t = at::randint(0, 2, type->sizes, options);
  else t = at::randint(0, 10, type->sizes, options);
  if (!type->strides.empty() && !type->is_contiguous())
    t = at::empty_strided(type->sizes, type->strides, options).copy_(t);
  return t;
}

std::string value_name(const ir::Value* v) { return ir::value_label(v); }

/// Compiles `graph` into stage closures and runs stages 0..last, printing every input
/// and output.
void run_stages(const std::shared_ptr<ir::Graph>& graph, std::size_t last, uint64_t seed) {
  STAGEJIT_CHECK(last < graph->num_stages(), "--stage ", last, ": the graph has ",
                 graph->num_stages(), " stage", graph->num_stages() == 1 ? "" : "s",
                 " (0..", graph->num_stages() - 1, ")");
  auto closure = std::make_shared<const stagejit::closure::MultiStageClosure>(graph);
  at::manual_seed(seed);
  std::vector<stagejit::variable_list> inputs(last + 1);
  for (std::size_t s = 0; s <= last; ++s)
    for (const ir::Value* v : closure->plan.stage_inputs(s))
      inputs[s].emplace_back(input_for(v, s, s == 0));
  auto outputs = stagejit::closure::run_stages(closure, inputs);
  for (std::size_t s = 0; s <= last; ++s) {
    std::cout << "---- stage " << s << " inputs"
              << (s == 0 ? " (random, seed " + std::to_string(seed) + ")" : " (ones)") << "\n";
    const auto& ins = closure->plan.stage_inputs(s);
    for (std::size_t i = 0; i < ins.size(); ++i)
      std::cout << value_name(ins[i]) << " : " << ir::to_string(ins[i]->type()) << " =\n"
                << inputs[s][i].data() << "\n";
    std::cout << "---- stage " << s << " outputs\n";
    const auto& outs = closure->plan.stage_outputs(s);
    for (std::size_t i = 0; i < outs.size(); ++i) {
      std::cout << value_name(outs[i]) << " : " << ir::to_string(outs[i]->type()) << " =\n";
      if (outputs[s][i].defined()) std::cout << outputs[s][i].data() << "\n";
      else std::cout << "undefined\n";
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Parse, lint, transform and print a stagejit IR file"};
  std::string file;
  bool print = false;
  std::vector<std::string> passes;
  int stage = -1;
  uint64_t seed = 0;
  app.add_option("file", file, "IR file (canonical or seed-era text)")->required();
  app.add_flag("--print", print, "print the (transformed) graph in canonical form");
  app.add_option("--passes", passes, "passes to run in order: dce, cse, fuse")
      ->delimiter(',')
      ->check(CLI::IsMember({"dce", "cse", "fuse"}));
  app.add_option("--stage", stage,
                 "run stages 0..K through the compiled closures and print their outputs")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed, "seed of the random stage-0 inputs (with --stage)")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help: 0; usage errors: 1
  }

  std::ifstream in(file, std::ios::binary);
  if (!in) {
    std::cerr << file << ": cannot open file\n";
    return 1;
  }
  std::ostringstream text;
  text << in.rdbuf();

  try {
    auto graph = ir::parse(text.str());
    ir::lint(*graph);
    for (const auto& p : passes) {
      if (p == "dce") stagejit::passes::eliminate_dead_code(*graph);
      else if (p == "cse") stagejit::passes::eliminate_common_subexpressions(*graph);
      else stagejit::passes::fuse(*graph);
      ir::lint(*graph);
    }
    if (print) std::cout << ir::to_string(*graph);
    else if (stage < 0)
      std::cerr << file << ": ok (" << graph->num_stages() << " stages, " << graph->nodes().size()
                << " nodes)\n";
    if (stage >= 0) run_stages(graph, static_cast<std::size_t>(stage), seed);
  } catch (const stagejit::ParseError& e) {
    std::cerr << file << ":" << e.line() << ":" << e.column() << ": " << e.message() << "\n";
    return 2;
  } catch (const ir::LintError& e) {
    std::cerr << file << ":" << e.location().line << ":" << e.location().column << ": " << e.what() << "\n";
    return 2;
  } catch (const stagejit::Error& e) {
    std::cerr << file << ": " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {  // ATen refusing a declared input type (--stage)
    std::cerr << file << ": " << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << file << ": " << e.what() << "\n";
    return 2;
  }
  return 0;
}
