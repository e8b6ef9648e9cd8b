#include <stagejit/stagejit.hpp>

#include <cstdio>
#include <cstring>

int main() {
  namespace sj = stagejit;
  // The shim and the headers must come from the same release.
  if (std::strcmp(sj::version_string(), STAGEJIT_VERSION_STRING) != 0) return 1;
  std::printf("consumer built against stagejit %s\n", sj::version_string());
  return 0;
}
