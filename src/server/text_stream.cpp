#include "server/text_stream.h"

#include <algorithm>

namespace dg::server {

namespace {

// Added tokens are short ("<|tool_call>", "<|\"|>"); markup scanning tries lengths up to this.
constexpr size_t kMaxAddedTokenBytes = 48;

// Leftmost-longest added-token match at `pos`, as HF's added-token splitter; returns the byte length or 0.
size_t match_added(const text::Tokenizer& tok, const std::string& s, size_t pos, int32_t& id) {
  const size_t limit = std::min(kMaxAddedTokenBytes, s.size() - pos);
  for (size_t len = limit; len >= 1; --len) {
    auto found = tok.token_to_id(std::string_view(s).substr(pos, len));
    if (found && tok.is_added(*found)) {
      id = *found;
      return len;
    }
  }
  return 0;
}

// Cut position <= want that does not split a UTF-8 sequence.
size_t utf8_floor(const std::string& s, size_t want) {
  while (want > 0 && want < s.size() && (uint8_t(s[want]) & 0xC0) == 0x80) --want;
  return want;
}

}  // namespace

std::vector<int32_t> encode_chat_segments(const text::Tokenizer& tok, const std::vector<text::ChatSegment>& segs) {
  std::vector<int32_t> ids;
  std::string run;  // plain text waiting for the next special token
  auto flush = [&] {
    if (run.empty()) return;
    auto part = tok.encode(run, /*add_special_tokens=*/false, /*parse_special=*/false);
    ids.insert(ids.end(), part.begin(), part.end());
    run.clear();
  };
  for (const auto& seg : segs) {
    if (!seg.is_markup) {
      run += seg.text;
      continue;
    }
    const std::string& s = seg.text;
    for (size_t i = 0; i < s.size();) {
      int32_t id = -1;
      const size_t len = match_added(tok, s, i, id);
      if (len == 0) {
        run += s[i++];
        continue;
      }
      flush();
      ids.push_back(id);
      i += len;
    }
  }
  flush();
  return ids;
}

OutputMapper::OutputMapper(const text::Tokenizer& tok, std::vector<std::string> stop, bool structured,
                           std::string forced_prefix)
    : decoder_(tok, /*skip_special=*/false), stop_(std::move(stop)), structured_(structured) {
  for (const auto& s : stop_) max_stop_ = std::max(max_stop_, s.size());
  if (structured_ && !forced_prefix.empty()) {
    OutputDelta ignored;
    absorb(parser_.feed(forced_prefix), ignored);
  }
}

void OutputMapper::absorb(std::vector<text::OutputEvent> events, OutputDelta& out) {
  for (auto& e : events) {
    switch (e.kind) {
      case text::OutputEvent::Kind::kContent: out.content += e.text; break;
      case text::OutputEvent::Kind::kReasoning: out.reasoning += e.text; break;
      case text::OutputEvent::Kind::kToolCall: out.tool_calls.push_back(std::move(e.tool_call)); break;
      case text::OutputEvent::Kind::kError: out.errors.push_back(std::move(e.text)); break;
    }
  }
}

void OutputMapper::emit(const std::string& text, OutputDelta& out) {
  if (text.empty()) return;
  text_ += text;
  if (structured_) absorb(parser_.feed(text), out);
  else out.content += text;
}

OutputDelta OutputMapper::push(std::span<const int32_t> ids) {
  OutputDelta out;
  if (stopped_ || finished_) return out;
  held_ += decoder_.push(ids);
  for (const auto& s : stop_) {
    const size_t at = held_.find(s);
    if (at == std::string::npos) continue;
    // Earliest match across all stop strings wins.
    size_t first = at;
    for (const auto& t : stop_) first = std::min(first, held_.find(t));
    emit(held_.substr(0, first), out);
    held_.clear();
    stopped_ = true;
    return out;
  }
  // Release everything except a tail that could still grow into a stop string.
  const size_t keep = max_stop_ > 0 ? max_stop_ - 1 : 0;
  if (held_.size() > keep) {
    const size_t cut = utf8_floor(held_, held_.size() - keep);
    emit(held_.substr(0, cut), out);
    held_.erase(0, cut);
  }
  return out;
}

OutputDelta OutputMapper::finish() {
  OutputDelta out;
  if (finished_) return out;
  if (!stopped_) {
    held_ += decoder_.finish();
    std::string tail;
    tail.swap(held_);
    size_t first = std::string::npos;
    for (const auto& t : stop_) first = std::min(first, tail.find(t));
    if (first != std::string::npos) {
      tail.resize(first);
      stopped_ = true;
    }
    emit(tail, out);
  }
  finished_ = true;
  if (structured_) absorb(parser_.finish(), out);
  return out;
}

}  // namespace dg::server
