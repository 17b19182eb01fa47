#include "text/chat_template.h"

#include <algorithm>
#include <charconv>
#include <optional>
#include <span>

#include "util/error.h"

// The functions below mirror the template's macros one to one (format_parameters, format_function_declaration,
// format_argument, strip_thinking, format_tool_response_block, then the main body), so a reader can check this
// file against tests/fixtures/chat/chat_template.jinja line by line. A `const Json*` that is nullptr stands for
// jinja's Undefined: a missing key, or an item lookup on a non-mapping (jinja answers those with Undefined rather
// than raising).

namespace dg::text {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kQuote = "<|\"|>";

// ---------- Python string semantics ----------

// Decodes one UTF-8 code point at s[i]; malformed bytes come back as themselves (never whitespace, never cased).
char32_t decode_utf8(std::string_view s, size_t& i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  int extra = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
  if (extra == 0 || i + extra >= s.size()) {
    ++i;
    return c;
  }
  char32_t cp = c & (0x3F >> extra);
  for (int k = 1; k <= extra; ++k) {
    unsigned char cc = static_cast<unsigned char>(s[i + k]);
    if ((cc & 0xC0) != 0x80) {
      ++i;
      return c;
    }
    cp = (cp << 6) | (cc & 0x3F);
  }
  i += extra + 1;
  return cp;
}

// Python's str.isspace(), which is what jinja's |trim (str.strip()) removes.
bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

std::string py_trim(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    size_t next = begin;
    if (!py_isspace(decode_utf8(s, next))) break;
    begin = next;
  }
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;  // back up to the lead byte of the last code point
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80 && end - start < 4) --start;
    size_t probe = start;
    char32_t c = decode_utf8(s, probe);
    if (probe != end || !py_isspace(c)) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

// str.lower() for the scripts that have case and appear in real JSON keys; only used as dictsort's sort key.
char32_t py_lower(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0xC0) return c;
  if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;
  if (c >= 0x100 && c <= 0x137 && c != 0x130) return c | 1;
  if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return (c & 1) ? c + 1 : c;
  if (c >= 0x14A && c <= 0x177) return c | 1;
  if (c == 0x178) return 0xFF;
  if (c >= 0x391 && c <= 0x3AB && c != 0x3A2) return c + 32;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 37;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 63;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if ((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF)) return c | 1;
  if (c >= 0xFF21 && c <= 0xFF3A) return c + 32;
  return c;
}

std::u32string py_lower_key(std::string_view s) {
  std::u32string out;
  for (size_t i = 0; i < s.size();) out.push_back(py_lower(decode_utf8(s, i)));
  return out;
}

// |upper on the type names of JSON schemas. Only ASCII is supported: Python's full-Unicode upper() (ß -> SS)
// is not worth a case table for schema type names, so anything else is rejected rather than rendered wrong.
std::string py_upper(std::string_view s, std::string_view where) {
  std::string out(s);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) >= 0x80)
      fail("chat template: {} '{}' contains non-ASCII characters; schema type names must be ASCII", where, s);
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  }
  return out;
}

// repr(float): shortest round-trip digits, exponent form when the decimal point is outside (-4, 16].
std::string py_float(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (!sci.empty() && sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits.push_back(c);
  int decpt = exponent + 1;
  if (decpt <= -4 || decpt > 16) {
    std::string out = sign + digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + eb;
  }
  if (decpt <= 0) return sign + "0." + std::string(-decpt, '0') + digits;
  if (decpt >= static_cast<int>(digits.size()))
    return sign + digits + std::string(decpt - digits.size(), '0') + ".0";
  return sign + digits.substr(0, decpt) + "." + digits.substr(decpt);
}

std::string py_repr(const Json& v);

// str(x) as jinja prints it: {{ x }} and the |trim/|upper filters' soft_str.
std::string py_str(const Json* v) {
  if (!v) return "";
  switch (v->type()) {
    case Json::value_t::null: return "None";
    case Json::value_t::boolean: return v->get<bool>() ? "True" : "False";
    case Json::value_t::number_integer: return std::to_string(v->get<int64_t>());
    case Json::value_t::number_unsigned: return std::to_string(v->get<uint64_t>());
    case Json::value_t::number_float: return py_float(v->get<double>());
    case Json::value_t::string: return v->get<std::string>();
    default: return py_repr(*v);
  }
}

// repr() of containers, which the template prints when a schema puts a list where it expects a string (JSON
// schema unions such as "type": ["string", "null"]). Non-ASCII strings are rejected: their repr depends on
// Unicode printability tables.
std::string py_repr(const Json& v) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    char quote = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
    std::string out(1, quote);
    for (unsigned char c : s) {
      if (c >= 0x80) fail("chat template: cannot print the non-ASCII string '{}' inside a list or object", s);
      if (c == '\\' || c == static_cast<unsigned char>(quote)) {
        out += '\\';
        out += static_cast<char>(c);
      } else if (c == '\n') {
        out += "\\n";
      } else if (c == '\r') {
        out += "\\r";
      } else if (c == '\t') {
        out += "\\t";
      } else if (c < 0x20 || c == 0x7F) {
        char b[8];
        std::snprintf(b, sizeof b, "\\x%02x", c);
        out += b;
      } else {
        out += static_cast<char>(c);
      }
    }
    return out + quote;
  }
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + py_repr(v[i]);
    return out + "]";
  }
  if (v.is_object()) {
    std::string out = "{";
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      out += (first ? "" : ", ") + py_repr(Json(it.key())) + ": " + py_repr(it.value());
      first = false;
    }
    return out + "}";
  }
  return py_str(&v);
}

// Python ==, as the template compares tool_call ids (None == None holds; 1 == 1.0 == True).
bool py_equal(const Json* a, const Json* b) {
  bool a_none = !a || a->is_null(), b_none = !b || b->is_null();
  if (a_none || b_none) return a_none && b_none;
  auto numeric = [](const Json& j) { return j.is_number() || j.is_boolean(); };
  if (numeric(*a) && numeric(*b)) {
    auto as_double = [](const Json& j) { return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>(); };
    if (a->is_number_float() || b->is_number_float() || a->is_boolean() || b->is_boolean())
      return as_double(*a) == as_double(*b);
    return *a == *b;
  }
  return *a == *b;
}

// A JSON value quoted in an error message: never throws on invalid UTF-8, never floods the log.
std::string show(const Json& v) {
  std::string text = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  return text.size() > 200 ? text.substr(0, 200) + "..." : text;
}

bool truthy(const Json* v) {
  if (!v) return false;
  switch (v->type()) {
    case Json::value_t::null: return false;
    case Json::value_t::boolean: return v->get<bool>();
    case Json::value_t::number_integer: return v->get<int64_t>() != 0;
    case Json::value_t::number_unsigned: return v->get<uint64_t>() != 0;
    case Json::value_t::number_float: return v->get<double>() != 0.0;
    case Json::value_t::string: return !v->get_ref<const std::string&>().empty();
    default: return !v->empty();
  }
}

const Json* item(const Json* obj, std::string_view key) {
  if (!obj || !obj->is_object()) return nullptr;
  auto it = obj->find(key);
  return it == obj->end() ? nullptr : &*it;
}

// `x | dictsort`: items sorted by case-folded key, stable for keys that fold equal.
std::vector<std::pair<std::string, const Json*>> dictsort(const Json& mapping, std::string_view where) {
  if (!mapping.is_object()) fail("chat template: {} must be a JSON object, got {}", where, show(mapping));
  std::vector<std::pair<std::string, const Json*>> items;
  for (auto it = mapping.begin(); it != mapping.end(); ++it) items.emplace_back(it.key(), &it.value());
  std::vector<std::u32string> folded;
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    folded.push_back(py_lower_key(items[i].first));
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return folded[a] < folded[b]; });
  std::vector<std::pair<std::string, const Json*>> sorted;
  for (size_t i : order) sorted.push_back(items[i]);
  return sorted;
}

// What `{% for x in v %}` iterates: list elements, or the keys of a mapping (strings iterate characters, which
// the template never relies on, so they are rejected with the rest).
std::vector<Json> iterate(const Json& v, std::string_view where) {
  if (v.is_array()) return std::vector<Json>(v.begin(), v.end());
  if (v.is_object()) {
    std::vector<Json> keys;
    for (auto it = v.begin(); it != v.end(); ++it) keys.emplace_back(it.key());
    return keys;
  }
  fail("chat template: {} must be a JSON array, got {}", where, show(v));
}

// ---------- output ----------

class Output {
 public:
  explicit Output(bool all_markup) : all_markup_(all_markup) {}
  void markup(std::string_view text) { append(text, true); }
  void content(std::string_view text) { append(text, all_markup_); }
  void append(const Output& other) {
    for (const auto& s : other.segments_) append(s.text, s.is_markup);
  }
  std::string text() const { return join_segments(segments_); }
  std::vector<ChatSegment> take() { return std::move(segments_); }
  bool all_markup() const { return all_markup_; }

 private:
  void append(std::string_view text, bool is_markup) {
    if (text.empty()) return;
    if (!segments_.empty() && segments_.back().is_markup == is_markup)
      segments_.back().text += text;
    else
      segments_.push_back({std::string(text), is_markup});
  }
  bool all_markup_;
  std::vector<ChatSegment> segments_;
};

// ---------- macros ----------

void format_argument(Output& out, const Json* arg, bool escape_keys) {
  if (!arg) {
    out.markup("[]");  // Undefined passes jinja's `is sequence` test and iterates as empty
  } else if (arg->is_string()) {
    out.markup(kQuote);
    out.content(arg->get_ref<const std::string&>());
    out.markup(kQuote);
  } else if (arg->is_boolean()) {
    out.markup(arg->get<bool>() ? "true" : "false");
  } else if (arg->is_object()) {
    out.markup("{");
    bool first = true;
    for (const auto& [key, value] : dictsort(*arg, "a tool argument or schema value")) {
      if (!first) out.markup(",");
      first = false;
      if (escape_keys) out.markup(kQuote);
      out.content(key);
      if (escape_keys) out.markup(kQuote);
      out.markup(":");
      format_argument(out, value, escape_keys);
    }
    out.markup("}");
  } else if (arg->is_array()) {
    out.markup("[");
    for (size_t i = 0; i < arg->size(); ++i) {
      if (i) out.markup(",");
      format_argument(out, &(*arg)[i], escape_keys);
    }
    out.markup("]");
  } else {
    out.content(py_str(arg));
  }
}

void quoted_list(Output& out, const Json& list, std::string_view where) {
  out.markup("required:[");
  auto items = iterate(list, where);
  for (size_t i = 0; i < items.size(); ++i) {
    out.markup(kQuote);
    out.content(py_str(&items[i]));
    out.markup(kQuote);
    if (i + 1 < items.size()) out.markup(",");
  }
  out.markup("]");
}

void format_parameters(Output& out, const Json& properties, bool filter_keys, int depth) {
  if (depth > 64) fail("chat template: tool parameter schema nests deeper than 64 levels");
  static const std::vector<std::string_view> kStandardKeys = {"description", "type", "properties", "required",
                                                              "nullable"};
  bool found_first = false;
  for (const auto& [key, value] : dictsort(properties, "tool parameter 'properties'")) {
    bool add_comma = false;
    auto comma = [&] {
      if (add_comma)
        out.markup(",");
      else
        add_comma = true;
    };
    if (filter_keys && std::find(kStandardKeys.begin(), kStandardKeys.end(), key) != kStandardKeys.end()) continue;
    if (found_first) out.markup(",");
    found_first = true;
    out.content(key);
    out.markup(":{");
    if (const Json* description = item(value, "description"); truthy(description)) {
      out.markup("description:<|\"|>");
      out.content(py_str(description));
      out.markup(kQuote);
      add_comma = true;
    }
    const std::string type = py_upper(py_str(item(value, "type")), "parameter '" + key + "' type");
    if (type == "STRING") {
      if (const Json* choices = item(value, "enum"); truthy(choices)) {
        comma();
        out.markup("enum:");
        format_argument(out, choices, true);
      }
    } else if (type == "ARRAY") {
      const Json* items = item(value, "items");
      if (items && items->is_object() && !items->empty()) {
        comma();
        out.markup("items:{");
        bool items_first = true;
        for (const auto& [item_key, item_value] : dictsort(*items, "parameter '" + key + "' items")) {
          if (item_value->is_null()) continue;
          if (!items_first) out.markup(",");
          items_first = false;
          if (item_key == "properties") {
            out.markup("properties:{");
            if (item_value->is_object()) format_parameters(out, *item_value, false, depth + 1);
            out.markup("}");
          } else if (item_key == "required") {
            quoted_list(out, *item_value, "parameter '" + key + "' items.required");
          } else if (item_key == "type") {
            out.markup("type:");
            if (item_value->is_string()) {
              Json upper = py_upper(item_value->get<std::string>(), "items type");
              format_argument(out, &upper, true);
            } else {
              Json upper = Json::array();
              for (const Json& t : iterate(*item_value, "parameter '" + key + "' items.type"))
                upper.push_back(py_upper(py_str(&t), "items type"));
              format_argument(out, &upper, true);
            }
          } else {
            out.content(item_key);
            out.markup(":");
            format_argument(out, item_value, true);
          }
        }
        out.markup("}");
      }
    }
    if (truthy(item(value, "nullable"))) {
      comma();
      out.markup("nullable:true");
    }
    if (type == "OBJECT") {
      const Json* nested = item(value, "properties");
      if (nested && nested->is_object()) {
        comma();
        out.markup("properties:{");
        format_parameters(out, *nested, false, depth + 1);
        out.markup("}");
      } else if (value->is_object()) {
        comma();
        out.markup("properties:{");
        format_parameters(out, *value, true, depth + 1);
        out.markup("}");
      }
      if (const Json* required = item(value, "required"); truthy(required)) {
        comma();
        quoted_list(out, *required, "parameter '" + key + "' required");
      }
    }
    comma();
    out.markup("type:<|\"|>");
    out.content(type);
    out.markup("<|\"|>}");
  }
}

void format_function_declaration(Output& out, const Json& tool, size_t index) {
  const Json* function = item(&tool, "function");
  if (!function || !function->is_object())
    fail("chat template: tools[{}] has no \"function\" object (expected {{\"type\":\"function\",\"function\":"
         "{{\"name\":...,\"description\":...,\"parameters\":{{...}}}}}})",
         index);
  out.markup("declaration:");
  out.content(py_str(item(function, "name")));
  out.markup("{description:<|\"|>");
  out.content(py_str(item(function, "description")));
  out.markup(kQuote);
  const Json* params = item(function, "parameters");
  if (truthy(params)) {
    out.markup(",parameters:{");
    if (const Json* properties = item(params, "properties"); truthy(properties)) {
      out.markup("properties:{");
      format_parameters(out, *properties, false, 0);
      out.markup("},");
    }
    if (const Json* required = item(params, "required"); truthy(required)) {
      auto names = iterate(*required, "tools[].function.parameters.required");
      out.markup("required:[");
      for (size_t i = 0; i < names.size(); ++i) {
        out.markup(kQuote);
        out.content(py_str(&names[i]));
        out.markup(kQuote);
        if (i + 1 < names.size()) out.markup(",");
      }
      out.markup("],");
    }
    if (const Json* type = item(params, "type"); truthy(type)) {
      out.markup("type:<|\"|>");
      out.content(py_upper(py_str(type), "parameters type"));
      out.markup("<|\"|>}");
    }
  }
  if (function->contains("response")) {
    const Json* response = item(function, "response");
    out.markup(",response:{");
    if (const Json* description = item(response, "description"); truthy(description)) {
      out.markup("description:<|\"|>");
      out.content(py_str(description));
      out.markup("<|\"|>,");
    }
    if (py_upper(py_str(item(response, "type")), "response type") == "OBJECT") out.markup("type:<|\"|>OBJECT<|\"|>}");
  }
  out.markup("}");
}

std::string strip_thinking(const std::string& text) {
  std::string result;
  constexpr std::string_view kOpen = "<|channel>", kClose = "<channel|>";
  size_t start = 0;
  while (true) {
    size_t close = text.find(kClose, start);
    std::string_view part = std::string_view(text).substr(start, close == std::string::npos ? std::string::npos
                                                                                           : close - start);
    size_t open = part.find(kOpen);
    result += part.substr(0, open);
    if (close == std::string::npos) break;
    start = close + kClose.size();
  }
  return py_trim(result);
}

void format_tool_response_block(Output& out, const std::string& tool_name, const Json* response) {
  out.markup("<|tool_response>");
  if (response && response->is_object()) {
    out.markup("response:");
    out.content(tool_name);
    out.markup("{");
    auto items = dictsort(*response, "tool response");
    for (size_t i = 0; i < items.size(); ++i) {
      out.content(items[i].first);
      out.markup(":");
      format_argument(out, items[i].second, false);
      if (i + 1 < items.size()) out.markup(",");
    }
    out.markup("}");
  } else {
    out.markup("response:");
    out.content(tool_name);
    out.markup("{value:");
    format_argument(out, response, false);
    out.markup("}");
  }
  out.markup("<tool_response|>");
}

// ---------- main body ----------

enum class PrevType { kNone, kThink, kTool, kToolCall, kToolResponse, kImage, kAudio, kVideo };

std::string role_of(const Json& message) { return message.at("role").get<std::string>(); }

void render_tool_call_arguments(Output& out, const Json* arguments, const ChatRenderOptions& options) {
  if (arguments && arguments->is_string() && options.parse_string_arguments) {
    Json parsed = Json::parse(arguments->get_ref<const std::string&>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_object()) {
      render_tool_call_arguments(out, &parsed, options);
      return;
    }
  }
  if (arguments && arguments->is_object()) {
    bool first = true;
    for (const auto& [key, value] : dictsort(*arguments, "tool call arguments")) {
      if (!first) out.markup(",");
      first = false;
      out.content(key);
      out.markup(":");
      format_argument(out, value, false);
    }
  } else if (arguments && arguments->is_string()) {
    out.content(arguments->get_ref<const std::string&>());
  }
}

void render_tool_calls(Output& out, const Json& tool_calls, size_t message_index, const ChatRenderOptions& options) {
  if (!tool_calls.is_array())
    fail("chat template: messages[{}].tool_calls must be an array of {{\"id\",\"type\",\"function\"}} objects",
         message_index);
  for (size_t i = 0; i < tool_calls.size(); ++i) {
    const Json* function = item(&tool_calls[i], "function");
    const Json* name = item(function, "name");
    if (!name || !name->is_string())
      fail("chat template: messages[{}].tool_calls[{}] needs \"function\": {{\"name\": <string>, \"arguments\": ...}}",
           message_index, i);
    out.markup("<|tool_call>call:");
    out.content(name->get_ref<const std::string&>());
    out.markup("{");
    render_tool_call_arguments(out, item(function, "arguments"), options);
    out.markup("}<tool_call|>");
  }
}

std::string tool_response_name(const Json* name, std::string_view where) {
  if (!name) return "unknown";
  if (!name->is_string())
    fail("chat template: {} must be a string, got {} (the template concatenates it into "
         "'response:NAME{{...}}')",
         where, show(*name));
  return name->get<std::string>();
}

// Renders the OpenAI role:"tool" messages that follow an assistant tool-call message inside the model turn.
bool render_following_tool_results(Output& out, std::span<const Json> loop_messages, size_t index, const Json& tool_calls,
                                   size_t offset) {
  bool any = false;
  for (size_t k = index + 1; k < loop_messages.size(); ++k) {
    const Json& follow = loop_messages[k];
    if (role_of(follow) != "tool") break;
    const Json* name = item(&follow, "name");
    for (const Json& call : tool_calls)
      if (py_equal(item(&call, "id"), item(&follow, "tool_call_id"))) name = item(item(&call, "function"), "name");
    if (!name || name->is_null())
      fail("chat template: tool message messages[{}] has tool_call_id {} that matches no id in the preceding "
           "assistant tool_calls and no \"name\"; set tool_call_id to the call's id or add \"name\"",
           k + offset, item(&follow, "tool_call_id") ? show(*item(&follow, "tool_call_id")) : "(missing)");
    const std::string tool_name = tool_response_name(name, "tool message name");
    const Json* body = item(&follow, "content");
    if (body && body->is_string()) {
      format_tool_response_block(out, tool_name, body);
    } else if (body && body->is_array()) {
      std::string text;
      for (const Json& part : *body) {
        if (!part.is_object())
          fail("chat template: messages[{}].content parts must be objects like {{\"type\":\"text\",\"text\":...}}",
               k + offset);
        const Json* type = item(&part, "type");
        if (type && *type == "text") {
          const Json* part_text = item(&part, "text");
          if (!part_text || !part_text->is_string())
            fail("chat template: messages[{}] has a text part without a string \"text\"", k + offset);
          text += part_text->get_ref<const std::string&>();
        }
      }
      Json joined = text;
      format_tool_response_block(out, tool_name, &joined);
      for (const Json& part : *body) {
        const Json* type = item(&part, "type");
        if (!type) continue;
        if (*type == "image") out.markup("<|image|>");
        else if (*type == "audio") out.markup("<|audio|>");
        else if (*type == "video") out.markup("<|video|>");
      }
    } else if (body && body->is_object()) {
      fail("chat template: messages[{}].content is an object; a tool result must be a string or an array of "
           "content parts (serialize structured results to a JSON string)",
           k + offset);
    } else {
      Json none;  // follow.get('content') yields None, not Undefined
      format_tool_response_block(out, tool_name, body ? body : &none);
    }
    any = true;
  }
  return any;
}

}  // namespace

std::string join_segments(const std::vector<ChatSegment>& segments) {
  std::string out;
  for (const auto& s : segments) out += s.text;
  return out;
}

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

bool is_builtin_chat_template(std::string_view template_text) {
  return template_text.size() == kDiffusionGemmaTemplateSize && fnv1a64(template_text) == kDiffusionGemmaTemplateFnv1a;
}

std::vector<ChatSegment> render_chat_segments(const Json& messages, const Json& tools,
                                              const ChatRenderOptions& options) {
  if (!messages.is_array() || messages.empty())
    fail("chat template: messages must be a non-empty JSON array of {{\"role\":...,\"content\":...}} objects");
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object() || !messages[i].contains("role") || !messages[i]["role"].is_string())
      fail("chat template: messages[{}] must be an object with a string \"role\" (user, assistant, system, "
           "developer or tool), got {}",
           i, show(messages[i]));
  }
  if (!tools.is_null() && !tools.is_array())
    fail("chat template: tools must be a JSON array of {{\"type\":\"function\",\"function\":{{...}}}} objects");

  Output out(options.special_tokens_in_content);
  PrevType prev_type = PrevType::kNone;
  out.markup(options.bos_token);

  const std::string first_role = role_of(messages[0]);
  const bool first_is_system = first_role == "system" || first_role == "developer";
  const bool has_tools = truthy(&tools);
  size_t offset = 0;  // loop_messages = messages[offset:]
  if (options.enable_thinking || has_tools || first_is_system) {
    out.markup("<|turn>system\n");
    if (options.enable_thinking) {
      out.markup("<|think|>\n");
      prev_type = PrevType::kThink;
    }
    if (first_is_system) {
      const Json* content = item(&messages[0], "content");
      if (content && content->is_string()) {
        out.content(py_trim(content->get_ref<const std::string&>()));
      } else if (content && content->is_array()) {
        for (const Json& part : *content) {
          out.content(py_trim(py_str(item(&part, "text"))));
          out.markup(" ");
        }
      } else if (content && content->is_object()) {
        fail("chat template: messages[0].content is an object; use a string or an array of content parts");
      }
      offset = 1;
    }
    if (has_tools) {
      for (size_t i = 0; i < tools.size(); ++i) {
        out.markup("<|tool>");
        format_function_declaration(out, tools[i], i);  // |trim is a no-op: it starts and ends with markup
        out.markup("<tool|>");
      }
      prev_type = PrevType::kTool;
    }
    out.markup("<turn|>\n");
  }

  const std::span<const Json> loop_messages = std::span<const Json>(messages.get_ref<const Json::array_t&>()).subspan(offset);
  long last_user_index = -1;
  for (size_t i = 0; i < loop_messages.size(); ++i)
    if (role_of(loop_messages[i]) == "user") last_user_index = static_cast<long>(i);

  for (size_t index = 0; index < loop_messages.size(); ++index) {
    const Json& message = loop_messages[index];
    const std::string raw_role = role_of(message);
    if (raw_role == "tool") continue;
    prev_type = PrevType::kNone;
    const std::string role = raw_role == "assistant" ? "model" : raw_role;

    std::optional<std::string> previous_role;
    for (size_t j = index; j-- > 0;) {
      if (role_of(loop_messages[j]) != "tool") {
        previous_role = role_of(loop_messages[j]);
        break;
      }
    }
    const bool continue_same_model_turn = role == "model" && previous_role == "assistant";
    if (!continue_same_model_turn) {
      out.markup("<|turn>");
      out.content(role);
      out.markup("\n");
    }

    const Json* tool_calls = item(&message, "tool_calls");
    const Json* reasoning = item(&message, "reasoning");
    const Json* thinking_text = truthy(reasoning) ? reasoning : item(&message, "reasoning_content");
    if (truthy(thinking_text) && static_cast<long>(index) > last_user_index && truthy(tool_calls)) {
      if (!thinking_text->is_string())
        fail("chat template: messages[{}].reasoning_content must be a string", index + offset);
      out.markup("<|channel>thought\n");
      out.content(thinking_text->get_ref<const std::string&>());
      out.markup("\n<channel|>");
    }

    if (truthy(tool_calls)) {
      render_tool_calls(out, *tool_calls, index + offset, options);
      prev_type = PrevType::kToolCall;
    }

    bool tool_results_rendered = false;
    if (const Json* responses = item(&message, "tool_responses"); truthy(responses)) {
      for (const Json& response : iterate(*responses, "tool_responses")) {
        format_tool_response_block(out, tool_response_name(item(&response, "name"), "tool_responses[].name"),
                                   item(&response, "response"));
        tool_results_rendered = true;
        prev_type = PrevType::kToolResponse;
      }
    } else if (truthy(tool_calls)) {
      if (render_following_tool_results(out, loop_messages, index, *tool_calls, offset)) {
        tool_results_rendered = true;
        prev_type = PrevType::kToolResponse;
      }
    }

    Output captured(out.all_markup());
    const Json* content = item(&message, "content");
    if (content && content->is_string()) {
      const std::string& text = content->get_ref<const std::string&>();
      captured.content(role == "model" ? strip_thinking(text) : py_trim(text));
    } else if (content && content->is_array()) {
      for (const Json& part : *content) {
        const Json* type = item(&part, "type");
        if (!type) continue;
        if (*type == "text") {
          const Json* text = item(&part, "text");
          if (role == "model") {
            if (!text || !text->is_string())
              fail("chat template: messages[{}] has a text part without a string \"text\"", index + offset);
            captured.content(strip_thinking(text->get<std::string>()));
          } else {
            captured.content(py_trim(py_str(text)));
          }
        } else if (*type == "image") {
          captured.markup("<|image|>");
          prev_type = PrevType::kImage;
        } else if (*type == "audio") {
          captured.markup("<|audio|>");
          prev_type = PrevType::kAudio;
        } else if (*type == "video") {
          captured.markup("<|video|>");
          prev_type = PrevType::kVideo;
        }
      }
    } else if (content && content->is_object()) {
      fail("chat template: messages[{}].content is an object; use a string or an array of content parts",
           index + offset);
    }
    const bool has_content = !py_trim(captured.text()).empty();
    out.append(captured);

    if (prev_type == PrevType::kToolCall && !tool_results_rendered)
      out.markup("<|tool_response>");
    else if (!(tool_results_rendered && !has_content))
      out.markup("<turn|>\n");
  }

  if (options.add_generation_prompt && prev_type != PrevType::kToolResponse && prev_type != PrevType::kToolCall) {
    out.markup("<|turn>model\n");
    if (!options.enable_thinking) out.markup("<|channel>thought\n<channel|>");
  }
  return out.take();
}

std::string render_chat(const Json& messages, const Json& tools, const ChatRenderOptions& options) {
  return join_segments(render_chat_segments(messages, tools, options));
}

std::vector<ChatSegment> render_chat_segments(const nlohmann::json& messages, const nlohmann::json& tools,
                                              const ChatRenderOptions& options) {
  // nlohmann::json has already lost the request's key order; only keys equal up to case could notice.
  constexpr auto kReplace = nlohmann::json::error_handler_t::replace;
  return render_chat_segments(Json::parse(messages.dump(-1, ' ', false, kReplace)),
                              Json::parse(tools.dump(-1, ' ', false, kReplace)), options);
}

std::string render_chat(const nlohmann::json& messages, const nlohmann::json& tools,
                        const ChatRenderOptions& options) {
  return join_segments(render_chat_segments(messages, tools, options));
}

}  // namespace dg::text
