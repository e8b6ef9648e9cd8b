#pragma once
/// \file
/// Library version.

#define STAGEJIT_VERSION_MAJOR 0
#define STAGEJIT_VERSION_MINOR 1
#define STAGEJIT_VERSION_PATCH 0
#define STAGEJIT_VERSION_STRING "0.1.0"

namespace stagejit {

/// The version of the compiled shim this program links, e.g. `"0.1.0"`. Comparing it
/// with `STAGEJIT_VERSION_STRING` detects headers and shim from different releases.
const char* version_string() noexcept;

}  // namespace stagejit
