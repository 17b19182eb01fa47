#include "text/output_parser.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cctype>
#include <cstdlib>
#include <optional>

#include "util/error.h"

namespace dg::text {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kChannelOpen = "<|channel>";
constexpr std::string_view kChannelClose = "<channel|>";
constexpr std::string_view kReasoningClose = "\n<channel|>";  // the template writes reasoning + "\n<channel|>"
constexpr std::string_view kToolCallOpen = "<|tool_call>";
constexpr std::string_view kToolCallClose = "<tool_call|>";
constexpr std::string_view kTurnEnd = "<turn|>";
constexpr std::string_view kToolResponse = "<|tool_response>";
constexpr std::string_view kQuote = "<|\"|>";

// A channel header is a short name line ("thought\n"); anything longer is the model misbehaving.
constexpr size_t kMaxChannelHeader = 32;
constexpr size_t kMaxRawInError = 256;
constexpr size_t kMaxArgumentDepth = 128;
constexpr size_t kLongestMarker = 16;  // <|tool_response>

constexpr std::array<std::string_view, 6> kContentMarkers = {kChannelOpen, kChannelClose, kToolCallOpen,
                                                             kToolCallClose, kTurnEnd, kToolResponse};
constexpr std::array<std::string_view, 5> kReasoningMarkers = {kReasoningClose, kChannelClose, kToolCallOpen,
                                                               kTurnEnd, kToolResponse};
constexpr std::array<std::string_view, 4> kToolCallMarkers = {kToolCallClose, kToolCallOpen, kTurnEnd, kToolResponse};

struct Match {
  size_t pos = std::string::npos;
  std::string_view marker;
};

template <size_t N>
Match earliest(std::string_view text, const std::array<std::string_view, N>& markers) {
  Match best;
  for (std::string_view m : markers) {
    size_t pos = text.find(m);
    if (pos < best.pos) best = {pos, m};
  }
  return best;
}

// Length of the longest suffix of `text` that is a proper prefix of a marker: bytes that may still become a marker.
template <size_t N>
size_t holdback(std::string_view text, const std::array<std::string_view, N>& markers) {
  size_t longest = 0;
  for (std::string_view m : markers) {
    for (size_t k = std::min(text.size(), m.size() - 1); k > longest; --k) {
      if (text.substr(text.size() - k) == m.substr(0, k)) {
        longest = k;
        break;
      }
    }
  }
  return longest;
}

std::string capped(std::string_view raw) {
  return std::string(raw.substr(0, kMaxRawInError)) + (raw.size() > kMaxRawInError ? "..." : "");
}

void emit_text(std::vector<OutputEvent>& events, OutputEvent::Kind kind, std::string_view text) {
  if (text.empty()) return;
  if (!events.empty() && events.back().kind == kind) {
    events.back().text += text;
    return;
  }
  OutputEvent event;
  event.kind = kind;
  event.text = std::string(text);
  events.push_back(std::move(event));
}

void emit_error(std::vector<OutputEvent>& events, std::string message, std::string_view raw) {
  OutputEvent event;
  event.kind = OutputEvent::Kind::kError;
  event.text = std::move(message);
  event.raw = capped(raw);
  events.push_back(std::move(event));
}

// ---------- argument grammar ----------

// Argument strings must stay serializable JSON even when the model (or a fuzzer) emits broken UTF-8; invalid
// sequences become U+FFFD, as the tokenizer's decoder does for invalid byte runs.
std::string valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
    if (ok && len >= 3) {
      const unsigned char c1 = static_cast<unsigned char>(s[i + 1]);
      if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0) || (c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 >= 0x90))
        ok = false;  // overlong, surrogate or beyond U+10FFFF
    }
    if (ok) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

class ArgumentReader {
 public:
  explicit ArgumentReader(std::string_view text) : text_(text) {}

  Json object(size_t depth) {
    expect('{');
    Json result = Json::object();
    skip_space();
    while (!at('}')) {
      std::string key = read_key();
      skip_space();
      expect(':');
      skip_space();
      result[key] = value(depth);
      skip_space();
      if (at(',')) {
        ++pos_;
        skip_space();
      } else if (!at('}')) {
        fail_here("expected ',' or '}' after the value of '" + key + "'");
      }
    }
    ++pos_;
    return result;
  }

  void skip_space() {
    while (pos_ < text_.size() && is_space(text_[pos_])) ++pos_;
  }
  bool at_end() const { return pos_ >= text_.size(); }
  size_t pos() const { return pos_; }
  [[noreturn]] void fail_here(const std::string& what) const {
    fail("tool call arguments: {} at offset {} (near '{}')", what, pos_, capped(text_.substr(pos_, 24)));
  }

 private:
  bool at(char c) const { return pos_ < text_.size() && text_[pos_] == c; }
  bool at(std::string_view s) const { return text_.substr(pos_, s.size()) == s; }
  void expect(char c) {
    if (!at(c)) fail_here(std::string("expected '") + c + "'");
    ++pos_;
  }

  std::string quoted() {
    pos_ += kQuote.size();
    size_t end = text_.find(kQuote, pos_);
    if (end == std::string_view::npos) fail_here("unterminated <|\"|> string");
    std::string s = valid_utf8(text_.substr(pos_, end - pos_));
    pos_ = end + kQuote.size();
    return s;
  }

  std::string read_key() {
    if (at(kQuote)) return quoted();
    size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != ':') {
      char c = text_[pos_];
      if (c == ',' || c == '{' || c == '}' || c == '[' || c == ']') fail_here("expected 'key:'");
      ++pos_;
    }
    if (pos_ >= text_.size()) fail_here("key without ':'");
    size_t end = pos_;
    while (end > start && is_space(text_[end - 1])) --end;
    if (end == start) fail_here("empty key");
    return valid_utf8(text_.substr(start, end - start));
  }

  Json value(size_t depth) {
    if (depth >= kMaxArgumentDepth) fail_here("arguments nest deeper than " + std::to_string(kMaxArgumentDepth));
    if (at(kQuote)) return quoted();
    if (at('{')) return object(depth + 1);
    if (at('[')) return array(depth + 1);
    return bare();
  }

  Json array(size_t depth) {
    expect('[');
    Json result = Json::array();
    skip_space();
    while (!at(']')) {
      result.push_back(value(depth));
      skip_space();
      if (at(',')) {
        ++pos_;
        skip_space();
      } else if (!at(']')) {
        fail_here("expected ',' or ']' in a list");
      }
    }
    ++pos_;
    return result;
  }

  Json bare() {
    size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '}' && text_[pos_] != ']') {
      if (at(kQuote) || text_[pos_] == '{' || text_[pos_] == '[') fail_here("unexpected text inside a bare value");
      ++pos_;
    }
    size_t end = pos_;
    while (end > start && is_space(text_[end - 1])) --end;
    std::string_view word = text_.substr(start, end - start);
    if (word.empty()) fail_here("missing value");
    if (word == "true") return true;
    if (word == "false") return false;
    if (word == "None" || word == "null") return nullptr;
    if (auto number = parse_number(word)) return *number;
    return valid_utf8(word);  // the model dropped the <|"|> quotes; the text is still the value it meant
  }

  // Python str() of int and float: -?digits[.digits][e[+-]digits]. Integers beyond 64 bits become doubles.
  static std::optional<Json> parse_number(std::string_view word) {
    size_t i = 0;
    if (i < word.size() && word[i] == '-') ++i;
    size_t digits_start = i;
    while (i < word.size() && std::isdigit(static_cast<unsigned char>(word[i]))) ++i;
    if (i == digits_start) return std::nullopt;
    bool is_float = false;
    if (i < word.size() && word[i] == '.') {
      is_float = true;
      size_t frac = ++i;
      while (i < word.size() && std::isdigit(static_cast<unsigned char>(word[i]))) ++i;
      if (i == frac) return std::nullopt;
    }
    if (i < word.size() && (word[i] == 'e' || word[i] == 'E')) {
      is_float = true;
      ++i;
      if (i < word.size() && (word[i] == '+' || word[i] == '-')) ++i;
      size_t exp = i;
      while (i < word.size() && std::isdigit(static_cast<unsigned char>(word[i]))) ++i;
      if (i == exp) return std::nullopt;
    }
    if (i != word.size()) return std::nullopt;
    if (!is_float) {
      int64_t signed_value = 0;
      if (std::from_chars(word.data(), word.data() + word.size(), signed_value).ec == std::errc())
        return Json(signed_value);
      uint64_t unsigned_value = 0;
      if (std::from_chars(word.data(), word.data() + word.size(), unsigned_value).ec == std::errc())
        return Json(unsigned_value);
    }
    return Json(std::strtod(std::string(word).c_str(), nullptr));
  }

  std::string_view text_;
  size_t pos_ = 0;
};

bool valid_tool_name(std::string_view name) {
  if (name.empty()) return false;
  for (char c : name)
    if (is_space(c) || c == '<' || c == '>' || c == '}' || c == ',' || c == '"') return false;
  return true;
}

}  // namespace

ToolCall parse_tool_call(std::string_view payload) {
  size_t start = 0;
  while (start < payload.size() && is_space(payload[start])) ++start;
  payload.remove_prefix(start);
  constexpr std::string_view kCall = "call:";
  if (payload.substr(0, kCall.size()) != kCall)
    fail("tool call: expected 'call:NAME{{...}}', got '{}'", capped(payload.substr(0, 32)));
  payload.remove_prefix(kCall.size());
  size_t brace = payload.find('{');
  if (brace == std::string_view::npos) fail("tool call: no '{{' after the function name in '{}'", capped(payload));
  ToolCall call;
  call.name = valid_utf8(payload.substr(0, brace));
  if (!valid_tool_name(call.name)) fail("tool call: invalid function name '{}'", capped(call.name));
  ArgumentReader reader(payload.substr(brace));
  call.arguments = reader.object(0);
  reader.skip_space();
  if (!reader.at_end()) reader.fail_here("unexpected text after the closing '}'");
  return call;
}

OutputParser::OutputParser(OutputParserOptions options)
    : options_(options), state_(options.start_in_reasoning ? State::kReasoning : State::kContent) {}

std::vector<OutputEvent> OutputParser::feed(std::string_view chunk) {
  std::vector<OutputEvent> events;
  if (state_ == State::kDone) return events;
  pending_.append(chunk);
  process(events);
  return events;
}

void OutputParser::end_tool_call(std::vector<OutputEvent>& events, size_t payload_end) {
  const std::string_view payload = std::string_view(pending_).substr(0, payload_end);
  const std::string raw = std::string(kToolCallOpen) + std::string(payload) + std::string(kToolCallClose);
  try {
    OutputEvent event;
    event.kind = OutputEvent::Kind::kToolCall;
    event.tool_call = parse_tool_call(payload);
    event.raw = raw;
    event.tool_index = tool_calls_++;
    events.push_back(std::move(event));
  } catch (const Error& e) {
    emit_error(events, e.what(), raw);
  }
}

void OutputParser::process(std::vector<OutputEvent>& events) {
  using Kind = OutputEvent::Kind;
  while (state_ != State::kDone) {
    std::string_view text = pending_;
    switch (state_) {
      case State::kContent:
      case State::kReasoning: {
        const bool reasoning = state_ == State::kReasoning;
        const Kind kind = reasoning ? Kind::kReasoning : Kind::kContent;
        const Match m = reasoning ? earliest(text, kReasoningMarkers) : earliest(text, kContentMarkers);
        if (m.pos == std::string::npos) {
          size_t keep = reasoning ? holdback(text, kReasoningMarkers) : holdback(text, kContentMarkers);
          emit_text(events, kind, text.substr(0, text.size() - keep));
          pending_.erase(0, text.size() - keep);
          return;
        }
        emit_text(events, kind, text.substr(0, m.pos));
        if (m.marker == kChannelOpen) {
          state_ = State::kChannelHeader;
        } else if (m.marker == kChannelClose || m.marker == kReasoningClose) {
          // In content a close without an open is dropped, as the template's strip_thinking drops it.
          state_ = State::kContent;
        } else if (m.marker == kToolCallOpen) {
          state_ = State::kToolCall;  // a tool call also ends reasoning
        } else if (m.marker == kToolCallClose) {
          emit_error(events, "<tool_call|> without a preceding <|tool_call>", m.marker);
        } else {
          state_ = State::kDone;
        }
        pending_.erase(0, m.pos + m.marker.size());
        break;
      }
      case State::kChannelHeader: {
        // A '\n' ends the name line; a <channel|> first means an empty channel. Neither can straddle the other,
        // so whichever is visible first is final.
        const size_t newline = text.find('\n');
        const size_t close = text.find(kChannelClose);
        const size_t first = std::min(newline, close);
        if (first <= kMaxChannelHeader) {
          if (first == close) {
            state_ = State::kContent;
            pending_.erase(0, close + kChannelClose.size());
          } else {
            state_ = State::kReasoning;
            pending_.erase(0, newline + 1);
          }
        } else if (text.size() > kMaxChannelHeader + kChannelClose.size()) {
          emit_error(events, "channel header without a newline; treating the rest as reasoning",
                     std::string(kChannelOpen) + std::string(text.substr(0, kMaxChannelHeader)));
          state_ = State::kReasoning;
        } else {
          return;
        }
        break;
      }
      case State::kToolCall: {
        const size_t cap = options_.max_tool_call_bytes;
        const Match m = earliest(text, kToolCallMarkers);
        if (m.pos <= cap) {
          if (m.marker == kToolCallClose) {
            end_tool_call(events, m.pos);
            state_ = State::kContent;
          } else {
            emit_error(events, std::string("tool call cut off by ") + std::string(m.marker),
                       std::string(kToolCallOpen) + std::string(text.substr(0, m.pos)));
            state_ = m.marker == kToolCallOpen ? State::kToolCall : State::kDone;
          }
          pending_.erase(0, m.pos + m.marker.size());
          break;
        }
        // Decide on overflow only once any marker starting within the cap would be complete (no tool-call marker
        // contains another, so a complete one past the cap also proves that), so the decision does not depend on
        // where the chunks were cut.
        if (text.size() >= cap + kLongestMarker || m.pos != std::string::npos) {
          emit_error(events, "tool call longer than " + std::to_string(cap) + " bytes; discarded",
                     std::string(kToolCallOpen) + std::string(text.substr(0, std::min(cap + 1, kMaxRawInError))));
          pending_.erase(0, cap + 1);
          state_ = State::kToolCallOverflow;
          break;
        }
        return;
      }
      case State::kToolCallOverflow: {
        const Match m = earliest(text, kToolCallMarkers);
        if (m.pos == std::string::npos) {
          pending_.erase(0, text.size() - holdback(text, kToolCallMarkers));
          return;
        }
        state_ = m.marker == kToolCallClose  ? State::kContent
                 : m.marker == kToolCallOpen ? State::kToolCall
                                             : State::kDone;
        pending_.erase(0, m.pos + m.marker.size());
        break;
      }
      case State::kDone:
        break;
    }
  }
  pending_.clear();
}

std::vector<OutputEvent> OutputParser::finish() {
  std::vector<OutputEvent> events;
  switch (state_) {
    case State::kContent: emit_text(events, OutputEvent::Kind::kContent, pending_); break;
    case State::kReasoning: emit_text(events, OutputEvent::Kind::kReasoning, pending_); break;
    case State::kChannelHeader:
      emit_error(events, "output ended inside a channel header", std::string(kChannelOpen) + pending_);
      break;
    case State::kToolCall:
      emit_error(events, "output ended inside a tool call (no <tool_call|>)", std::string(kToolCallOpen) + pending_);
      break;
    case State::kToolCallOverflow:
    case State::kDone: break;
  }
  pending_.clear();
  state_ = State::kDone;
  return events;
}

std::vector<OutputEvent> parse_output_events(std::string_view text, OutputParserOptions options) {
  OutputParser parser(options);
  std::vector<OutputEvent> events = parser.feed(text);
  for (auto& event : parser.finish()) {
    if (event.kind != OutputEvent::Kind::kToolCall && event.kind != OutputEvent::Kind::kError && !events.empty() &&
        events.back().kind == event.kind)
      events.back().text += event.text;
    else
      events.push_back(std::move(event));
  }
  return events;
}

ParsedOutput collect_events(const std::vector<OutputEvent>& events) {
  ParsedOutput out;
  for (const auto& event : events) {
    switch (event.kind) {
      case OutputEvent::Kind::kReasoning: out.reasoning += event.text; break;
      case OutputEvent::Kind::kContent: out.content += event.text; break;
      case OutputEvent::Kind::kToolCall: out.tool_calls.push_back(event.tool_call); break;
      case OutputEvent::Kind::kError: out.errors.push_back(event.text); break;
    }
  }
  return out;
}

ParsedOutput parse_output(std::string_view text, OutputParserOptions options) {
  return collect_events(parse_output_events(text, options));
}

}  // namespace dg::text
