#pragma once
/// \file
/// The precompiled header of the header checks (test/headers/meson.build: each public
/// header compiled alone): ATen and the standard headers the library uses, without
/// torch/torch.h and doctest, which the headers do not include. A third the size of the
/// tests' (testing/pch.hpp), so each of the checks' many small translation units loads it
/// in about a second instead of four.
#include <ATen/ATen.h>

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
