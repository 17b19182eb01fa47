#pragma once
// Streaming parser for DiffusionGemma's generated text: splits it into reasoning, answer content and tool calls.
//
// Output conventions (the mirror image of what the chat template renders for assistant history):
//   <|channel>thought\n ... \n<channel|>        reasoning (the channel name line and the newline before the
//                                               close are framing, not reasoning)
//   <|tool_call>call:NAME{key:value,...}<tool_call|>   a tool call; also ends an open reasoning channel
//   <turn|> or <|tool_response>                 end of the model's turn (both are stop tokens); text after is ignored
// Text arrives in arbitrary chunks (diffusion commits whole blocks; a chunk may end inside a marker). The parser
// holds back only what could still be the start of a marker, so concatenating the deltas of each kind gives the
// same result for every way of splitting the same text. Malformed or truncated structures become kError events;
// no input makes it throw or crash.
//
// Tool-call argument grammar (inverse of the template's format_argument with escape_keys=False):
//   args   := '{' [pair (',' pair)* [',']] '}'
//   pair   := key ':' value            key: <|"|>text<|"|> or bare text up to ':' (ends trimmed)
//   value  := <|"|>text<|"|>           string, taken verbatim (the format has no escapes)
//           | '{' ... '}' | '[' [value (',' value)* [',']] ']'
//           | true | false | None | null | number (Python str() of int/float) | other bare text -> string
// ASCII whitespace is allowed between tokens. A string containing <|"|> or <tool_call|>, or a key containing ':',
// cannot be represented in this format and does not round-trip.
#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace dg::text {

struct ToolCall {
  std::string name;
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();  // keys in the order the model wrote them
};

struct OutputEvent {
  enum class Kind { kReasoning, kContent, kToolCall, kError };
  Kind kind = Kind::kContent;
  std::string text;  // kReasoning/kContent: the delta; kError: what is wrong
  std::string raw;   // kToolCall/kError: the generated text the event was made from (errors: capped)
  ToolCall tool_call;
  size_t tool_index = 0;  // kToolCall: 0, 1, ... in output order
};

struct OutputParserOptions {
  // The prompt itself opened a thought channel (e.g. a forced "<|channel>thought\n" after the generation prompt),
  // so the output begins inside reasoning.
  bool start_in_reasoning = false;
  size_t max_tool_call_bytes = 1 << 20;
};

class OutputParser {
 public:
  explicit OutputParser(OutputParserOptions options = {});
  // Returns the events completed by this chunk; adjacent deltas of one kind are merged.
  std::vector<OutputEvent> feed(std::string_view chunk);
  // End of generation: flushes held-back text and reports structures left open (truncated tool call, channel
  // header). Further feed() calls are ignored.
  std::vector<OutputEvent> finish();
  // True once the turn ended (<turn|>, <|tool_response>) or finish() ran.
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State { kContent, kChannelHeader, kReasoning, kToolCall, kToolCallOverflow, kDone };
  void process(std::vector<OutputEvent>& events);
  void end_tool_call(std::vector<OutputEvent>& events, size_t payload_end);

  OutputParserOptions options_;
  State state_;
  std::string pending_;  // received but not yet emitted: a partial marker, header or tool-call payload
  size_t tool_calls_ = 0;
};

// Whole-text convenience: feed + finish.
std::vector<OutputEvent> parse_output_events(std::string_view text, OutputParserOptions options = {});

struct ParsedOutput {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  std::vector<std::string> errors;
};
ParsedOutput parse_output(std::string_view text, OutputParserOptions options = {});
ParsedOutput collect_events(const std::vector<OutputEvent>& events);

// Decodes one tool-call payload, the text between <|tool_call> and <tool_call|> ("call:NAME{...}").
// Throws dg::Error naming the offset and problem.
ToolCall parse_tool_call(std::string_view payload);

}  // namespace dg::text
