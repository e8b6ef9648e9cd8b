#include <stagejit/core/aten_error.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/testing/doctest.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

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
    CHECK_THROWS_AS(throw sj::DtypeError("x"), sj::Error);
    CHECK_THROWS_AS(throw sj::ParseError(1, 1, "x"), sj::Error);
  }

  TEST_CASE("ATen's error kinds map to stagejit classes (error.hpp, \"ATen errors\")") {
    // Throws `make()`'s c10 error, rethrown through rethrow_aten_error; returns what() .
    auto mapped = [](auto make) -> std::string {
      try {
        make();
      } catch (const c10::Error& e) {
        sj::rethrow_aten_error(e, "op 'x': ");
      }
      return {};
    };
    CHECK_THROWS_WITH_AS(mapped([] { TORCH_CHECK_TYPE(false, "bad type"); }), "op 'x': bad type", sj::DtypeError);
    CHECK_THROWS_AS(mapped([] { TORCH_CHECK_NOT_IMPLEMENTED(false, "no kernel"); }), sj::DtypeError);
    CHECK_THROWS_AS(mapped([] { TORCH_CHECK_INDEX(false, "Dimension out of range"); }), sj::ShapeError);
    CHECK_THROWS_AS(mapped([] { TORCH_CHECK_LINALG(false, "singular"); }), sj::Error);
    CHECK_THROWS_WITH_AS(mapped([] { TORCH_CHECK_VALUE(false, "bad value"); }), "op 'x': bad value", sj::Error);
    CHECK_FALSE((std::is_base_of_v<sj::ShapeError, sj::DtypeError>));
    auto kind = [](auto make) {
      try {
        make();
      } catch (const c10::Error& e) {
        return sj::classify_aten_error(e);
      }
      return sj::AtenErrorKind::Other;
    };
    CHECK(kind([] { TORCH_CHECK_VALUE(false, "bad value"); }) == sj::AtenErrorKind::Other);
    // Plain c10::Error: ATen 1.13 reports dtype errors this way too; told apart by message.
    CHECK(kind([] { TORCH_CHECK(false, "\"addmm_impl_cpu_\" not implemented for 'Half'"); }) ==
          sj::AtenErrorKind::Dtype);
    CHECK(kind([] { TORCH_CHECK(false, "expected scalar type Float but found Double"); }) == sj::AtenErrorKind::Dtype);
    CHECK(kind([] { TORCH_CHECK(false, "Expected all tensors to be on the same device"); }) ==
          sj::AtenErrorKind::Dtype);
    CHECK(kind([] { TORCH_CHECK(false, "mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)"); }) ==
          sj::AtenErrorKind::Shape);
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
