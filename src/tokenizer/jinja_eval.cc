// The evaluator: executes a parsed template with Python/jinja2 semantics.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <set>

#include "tokenizer/jinja.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_builtins.h"
#include "tokenizer/utf8.h"

namespace pd::tokenizer::jinja {
namespace {

constexpr int64_t kMaxRange = 100000;  // jinja2's sandbox MAX_RANGE

const std::set<std::string>& filter_names() {
  static const std::set<std::string> names = {
      "length",  "count",       "join",       "tojson",     "string",    "trim",       "replace",   "items",
      "reject",  "select",      "rejectattr", "selectattr", "map",       "list",       "first",     "last",
      "default", "d",           "lower",      "upper",      "title",     "capitalize", "safe",      "e",
      "escape",  "forceescape", "int",        "float",      "abs",       "round",      "reverse",   "sort",
      "unique",  "dictsort",    "indent",     "min",        "max",       "sum",        "wordcount", "attr",
      "batch",   "center",      "truncate",   "format",     "striptags", "bool"};
  return names;
}
const std::set<std::string>& test_names() {
  static const std::set<std::string> names = {
      "defined", "undefined", "none",        "boolean",  "true",     "false",    "integer", "float",
      "number",  "string",    "mapping",     "iterable", "sequence", "callable", "sameas",  "escaped",
      "in",      "eq",        "equalto",     "==",       "ne",       "!=",       "lt",      "lessthan",
      "<",       "gt",        "greaterthan", ">",        "le",       "<=",       "ge",      ">=",
      "odd",     "even",      "divisibleby", "lower",    "upper",    "filter",   "test"};
  return names;
}

[[noreturn]] void raise_undefined(const Value& v) {
  if (v.as_string().empty()) fail("value is undefined");
  fail(fmt::format("'{}' is undefined", v.as_string()));
}

bool is_py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::vector<uint32_t> codepoints(const std::string& s) {
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (utf8_valid_length(s, i) == 0) {
      cps.push_back(0xFFFD);
      ++i;
    } else {
      cps.push_back(utf8_next(s, i));
    }
  }
  return cps;
}
std::string from_codepoints(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) utf8_append(out, cps[i]);
  return out;
}

std::string py_strip(const std::string& s, const Value* chars, bool left, bool right) {
  const auto cps = codepoints(s);
  std::vector<uint32_t> set;
  const bool by_set = chars != nullptr && !chars->is_none() && !chars->is_undefined();
  if (by_set) {
    if (!chars->is_string()) fail("strip arg must be None or str");
    set = codepoints(chars->as_string());
  }
  auto strip_it = [&](uint32_t cp) {
    return by_set ? std::find(set.begin(), set.end(), cp) != set.end() : is_py_space(cp);
  };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  return from_codepoints(cps, b, e);
}

std::string ascii_lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string ascii_upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string py_title(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalpha(u)) {
      c = static_cast<char>(prev_cased ? std::tolower(u) : std::toupper(u));
      prev_cased = true;
    } else {
      prev_cased = false;
    }
  }
  return out;
}
std::string py_capitalize(const std::string& s) {
  std::string out = ascii_lower(s);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts repl before every character and at the end.
    const auto cps = codepoints(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += repl;
    pos = hit + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<std::string> py_split(const std::string& s, const Value* sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep == nullptr || sep->is_none()) {
    // Whitespace split: runs of whitespace separate, no empty strings.
    const auto cps = codepoints(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && is_py_space(cps[i])) ++i;
      if (i >= cps.size()) break;
      size_t j = i;
      while (j < cps.size() && !is_py_space(cps[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit < 0 || static_cast<size_t>(maxsplit) + 1 >= words.size()) {
      for (auto [b, e] : words) parts.push_back(from_codepoints(cps, b, e));
      return parts;
    }
    const auto keep = static_cast<size_t>(maxsplit);
    if (!from_right) {
      for (size_t k = 0; k < keep; ++k) parts.push_back(from_codepoints(cps, words[k].first, words[k].second));
      size_t e = cps.size();
      while (e > words[keep].first && is_py_space(cps[e - 1])) --e;
      parts.push_back(from_codepoints(cps, words[keep].first, e));
    } else {
      const size_t first_kept = words.size() - keep;
      size_t b = 0;
      while (b < cps.size() && is_py_space(cps[b])) ++b;
      parts.push_back(from_codepoints(cps, b, words[first_kept - 1].second));
      for (size_t k = first_kept; k < words.size(); ++k)
        parts.push_back(from_codepoints(cps, words[k].first, words[k].second));
    }
    return parts;
  }
  if (!sep->is_string()) fail("must be str or None, not " + sep->type_name());
  const std::string& d = sep->as_string();
  if (d.empty()) fail("empty separator");
  if (!from_right) {
    size_t pos = 0;
    int64_t done = 0;
    while (maxsplit < 0 || done < maxsplit) {
      const size_t hit = s.find(d, pos);
      if (hit == std::string::npos) break;
      parts.push_back(s.substr(pos, hit - pos));
      pos = hit + d.size();
      ++done;
    }
    parts.push_back(s.substr(pos));
    return parts;
  }
  std::vector<std::string> rev;
  size_t end = s.size();
  int64_t done = 0;
  while (maxsplit < 0 || done < maxsplit) {
    if (end < d.size()) break;
    const size_t hit = s.rfind(d, end - d.size());
    if (hit == std::string::npos) break;
    rev.push_back(s.substr(hit + d.size(), end - hit - d.size()));
    end = hit;
    ++done;
  }
  rev.push_back(s.substr(0, end));
  parts.assign(rev.rbegin(), rev.rend());
  return parts;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string ensure_ascii(const std::string& json) {
  std::string out;
  size_t i = 0;
  while (i < json.size()) {
    if (static_cast<unsigned char>(json[i]) < 0x80) {
      out.push_back(json[i++]);
      continue;
    }
    uint32_t cp = utf8_valid_length(json, i) ? utf8_next(json, i) : (++i, 0xFFFD);
    char buf[16];
    if (cp >= 0x10000) {
      cp -= 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
    } else {
      std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
    }
    out += buf;
  }
  return out;
}

int64_t py_floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t py_mod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

// Python slice index normalisation.
void slice_indices(int64_t len, const Value& start_v, const Value& stop_v, const Value& step_v, int64_t& start,
                   int64_t& stop, int64_t& step) {
  auto as_index = [](const Value& v, const char* what) {
    if (v.kind() != Value::Kind::kInt && v.kind() != Value::Kind::kBool) {
      fail(fmt::format("slice {} must be an integer or None", what));
    }
    return v.as_int();
  };
  step = step_v.is_none() || step_v.is_undefined() ? 1 : as_index(step_v, "step");
  if (step == 0) fail("slice step cannot be zero");
  auto adjust = [&](const Value& v, int64_t fallback, bool is_stop) -> int64_t {
    (void)is_stop;
    if (v.is_none() || v.is_undefined()) return fallback;
    int64_t x = as_index(v, "index");
    if (x < 0) {
      x += len;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= len) {
      x = step < 0 ? len - 1 : len;
    }
    return x;
  };
  start = adjust(start_v, step < 0 ? len - 1 : 0, false);
  stop = adjust(stop_v, step < 0 ? -1 : len, true);
}

struct Frame {
  Frame* parent = nullptr;
  std::vector<std::pair<std::string, Value>> vars;
  Value* find_here(const std::string& name) {
    for (auto& [k, v] : vars) {
      if (k == name) return &v;
    }
    return nullptr;
  }
  void set(const std::string& name, Value value) {
    if (Value* v = find_here(name)) {
      *v = std::move(value);
    } else {
      vars.emplace_back(name, std::move(value));
    }
  }
};

enum class Flow { kNormal, kBreak, kContinue };

class Interpreter {
 public:
  Interpreter(const nlohmann::ordered_json& context, const RenderLimits& limits) : limits_(limits) {
    install_globals();
    root_.parent = &globals_;
    if (context.is_object()) {
      for (const auto& [k, v] : context.items()) root_.set(k, Value::from_json(v));
    }
  }

  std::string run(const Node& root) {
    std::string out;
    exec(root, root_, out);
    return out;
  }

 private:
  // ---- errors ----
  [[noreturn]] static void fail_at(int line, const std::string& message) {
    TemplateError e(TemplateError::Kind::kRuntime, message);
    e.line = line;
    throw e;
  }

  void step() {
    if (++steps_ > limits_.max_steps) throw TemplateError(TemplateError::Kind::kLimit, "template ran too many steps");
  }
  void append_output(std::string& out, const std::string& s) const {
    if (out.size() + s.size() > limits_.max_output_bytes) {
      throw TemplateError(TemplateError::Kind::kLimit, "template output exceeds the size limit");
    }
    out += s;
  }

  // ---- globals ----
  static std::shared_ptr<Callable> make_fn(std::string name, std::function<Value(CallArgs&)> fn) {
    auto c = std::make_shared<Callable>();
    c->name = std::move(name);
    c->fn = std::move(fn);
    return c;
  }

  void install_globals() {
    globals_.set("range", Value::callable(make_fn("range", [](CallArgs& a) {
                   if (!a.keyword.empty()) fail("range() takes no keyword arguments");
                   int64_t start = 0, stop = 0, stp = 1;
                   auto as_int = [](const Value& v) {
                     if (v.kind() != Value::Kind::kInt && v.kind() != Value::Kind::kBool) {
                       fail("'" + v.type_name() + "' object cannot be interpreted as an integer");
                     }
                     return v.as_int();
                   };
                   if (a.positional.size() == 1) {
                     stop = as_int(a.positional[0]);
                   } else if (a.positional.size() == 2 || a.positional.size() == 3) {
                     start = as_int(a.positional[0]);
                     stop = as_int(a.positional[1]);
                     if (a.positional.size() == 3) stp = as_int(a.positional[2]);
                   } else {
                     fail("range expected 1 to 3 arguments");
                   }
                   if (stp == 0) fail("range() arg 3 must not be zero");
                   int64_t n = 0;
                   if (stp > 0 && stop > start) n = (stop - start + stp - 1) / stp;
                   if (stp < 0 && stop < start) n = (start - stop - stp - 1) / -stp;
                   if (n > kMaxRange) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
                   ValueList items;
                   items.reserve(static_cast<size_t>(n));
                   for (int64_t i = 0; i < n; ++i) items.push_back(Value::integer(start + i * stp));
                   return Value::list(std::move(items));
                 })));
    auto make_dict = [](CallArgs& a, bool is_namespace) {
      auto d = std::make_shared<ValueDict>();
      d->is_namespace = is_namespace;
      if (a.positional.size() > 1) fail("expected at most 1 positional argument");
      if (a.positional.size() == 1) {
        const Value& init = a.positional[0];
        if (!init.is_dict()) fail("cannot convert " + init.type_name() + " to a dictionary");
        for (const auto& [k, v] : init.dict_ref().entries) d->set(k, v);
      }
      for (const auto& [k, v] : a.keyword) {
        if (is_namespace && !k.empty() && k[0] == '_') {
          fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + k + "'");
        }
        d->set(k, v);
      }
      return Value::dict(std::move(d));
    };
    globals_.set("namespace",
                 Value::callable(make_fn("namespace", [make_dict](CallArgs& a) { return make_dict(a, true); })));
    globals_.set("dict", Value::callable(make_fn("dict", [make_dict](CallArgs& a) { return make_dict(a, false); })));
    globals_.set("raise_exception", Value::callable(make_fn("raise_exception", [](CallArgs& a) -> Value {
                   const Value* msg = a.get(0, "message");
                   throw TemplateError(TemplateError::Kind::kRaised, msg == nullptr ? std::string() : msg->str());
                 })));
    globals_.set("strftime_now", Value::callable(make_fn("strftime_now", [](CallArgs& a) {
                   const Value* format = a.get(0, "format");
                   if (format == nullptr || !format->is_string()) fail("strftime_now() needs a format string");
                   const std::time_t now = std::time(nullptr);
                   std::tm local{};
                   localtime_r(&now, &local);
                   char buf[512];
                   const size_t n = std::strftime(buf, sizeof(buf), format->as_string().c_str(), &local);
                   return Value::string(std::string(buf, n));
                 })));
  }

  // ---- lookup / assignment ----
  Value lookup(const std::string& name, Frame& frame) {
    for (Frame* f = &frame; f != nullptr; f = f->parent) {
      if (Value* v = f->find_here(name)) return *v;
    }
    return Value::undefined(name);
  }

  // ---- iteration ----
  static ValueList iterate(const Value& v) {
    switch (v.kind()) {
      case Value::Kind::kList:
        return v.items();
      case Value::Kind::kDict: {
        if (v.dict_ref().is_namespace) fail("'Namespace' object is not iterable");
        ValueList keys;
        for (const auto& [k, unused] : v.dict_ref().entries) keys.push_back(Value::string(k));
        return keys;
      }
      case Value::Kind::kString: {
        ValueList chars;
        for (uint32_t cp : codepoints(v.as_string())) {
          std::string s;
          utf8_append(s, cp);
          chars.push_back(Value::string(std::move(s)));
        }
        return chars;
      }
      case Value::Kind::kUndefined:
        return {};
      default:
        fail("'" + v.type_name() + "' object is not iterable");
    }
  }

  static int64_t length_of(const Value& v) {
    switch (v.kind()) {
      case Value::Kind::kString:
        return static_cast<int64_t>(utf8_length(v.as_string()));
      case Value::Kind::kList:
        return static_cast<int64_t>(v.items().size());
      case Value::Kind::kDict:
        return static_cast<int64_t>(v.dict_ref().entries.size());
      case Value::Kind::kUndefined:
        return 0;
      default:
        fail("object of type '" + v.type_name() + "' has no len()");
    }
  }

  // ---- attribute and item access (jinja2 sandbox getattr/getitem) ----
  Value get_attr(const Value& obj, const std::string& name) {
    if (obj.is_undefined()) raise_undefined(obj);
    if (obj.is_dict()) {
      if (!obj.dict_ref().is_namespace && is_method_name(obj, name)) return bound_method(obj, name);
      if (const Value* v = obj.dict_ref().find(name)) return *v;
      return Value::undefined(name);
    }
    if ((obj.is_string() || obj.is_list()) && is_method_name(obj, name)) return bound_method(obj, name);
    return Value::undefined(name);
  }

  Value get_item(const Value& obj, const Value& key) {
    if (obj.is_undefined()) raise_undefined(obj);
    if (obj.is_dict()) {
      if (key.is_string()) {
        if (const Value* v = obj.dict_ref().find(key.as_string())) return *v;
        if (!obj.dict_ref().is_namespace && is_method_name(obj, key.as_string()))
          return bound_method(obj, key.as_string());
        return Value::undefined(key.as_string());
      }
      return Value::undefined();
    }
    if ((obj.is_list() || obj.is_string()) && (key.kind() == Value::Kind::kInt || key.kind() == Value::Kind::kBool)) {
      int64_t index = key.as_int();
      if (obj.is_list()) {
        const auto n = static_cast<int64_t>(obj.items().size());
        if (index < 0) index += n;
        if (index < 0 || index >= n) return Value::undefined();
        return obj.items()[static_cast<size_t>(index)];
      }
      const auto cps = codepoints(obj.as_string());
      const auto n = static_cast<int64_t>(cps.size());
      if (index < 0) index += n;
      if (index < 0 || index >= n) return Value::undefined();
      return Value::string(from_codepoints(cps, static_cast<size_t>(index), static_cast<size_t>(index) + 1));
    }
    if (key.is_string()) return get_attr(obj, key.as_string());
    return Value::undefined();
  }

  static bool is_method_name(const Value& obj, const std::string& name) {
    static const std::set<std::string> kStr = {
        "startswith", "endswith",   "split",   "rsplit",  "strip",      "lstrip", "rstrip", "upper",   "lower",
        "title",      "capitalize", "replace", "find",    "rfind",      "count",  "join",   "isdigit", "isalpha",
        "isspace",    "isalnum",    "isupper", "islower", "splitlines", "format", "index"};
    static const std::set<std::string> kList = {"index",  "count",   "append", "extend", "insert", "pop",
                                                "remove", "reverse", "sort",   "clear",  "copy"};
    static const std::set<std::string> kDict = {"items",  "keys", "values",  "get",        "copy",
                                                "update", "pop",  "popitem", "setdefault", "clear"};
    if (obj.is_string()) return kStr.count(name) != 0;
    if (obj.is_list()) return kList.count(name) != 0;
    if (obj.is_dict()) return kDict.count(name) != 0;
    return false;
  }

  Value bound_method(const Value& obj, const std::string& name) {
    Value self = obj;
    return Value::callable(make_fn(name, [this, self, name](CallArgs& a) { return call_method(self, name, a); }));
  }

  Value call_method(const Value& self, const std::string& name, CallArgs& a) {
    if (self.is_list()) {
      if (name == "index" || name == "count") {
        const Value* x = a.get(0, "value");
        if (x == nullptr) fail(name + "() takes exactly one argument");
        const auto& items = self.items();
        int64_t count = 0;
        for (size_t i = 0; i < items.size(); ++i) {
          if (values_equal(items[i], *x)) {
            if (name == "index") return Value::integer(static_cast<int64_t>(i));
            ++count;
          }
        }
        if (name == "index") fail(x->repr() + " is not in list");
        return Value::integer(count);
      }
      if (name == "copy") return Value::list(self.items());
      fail("access to attribute '" + name + "' of 'list' object is unsafe.");
    }
    if (self.is_dict()) {
      const ValueDict& d = self.dict_ref();
      if (name == "items" || name == "keys" || name == "values") {
        ValueList out;
        for (const auto& [k, v] : d.entries) {
          if (name == "items")
            out.push_back(Value::list({Value::string(k), v}, true));
          else if (name == "keys")
            out.push_back(Value::string(k));
          else
            out.push_back(v);
        }
        return Value::list(std::move(out));
      }
      if (name == "get") {
        const Value* key = a.get(0, "key");
        if (key == nullptr) fail("get expected at least 1 argument");
        const Value* fallback = a.get(1, "default");
        if (key->is_string()) {
          if (const Value* v = d.find(key->as_string())) return *v;
        }
        return fallback == nullptr ? Value::none() : *fallback;
      }
      if (name == "copy") {
        auto copy = std::make_shared<ValueDict>(d);
        copy->is_namespace = false;
        return Value::dict(std::move(copy));
      }
      fail("access to attribute '" + name + "' of 'dict' object is unsafe.");
    }
    // str
    const std::string& s = self.as_string();
    if (name == "startswith" || name == "endswith") {
      const Value* arg = a.get(0, "prefix");
      if (arg == nullptr) fail(name + "() takes at least 1 argument");
      ValueList options = arg->is_tuple() ? arg->items() : ValueList{*arg};
      for (const Value& o : options) {
        if (!o.is_string()) fail(name + " first arg must be str or a tuple of str, not " + o.type_name());
        const std::string& p = o.as_string();
        if (name == "startswith" ? s.starts_with(p) : s.ends_with(p)) return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (name == "split" || name == "rsplit") {
      const Value* sep = a.get(0, "sep");
      const Value* maxsplit = a.get(1, "maxsplit");
      ValueList out;
      for (auto& part : py_split(s, sep, maxsplit == nullptr ? -1 : maxsplit->as_int(), name == "rsplit")) {
        out.push_back(Value::string(std::move(part)));
      }
      return Value::list(std::move(out));
    }
    if (name == "strip") return Value::string(py_strip(s, a.get(0, "chars"), true, true));
    if (name == "lstrip") return Value::string(py_strip(s, a.get(0, "chars"), true, false));
    if (name == "rstrip") return Value::string(py_strip(s, a.get(0, "chars"), false, true));
    if (name == "upper") return Value::string(ascii_upper(s));
    if (name == "lower") return Value::string(ascii_lower(s));
    if (name == "title") return Value::string(py_title(s));
    if (name == "capitalize") return Value::string(py_capitalize(s));
    if (name == "replace") {
      const Value* old = a.get(0, "old");
      const Value* repl = a.get(1, "new");
      const Value* count = a.get(2, "count");
      if (old == nullptr || repl == nullptr || !old->is_string() || !repl->is_string())
        fail("replace() needs two strings");
      return Value::string(py_replace(s, old->as_string(), repl->as_string(), count == nullptr ? -1 : count->as_int()));
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "count") {
      const Value* sub = a.get(0, "sub");
      if (sub == nullptr || !sub->is_string()) fail(name + "() needs a string argument");
      const std::string& needle = sub->as_string();
      if (name == "count") {
        if (needle.empty()) return Value::integer(static_cast<int64_t>(utf8_length(s)) + 1);
        int64_t n = 0;
        for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + needle.size())) ++n;
        return Value::integer(n);
      }
      const size_t hit = name == "rfind" ? s.rfind(needle) : s.find(needle);
      if (hit == std::string::npos) {
        if (name == "index") fail("substring not found");
        return Value::integer(-1);
      }
      return Value::integer(static_cast<int64_t>(utf8_length(s.substr(0, hit))));
    }
    if (name == "join") {
      const Value* items = a.get(0, "iterable");
      if (items == nullptr) fail("join() takes exactly one argument");
      std::string out;
      bool first = true;
      for (const Value& item : iterate(*items)) {
        if (!item.is_string()) fail("sequence item: expected str instance, " + item.type_name() + " found");
        if (!first) out += s;
        first = false;
        out += item.as_string();
      }
      return Value::string(std::move(out));
    }
    if (name == "splitlines") {
      ValueList out;
      size_t pos = 0;
      while (pos < s.size()) {
        size_t end = s.find_first_of("\r\n", pos);
        if (end == std::string::npos) {
          out.push_back(Value::string(s.substr(pos)));
          break;
        }
        out.push_back(Value::string(s.substr(pos, end - pos)));
        pos = end + ((s[end] == '\r' && end + 1 < s.size() && s[end + 1] == '\n') ? 2 : 1);
      }
      return Value::list(std::move(out));
    }
    if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isalnum" || name == "isupper" ||
        name == "islower") {
      if (s.empty()) return Value::boolean(false);
      bool any_cased = false;
      for (unsigned char c : s) {
        if (name == "isdigit" && !std::isdigit(c)) return Value::boolean(false);
        if (name == "isalpha" && !std::isalpha(c)) return Value::boolean(false);
        if (name == "isalnum" && !std::isalnum(c)) return Value::boolean(false);
        if (name == "isspace" && !is_py_space(c)) return Value::boolean(false);
        if (name == "isupper" && std::islower(c)) return Value::boolean(false);
        if (name == "islower" && std::isupper(c)) return Value::boolean(false);
        any_cased = any_cased || std::isalpha(c);
      }
      if (name == "isupper" || name == "islower") return Value::boolean(any_cased);
      return Value::boolean(true);
    }
    fail("str." + name + "() is not supported");
  }

  // ---- calls ----
  Value call_value(const Value& callee, CallArgs& args) {
    if (callee.is_undefined()) raise_undefined(callee);
    if (callee.kind() != Value::Kind::kCallable) fail("'" + callee.type_name() + "' object is not callable");
    return callee.callable_ref().fn(args);
  }

  CallArgs eval_args(const Expr& e, Frame& frame, size_t first_arg) {
    CallArgs args;
    const size_t num_kw = e.kwarg_names.size();
    const size_t num_pos = e.children.size() - first_arg - num_kw;
    for (size_t i = 0; i < num_pos; ++i) args.positional.push_back(eval(*e.children[first_arg + i], frame));
    for (size_t i = 0; i < num_kw; ++i) {
      args.keyword.emplace_back(e.kwarg_names[i], eval(*e.children[first_arg + num_pos + i], frame));
    }
    return args;
  }

  Value define_macro(const Node& n) {
    const Node* node = &n;
    return Value::callable(make_fn(n.text, [this, node](CallArgs& a) {
      if (a.positional.size() > node->targets.size()) {
        fail(fmt::format("macro '{}' takes not more than {} argument(s)", node->text, node->targets.size()));
      }
      if (++call_depth_ > limits_.max_call_depth) {
        --call_depth_;
        throw TemplateError(TemplateError::Kind::kLimit, "macro recursion too deep");
      }
      Frame frame;
      frame.parent = &root_;
      for (size_t i = 0; i < node->targets.size(); ++i) {
        const std::string& param = node->targets[i];
        if (i < a.positional.size()) {
          frame.set(param, a.positional[i]);
        } else if (const Value* kw = a.kwarg(param)) {
          frame.set(param, *kw);
        } else if (node->defaults[i]) {
          frame.set(param, eval(*node->defaults[i], frame));
        } else {
          frame.set(param, Value::undefined(param));
        }
      }
      for (const auto& [k, unused] : a.keyword) {
        if (std::find(node->targets.begin(), node->targets.end(), k) == node->targets.end()) {
          --call_depth_;
          fail(fmt::format("macro '{}' takes no keyword argument '{}'", node->text, k));
        }
      }
      std::string out;
      try {
        exec(*node->body, frame, out);
      } catch (...) {
        --call_depth_;
        throw;
      }
      --call_depth_;
      return Value::string(std::move(out));
    }));
  }

  // ---- expressions ----
  Value eval(const Expr& e, Frame& frame) {
    step();
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName:
        return lookup(e.name, frame);
      case Expr::Kind::kAttr:
        return get_attr(eval(*e.children[0], frame), e.name);
      case Expr::Kind::kItem: {
        Value obj = eval(*e.children[0], frame);
        return get_item(obj, eval(*e.children[1], frame));
      }
      case Expr::Kind::kSlice:
        return eval_slice(e, frame);
      case Expr::Kind::kCall: {
        const Expr& callee = *e.children[0];
        if (callee.kind == Expr::Kind::kAttr) {
          Value obj = eval(*callee.children[0], frame);
          CallArgs args = eval_args(e, frame, 1);
          if (obj.is_dict() && !obj.dict_ref().is_namespace && is_method_name(obj, callee.name)) {
            return call_method(obj, callee.name, args);
          }
          if ((obj.is_string() || obj.is_list()) && is_method_name(obj, callee.name)) {
            return call_method(obj, callee.name, args);
          }
          return call_value(get_attr(obj, callee.name), args);
        }
        Value fn = eval(callee, frame);
        CallArgs args = eval_args(e, frame, 1);
        return call_value(fn, args);
      }
      case Expr::Kind::kFilter: {
        Value operand = eval(*e.children[0], frame);
        CallArgs args = eval_args(e, frame, 1);
        return apply_filter(e.name, operand, args);
      }
      case Expr::Kind::kTest: {
        // "x is defined" must not fail on an undefined x.
        Value operand = eval(*e.children[0], frame);
        CallArgs args = eval_args(e, frame, 1);
        const bool result = apply_test(e.name, operand, args);
        return Value::boolean(e.negated ? !result : result);
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        Value v = eval(*e.children[0], frame);
        if (v.is_undefined()) raise_undefined(v);
        if (v.kind() == Value::Kind::kFloat)
          return Value::real(e.kind == Expr::Kind::kNeg ? -v.as_number() : v.as_number());
        if (v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool) {
          return Value::integer(e.kind == Expr::Kind::kNeg ? -v.as_int() : v.as_int());
        }
        fail("bad operand type for unary " + std::string(e.kind == Expr::Kind::kNeg ? "-" : "+") + ": '" +
             v.type_name() + "'");
      }
      case Expr::Kind::kNot:
        return Value::boolean(!eval(*e.children[0], frame).truthy());
      case Expr::Kind::kAnd: {
        Value l = eval(*e.children[0], frame);
        return l.truthy() ? eval(*e.children[1], frame) : l;
      }
      case Expr::Kind::kOr: {
        Value l = eval(*e.children[0], frame);
        return l.truthy() ? l : eval(*e.children[1], frame);
      }
      case Expr::Kind::kBinary: {
        Value l = eval(*e.children[0], frame);
        Value r = eval(*e.children[1], frame);
        return binary(e.name, l, r);
      }
      case Expr::Kind::kCompare: {
        Value left = eval(*e.children[0], frame);
        for (size_t i = 0; i < e.compare_ops.size(); ++i) {
          Value right = eval(*e.children[i + 1], frame);
          if (!compare(e.compare_ops[i], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::kCond: {
        if (eval(*e.children[1], frame).truthy()) return eval(*e.children[0], frame);
        if (e.children[2]) return eval(*e.children[2], frame);
        return Value::undefined();
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        ValueList items;
        for (const auto& c : e.children) items.push_back(eval(*c, frame));
        return Value::list(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        auto d = std::make_shared<ValueDict>();
        for (size_t i = 0; i + 1 < e.children.size(); i += 2) {
          Value k = eval(*e.children[i], frame);
          if (!k.is_string()) fail("only string keys are supported in dict literals");
          d->set(k.as_string(), eval(*e.children[i + 1], frame));
        }
        return Value::dict(std::move(d));
      }
      case Expr::Kind::kConcat: {
        std::string out;
        for (const auto& c : e.children) out += eval(*c, frame).str();
        return Value::string(std::move(out));
      }
    }
    fail("unknown expression");
  }

  Value eval_slice(const Expr& e, Frame& frame) {
    Value obj = eval(*e.children[0], frame);
    Value parts[3];
    for (int i = 0; i < 3; ++i)
      parts[i] =
          e.children[static_cast<size_t>(i) + 1] ? eval(*e.children[static_cast<size_t>(i) + 1], frame) : Value::none();
    if (obj.is_undefined()) raise_undefined(obj);
    int64_t start, stop, stp;
    if (obj.is_list()) {
      const auto& items = obj.items();
      slice_indices(static_cast<int64_t>(items.size()), parts[0], parts[1], parts[2], start, stop, stp);
      ValueList out;
      for (int64_t i = start; stp > 0 ? i < stop : i > stop; i += stp) out.push_back(items[static_cast<size_t>(i)]);
      return Value::list(std::move(out), obj.is_tuple());
    }
    if (obj.is_string()) {
      const auto cps = codepoints(obj.as_string());
      slice_indices(static_cast<int64_t>(cps.size()), parts[0], parts[1], parts[2], start, stop, stp);
      std::string out;
      for (int64_t i = start; stp > 0 ? i < stop : i > stop; i += stp) utf8_append(out, cps[static_cast<size_t>(i)]);
      return Value::string(std::move(out));
    }
    return Value::undefined();
  }

  static Value binary(const std::string& op, const Value& l, const Value& r) {
    if (l.is_undefined()) raise_undefined(l);
    if (r.is_undefined()) raise_undefined(r);
    auto type_error = [&]() -> Value {
      fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, l.type_name(), r.type_name()));
    };
    const bool both_int = (l.kind() == Value::Kind::kInt || l.kind() == Value::Kind::kBool) &&
                          (r.kind() == Value::Kind::kInt || r.kind() == Value::Kind::kBool);
    const bool both_num = l.is_number() && r.is_number();
    if (op == "+") {
      if (both_int) return Value::integer(l.as_int() + r.as_int());
      if (both_num) return Value::real(l.as_number() + r.as_number());
      if (l.is_string() && r.is_string()) return Value::string(l.as_string() + r.as_string());
      if (l.is_list() && r.is_list() && l.is_tuple() == r.is_tuple()) {
        ValueList out = l.items();
        out.insert(out.end(), r.items().begin(), r.items().end());
        return Value::list(std::move(out), l.is_tuple());
      }
      if (l.is_string()) fail(fmt::format("can only concatenate str (not \"{}\") to str", r.type_name()));
      return type_error();
    }
    if (op == "-") {
      if (both_int) return Value::integer(l.as_int() - r.as_int());
      if (both_num) return Value::real(l.as_number() - r.as_number());
      return type_error();
    }
    if (op == "*") {
      if (both_int) return Value::integer(l.as_int() * r.as_int());
      if (both_num) return Value::real(l.as_number() * r.as_number());
      const Value* seq = l.is_string() || l.is_list() ? &l : (r.is_string() || r.is_list() ? &r : nullptr);
      const Value* times = seq == &l ? &r : &l;
      if (seq != nullptr && (times->kind() == Value::Kind::kInt || times->kind() == Value::Kind::kBool)) {
        const int64_t n = std::max<int64_t>(0, times->as_int());
        if (seq->is_string()) {
          if (static_cast<double>(seq->as_string().size()) * static_cast<double>(n) > 64.0 * (1 << 20)) {
            throw TemplateError(TemplateError::Kind::kLimit, "string repetition too large");
          }
          std::string out;
          for (int64_t i = 0; i < n; ++i) out += seq->as_string();
          return Value::string(std::move(out));
        }
        if (static_cast<double>(seq->items().size()) * static_cast<double>(n) > 1e6) {
          throw TemplateError(TemplateError::Kind::kLimit, "list repetition too large");
        }
        ValueList out;
        for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq->items().begin(), seq->items().end());
        return Value::list(std::move(out));
      }
      return type_error();
    }
    if (op == "/") {
      if (!both_num) return type_error();
      if (r.as_number() == 0) fail("division by zero");
      return Value::real(l.as_number() / r.as_number());
    }
    if (op == "//" || op == "%") {
      if (!both_num) {
        if (op == "%" && l.is_string()) fail("printf-style '%' string formatting is not supported");
        return type_error();
      }
      if (r.as_number() == 0) fail("integer division or modulo by zero");
      if (both_int) {
        if (l.as_int() == INT64_MIN && r.as_int() == -1) fail("integer overflow");
        return Value::integer(op == "//" ? py_floordiv(l.as_int(), r.as_int()) : py_mod(l.as_int(), r.as_int()));
      }
      const double a = l.as_number(), b = r.as_number();
      if (op == "//") return Value::real(std::floor(a / b));
      double m = std::fmod(a, b);
      if (m != 0 && ((m < 0) != (b < 0))) m += b;
      return Value::real(m);
    }
    if (op == "**") {
      if (both_int && r.as_int() >= 0) {
        int64_t result = 1;
        for (int64_t i = 0; i < r.as_int() && i < 64; ++i) result *= l.as_int();
        return Value::integer(result);
      }
      if (both_num) return Value::real(std::pow(l.as_number(), r.as_number()));
      return type_error();
    }
    return type_error();
  }

  static bool contains(const Value& container, const Value& item) {
    switch (container.kind()) {
      case Value::Kind::kString:
        if (item.is_undefined()) raise_undefined(item);
        if (!item.is_string()) fail("'in <string>' requires string as left operand, not " + item.type_name());
        return container.as_string().find(item.as_string()) != std::string::npos;
      case Value::Kind::kList:
        for (const Value& v : container.items()) {
          if (values_equal(v, item)) return true;
        }
        return false;
      case Value::Kind::kDict:
        if (container.dict_ref().is_namespace) fail("argument of type 'Namespace' is not iterable");
        return item.is_string() && container.dict_ref().find(item.as_string()) != nullptr;
      case Value::Kind::kUndefined:
        return false;
      default:
        fail("argument of type '" + container.type_name() + "' is not iterable");
    }
  }

  static bool compare(const std::string& op, const Value& l, const Value& r) {
    if (op == "==") return values_equal(l, r);
    if (op == "!=") return !values_equal(l, r);
    if (op == "in") return contains(r, l);
    if (op == "notin") return !contains(r, l);
    if (l.is_undefined()) raise_undefined(l);
    if (r.is_undefined()) raise_undefined(r);
    if (op == "<") return value_less(l, r);
    if (op == ">") return value_less(r, l);
    if (op == "<=") return !value_less(r, l);
    if (op == ">=") return !value_less(l, r);
    fail("unknown comparison " + op);
  }

  // ---- tests ----
  bool apply_test(const std::string& name, const Value& v, CallArgs& a) {
    const Value* arg = a.get(0, "other");
    auto need_arg = [&]() -> const Value& {
      if (arg == nullptr) fail("test '" + name + "' needs an argument");
      return *arg;
    };
    const Value::Kind k = v.kind();
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return k == Value::Kind::kBool;
    if (name == "true") return k == Value::Kind::kBool && v.as_bool();
    if (name == "false") return k == Value::Kind::kBool && !v.as_bool();
    if (name == "integer") return k == Value::Kind::kInt;
    if (name == "float") return k == Value::Kind::kFloat;
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict() && !v.dict_ref().is_namespace;
    if (name == "iterable")
      return v.is_string() || v.is_list() || (v.is_dict() && !v.dict_ref().is_namespace) || v.is_undefined();
    if (name == "sequence")
      return v.is_string() || v.is_list() || (v.is_dict() && !v.dict_ref().is_namespace) || v.is_undefined();
    if (name == "callable") return k == Value::Kind::kCallable;
    if (name == "escaped") return false;
    if (name == "sameas") {
      const Value& o = need_arg();
      if (v.kind() != o.kind()) return false;
      switch (k) {
        case Value::Kind::kNone:
          return true;
        case Value::Kind::kBool:
          return v.as_bool() == o.as_bool();
        case Value::Kind::kInt:
          return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
        case Value::Kind::kList:
          return v.list_ptr() == o.list_ptr();
        case Value::Kind::kDict:
          return v.dict_ptr() == o.dict_ptr();
        default:
          return false;
      }
    }
    if (name == "in") return contains(need_arg(), v);
    if (name == "eq" || name == "equalto" || name == "==") return values_equal(v, need_arg());
    if (name == "ne" || name == "!=") return !values_equal(v, need_arg());
    if (name == "lt" || name == "lessthan" || name == "<") return compare("<", v, need_arg());
    if (name == "gt" || name == "greaterthan" || name == ">") return compare(">", v, need_arg());
    if (name == "le" || name == "<=") return compare("<=", v, need_arg());
    if (name == "ge" || name == ">=") return compare(">=", v, need_arg());
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (k != Value::Kind::kInt && k != Value::Kind::kBool) fail("test '" + name + "' needs an integer");
      if (name == "odd") return py_mod(v.as_int(), 2) == 1;
      if (name == "even") return py_mod(v.as_int(), 2) == 0;
      const Value& d = need_arg();
      if (!d.is_number() || d.as_number() == 0) fail("divisibleby needs a non-zero number");
      return py_mod(v.as_int(), d.as_int()) == 0;
    }
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) fail("test '" + name + "' needs a string");
      return name == "lower" ? ascii_lower(v.as_string()) == v.as_string()
                             : ascii_upper(v.as_string()) == v.as_string();
    }
    if (name == "filter") return v.is_string() && has_filter(v.as_string());
    if (name == "test") return v.is_string() && has_test(v.as_string());
    fail("unknown test '" + name + "'");
  }

  // Attribute path "a.b.0" as jinja2's make_attrgetter walks it.
  Value attr_path(const Value& v, const std::string& path) {
    Value cur = v;
    size_t pos = 0;
    while (true) {
      const size_t dot = path.find('.', pos);
      const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
      bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                  [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      cur = numeric ? get_item(cur, Value::integer(std::stoll(part))) : get_item(cur, Value::string(part));
      if (dot == std::string::npos) break;
      pos = dot + 1;
    }
    return cur;
  }

  // ---- filters ----
  Value apply_filter(const std::string& name, const Value& v, CallArgs& a) {
    if (name == "length" || name == "count") return Value::integer(length_of(v));
    if (name == "string") return Value::string(v.str());
    if (name == "safe" || name == "bool") return name == "bool" ? Value::boolean(v.truthy()) : v;
    if (name == "e" || name == "escape" || name == "forceescape") return Value::string(html_escape(v.str()));
    if (name == "default" || name == "d") {
      const Value* fallback = a.get(0, "default_value");
      const Value* boolean = a.get(1, "boolean");
      const bool use_fallback = v.is_undefined() || (boolean != nullptr && boolean->truthy() && !v.truthy());
      if (!use_fallback) return v;
      return fallback == nullptr ? Value::string("") : *fallback;
    }
    if (name == "tojson") {
      if (v.is_undefined()) fail("Object of type Undefined is not JSON serializable");
      const Value* ascii = a.get(0, "ensure_ascii");
      const Value* indent_v = a.get(1, "indent");
      const Value* separators = a.get(2, "separators");
      const Value* sort_keys = a.get(3, "sort_keys");
      int indent = -1;
      if (indent_v != nullptr && !indent_v->is_none()) {
        if (indent_v->kind() != Value::Kind::kInt) fail("tojson indent must be an integer");
        indent = static_cast<int>(std::clamp<int64_t>(indent_v->as_int(), 0, 64));
      }
      std::string item_sep = indent >= 0 ? "," : ", ";
      std::string key_sep = ": ";
      if (separators != nullptr && !separators->is_none()) {
        if (!separators->is_list() || separators->items().size() != 2 || !separators->items()[0].is_string() ||
            !separators->items()[1].is_string()) {
          fail("tojson separators must be a pair of strings");
        }
        item_sep = separators->items()[0].as_string();
        key_sep = separators->items()[1].as_string();
      }
      std::string json = to_python_json(v, indent, sort_keys != nullptr && sort_keys->truthy(), item_sep, key_sep);
      if (ascii != nullptr && ascii->truthy()) json = ensure_ascii(json);
      return Value::string(std::move(json));
    }
    if (name == "trim") return Value::string(py_strip(v.str(), a.get(0, "chars"), true, true));
    if (name == "lower") return Value::string(ascii_lower(v.str()));
    if (name == "upper") return Value::string(ascii_upper(v.str()));
    if (name == "title") return Value::string(py_title(v.str()));
    if (name == "capitalize") return Value::string(py_capitalize(v.str()));
    if (name == "replace") {
      const Value* old = a.get(0, "old");
      const Value* repl = a.get(1, "new");
      const Value* count = a.get(2, "count");
      if (old == nullptr || repl == nullptr) fail("replace filter needs two arguments");
      return Value::string(
          py_replace(v.str(), old->str(), repl->str(), count == nullptr || count->is_none() ? -1 : count->as_int()));
    }
    if (name == "join") {
      const Value* sep = a.get(0, "d");
      const Value* attribute = a.get(1, "attribute");
      std::string out;
      bool first = true;
      for (const Value& item : iterate(v)) {
        if (!first) out += sep == nullptr ? "" : sep->str();
        first = false;
        out += (attribute != nullptr && !attribute->is_none() ? attr_path(item, attribute->str()) : item).str();
      }
      return Value::string(std::move(out));
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::list({});
      if (!v.is_dict()) fail("items filter needs a mapping, got " + v.type_name());
      CallArgs none;
      return call_method(v, "items", none);
    }
    if (name == "list") return Value::list(iterate(v));
    if (name == "first" || name == "last") {
      ValueList items = iterate(v);
      if (items.empty()) return Value::undefined();
      return name == "first" ? items.front() : items.back();
    }
    if (name == "reverse") {
      if (v.is_string()) {
        auto cps = codepoints(v.as_string());
        std::reverse(cps.begin(), cps.end());
        return Value::string(from_codepoints(cps, 0, cps.size()));
      }
      ValueList items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep_passing = name == "select" || name == "selectattr";
      size_t arg_index = 0;
      std::string attribute;
      if (by_attr) {
        if (a.positional.empty()) fail(name + " needs an attribute name");
        attribute = a.positional[0].str();
        arg_index = 1;
      }
      std::string test;
      if (a.positional.size() > arg_index) test = a.positional[arg_index].str();
      if (!test.empty() && !has_test(test)) fail("no test named '" + test + "'");
      CallArgs test_args;
      for (size_t i = arg_index + 1; i < a.positional.size(); ++i) test_args.positional.push_back(a.positional[i]);
      ValueList out;
      for (const Value& item : iterate(v)) {
        const Value subject = by_attr ? attr_path(item, attribute) : item;
        const bool pass = test.empty() ? subject.truthy() : apply_test(test, subject, test_args);
        if (pass == keep_passing) out.push_back(item);
      }
      return Value::list(std::move(out));
    }
    if (name == "map") {
      ValueList out;
      if (const Value* attribute = a.kwarg("attribute")) {
        const Value* fallback = a.kwarg("default");
        for (const Value& item : iterate(v)) {
          Value got = attr_path(item, attribute->str());
          out.push_back(got.is_undefined() && fallback != nullptr ? *fallback : got);
        }
        return Value::list(std::move(out));
      }
      if (a.positional.empty()) fail("map needs a filter name or attribute=");
      const std::string filter = a.positional[0].str();
      if (!has_filter(filter)) fail("no filter named '" + filter + "'");
      CallArgs filter_args;
      filter_args.positional.assign(a.positional.begin() + 1, a.positional.end());
      filter_args.keyword = a.keyword;
      for (const Value& item : iterate(v)) out.push_back(apply_filter(filter, item, filter_args));
      return Value::list(std::move(out));
    }
    if (name == "int") {
      const Value* fallback = a.get(0, "default");
      const Value zero = fallback == nullptr ? Value::integer(0) : *fallback;
      if (v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool) return Value::integer(v.as_int());
      if (v.kind() == Value::Kind::kFloat)
        return std::isfinite(v.as_number()) ? Value::integer(static_cast<int64_t>(v.as_number())) : zero;
      if (v.is_string()) {
        const std::string s = py_strip(v.as_string(), nullptr, true, true);
        char* end = nullptr;
        errno = 0;
        const long long parsed = std::strtoll(s.c_str(), &end, 10);
        if (!s.empty() && end == s.c_str() + s.size() && errno == 0) return Value::integer(parsed);
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end == s.c_str() + s.size() && std::isfinite(d))
          return Value::integer(static_cast<int64_t>(d));
      }
      return zero;
    }
    if (name == "float") {
      const Value* fallback = a.get(0, "default");
      if (v.is_number()) return Value::real(v.as_number());
      if (v.is_string()) {
        const std::string s = py_strip(v.as_string(), nullptr, true, true);
        char* end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end == s.c_str() + s.size()) return Value::real(d);
      }
      return fallback == nullptr ? Value::real(0.0) : *fallback;
    }
    if (name == "abs") {
      if (v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool)
        return Value::integer(std::llabs(v.as_int()));
      if (v.kind() == Value::Kind::kFloat) return Value::real(std::fabs(v.as_number()));
      fail("bad operand type for abs(): '" + v.type_name() + "'");
    }
    if (name == "round") {
      const Value* precision = a.get(0, "precision");
      const Value* method = a.get(1, "method");
      if (!v.is_number()) fail("round filter needs a number");
      const int64_t digits = precision == nullptr ? 0 : precision->as_int();
      const double scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(digits, -300, 300)));
      const std::string m = method == nullptr ? "common" : method->str();
      double x = v.as_number() * scale;
      x = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::round(x);
      return Value::real(x / scale);
    }
    if (name == "sort" || name == "unique" || name == "dictsort" || name == "min" || name == "max") {
      const Value* attribute = a.kwarg("attribute");
      const Value* case_sensitive = a.kwarg("case_sensitive");
      const bool fold = case_sensitive == nullptr || !case_sensitive->truthy();
      auto key = [&](const Value& item) {
        Value k = attribute != nullptr ? attr_path(item, attribute->str()) : item;
        if (fold && k.is_string()) return Value::string(ascii_lower(k.as_string()));
        return k;
      };
      ValueList items;
      if (name == "dictsort") {
        if (!v.is_dict()) fail("dictsort needs a mapping");
        CallArgs none;
        items = call_method(v, "items", none).items();
        std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
          return value_less(key(x.items()[0]), key(y.items()[0]));
        });
        return Value::list(std::move(items));
      }
      items = iterate(v);
      if (name == "unique") {
        ValueList out;
        std::vector<Value> seen;
        for (const Value& item : items) {
          const Value k = key(item);
          if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return values_equal(s, k); })) {
            seen.push_back(k);
            out.push_back(item);
          }
        }
        return Value::list(std::move(out));
      }
      if (name == "min" || name == "max") {
        if (items.empty()) return Value::undefined();
        size_t best = 0;
        for (size_t i = 1; i < items.size(); ++i) {
          const bool better =
              name == "min" ? value_less(key(items[i]), key(items[best])) : value_less(key(items[best]), key(items[i]));
          if (better) best = i;
        }
        return items[best];
      }
      const Value* reverse = a.get(0, "reverse");
      const bool descending = reverse != nullptr && reverse->truthy();
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        return descending ? value_less(key(y), key(x)) : value_less(key(x), key(y));
      });
      return Value::list(std::move(items));
    }
    if (name == "sum") {
      const Value* attribute = a.get(0, "attribute");
      const Value* start = a.get(1, "start");
      Value total = start == nullptr ? Value::integer(0) : *start;
      for (const Value& item : iterate(v)) {
        total = binary("+", total,
                       attribute != nullptr && !attribute->is_none() ? attr_path(item, attribute->str()) : item);
      }
      return total;
    }
    if (name == "indent") {
      const Value* width_v = a.get(0, "width");
      const Value* first_v = a.get(1, "first");
      const Value* blank_v = a.get(2, "blank");
      std::string pad = width_v == nullptr ? "    "
                        : width_v->is_string()
                            ? width_v->as_string()
                            : std::string(static_cast<size_t>(std::clamp<int64_t>(width_v->as_int(), 0, 256)), ' ');
      const bool first = first_v != nullptr && first_v->truthy();
      const bool blank = blank_v != nullptr && blank_v->truthy();
      std::string s = v.str();
      std::string out;
      size_t pos = 0;
      bool is_first = true;
      while (true) {
        const size_t nl = s.find('\n', pos);
        const std::string line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        const bool indent_line = (is_first ? first : true) && (blank || !line.empty());
        if (indent_line) out += pad;
        out += line;
        if (nl == std::string::npos) break;
        out += "\n";
        pos = nl + 1;
        is_first = false;
      }
      return Value::string(std::move(out));
    }
    if (name == "wordcount") return Value::integer(static_cast<int64_t>(py_split(v.str(), nullptr, -1, false).size()));
    if (name == "attr") {
      const Value* attribute = a.get(0, "name");
      if (attribute == nullptr) fail("attr filter needs a name");
      return get_attr(v, attribute->str());
    }
    if (name == "center") {
      const Value* width_v = a.get(0, "width");
      const std::string s = v.str();
      const int64_t width = width_v == nullptr ? 80 : std::min<int64_t>(width_v->as_int(), 1 << 16);
      const auto len = static_cast<int64_t>(utf8_length(s));
      if (width <= len) return Value::string(s);
      const int64_t total = width - len;
      const int64_t left = total / 2 + (total & width & 1);
      return Value::string(std::string(static_cast<size_t>(left), ' ') + s +
                           std::string(static_cast<size_t>(total - left), ' '));
    }
    fail("filter '" + name + "' is not supported at runtime");
  }

  // ---- statements ----
  void assign_targets(Frame& frame, const std::vector<std::string>& targets, const Value& value) {
    if (targets.size() == 1) {
      frame.set(targets[0], value);
      return;
    }
    ValueList items = iterate(value);
    if (items.size() != targets.size()) {
      fail(fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
    }
    for (size_t i = 0; i < targets.size(); ++i) frame.set(targets[i], items[i]);
  }

  Flow exec(const Node& n, Frame& frame, std::string& out) {
    step();
    try {
      return exec_inner(n, frame, out);
    } catch (TemplateError& e) {
      if (e.kind == TemplateError::Kind::kRuntime && e.line == 0) e.line = n.line;
      throw;
    }
  }

  Flow exec_inner(const Node& n, Frame& frame, std::string& out) {
    switch (n.kind) {
      case Node::Kind::kBody:
        for (const auto& child : n.children) {
          const Flow f = exec(*child, frame, out);
          if (f != Flow::kNormal) return f;
        }
        return Flow::kNormal;
      case Node::Kind::kText:
        append_output(out, n.text);
        return Flow::kNormal;
      case Node::Kind::kOutput:
        append_output(out, eval(*n.expr, frame).str());
        return Flow::kNormal;
      case Node::Kind::kIf:
        for (size_t i = 0; i < n.conds.size(); ++i) {
          if (eval(*n.conds[i], frame).truthy()) return exec(*n.children[i], frame, out);
        }
        if (n.children.size() > n.conds.size()) return exec(*n.children.back(), frame, out);
        return Flow::kNormal;
      case Node::Kind::kFor:
        return exec_for(n, frame, out);
      case Node::Kind::kSet: {
        Value value = eval(*n.expr, frame);
        if (!n.attr.empty()) {
          Value target = lookup(n.targets[0], frame);
          if (!target.is_dict() || !target.dict_ref().is_namespace) {
            fail("cannot assign attribute on non-namespace object");
          }
          if (n.attr[0] == '_') fail("Chat templates cannot store underscore-prefixed attributes on a namespace");
          target.dict_ref().set(n.attr, std::move(value));
          return Flow::kNormal;
        }
        assign_targets(frame, n.targets, value);
        return Flow::kNormal;
      }
      case Node::Kind::kSetBlock: {
        std::string captured;
        exec(*n.body, frame, captured);
        frame.set(n.targets[0], Value::string(std::move(captured)));
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        frame.set(n.text, define_macro(n));
        return Flow::kNormal;
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  Flow exec_for(const Node& n, Frame& frame, std::string& out) {
    ValueList items = iterate(eval(*n.expr, frame));
    Frame loop_frame;
    loop_frame.parent = &frame;
    if (n.filter) {
      ValueList kept;
      for (const Value& item : items) {
        step();
        assign_targets(loop_frame, n.targets, item);
        if (eval(*n.filter, loop_frame).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (n.else_body) exec(*n.else_body, frame, out);
      return Flow::kNormal;
    }
    const auto length = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < length; ++i) {
      step();
      const Value& item = items[static_cast<size_t>(i)];
      assign_targets(loop_frame, n.targets, item);
      auto loop = std::make_shared<ValueDict>();
      loop->entries.reserve(12);
      loop->entries.emplace_back("index0", Value::integer(i));
      loop->entries.emplace_back("index", Value::integer(i + 1));
      loop->entries.emplace_back("revindex0", Value::integer(length - i - 1));
      loop->entries.emplace_back("revindex", Value::integer(length - i));
      loop->entries.emplace_back("first", Value::boolean(i == 0));
      loop->entries.emplace_back("last", Value::boolean(i == length - 1));
      loop->entries.emplace_back("length", Value::integer(length));
      loop->entries.emplace_back("depth", Value::integer(1));
      loop->entries.emplace_back("depth0", Value::integer(0));
      if (i > 0) loop->entries.emplace_back("previtem", items[static_cast<size_t>(i - 1)]);
      if (i + 1 < length) loop->entries.emplace_back("nextitem", items[static_cast<size_t>(i + 1)]);
      const int64_t index0 = i;
      loop->entries.emplace_back(
          "cycle", Value::callable(make_fn("cycle", [index0](CallArgs& a) {
            if (a.positional.empty()) fail("no items for cycling given");
            return a.positional[static_cast<size_t>(index0 % static_cast<int64_t>(a.positional.size()))];
          })));
      // Loop metadata lives in the namespace-like "loop" object; it is not a Mapping in jinja2.
      loop->is_namespace = true;
      loop_frame.set("loop", Value::dict(std::move(loop)));
      const Flow f = exec(*n.body, loop_frame, out);
      if (f == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  RenderLimits limits_;
  Frame globals_;
  Frame root_;
  uint64_t steps_ = 0;
  int call_depth_ = 0;
};

}  // namespace

bool has_filter(const std::string& name) {
  return filter_names().count(name) != 0;
}
bool has_test(const std::string& name) {
  return test_names().count(name) != 0;
}

Result<std::string> Template::render(const nlohmann::ordered_json& context, const RenderLimits& limits) const {
  try {
    Interpreter interp(context, limits);
    return interp.run(*root_);
  } catch (const TemplateError& e) {
    switch (e.kind) {
      case TemplateError::Kind::kRaised:
        return invalid_argument("chat template raised an exception: {}", e.what());
      case TemplateError::Kind::kLimit:
        return resource_exhausted("chat template: {}", e.what());
      case TemplateError::Kind::kRuntime:
        if (e.line > 0) return invalid_argument("chat template error at line {}: {}", e.line, e.what());
        return invalid_argument("chat template error: {}", e.what());
    }
  } catch (const std::exception& e) {
    return internal_error("chat template: unexpected error: {}", e.what());
  }
  return internal_error("chat template: unreachable");
}

}  // namespace pd::tokenizer::jinja
