// Values of the template language, with Python semantics (what jinja2 evaluates to).
// Lists and dicts have reference semantics like Python objects.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pd::tokenizer::jinja {

// Internal error type; converted to a Status at the render() boundary.
struct TemplateError : std::runtime_error {
  enum class Kind { kRuntime, kRaised, kLimit };
  Kind kind;
  int line = 0;  // template line the error happened on, once known
  TemplateError(Kind k, const std::string& message) : std::runtime_error(message), kind(k) {}
};
[[noreturn]] inline void fail(const std::string& message) {
  throw TemplateError(TemplateError::Kind::kRuntime, message);
}

class Value;
using ValueList = std::vector<Value>;
struct ValueDict;
struct Callable;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };

  Value() = default;  // undefined
  static Value undefined(std::string name = {}) {
    Value v;
    v.str_ = std::move(name);
    return v;
  }
  static Value none() { return Value(Kind::kNone); }
  static Value boolean(bool b) {
    Value v(Kind::kBool);
    v.int_ = b ? 1 : 0;
    return v;
  }
  static Value integer(int64_t i) {
    Value v(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value real(double d) {
    Value v(Kind::kFloat);
    v.float_ = d;
    return v;
  }
  static Value string(std::string s) {
    Value v(Kind::kString);
    v.str_ = std::move(s);
    return v;
  }
  static Value list(ValueList items, bool tuple = false);
  static Value dict(std::shared_ptr<ValueDict> d);
  static Value callable(std::shared_ptr<Callable> c);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_tuple() const { return kind_ == Kind::kList && tuple_; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }  // kInt and kBool
  double as_number() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return str_; }  // kString; for kUndefined, the name
  ValueList& items() const { return *list_; }
  ValueDict& dict_ref() const { return *dict_; }
  const std::shared_ptr<ValueDict>& dict_ptr() const { return dict_; }
  const std::shared_ptr<ValueList>& list_ptr() const { return list_; }
  Callable& callable_ref() const { return *callable_; }

  bool truthy() const;
  std::string str() const;   // Python str()
  std::string repr() const;  // Python repr()
  std::string type_name() const;

 private:
  explicit Value(Kind k) : kind_(k) {}
  Kind kind_ = Kind::kUndefined;
  bool tuple_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::string str_;
  std::shared_ptr<ValueList> list_;
  std::shared_ptr<ValueDict> dict_;
  std::shared_ptr<Callable> callable_;
};

// Insertion-ordered string-keyed mapping (Python dict / jinja2 Namespace).
struct ValueDict {
  std::vector<std::pair<std::string, Value>> entries;
  bool is_namespace = false;
  const Value* find(const std::string& key) const {
    for (const auto& [k, v] : entries) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  void set(const std::string& key, Value value) {
    for (auto& [k, v] : entries) {
      if (k == key) {
        v = std::move(value);
        return;
      }
    }
    entries.emplace_back(key, std::move(value));
  }
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  const Value* kwarg(const std::string& name) const {
    for (const auto& [k, v] : keyword) {
      if (k == name) return &v;
    }
    return nullptr;
  }
  // Positional index i or keyword name, else nullptr.
  const Value* get(size_t i, const std::string& name) const {
    if (i < positional.size()) return &positional[i];
    return kwarg(name);
  }
};

struct Callable {
  std::string name;
  std::function<Value(CallArgs&)> fn;
};

bool values_equal(const Value& a, const Value& b);
// Python's < ; fails for unorderable types.
bool value_less(const Value& a, const Value& b);
// json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=...) as Python does it.
std::string to_python_json(const Value& value, int indent, bool sort_keys, const std::string& item_sep,
                           const std::string& key_sep);
std::string python_float_repr(double d);
size_t utf8_length(const std::string& s);  // code points

}  // namespace pd::tokenizer::jinja
