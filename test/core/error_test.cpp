#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/testing/doctest.hpp>

namespace sj = stagejit;

TEST_SUITE("core") {
  TEST_CASE("ParseError carries a 1-based position and prefixes it to what()") {
    sj::ParseError e(3, 14, "expected ')'");
    CHECK(e.line() == 3);
    CHECK(e.column() == 14);
    CHECK(std::string(e.what()) == "3:14: expected ')'");
    CHECK(e.message() == "expected ')'");
  }

  TEST_CASE("every error kind is a stagejit::Error") {
    CHECK_THROWS_AS(throw sj::IrError("x"), sj::Error);
    CHECK_THROWS_AS(throw sj::TraceError("x"), sj::Error);
    CHECK_THROWS_AS(throw sj::CompileError("x"), sj::Error);
    CHECK_THROWS_AS(throw sj::ShapeError("x"), sj::Error);
    CHECK_THROWS_AS(throw sj::FusionError("x"), sj::Error);
    CHECK_THROWS_AS(throw sj::ParseError(1, 1, "x"), sj::Error);
  }

  TEST_CASE("STAGEJIT_CHECK throws only when the condition is false, with the streamed message") {
    CHECK_NOTHROW(STAGEJIT_CHECK(1 + 1 == 2, "never"));
    try {
      STAGEJIT_CHECK(false, "node %", 7, " expected ", 2, " inputs");
      FAIL("STAGEJIT_CHECK did not throw");
    } catch (const sj::Error& e) {
      CHECK(std::string(e.what()) == "node %7 expected 2 inputs");
    }
    CHECK_THROWS_AS(STAGEJIT_CHECK_AS(sj::ShapeError, false, "bad"), sj::ShapeError);
  }

  TEST_CASE("glog's CHECK does not shadow doctest's (a failing CHECK is counted, not fatal)") {
    // If glog's CHECK were active, this file would not compile CHECK(a == b) with
    // doctest semantics; this case documents the include order in testing/doctest.hpp.
    int counted = 0;
    CHECK((++counted, true));
    CHECK(counted == 1);
  }
}
