#pragma once
// Hand-written renderer of the DiffusionGemma (Gemma 4 "large") chat template for OpenAI-style messages.
//
// Contract: for every input the official template renders without error, the output is byte-identical to
// HF transformers' apply_chat_template (jinja2, trim_blocks + lstrip_blocks, bos_token "<bos>"), including the
// template's Python-isms (str() of numbers, None, case-insensitive dictsort, str.strip() whitespace). Inputs on
// which the template raises, or which only "render" through jinja accidents (an object where a list or string
// belongs), raise dg::Error instead. tests/fixtures/chat/goldens.json pins this; see docs/TEXT.md.
//
// Prompt safety: the result is a list of segments. Markup segments are the template's own text (turn markers,
// tool-call syntax) and may be tokenized with special-token parsing; content segments hold text copied from the
// request (message text, reasoning, tool names/arguments/results, tool declarations) and must be tokenized as
// plain text, so a user writing "<turn|>" cannot forge a turn boundary. See docs/TEXT.md for how an encoder has
// to consume the segments to stay id-identical to HF on ordinary text.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dg::text {

struct ChatSegment {
  std::string text;
  bool is_markup = false;  // true: the template's own text; false: copied from the request
  bool operator==(const ChatSegment&) const = default;
};

struct ChatRenderOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = false;
  // OpenAI clients send tool-call arguments as a JSON *string*; the template only formats mappings and would
  // paste the JSON text verbatim (`call:f{{"a":1}}`), a format the model never saw. When true, a string that
  // parses as a JSON object is rendered as that mapping (what vLLM and llama.cpp do before templating);
  // false renders exactly what the template does with the raw message.
  bool parse_string_arguments = true;
  // Opt-out of prompt safety: every segment is reported as markup, i.e. HF's behaviour of parsing special-token
  // text anywhere in the prompt, including user content. Only for trusted input or reproducing HF token ids.
  bool special_tokens_in_content = false;
  std::string bos_token = "<bos>";
};

// messages: JSON array of OpenAI chat messages; tools: JSON array of {"type":"function","function":{...}}
// declarations, or null/empty for none. Object key order matters only for keys equal up to case (jinja's
// dictsort is stable), which is why the ordered_json overloads are the primary ones.
std::vector<ChatSegment> render_chat_segments(const nlohmann::ordered_json& messages,
                                              const nlohmann::ordered_json& tools,
                                              const ChatRenderOptions& options = {});
std::string render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                        const ChatRenderOptions& options = {});

std::vector<ChatSegment> render_chat_segments(const nlohmann::json& messages, const nlohmann::json& tools,
                                              const ChatRenderOptions& options = {});
std::string render_chat(const nlohmann::json& messages, const nlohmann::json& tools,
                        const ChatRenderOptions& options = {});

std::string join_segments(const std::vector<ChatSegment>& segments);

// Identifies the official template text this renderer implements (FNV-1a 64 of its bytes), so a CLI or
// loader can refuse a checkpoint whose chat_template.jinja is a different revision.
inline constexpr size_t kDiffusionGemmaTemplateSize = 17466;
inline constexpr uint64_t kDiffusionGemmaTemplateFnv1a = 0x563ce4e7205ecfd0ULL;
uint64_t fnv1a64(std::string_view bytes);
bool is_builtin_chat_template(std::string_view template_text);

}  // namespace dg::text
