#include <stagejit/core/version.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

namespace stagejit {

const char* version_string() noexcept { return STAGEJIT_VERSION_STRING; }

}  // namespace stagejit
