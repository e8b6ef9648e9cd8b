// KernelKey and the host-side packing of the launch ABI (include/stagejit/fusion/).
#include <stagejit/core/error.hpp>
#include <stagejit/fusion/kernel_spec.hpp>
#include <stagejit/fusion/tensor_args.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <ATen/MemoryOverlap.h>
#include <algorithm>

#include <optional>
#include <sstream>

namespace stagejit::fusion {

const char* to_string(DeviceKind kind) noexcept {
  switch (kind) {
    case DeviceKind::CPU: return "cpu";
    case DeviceKind::CUDA: return "cuda";
  }
  return "unknown";
}

std::string KernelKey::to_string() const {
  std::ostringstream os;
  os << fusion::to_string(device);
  if (device_index >= 0) os << ':' << device_index;
  auto list = [&](const char* name, const std::vector<TensorDesc>& ds) {
    os << ';' << name << '=';
    for (std::size_t i = 0; i < ds.size(); ++i) {
      if (i) os << ',';
      os << c10::toString(ds[i].dtype) << '/' << ds[i].rank << '/' << (ds[i].contiguous ? 'c' : 'n');
    }
  };
  list("in", inputs);
  list("out", outputs);
  return os.str();
}

namespace {

void check_defined(const at::Tensor& t, const char* what, std::size_t i) {
  STAGEJIT_CHECK_AS(FusionError, t.defined(), "fusion kernel ", what, " ", i, " is an undefined tensor");
}

}  // namespace

KernelKey KernelKey::of(at::TensorList inputs, at::TensorList outputs) {
  KernelKey key;
  std::optional<at::Device> dev;
  auto add = [&](at::TensorList ts, const char* what, std::vector<TensorDesc>& out) {
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const at::Tensor& t = ts[i];
      check_defined(t, what, i);
      if (!dev) dev = t.device();
      STAGEJIT_CHECK_AS(FusionError, t.device() == *dev, "fusion kernel ", what, " ", i, " is on ", t.device(),
                        " but the first tensor is on ", *dev);
      out.push_back(TensorDesc{t.scalar_type(), t.dim(), t.is_contiguous()});
    }
  };
  add(inputs, "input", key.inputs);
  add(outputs, "output", key.outputs);
  if (dev && dev->is_cuda()) {
    key.device = DeviceKind::CUDA;
    key.device_index = dev->index();
  } else {
    STAGEJIT_CHECK_AS(FusionError, !dev || dev->is_cpu(), "fusion kernels run on the CPU or CUDA, not on ", *dev);
  }
  return key;
}

PackedArgs pack_tensor_args(at::IntArrayRef shape, at::TensorList inputs, at::TensorList outputs) {
  const int64_t R = static_cast<int64_t>(shape.size());
  const std::size_t N = inputs.size() + outputs.size();
  STAGEJIT_CHECK_AS(FusionError, !outputs.empty(), "fusion kernel call without outputs");
  for (int64_t d = 0; d < R; ++d)
    STAGEJIT_CHECK_AS(ShapeError, shape[d] >= 0, "fusion iteration shape ", shape, " has a negative size");

  // Per tensor, strides over the full iteration shape (0 where broadcast).
  std::vector<std::vector<int64_t>> strides(N, std::vector<int64_t>(R, 0));
  std::optional<at::Device> dev;
  auto same_device = [&](const at::Tensor& t, const char* what, std::size_t i) {
    if (!dev) dev = t.device();
    STAGEJIT_CHECK_AS(FusionError, t.device() == *dev, "fusion kernel ", what, " ", i, " is on ", t.device(),
                      " but the first tensor is on ", *dev);
  };
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    check_defined(t, "input", i);
    same_device(t, "input", i);
    const int64_t r = t.dim();
    STAGEJIT_CHECK_AS(ShapeError, r <= R, "fusion kernel input ", i, " of sizes ", t.sizes(),
                      " does not broadcast to the output shape ", shape);
    for (int64_t k = 0; k < r; ++k) {
      const int64_t d = R - r + k;
      const int64_t s = t.size(k);
      STAGEJIT_CHECK_AS(ShapeError, s == shape[d] || s == 1, "fusion kernel input ", i, " of sizes ", t.sizes(),
                        " does not broadcast to the output shape ", shape, " (dimension ", k, ")");
      strides[i][d] = (s == shape[d]) ? t.stride(k) : 0;
    }
  }
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    const at::Tensor& t = outputs[o];
    check_defined(t, "output", o);
    same_device(t, "output", o);
    STAGEJIT_CHECK_AS(ShapeError, t.sizes() == shape, "fusion kernel output ", o, " has sizes ", t.sizes(),
                      " but the iteration shape is ", shape);
    STAGEJIT_CHECK_AS(FusionError, at::has_internal_overlap(t) != at::MemOverlap::Yes, "fusion kernel output ", o,
                      " has internal overlap (an expanded tensor); outputs must be writable element by element");
    for (int64_t d = 0; d < R; ++d) strides[inputs.size() + o][d] = t.stride(d);
  }

  PackedArgs packed;
  packed.numel = 1;
  for (int64_t d = 0; d < R; ++d) packed.numel *= shape[d];

  // Drop size-1 dimensions, then merge, from the innermost outwards, every dimension
  // that is contiguous with the next one in every tensor.
  std::vector<int64_t> dims;  // kept original dimensions
  for (int64_t d = 0; d < R; ++d)
    if (shape[d] != 1) dims.push_back(d);
  // Iterate in the first output's memory order (its largest stride outermost), as ATen's
  // TensorIterator does: every element is computed on its own, so the order is free, and
  // tensors that share a permuted dense layout (a weight gradient summed from transposed
  // products, `add(t(a), t(b))` written as t(c)) then merge into one contiguous row instead
  // of being read one element at a time (bench/higher_order.md, "Session of 2026-12-07,
  // 02:30").
  {
    const std::vector<int64_t>& first_out = strides[inputs.size()];
    std::stable_sort(dims.begin(), dims.end(),
                     [&](int64_t a, int64_t b) { return first_out[a] > first_out[b]; });
  }
  std::vector<int64_t> msize;                   // innermost first
  std::vector<std::vector<int64_t>> mstride(N);  // innermost first
  if (packed.numel == 0) {
    msize.push_back(0);
    for (auto& s : mstride) s.push_back(0);
  } else {
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
      const int64_t d = *it;
      bool merge = !msize.empty();
      for (std::size_t k = 0; merge && k < N; ++k) merge = strides[k][d] == mstride[k].back() * msize.back();
      if (merge) {
        msize.back() *= shape[d];
      } else {
        msize.push_back(shape[d]);
        for (std::size_t k = 0; k < N; ++k) mstride[k].push_back(strides[k][d]);
      }
    }
    if (msize.empty()) {
      msize.push_back(1);
      for (auto& s : mstride) s.push_back(0);
    }
  }
  const int64_t rank = static_cast<int64_t>(msize.size());
  STAGEJIT_CHECK_AS(FusionError, rank <= kMaxDims, "fusion kernel iteration shape ", shape, " needs ", rank,
                    " dimensions after merging contiguous ones; kernels take at most ", kMaxDims);
  packed.rank = static_cast<int32_t>(rank);
  packed.shape.assign(msize.rbegin(), msize.rend());
  packed.args.resize(N);
  packed.dtypes.resize(N);
  for (std::size_t k = 0; k < N; ++k) {
    const at::Tensor& t = k < inputs.size() ? inputs[k] : outputs[k - inputs.size()];
    TensorArg& a = packed.args[k];
    a.data = const_cast<void*>(t.data_ptr());
    packed.dtypes[k] = t.scalar_type();
    for (int64_t d = 0; d < rank; ++d) {
      a.sizes[d] = msize[rank - 1 - d];
      a.strides[d] = mstride[k][rank - 1 - d];
    }
  }
  packed.device = dev ? *dev : at::Device(at::kCPU);
  return packed;
}

}  // namespace stagejit::fusion
