#pragma once
// Precompiled header for stagejit's own tests, tools and benchmarks (never for users):
// the heavy third-party headers only, so that every stagejit header still has to
// include what it uses.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>
