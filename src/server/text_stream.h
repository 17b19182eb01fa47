#pragma once
// The message layer between OpenAI text and the engine's token ids (the engine itself only sees ids, as the
// seed's token pipeline): prompt encoding of rendered chat segments, and the streaming map from generated ids to
// content / reasoning / tool-call deltas with OpenAI `stop` strings applied. Shared by the server and `chat`.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "text/chat_template.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace dg::server {

// Encodes rendered chat segments the way HF encodes the joined prompt, except that special-token text inside
// content segments stays plain text (prompt safety): the text between two special tokens of the markup is one
// BPE run even when it spans markup and content, as it is one run for HF.
std::vector<int32_t> encode_chat_segments(const text::Tokenizer& tok, const std::vector<text::ChatSegment>& segs);

struct OutputDelta {
  std::string content;
  std::string reasoning;
  std::vector<text::ToolCall> tool_calls;
  std::vector<std::string> errors;  // malformed tool calls etc.: reported, never fatal
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty() && errors.empty(); }
};

class OutputMapper {
 public:
  // structured: split reasoning/tool calls with text::OutputParser (chat); false: raw text (completions).
  // forced_prefix: text the prompt already wrote on the model's behalf (a forced tool-call opener), fed to the
  // parser first so the structure it opens is parsed.
  OutputMapper(const text::Tokenizer& tok, std::vector<std::string> stop, bool structured,
               std::string forced_prefix = {});

  OutputDelta push(std::span<const int32_t> ids);
  OutputDelta finish();
  // A stop string matched: the caller should cancel the generation; further pushes are ignored.
  bool stopped() const { return stopped_; }
  // The decoded output so far, cut at a matched stop string.
  const std::string& text() const { return text_; }

 private:
  void emit(const std::string& text, OutputDelta& out);
  void absorb(std::vector<text::OutputEvent> events, OutputDelta& out);

  text::IncrementalDecoder decoder_;
  std::vector<std::string> stop_;
  size_t max_stop_ = 0;
  bool structured_;
  text::OutputParser parser_;
  std::string held_;  // decoded text not yet released: could be the start of a stop string
  std::string text_;
  bool stopped_ = false;
  bool finished_ = false;
};

}  // namespace dg::server
