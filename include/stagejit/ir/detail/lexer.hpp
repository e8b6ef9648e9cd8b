#pragma once
/// \file
/// Tokens of the IR text form, read lazily with one token of lookahead so that the
/// first error in the text is the one reported. `#` starts a comment to the end of
/// the line. Identifiers may carry `::` namespaces (`aten::mul`, `prim::FusionGroup_0`,
/// the 2018 printer's kinds). The parser reads a few seed-era constructs that are not
/// token sequences (a CppOp's C++ type name, a `scope:` path, a tensor dump) with the raw
/// readers below, which work only while no token is peeked.

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <string>
#include <optional>
#include <string_view>
#include <utility>

#include <stagejit/core/error.hpp>

namespace stagejit::ir::detail {

enum class TokenKind { End, Ident, ValueRef, Number, String, Dashes, Punct };

struct Token {
  TokenKind kind = TokenKind::End;
  std::string text;  // identifier, value name (without %), number, unescaped string, punct
  size_t line = 1, column = 1;

  bool is(char punct) const { return kind == TokenKind::Punct && text.size() == 1 && text[0] == punct; }
  bool is_ident(std::string_view s) const { return kind == TokenKind::Ident && text == s; }
  /// How the token reads in a message: `'mul'`, `'%x'`, `end of input`.
  std::string describe() const {
    switch (kind) {
      case TokenKind::End: return "end of input";
      case TokenKind::ValueRef: return "'%" + text + "'";
      case TokenKind::String: return "a string";
      case TokenKind::Dashes: return "a stage separator";
      default: return "'" + text + "'";
    }
  }
};

class Lexer {
 public:
  /// A UTF-8 byte-order mark at the very start (editors on Windows write one) is skipped;
  /// one anywhere else is a ParseError at its line:column.
  explicit Lexer(std::string_view text) : text_(text) {
    if (text_.substr(0, 3) == bom) text_.remove_prefix(3);
  }
  static constexpr std::string_view bom = "\xEF\xBB\xBF";

  const Token& peek() {
    if (!has_peeked_) {
      peeked_ = lex();
      has_peeked_ = true;
    }
    return peeked_;
  }
  Token next() {
    peek();
    has_peeked_ = false;
    return peeked_;
  }
  /// Whether a token has been peeked (the raw readers need none).
  bool has_peeked() const { return has_peeked_; }
  /// Line and column of the next unread character (after any peeked token).
  std::pair<size_t, size_t> position() const { return {line_, col_}; }

  /// Raw text up to (not including) the first character of `stops` on the same line,
  /// trimmed; fails at end of line or input when `must_stop` is set.
  std::string raw_until(std::string_view stops, bool must_stop, std::string_view what) {
    if (has_peeked_) fail(peeked_, "internal: raw read after a peeked token");
    size_t line = line_, col = col_;
    std::string out;
    while (pos_ < text_.size() && cur() != '\n' && stops.find(cur()) == std::string_view::npos) out += cur(), advance();
    if (must_stop && (pos_ >= text_.size() || cur() == '\n'))
      fail(line, col, "expected " + std::string(what) + " to end with '" + std::string(stops.substr(0, 1)) + "'");
    size_t b = out.find_first_not_of(" \t\r"), e = out.find_last_not_of(" \t\r");
    return b == std::string::npos ? std::string() : out.substr(b, e - b + 1);
  }

  /// A seed-era tensor dump as an attribute value: the values as TH printed them (any
  /// layout across lines: numbers, `nan`, `inf`, a `1e-02 *` scale, `(1,.,.) =` slices,
  /// `Columns 1 to 8` headers) followed by `[ CPUDoubleTensor{2,2} ]`. Returns the text
  /// from its first character to the closing `]` and consumes it, or nothing (consuming
  /// nothing) when the text ahead, up to its first bracket or quote, is not such a dump.
  std::optional<std::string> tensor_dump() {
    if (has_peeked_) return std::nullopt;
    size_t p = pos_;
    auto at_p = [&](size_t k) { return p + k < text_.size() ? text_[p + k] : '\0'; };
    while (p < text_.size() && std::isspace(static_cast<unsigned char>(text_[p]))) ++p;
    size_t start = p;
    bool any_number = false;  // a value of some kind
    const size_t limit = std::min(text_.size(), start + (size_t(1) << 20));  // no quadratic rescans
    while (p < limit && text_[p] != '[' && text_[p] != ']' && text_[p] != '"') {
      any_number = any_number || std::isalnum(static_cast<unsigned char>(text_[p]));  // digits, nan, inf
      ++p;
    }
    if (!any_number || at_p(0) != '[') return std::nullopt;
    // `[ CPUDoubleTensor{2,2} ]` (2017) or `[ CPUDoubleType{2} ]` (2018); whitespace,
    // newlines included, may stand between any two of its parts.
    auto space = [&](size_t& k) {
      while (k < text_.size() && std::isspace(static_cast<unsigned char>(text_[k]))) ++k;
    };
    size_t q = p + 1;
    space(q);
    size_t name_begin = q;
    while (q < text_.size() && (ident_char(text_[q]) || text_[q] == '.')) ++q;  // torch.DoubleTensor
    std::string_view type_name = text_.substr(name_begin, q - name_begin);
    auto ends_with = [&](std::string_view suffix) {
      return type_name.size() > suffix.size() && type_name.substr(type_name.size() - suffix.size()) == suffix;
    };
    if (!ends_with("Tensor") && !ends_with("Type")) return std::nullopt;
    space(q);
    if (q >= text_.size() || text_[q] != '{') return std::nullopt;
    while (q < text_.size() && text_[q] != '}' &&
           (digit(text_[q]) || text_[q] == ',' || text_[q] == '{' || std::isspace(static_cast<unsigned char>(text_[q]))))
      ++q;
    if (q >= text_.size() || text_[q] != '}') return std::nullopt;
    ++q;
    space(q);
    if (q >= text_.size() || text_[q] != ']') return std::nullopt;
    ++q;
    while (pos_ < start) advance();
    std::string out;
    while (pos_ < q) out += cur(), advance();
    return out;
  }

  [[noreturn]] void fail(size_t line, size_t column, const std::string& msg) const {
    throw ParseError(line, column, msg);
  }
  [[noreturn]] void fail(const Token& at, const std::string& msg) const {
    fail(at.line, at.column, msg);
  }

 private:
  char cur() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  char at(size_t k) const { return pos_ + k < text_.size() ? text_[pos_ + k] : '\0'; }
  void advance() {
    if (pos_ >= text_.size()) return;
    if (text_[pos_] == '\n') {
      ++line_;
      col_ = 1;
    } else {
      ++col_;
    }
    ++pos_;
  }
  static bool ident_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
  static bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
  static bool digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

  Token lex() {
    for (;;) {
      while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(cur()))) advance();
      if (cur() == '#') {
        while (pos_ < text_.size() && cur() != '\n') advance();
        continue;
      }
      break;
    }
    Token t;
    t.line = line_;
    t.column = col_;
    if (pos_ >= text_.size()) return t;
    char c = cur();
    if (ident_start(c)) {
      t.kind = TokenKind::Ident;
      for (;;) {
        while (ident_char(cur())) t.text += cur(), advance();
        if (cur() != ':' || at(1) != ':' || !ident_start(at(2))) break;
        t.text += "::", advance(), advance();
      }
      return t;
    }
    if (c == '%') {
      advance();
      t.kind = TokenKind::ValueRef;
      while (ident_char(cur()) || cur() == '.') t.text += cur(), advance();
      if (t.text.empty()) fail(t, "expected a value name after '%'");
      return t;
    }
    if (c == '-' && at(1) == '-') {
      t.kind = TokenKind::Dashes;
      while (cur() == '-') t.text += cur(), advance();
      return t;
    }
    if (digit(c) || ((c == '-' || c == '+') && (digit(at(1)) || at(1) == 'i' || at(1) == 'n'))) {
      t.kind = TokenKind::Number;
      if (c == '-' || c == '+') t.text += c, advance();
      if (ident_start(cur())) {  // inf / nan
        while (ident_char(cur())) t.text += cur(), advance();
        std::string_view body = std::string_view(t.text).substr(1);
        if (body != "inf" && body != "nan") fail(t, "malformed number '" + t.text + "'");
        return t;
      }
      while (digit(cur())) t.text += cur(), advance();
      if (cur() == '.' && digit(at(1))) {
        t.text += cur(), advance();
        while (digit(cur())) t.text += cur(), advance();
      } else if (cur() == '.' && !ident_start(at(1))) {
        t.text += cur(), advance();  // `1.`
      }
      if ((cur() == 'e' || cur() == 'E') &&
          (digit(at(1)) || ((at(1) == '-' || at(1) == '+') && digit(at(2))))) {
        t.text += cur(), advance();
        if (cur() == '-' || cur() == '+') t.text += cur(), advance();
        while (digit(cur())) t.text += cur(), advance();
      }
      if (ident_char(cur())) fail(line_, col_, "malformed number: unexpected '" + std::string(1, cur()) + "'");
      return t;
    }
    if (c == '"') {
      t.kind = TokenKind::String;
      advance();
      for (;;) {
        if (pos_ >= text_.size() || cur() == '\n') fail(t, "unterminated string");
        char d = cur();
        advance();
        if (d == '"') break;
        if (d == '\\') {
          char e = cur();
          if (pos_ >= text_.size()) fail(t, "unterminated string");
          advance();
          switch (e) {
            case 'n': t.text += '\n'; break;
            case 't': t.text += '\t'; break;
            case '"': t.text += '"'; break;
            case '\\': t.text += '\\'; break;
            default: fail(line_, col_ - 2, std::string("unknown escape '\\") + e + "' in string");
          }
        } else {
          t.text += d;
        }
      }
      return t;
    }
    static constexpr std::string_view puncts = "()[]{},:=;^!|<>*";
    if (puncts.find(c) != std::string_view::npos) {
      t.kind = TokenKind::Punct;
      t.text = std::string(1, c);
      advance();
      return t;
    }
    if (std::isprint(static_cast<unsigned char>(c)))
      fail(t, std::string("unexpected character '") + c + "'");
    if (text_.substr(pos_, 3) == bom)
      fail(t, "unexpected UTF-8 byte-order mark (U+FEFF): one is only allowed at the start of the file");
    fail(t, "unexpected byte " + std::to_string(static_cast<unsigned char>(c)));
  }

  std::string_view text_;
  size_t pos_ = 0, line_ = 1, col_ = 1;
  Token peeked_;
  bool has_peeked_ = false;
};

}  // namespace stagejit::ir::detail
