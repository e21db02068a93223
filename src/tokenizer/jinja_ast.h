// Syntax tree of a parsed template (internal to the jinja interpreter).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace pd::tokenizer::jinja {

struct Expr {
  enum class Kind {
    kLiteral,
    kName,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNeg,
    kPos,
    kNot,
    kBinary,
    kAnd,
    kOr,
    kCompare,
    kCond,
    kList,
    kTuple,
    kDict,
    kConcat
  };
  Kind kind;
  int line = 0;
  int col = 0;
  Value literal;                                // kLiteral
  std::string name;                             // kName, kAttr (attribute), kFilter/kTest (name), kBinary (op)
  std::vector<std::unique_ptr<Expr>> children;  // operands; null entries for omitted slice parts / else
  std::vector<std::string> kwarg_names;         // kCall/kFilter/kTest: names of the trailing keyword args
  std::vector<std::string> compare_ops;         // kCompare: ops between consecutive children
  bool negated = false;                         // kTest: "is not"
  size_t num_positional() const { return children.size() - 1 - kwarg_names.size(); }
};

struct Node {
  enum class Kind { kBody, kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue };
  Kind kind;
  int line = 0;
  int col = 0;
  std::string text;                             // kText; kMacro name
  std::unique_ptr<Expr> expr;                   // kOutput, kSet value, kFor iterable
  std::vector<std::unique_ptr<Expr>> conds;     // kIf: one per branch
  std::vector<std::unique_ptr<Node>> children;  // kBody statements; kIf bodies (one extra = else)
  std::vector<std::string> targets;             // kFor loop variables; kSet names; kMacro params
  std::string attr;                             // kSet "ns.attr": targets[0] is ns
  std::vector<std::unique_ptr<Expr>> defaults;  // kMacro: default per param (null = none)
  std::unique_ptr<Expr> filter;                 // kFor "if" clause
  std::unique_ptr<Node> body;                   // kFor, kSetBlock, kMacro
  std::unique_ptr<Node> else_body;              // kFor
};

}  // namespace pd::tokenizer::jinja
