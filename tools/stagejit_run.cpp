// stagejit-run FILE.ir [--print] [--passes dce,cse,fuse] [--stage K [--seed N]]
//               [--allow-unknown-ops]
//
// Parses an IR file, lints it, applies the requested passes (linting after each) and
// optionally prints the canonical text. Lint refuses ops the op table does not know
// unless `--allow-unknown-ops` is given (such a graph can be printed and transformed,
// not run). With `--stage K` it then compiles the graph into stage closures and runs
// stages 0..K through them: stage 0 on random inputs of the declared types (standard
// normal for floating dtypes, integers in [0, 10) otherwise, from `--seed`), every later
// stage on grad outputs of ones; it prints each stage's outputs. Before that it runs the
// graph as read, node by node, and checks every value it computes against its declared
// type (dtype and sizes): a type that lies is an error naming the value, its node (line
// and column) and both types. An input too large to allocate is an error naming the
// input, its type and its size in bytes. Exit status: 0 on success; 2 on a parse, lint,
// compile or run error, reported on stderr as `FILE:line:col: message` (errors without a
// source position report 0:0, or just `FILE: message`); 1 on usage or I/O errors.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <charconv>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <stagejit/ir/node_semantics.hpp>
#include <stagejit/compiler.hpp>

namespace ir = stagejit::ir;

namespace {

/// `bytes` for people: 1.5 GiB.
std::string bytes_text(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes);
  std::size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(units)) v /= 1024, ++u;
  std::ostringstream os;
  os.precision(3);
  os << v << " " << units[u];
  return os.str();
}

/// A tensor of `v`'s declared type: random (seeded by the caller) or ones. Throws Error
/// naming the input, its type and its size in bytes when the tensor does not fit (in
/// 64 bits, in this machine's memory, or ATen's allocator refuses it).
at::Tensor input_for(const ir::Value* v, std::size_t stage, bool random) {
  const ir::TensorType* type = v->tensor_type();
  if (!type)
    stagejit::detail::throw_error<stagejit::Error>(
        "stage ", stage, " input ", ir::value_label(v),
        " has no tensor type (", ir::to_string(v->type()),
        "); --stage needs declared types such as Float(4, 3)");
  const std::string what = stagejit::detail::str_cat("stage ", stage, " input ", ir::value_label(v), " : ",
                                                     ir::to_string(v->type()));
  uint64_t bytes = c10::elementSize(type->dtype);
  for (int64_t s : type->sizes)
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(s), &bytes))
      stagejit::detail::throw_error<stagejit::Error>(what, ": its size in bytes does not fit in 64 bits");
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  const uint64_t memory = pages > 0 && page_size > 0 ? uint64_t(pages) * uint64_t(page_size) : 0;
  if (memory && bytes > memory)
    stagejit::detail::throw_error<stagejit::Error>(what, " needs ", bytes, " bytes (", bytes_text(bytes),
                                                   "), more than this machine's memory (", bytes_text(memory), ")");
  try {
    auto options = at::TensorOptions().dtype(type->dtype);
    at::Tensor t;
    if (!random) t = at::ones(type->sizes, options);
    else if (at::isFloatingType(type->dtype)) t = at::randn(type->sizes, options);
    else if (type->dtype == at::kBool) t = at::randint(0, 2, type->sizes, options);
    else t = at::randint(0, 10, type->sizes, options);
    if (!type->strides.empty() && !type->is_contiguous())
      t = at::empty_strided(type->sizes, type->strides, options).copy_(t);
    return t;
  } catch (const c10::Error& e) {
    std::string reason = e.what_without_backtrace();
    reason = reason.substr(0, reason.find('\n'));
    stagejit::detail::throw_error<stagejit::Error>(what, " needs ", bytes, " bytes (", bytes_text(bytes),
                                                   "): cannot allocate it: ", reason);
  } catch (const std::bad_alloc&) {
    stagejit::detail::throw_error<stagejit::Error>(what, " needs ", bytes, " bytes (", bytes_text(bytes),
                                                   "): cannot allocate it");
  }
}

/// Runs `g` node by node on `env` (its inputs' tensors) without autograd and checks each
/// value it computes against its declared type; a FusionGroup's subgraph is run and
/// checked the same way. Nodes it cannot run alone (host ops, Evals, an op that fails)
/// leave their outputs unknown: the closures report their errors.
void check_computed_types(const ir::Graph& g, std::unordered_map<const ir::Value*, at::Tensor>& env,
                          std::size_t depth = 0) {
  std::unordered_map<const ir::Value*, std::size_t> uses_left;
  for (const ir::Node* n : g.nodes())
    for (const ir::Value* v : n->inputs()) ++uses_left[v];
  for (const ir::Node* n : g.nodes()) {
    std::vector<at::Tensor> in;
    bool known = true;
    for (const ir::Value* v : n->inputs()) {
      auto it = env.find(v);
      if (it == env.end()) known = false;
      else in.push_back(it->second);
    }
    for (const ir::Value* v : n->inputs())  // free what no later node reads
      if (--uses_left[v] == 0 && v->node()->owning_graph() == &g && !v->node()->is<ir::Param>()) {
        bool output = false;
        for (const ir::Value* o : g.outputs()) output = output || o == v;
        if (!output) env.erase(v);
      }
    if (!known) continue;
    std::vector<at::Tensor> out;
    if (const auto* fg = n->get_if<ir::FusionGroup>(); fg && fg->subgraph && depth < 64) {
      const ir::Graph& sub = *fg->subgraph;
      if (sub.inputs().size() != in.size()) continue;
      std::unordered_map<const ir::Value*, at::Tensor> sub_env;
      for (std::size_t i = 0; i < in.size(); ++i) sub_env[sub.inputs()[i]] = in[i];
      check_computed_types(sub, sub_env, depth + 1);
      for (const ir::Value* o : sub.outputs()) {
        auto it = sub_env.find(o);
        if (it == sub_env.end()) break;
        out.push_back(it->second);
      }
      if (out.size() != sub.outputs().size()) continue;
    } else {
      bool pure = std::visit([](const auto& k) { return stagejit::semantics::is_pure_kind<std::decay_t<decltype(k)>>; },
                             n->kind());
      if (!pure) continue;
      try {
        out = stagejit::semantics::run_pure(*n, in);
      } catch (const std::exception&) {
        continue;  // the closures run it again and report the error
      }
    }
    if (out.size() != n->outputs().size()) continue;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const ir::Value* v = n->outputs()[i];
      const ir::TensorType* declared = v->tensor_type();
      if (declared && out[i].defined()) {
        const bool dtype_ok = out[i].scalar_type() == declared->dtype;
        if (!dtype_ok || out[i].sizes() != at::IntArrayRef(declared->sizes)) {
          const std::string what = stagejit::detail::str_cat(
              "value ", ir::value_label(v), " (node ", ir::node_label(n), depth ? ", in a fusion group" : "",
              ") is computed as ", ir::to_string(ir::Type(ir::TensorType::contiguous(out[i].scalar_type(), out[i].sizes()))),
              " (a ", out[i].scalar_type(), " tensor of sizes ", out[i].sizes(), ") but is declared ",
              ir::to_string(v->type()));
          if (!dtype_ok) throw stagejit::DtypeError(what);
          throw stagejit::ShapeError(what);
        }
      }
      env[v] = out[i];
    }
  }
}

std::string value_name(const ir::Value* v) { return ir::value_label(v); }

/// The inputs of stages 0..last: stage 0 random (from `seed`), later stages ones.
std::vector<stagejit::variable_list> make_inputs(const ir::Graph& graph, std::size_t last, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<stagejit::variable_list> inputs(last + 1);
  for (std::size_t s = 0; s <= last; ++s)
    for (const ir::Value* v : graph.stage_inputs(s)) inputs[s].emplace_back(input_for(v, s, s == 0));
  return inputs;
}

/// Checks the values of stages 0..last of `graph` (as read) against their declared types
/// (`check_computed_types`); the random generator is left as it was.
void check_declared_types(const ir::Graph& graph, const std::vector<stagejit::variable_list>& inputs) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state = gen.get_state();
  std::unordered_map<const ir::Value*, at::Tensor> env;
  for (std::size_t s = 0; s < inputs.size(); ++s) {
    auto ins = graph.stage_inputs(s);
    for (std::size_t i = 0; i < ins.size() && i < inputs[s].size(); ++i) env[ins[i]] = inputs[s][i].data();
  }
  // Nodes of later stages than the last one run are not checked: their inputs are not given.
  for (const ir::Value* v : graph.inputs())
    if (v->stage() >= inputs.size()) env.erase(v);
  try {
    check_computed_types(graph, env);
  } catch (...) {
    gen.set_state(state);
    throw;
  }
  gen.set_state(state);
}

/// Compiles `graph` into stage closures and runs stages 0..inputs.size()-1 on `inputs`,
/// printing every input and output.
void run_stages(const std::shared_ptr<ir::Graph>& graph, const std::vector<stagejit::variable_list>& inputs,
                uint64_t seed) {
  const std::size_t last = inputs.size() - 1;
  auto closure = std::make_shared<const stagejit::closure::MultiStageClosure>(graph);
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

/// `--stage`'s value: a stage number, 0 to Graph's limit (2^20 - 1). Empty when it is
/// one, else what is wrong with it.
std::string check_stage_text(const std::string& text) {
  int64_t k = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), k);
  constexpr int64_t limit = (int64_t(1) << 20) - 1;
  if (ec == std::errc::result_out_of_range || (ec == std::errc() && end == text.data() + text.size() && (k < 0 || k > limit)))
    return "stage " + text + " is out of range: a stage number is 0 to " + std::to_string(limit) +
           " (and below the graph's number of stages)";
  if (ec != std::errc() || end != text.data() + text.size())
    return "'" + text + "' is not a stage number (an integer, 0 for stage 0 only)";
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Parse, lint, transform and print a stagejit IR file"};
  std::string file;
  bool print = false;
  std::vector<std::string> passes;
  std::string stage_text;
  uint64_t seed = 0;
  bool allow_unknown_ops = false;
  app.add_option("file", file, "IR file (canonical or seed-era text)")->required();
  app.add_flag("--print", print, "print the (transformed) graph in canonical form");
  app.add_option("--passes", passes, "passes to run in order: dce, cse, fuse")
      ->delimiter(',')
      ->check(CLI::IsMember({"dce", "cse", "fuse"}));
  app.add_option("--stage", stage_text,
                 "run stages 0..K through the compiled closures and print their outputs")
      ->check(CLI::Validator(check_stage_text, "STAGE", "stage number"));
  app.add_option("--seed", seed, "seed of the random stage-0 inputs (with --stage)")
      ->capture_default_str();
  app.add_flag("--allow-unknown-ops", allow_unknown_ops,
               "keep ops the op table does not know (lint refuses them otherwise); such a graph "
               "cannot run");
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
    const ir::LintOptions lint_options{.allow_unknown_ops = allow_unknown_ops};
    ir::lint(*graph, lint_options);
    const bool run = !stage_text.empty();
    std::vector<stagejit::variable_list> inputs;
    if (run) {
      const std::size_t last = std::stoull(stage_text);  // checked by check_stage_text
      STAGEJIT_CHECK(last < graph->num_stages(), "--stage ", last, ": the graph has ",
                     graph->num_stages(), " stage", graph->num_stages() == 1 ? "" : "s",
                     " (0..", graph->num_stages() - 1, ")");
      inputs = make_inputs(*graph, last, seed);
      check_declared_types(*graph, inputs);  // the graph as read, before any pass
    }
    for (const auto& p : passes) {
      if (p == "dce") stagejit::passes::eliminate_dead_code(*graph);
      else if (p == "cse") stagejit::passes::eliminate_common_subexpressions(*graph);
      else stagejit::passes::fuse(*graph);
      ir::lint(*graph, lint_options);
    }
    if (print) std::cout << ir::to_string(*graph);
    else if (!run)
      std::cerr << file << ": ok (" << graph->num_stages() << " stages, " << graph->nodes().size()
                << " nodes)\n";
    if (run) run_stages(graph, inputs, seed);
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
