// Ops for models (issue 19): see test/models/meson.build.
#include "../autograd/oracle.hpp"
