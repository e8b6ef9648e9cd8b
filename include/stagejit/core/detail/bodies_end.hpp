// No include guard: included at the end of every public stagejit header. See
// bodies_begin.hpp.
#if defined(STAGEJIT_HEADER_ONLY) && defined(STAGEJIT_DETAIL_OUTER_LEVEL) && \
    !defined(STAGEJIT_DETAIL_BODIES_INCLUDED) && __INCLUDE_LEVEL__ == STAGEJIT_DETAIL_OUTER_LEVEL
#define STAGEJIT_DETAIL_BODIES_INCLUDED
#include <stagejit/core/detail/bodies.hpp>
#endif
