// No include guard: included at the top of every public stagejit header.
//
// Header-only builds (core/config.hpp): the first stagejit header a translation unit
// includes is the outermost of any stagejit include chain. It records its include level
// here, and at its end (bodies_end.hpp, seen at that same level) the function bodies are
// included, once, when every header they need is complete: an inner header finishing
// first must not pull them in while an outer one is still half read. GCC and Clang
// provide __INCLUDE_LEVEL__.
#if defined(STAGEJIT_HEADER_ONLY) && !defined(STAGEJIT_DETAIL_OUTER_LEVEL)
#if !defined(__INCLUDE_LEVEL__)
#error "STAGEJIT_HEADER_ONLY needs __INCLUDE_LEVEL__ (GCC, Clang); build with stagejit_dep instead"
#elif __INCLUDE_LEVEL__ == 1
#define STAGEJIT_DETAIL_OUTER_LEVEL 1
#elif __INCLUDE_LEVEL__ == 2
#define STAGEJIT_DETAIL_OUTER_LEVEL 2
#elif __INCLUDE_LEVEL__ == 3
#define STAGEJIT_DETAIL_OUTER_LEVEL 3
#elif __INCLUDE_LEVEL__ == 4
#define STAGEJIT_DETAIL_OUTER_LEVEL 4
#elif __INCLUDE_LEVEL__ == 5
#define STAGEJIT_DETAIL_OUTER_LEVEL 5
#elif __INCLUDE_LEVEL__ == 6
#define STAGEJIT_DETAIL_OUTER_LEVEL 6
#elif __INCLUDE_LEVEL__ == 7
#define STAGEJIT_DETAIL_OUTER_LEVEL 7
#elif __INCLUDE_LEVEL__ == 8
#define STAGEJIT_DETAIL_OUTER_LEVEL 8
#elif __INCLUDE_LEVEL__ == 9
#define STAGEJIT_DETAIL_OUTER_LEVEL 9
#elif __INCLUDE_LEVEL__ == 10
#define STAGEJIT_DETAIL_OUTER_LEVEL 10
#elif __INCLUDE_LEVEL__ == 11
#define STAGEJIT_DETAIL_OUTER_LEVEL 11
#elif __INCLUDE_LEVEL__ == 12
#define STAGEJIT_DETAIL_OUTER_LEVEL 12
#else
#error "stagejit: headers included more than 11 levels deep in a header-only build"
#endif
#endif
