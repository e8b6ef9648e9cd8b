#include <stagejit/core/version.hpp>

namespace stagejit {

const char* version_string() noexcept { return STAGEJIT_VERSION_STRING; }

}  // namespace stagejit
