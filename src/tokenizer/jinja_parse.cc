// Lexer and parser: source text -> Node tree, with jinja2's whitespace control as transformers
// configures it (trim_blocks, lstrip_blocks, keep_trailing_newline=False).
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "tokenizer/jinja.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_builtins.h"
#include "tokenizer/utf8.h"

namespace pd::tokenizer::jinja {
namespace {

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;
  int line = 1;
  int col = 1;
  int64_t int_value = 0;
  double float_value = 0;
};

struct ParseError {
  bool unsupported;
  std::string message;
};

[[noreturn]] void syntax_error(int line, int col, const std::string& what) {
  throw ParseError{false, fmt::format("template syntax error at line {} column {}: {}", line, col, what)};
}
[[noreturn]] void unsupported(int line, int col, const std::string& what) {
  throw ParseError{true, fmt::format("unsupported template construct {} at line {} column {}", what, line, col)};
}

bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

class Lexer {
 public:
  explicit Lexer(std::string_view raw) {
    // jinja2 turns \r\n and \r into \n and drops one trailing newline.
    src_.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        src_.push_back(raw[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> run() {
    enum class Pending { kNone, kStripAll, kStripNewline } pending = Pending::kNone;
    size_t pos = 0;
    const size_t n = src_.size();
    while (pos <= n) {
      size_t tag = pos;
      while (true) {
        tag = src_.find('{', tag);
        if (tag == std::string::npos || tag + 1 >= n) {
          tag = std::string::npos;
          break;
        }
        const char k = src_[tag + 1];
        if (k == '{' || k == '%' || k == '#') break;
        ++tag;
      }
      size_t text_begin = pos;
      size_t text_end = tag == std::string::npos ? n : tag;
      if (pending == Pending::kStripAll) {
        while (text_begin < text_end && is_ws(src_[text_begin])) ++text_begin;
      } else if (pending == Pending::kStripNewline && text_begin < text_end && src_[text_begin] == '\n') {
        ++text_begin;
      }
      pending = Pending::kNone;
      if (tag == std::string::npos) {
        push_text(text_begin, text_end);
        break;
      }
      const char kind = src_[tag + 1];
      size_t inner = tag + 2;
      bool strip_before = false;
      bool plus = false;
      if (inner < n && src_[inner] == '-') {
        strip_before = true;
        ++inner;
      } else if (inner < n && src_[inner] == '+') {
        plus = true;
        ++inner;
      }
      if (strip_before) {
        while (text_end > text_begin && is_ws(src_[text_end - 1])) --text_end;
      } else if (kind != '{' && !plus) {
        // lstrip_blocks: drop spaces/tabs between the start of the line and a block or comment tag.
        size_t line_begin = text_end;
        while (line_begin > text_begin && (src_[line_begin - 1] == ' ' || src_[line_begin - 1] == '\t')) --line_begin;
        const bool at_line_start = line_begin == 0 || src_[line_begin - 1] == '\n';
        if (at_line_start) text_end = line_begin;
      }
      push_text(text_begin, text_end);
      if (kind == '#') {
        const size_t close = src_.find("#}", inner);
        if (close == std::string::npos) syntax_error_at(tag, "unterminated comment");
        const char marker = close > inner ? src_[close - 1] : '\0';
        pending = marker == '-' ? Pending::kStripAll : marker == '+' ? Pending::kNone : Pending::kStripNewline;
        pos = close + 2;
        continue;
      }
      const bool is_block = kind == '%';
      tokens_.push_back(make(is_block ? Tok::kBlockBegin : Tok::kVarBegin, "", tag));
      pos = lex_tag(inner, is_block, pending_marker_);
      if (is_block) {
        pending = pending_marker_ == '-'   ? Pending::kStripAll
                  : pending_marker_ == '+' ? Pending::kNone
                                           : Pending::kStripNewline;
      } else {
        pending = pending_marker_ == '-' ? Pending::kStripAll : Pending::kNone;
      }
    }
    tokens_.push_back(make(Tok::kEof, "", src_.size()));
    return std::move(tokens_);
  }

 private:
  Token make(Tok type, std::string text, size_t offset) const {
    Token t;
    t.type = type;
    t.text = std::move(text);
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line_index = static_cast<size_t>(it - line_starts_.begin()) - 1;
    t.line = static_cast<int>(line_index + 1);
    t.col = static_cast<int>(offset - line_starts_[line_index] + 1);
    return t;
  }

  [[noreturn]] void syntax_error_at(size_t offset, const std::string& what) const {
    const Token t = make(Tok::kEof, "", offset);
    syntax_error(t.line, t.col, what);
  }

  void push_text(size_t begin, size_t end) {
    if (end > begin) tokens_.push_back(make(Tok::kText, src_.substr(begin, end - begin), begin));
  }

  // Lexes expression tokens up to the tag end; returns the offset after it and sets marker to the
  // whitespace modifier before the end delimiter ('-', '+' or '\0').
  size_t lex_tag(size_t pos, bool is_block, char& marker) {
    int brace_depth = 0;
    const size_t n = src_.size();
    while (true) {
      while (pos < n && is_ws(src_[pos])) ++pos;
      if (pos >= n)
        syntax_error_at(
            pos, is_block ? "unexpected end of template, expected '%}'" : "unexpected end of template, expected '}}'");
      const char c = src_[pos];
      auto ends_at = [&](size_t p) {
        if (is_block) return src_.compare(p, 2, "%}") == 0;
        return brace_depth == 0 && src_.compare(p, 2, "}}") == 0;
      };
      if ((c == '-' || c == '+') && pos + 1 < n && ends_at(pos + 1)) {
        marker = c;
        tokens_.push_back(make(is_block ? Tok::kBlockEnd : Tok::kVarEnd, "", pos));
        return pos + 3;
      }
      if (ends_at(pos)) {
        marker = '\0';
        tokens_.push_back(make(is_block ? Tok::kBlockEnd : Tok::kVarEnd, "", pos));
        return pos + 2;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t end = pos;
        while (end < n && (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) ++end;
        tokens_.push_back(make(Tok::kName, src_.substr(pos, end - pos), pos));
        pos = end;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t end = pos;
        while (end < n && (std::isdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) ++end;
        bool is_float = false;
        if (end + 1 < n && src_[end] == '.' && std::isdigit(static_cast<unsigned char>(src_[end + 1]))) {
          is_float = true;
          ++end;
          while (end < n && (std::isdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) ++end;
        }
        if (end < n && (src_[end] == 'e' || src_[end] == 'E')) {
          size_t e = end + 1;
          if (e < n && (src_[e] == '+' || src_[e] == '-')) ++e;
          if (e < n && std::isdigit(static_cast<unsigned char>(src_[e]))) {
            is_float = true;
            end = e;
            while (end < n && std::isdigit(static_cast<unsigned char>(src_[end]))) ++end;
          }
        }
        std::string digits;
        for (size_t i = pos; i < end; ++i) {
          if (src_[i] != '_') digits.push_back(src_[i]);
        }
        Token t = make(is_float ? Tok::kFloat : Tok::kInt, digits, pos);
        if (is_float) {
          t.float_value = std::strtod(digits.c_str(), nullptr);
        } else {
          errno = 0;
          t.int_value = std::strtoll(digits.c_str(), nullptr, 10);
          if (errno == ERANGE) syntax_error(t.line, t.col, "integer literal too large");
        }
        tokens_.push_back(std::move(t));
        pos = end;
        continue;
      }
      if (c == '\'' || c == '"') {
        pos = lex_string(pos);
        continue;
      }
      static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                         ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
      bool matched = false;
      for (const char* op : kOps) {
        const size_t len = std::strlen(op);
        if (src_.compare(pos, len, op) == 0) {
          if (op[0] == '{' && len == 1) ++brace_depth;
          if (op[0] == '}' && len == 1) --brace_depth;
          tokens_.push_back(make(Tok::kOp, op, pos));
          pos += len;
          matched = true;
          break;
        }
      }
      if (!matched) syntax_error_at(pos, fmt::format("unexpected character '{}'", c));
    }
  }

  // Python string literal with the escapes unicode-escape decoding accepts.
  size_t lex_string(size_t pos) {
    const char quote = src_[pos];
    const size_t start = pos;
    std::string value;
    ++pos;
    const size_t n = src_.size();
    while (true) {
      if (pos >= n) syntax_error_at(start, "unterminated string literal");
      const char c = src_[pos];
      if (c == quote) break;
      if (c != '\\') {
        value.push_back(c);
        ++pos;
        continue;
      }
      if (pos + 1 >= n) syntax_error_at(start, "unterminated string literal");
      const char e = src_[pos + 1];
      pos += 2;
      auto hex = [&](int digits) -> uint32_t {
        uint32_t v = 0;
        for (int i = 0; i < digits; ++i) {
          if (pos >= n || !std::isxdigit(static_cast<unsigned char>(src_[pos]))) {
            syntax_error_at(start, "truncated \\x/\\u escape in string literal");
          }
          const char h = src_[pos++];
          v = v * 16 + static_cast<uint32_t>(
                           std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
        }
        return v;
      };
      switch (e) {
        case '\n':
          break;
        case '\\':
          value.push_back('\\');
          break;
        case '\'':
          value.push_back('\'');
          break;
        case '"':
          value.push_back('"');
          break;
        case 'a':
          value.push_back('\a');
          break;
        case 'b':
          value.push_back('\b');
          break;
        case 'f':
          value.push_back('\f');
          break;
        case 'n':
          value.push_back('\n');
          break;
        case 'r':
          value.push_back('\r');
          break;
        case 't':
          value.push_back('\t');
          break;
        case 'v':
          value.push_back('\v');
          break;
        case 'x':
          utf8_append(value, hex(2));
          break;
        case 'u': {
          const uint32_t cp = hex(4);
          if (cp >= 0xD800 && cp <= 0xDFFF) syntax_error_at(start, "surrogate escape in string literal");
          utf8_append(value, cp);
          break;
        }
        case 'U': {
          const uint32_t cp = hex(8);
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) syntax_error_at(start, "invalid \\U escape");
          utf8_append(value, cp);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int i = 0; i < 2 && pos < n && src_[pos] >= '0' && src_[pos] <= '7'; ++i) {
              v = v * 8 + static_cast<uint32_t>(src_[pos++] - '0');
            }
            utf8_append(value, v);
          } else if (e == 'N') {
            unsupported(make(Tok::kEof, "", start).line, make(Tok::kEof, "", start).col, "'\\N{...}' string escape");
          } else {
            value.push_back('\\');
            value.push_back(e);
          }
      }
    }
    Token t = make(Tok::kString, std::move(value), start);
    tokens_.push_back(std::move(t));
    return pos + 1;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
  char pending_marker_ = '\0';
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  std::unique_ptr<Node> parse_template() {
    auto body = parse_body({});
    if (peek().type != Tok::kEof) syntax_error(peek().line, peek().col, "unexpected tag");
    return body;
  }

 private:
  const Token& peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  const Token& next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).type == Tok::kOp && peek(ahead).text == op; }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kName && peek(ahead).text == name;
  }
  void expect_op(const char* op) {
    if (!is_op(op)) syntax_error(peek().line, peek().col, fmt::format("expected '{}', got '{}'", op, describe(peek())));
    next();
  }
  std::string expect_name() {
    if (peek().type != Tok::kName)
      syntax_error(peek().line, peek().col, fmt::format("expected a name, got '{}'", describe(peek())));
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Tok::kBlockEnd)
      syntax_error(peek().line, peek().col, fmt::format("expected '%}}', got '{}'", describe(peek())));
    next();
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof:
        return "end of template";
      case Tok::kBlockEnd:
        return "%}";
      case Tok::kVarEnd:
        return "}}";
      case Tok::kText:
        return "text";
      default:
        return t.text;
    }
  }

  static std::unique_ptr<Node> node(Node::Kind kind, const Token& at) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = at.line;
    n->col = at.col;
    return n;
  }
  static std::unique_ptr<Expr> expr(Expr::Kind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->col = at.col;
    return e;
  }

  // Parses statements until a block tag whose keyword is in `ends` (left unconsumed: the
  // position is at that keyword) or the end of the template.
  std::unique_ptr<Node> parse_body(const std::set<std::string>& ends) {
    auto body = node(Node::Kind::kBody, peek());
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::kEof) {
        if (!ends.empty()) {
          std::string expected;
          for (const auto& e : ends) expected += (expected.empty() ? "'" : ", '") + e + "'";
          syntax_error(t.line, t.col, fmt::format("unexpected end of template, expected one of {}", expected));
        }
        return body;
      }
      if (t.type == Tok::kText) {
        auto text = node(Node::Kind::kText, t);
        text->text = next().text;
        body->children.push_back(std::move(text));
        continue;
      }
      if (t.type == Tok::kVarBegin) {
        auto out = node(Node::Kind::kOutput, t);
        next();
        out->expr = parse_expression();
        if (peek().type != Tok::kVarEnd)
          syntax_error(peek().line, peek().col, fmt::format("expected '}}}}', got '{}'", describe(peek())));
        next();
        body->children.push_back(std::move(out));
        continue;
      }
      if (t.type != Tok::kBlockBegin) syntax_error(t.line, t.col, "unexpected token");
      const Token& keyword = peek(1);
      if (keyword.type != Tok::kName) syntax_error(keyword.line, keyword.col, "expected a statement keyword");
      if (ends.count(keyword.text) != 0) {
        next();  // the block begin; the keyword stays for the caller
        return body;
      }
      next();
      body->children.push_back(parse_statement());
    }
  }

  std::unique_ptr<Node> parse_statement() {
    const Token& kw = next();
    const std::string& k = kw.text;
    if (k == "if") return parse_if(kw);
    if (k == "for") return parse_for(kw);
    if (k == "set") return parse_set(kw);
    if (k == "macro") return parse_macro(kw);
    if (k == "break" || k == "continue") {
      if (loop_depth_ == 0) syntax_error(kw.line, kw.col, fmt::format("'{}' outside a loop", k));
      auto n = node(k == "break" ? Node::Kind::kBreak : Node::Kind::kContinue, kw);
      expect_block_end();
      return n;
    }
    if (k == "generation") {
      // transformers' AssistantTracker tag: renders its body unchanged.
      expect_block_end();
      auto body = parse_body({"endgeneration"});
      next();
      expect_block_end();
      return body;
    }
    static const std::set<std::string> kKnownUnsupported = {
        "include", "import", "from", "extends", "block", "call", "filter", "raw", "with", "autoescape", "do", "trans"};
    if (kKnownUnsupported.count(k) != 0) unsupported(kw.line, kw.col, fmt::format("'{{% {} %}}'", k));
    syntax_error(kw.line, kw.col, fmt::format("unknown tag '{}'", k));
  }

  std::unique_ptr<Node> parse_if(const Token& kw) {
    auto n = node(Node::Kind::kIf, kw);
    n->conds.push_back(parse_expression());
    expect_block_end();
    while (true) {
      n->children.push_back(parse_body({"elif", "else", "endif"}));
      const Token& end = next();
      if (end.text == "elif") {
        n->conds.push_back(parse_expression());
        expect_block_end();
        continue;
      }
      if (end.text == "else") {
        expect_block_end();
        n->children.push_back(parse_body({"endif"}));
        next();
      }
      expect_block_end();
      return n;
    }
  }

  std::unique_ptr<Node> parse_for(const Token& kw) {
    auto n = node(Node::Kind::kFor, kw);
    n->targets.push_back(expect_name());
    while (is_op(",")) {
      next();
      n->targets.push_back(expect_name());
    }
    if (!is_name("in")) syntax_error(peek().line, peek().col, "expected 'in' in for loop");
    next();
    n->expr = parse_or_test_no_cond();
    if (is_name("if")) {
      next();
      n->filter = parse_or_test_no_cond();
    }
    if (is_name("recursive")) unsupported(peek().line, peek().col, "'recursive' for loop");
    expect_block_end();
    ++loop_depth_;
    n->body = parse_body({"else", "endfor"});
    --loop_depth_;
    if (next().text == "else") {
      expect_block_end();
      n->else_body = parse_body({"endfor"});
      next();
    }
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> parse_set(const Token& kw) {
    std::vector<std::string> names;
    names.push_back(expect_name());
    std::string attr;
    if (is_op(".")) {
      next();
      attr = expect_name();
    }
    while (attr.empty() && is_op(",")) {
      next();
      names.push_back(expect_name());
    }
    if (is_op("=")) {
      next();
      auto n = node(Node::Kind::kSet, kw);
      n->targets = std::move(names);
      n->attr = std::move(attr);
      n->expr = parse_tuple_or_expression();
      expect_block_end();
      return n;
    }
    if (names.size() != 1 || !attr.empty()) syntax_error(peek().line, peek().col, "expected '=' in set");
    if (is_op("|")) unsupported(peek().line, peek().col, "filtered block set");
    expect_block_end();
    auto n = node(Node::Kind::kSetBlock, kw);
    n->targets = std::move(names);
    n->body = parse_body({"endset"});
    next();
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> parse_macro(const Token& kw) {
    auto n = node(Node::Kind::kMacro, kw);
    n->text = expect_name();
    expect_op("(");
    bool seen_default = false;
    while (!is_op(")")) {
      n->targets.push_back(expect_name());
      if (is_op("=")) {
        next();
        n->defaults.push_back(parse_expression());
        seen_default = true;
      } else {
        if (seen_default) syntax_error(peek().line, peek().col, "non-default macro argument follows a default one");
        n->defaults.push_back(nullptr);
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
    expect_block_end();
    const int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;
    n->body = parse_body({"endmacro"});
    loop_depth_ = saved_loop_depth;
    next();
    if (peek().type == Tok::kName) next();  // "endmacro name"
    expect_block_end();
    return n;
  }

  // ---- expressions (jinja2's precedence) ----
  std::unique_ptr<Expr> parse_tuple_or_expression() {
    const Token& at = peek();
    auto first = parse_expression();
    if (!is_op(",")) return first;
    auto tuple = expr(Expr::Kind::kTuple, at);
    tuple->children.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().type == Tok::kBlockEnd) break;
      tuple->children.push_back(parse_expression());
    }
    return tuple;
  }

  std::unique_ptr<Expr> parse_expression() {
    if (++depth_ > 200) syntax_error(peek().line, peek().col, "expression nested too deeply");
    const Token& at = peek();
    auto value = parse_or();
    while (is_name("if")) {
      next();
      auto cond = expr(Expr::Kind::kCond, at);
      auto test = parse_or();
      std::unique_ptr<Expr> otherwise;
      if (is_name("else")) {
        next();
        otherwise = parse_expression();
      }
      cond->children.push_back(std::move(value));
      cond->children.push_back(std::move(test));
      cond->children.push_back(std::move(otherwise));
      value = std::move(cond);
    }
    --depth_;
    return value;
  }
  std::unique_ptr<Expr> parse_or_test_no_cond() { return parse_or(); }

  std::unique_ptr<Expr> parse_or() {
    auto left = parse_and();
    while (is_name("or")) {
      const Token& at = next();
      auto e = expr(Expr::Kind::kOr, at);
      e->children.push_back(std::move(left));
      e->children.push_back(parse_and());
      left = std::move(e);
    }
    return left;
  }
  std::unique_ptr<Expr> parse_and() {
    auto left = parse_not();
    while (is_name("and")) {
      const Token& at = next();
      auto e = expr(Expr::Kind::kAnd, at);
      e->children.push_back(std::move(left));
      e->children.push_back(parse_not());
      left = std::move(e);
    }
    return left;
  }
  std::unique_ptr<Expr> parse_not() {
    if (is_name("not")) {
      const Token& at = next();
      auto e = expr(Expr::Kind::kNot, at);
      if (++depth_ > 200) syntax_error(at.line, at.col, "expression nested too deeply");
      e->children.push_back(parse_not());
      --depth_;
      return e;
    }
    return parse_compare();
  }
  std::unique_ptr<Expr> parse_compare() {
    const Token& at = peek();
    auto first = parse_math1();
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      if (peek().type == Tok::kOp && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                      peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = expr(Expr::Kind::kCompare, at);
        cmp->children.push_back(std::move(first));
      }
      cmp->compare_ops.push_back(op);
      cmp->children.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  std::unique_ptr<Expr> binary(const Token& at, const std::string& op, std::unique_ptr<Expr> l,
                               std::unique_ptr<Expr> r) {
    auto e = expr(Expr::Kind::kBinary, at);
    e->name = op;
    e->children.push_back(std::move(l));
    e->children.push_back(std::move(r));
    return e;
  }
  std::unique_ptr<Expr> parse_math1() {
    auto left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& at = next();
      left = binary(at, at.text, std::move(left), parse_concat());
    }
    return left;
  }
  std::unique_ptr<Expr> parse_concat() {
    const Token& at = peek();
    auto first = parse_math2();
    if (!is_op("~")) return first;
    auto e = expr(Expr::Kind::kConcat, at);
    e->children.push_back(std::move(first));
    while (is_op("~")) {
      next();
      e->children.push_back(parse_math2());
    }
    return e;
  }
  std::unique_ptr<Expr> parse_math2() {
    auto left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& at = next();
      left = binary(at, at.text, std::move(left), parse_pow());
    }
    return left;
  }
  std::unique_ptr<Expr> parse_pow() {
    auto left = parse_unary(true);
    while (is_op("**")) {
      const Token& at = next();
      left = binary(at, "**", std::move(left), parse_unary(true));
    }
    return left;
  }
  std::unique_ptr<Expr> parse_unary(bool with_filter) {
    std::unique_ptr<Expr> node_expr;
    if (is_op("-") || is_op("+")) {
      const Token& at = next();
      node_expr = expr(at.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, at);
      if (++depth_ > 200) syntax_error(at.line, at.col, "expression nested too deeply");
      node_expr->children.push_back(parse_unary(false));
      --depth_;
    } else {
      node_expr = parse_primary();
    }
    node_expr = parse_postfix(std::move(node_expr));
    if (with_filter) node_expr = parse_filter_expr(std::move(node_expr));
    return node_expr;
  }

  std::unique_ptr<Expr> parse_primary() {
    const Token& t = peek();
    switch (t.type) {
      case Tok::kName: {
        next();
        if (t.text == "true" || t.text == "True") return literal(t, Value::boolean(true));
        if (t.text == "false" || t.text == "False") return literal(t, Value::boolean(false));
        if (t.text == "none" || t.text == "None") return literal(t, Value::none());
        auto e = expr(Expr::Kind::kName, t);
        e->name = t.text;
        return e;
      }
      case Tok::kString: {
        std::string s = next().text;
        while (peek().type == Tok::kString) s += next().text;
        return literal(t, Value::string(std::move(s)));
      }
      case Tok::kInt:
        next();
        return literal(t, Value::integer(t.int_value));
      case Tok::kFloat:
        next();
        return literal(t, Value::real(t.float_value));
      case Tok::kOp:
        if (t.text == "(") {
          next();
          if (is_op(")")) {
            next();
            return expr(Expr::Kind::kTuple, t);
          }
          auto first = parse_expression();
          if (is_op(")")) {
            next();
            return first;
          }
          auto tuple = expr(Expr::Kind::kTuple, t);
          tuple->children.push_back(std::move(first));
          while (is_op(",")) {
            next();
            if (is_op(")")) break;
            tuple->children.push_back(parse_expression());
          }
          expect_op(")");
          return tuple;
        }
        if (t.text == "[") {
          next();
          auto list = expr(Expr::Kind::kList, t);
          while (!is_op("]")) {
            list->children.push_back(parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("]");
          return list;
        }
        if (t.text == "{") {
          next();
          auto dict = expr(Expr::Kind::kDict, t);
          while (!is_op("}")) {
            dict->children.push_back(parse_expression());
            expect_op(":");
            dict->children.push_back(parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("}");
          return dict;
        }
        break;
      default:
        break;
    }
    syntax_error(t.line, t.col, fmt::format("unexpected '{}'", describe(t)));
  }

  std::unique_ptr<Expr> literal(const Token& at, Value v) {
    auto e = expr(Expr::Kind::kLiteral, at);
    e->literal = std::move(v);
    return e;
  }

  void parse_call_args(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) unsupported(peek().line, peek().col, "'*args' / '**kwargs' in a call");
      if (peek().type == Tok::kName && is_op("=", 1)) {
        call.kwarg_names.push_back(next().text);
        next();
        call.children.push_back(parse_expression());
      } else {
        if (!call.kwarg_names.empty())
          syntax_error(peek().line, peek().col, "positional argument follows keyword argument");
        call.children.push_back(parse_expression());
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  std::unique_ptr<Expr> parse_postfix(std::unique_ptr<Expr> value) {
    while (true) {
      if (is_op(".")) {
        const Token& at = next();
        auto e = expr(Expr::Kind::kAttr, at);
        if (peek().type == Tok::kInt) {
          // foo.0 is foo[0] in jinja2.
          e->kind = Expr::Kind::kItem;
          e->children.push_back(std::move(value));
          e->children.push_back(literal(peek(), Value::integer(peek().int_value)));
          next();
        } else {
          e->name = expect_name();
          e->children.push_back(std::move(value));
        }
        value = std::move(e);
      } else if (is_op("[")) {
        const Token& at = next();
        std::unique_ptr<Expr> parts[3];
        bool is_slice = false;
        for (int i = 0; i < 3; ++i) {
          if (!is_op(":") && !is_op("]")) parts[i] = parse_expression();
          if (i < 2 && is_op(":")) {
            next();
            is_slice = true;
          } else {
            break;
          }
        }
        expect_op("]");
        auto e = expr(is_slice ? Expr::Kind::kSlice : Expr::Kind::kItem, at);
        e->children.push_back(std::move(value));
        if (is_slice) {
          for (auto& p : parts) e->children.push_back(std::move(p));
        } else {
          if (!parts[0]) syntax_error(at.line, at.col, "empty subscript");
          e->children.push_back(std::move(parts[0]));
        }
        value = std::move(e);
      } else if (is_op("(")) {
        auto e = expr(Expr::Kind::kCall, peek());
        e->children.push_back(std::move(value));
        parse_call_args(*e);
        value = std::move(e);
      } else {
        return value;
      }
    }
  }

  std::unique_ptr<Expr> parse_filter_expr(std::unique_ptr<Expr> value) {
    while (true) {
      if (is_op("|")) {
        next();
        const Token& at = peek();
        auto e = expr(Expr::Kind::kFilter, at);
        e->name = expect_name();
        while (is_op(".")) {
          next();
          e->name += "." + expect_name();
        }
        if (!has_filter(e->name)) unsupported(at.line, at.col, fmt::format("filter '{}'", e->name));
        e->children.push_back(std::move(value));
        if (is_op("(")) parse_call_args(*e);
        value = std::move(e);
      } else if (is_name("is")) {
        next();
        const Token& at = peek();
        auto e = expr(Expr::Kind::kTest, at);
        if (is_name("not")) {
          next();
          e->negated = true;
        }
        const Token& name_token = peek();
        e->name = expect_name();
        if (!has_test(e->name)) unsupported(name_token.line, name_token.col, fmt::format("test '{}'", e->name));
        e->children.push_back(std::move(value));
        if (is_op("(")) {
          parse_call_args(*e);
        } else if ((peek().type == Tok::kName || peek().type == Tok::kString || peek().type == Tok::kInt ||
                    peek().type == Tok::kFloat || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") && !is_name("in") &&
                   !is_name("not") && !is_name("is")) {
          auto arg = parse_primary();
          e->children.push_back(parse_postfix(std::move(arg)));
        }
        value = std::move(e);
      } else if (is_op("(")) {
        auto e = expr(Expr::Kind::kCall, peek());
        e->children.push_back(std::move(value));
        parse_call_args(*e);
        value = std::move(e);
      } else {
        return value;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
  int depth_ = 0;
};

}  // namespace

Template::~Template() = default;

Result<std::shared_ptr<const Template>> Template::parse(std::string_view source) {
  try {
    Lexer lexer(source);
    Parser parser(lexer.run());
    std::shared_ptr<Template> tmpl(new Template());
    tmpl->root_ = parser.parse_template();
    return std::shared_ptr<const Template>(std::move(tmpl));
  } catch (const ParseError& e) {
    return Status(e.unsupported ? ErrorCode::kUnimplemented : ErrorCode::kInvalidArgument, e.message);
  } catch (const TemplateError& e) {
    return invalid_argument("template syntax error: {}", e.what());
  }
}

}  // namespace pd::tokenizer::jinja
