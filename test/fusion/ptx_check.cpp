// See ptx_check.hpp.
#include "ptx_check.hpp"

#include <stagejit/fusion/codegen.hpp>
#include <stagejit/ir/printer.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace stagejit::testing {
namespace {

struct State {
  std::mutex mutex;
  std::set<std::string> groups;   // subgraph text + input signature
  std::set<std::string> sources;  // CUDA sources compiled
  std::vector<std::string> failures;
  bool installed = false;
};

State& state() {
  static State s;
  return s;
}

std::string signature(const std::vector<at::Tensor>& inputs) {
  std::string sig;
  for (const auto& x : inputs) {
    sig += std::string(c10::toString(x.scalar_type())) + "[";
    for (int64_t d = 0; d < x.dim(); ++d) sig += std::to_string(x.size(d)) + ":" + std::to_string(x.stride(d)) + ",";
    sig += "] ";
  }
  return sig;
}

void observe(const ir::Graph& subgraph, const std::vector<at::Tensor>& inputs) noexcept {
  State& st = state();
  std::string text, sig;
  try {
    text = ir::to_string(subgraph);
    sig = signature(inputs);
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      if (!st.groups.insert(text + "\n" + sig).second) return;
    }
  } catch (...) {
    return;
  }
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf}) {
    const std::string dtype_name = c10::toString(dtype);
    try {
      std::vector<at::Tensor> metas;
      for (const auto& x : inputs)
        metas.push_back(at::empty_strided(
            x.sizes(), x.strides(),
            at::TensorOptions().dtype(x.scalar_type() == at::kBool ? at::kBool : dtype).device(at::kMeta)));
      const fusion::KernelSource ks = fusion::generate(subgraph, metas, fusion::DeviceKind::CUDA, 0);
      {
        std::lock_guard<std::mutex> lock(st.mutex);
        if (!st.sources.insert(ks.source).second) continue;
      }
      const std::string ptx = fusion::compile_to_ptx(fusion::cuda_prelude() + "\n" + ks.source, "", "group.cu");
      if (ptx.find(".entry " + ks.entry + "(") == std::string::npos)
        throw FusionError("the PTX has no entry point `" + ks.entry + "`");
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(st.mutex);
      st.failures.push_back("group on inputs " + sig + "as " + dtype_name + ":\n" + text + e.what());
    }
  }
}

}  // namespace

bool install_ptx_check() {
  const char* env = std::getenv("STAGEJIT_PTX_CHECK");
  if (!env || std::string(env) != "1") return false;
  if (!fusion::nvrtc_available()) {
    std::printf("[ptx-check] skipped: NVRTC is not available (stagejit built without the CUDA toolkit, or "
                "libnvrtc not found)\n");
    return false;
  }
  state().installed = true;
  fusion::set_group_observer(&observe);
  return true;
}

PtxCheckCounts ptx_check_counts() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  return {static_cast<long>(st.groups.size()), static_cast<long>(st.sources.size()),
          static_cast<long>(st.failures.size())};
}

int report_ptx_check() {
  State& st = state();
  if (!st.installed) return 0;
  fusion::set_group_observer(nullptr);
  std::lock_guard<std::mutex> lock(st.mutex);
  for (const auto& f : st.failures) std::printf("[ptx-check] FAILED: %s\n", f.c_str());
  std::printf("[ptx-check] NVRTC %s: %zu fused group signature(s) of this run generated in the CUDA dialect as "
              "float, double and half: %zu distinct source(s) compiled to PTX, %zu failure(s)\n",
              fusion::nvrtc_version().c_str(), st.groups.size(), st.sources.size(), st.failures.size());
  return static_cast<int>(st.failures.size());
}

}  // namespace stagejit::testing
