#pragma once
// The OpenAI wire format: request parsing/validation and response/chunk/SSE construction. Pure functions over
// JSON, no I/O and no model, so every rule is unit-testable. Validation failures are ApiError values carrying the
// HTTP status and the offending field, rendered in OpenAI's error shape.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dg::server {

using Json = nlohmann::ordered_json;

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string message, std::string param = {}, std::string code = {})
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type;   // invalid_request_error, authentication_error, not_found_error, server_error, ...
  std::string param;  // the request field at fault, or empty
  std::string code;   // machine-readable: invalid_type, model_not_found, context_length_exceeded, ...
};

// {"error": {"message", "type", "param", "code"}} (param/code null when empty).
Json error_body(const ApiError& e);
ApiError bad_request(std::string param, std::string message, std::string code = "invalid_value");

enum class ToolChoice { Auto, None, Required, Named };

// The request fields the engine acts on; everything else in the body is ignored, as OpenAI does for unknown keys.
struct ChatRequest {
  std::string model;
  Json messages = Json::array();
  Json tools = Json::array();
  ToolChoice tool_choice = ToolChoice::Auto;
  std::string tool_choice_name;  // ToolChoice::Named
  std::optional<int> max_tokens;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  bool include_drafts = false;  // extension: per-step canvas drafts as `event: draft` SSE events
  bool enable_thinking = false;
  std::optional<int> max_denoising_steps;  // extension
  std::optional<double> entropy_bound;     // extension
  std::optional<std::string> test_output;  // test hook (x_test_output), honoured only when the server enables it
};

struct CompletionRequest {
  std::string model;
  std::string prompt_text;              // when the prompt is a string
  std::vector<int32_t> prompt_ids;      // when the prompt is an array of token ids
  bool prompt_is_ids = false;
  std::optional<int> max_tokens;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  bool include_drafts = false;
  std::optional<int> max_denoising_steps;
  std::optional<double> entropy_bound;
  std::optional<std::string> test_output;
};

// Parses a request body (the raw bytes). Throws ApiError(400) naming the field for malformed JSON, wrong types and
// out-of-range values.
Json parse_body(const std::string& body);
ChatRequest parse_chat_request(const Json& body);
CompletionRequest parse_completion_request(const Json& body);

// --- responses ---
struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens served from the KV cache (usage.prompt_tokens_details.cached_tokens)
};
Json usage_json(const Usage& u);

struct ToolCallOut {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text, as OpenAI sends it
};

struct ChatMessageOut {
  std::string content;
  std::string reasoning;
  std::vector<ToolCallOut> tool_calls;
};

Json chat_completion_json(const std::string& id, int64_t created, const std::string& model,
                          const ChatMessageOut& message, const std::string& finish_reason, const Usage& usage);
Json text_completion_json(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                          const std::string& finish_reason, const Usage& usage);

// One chat.completion.chunk with a single choice carrying `delta` (finish_reason null when empty).
Json chat_chunk(const std::string& id, int64_t created, const std::string& model, const Json& delta,
                const std::string& finish_reason = {});
Json text_chunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                const std::string& finish_reason = {});
// The final usage chunk of stream_options.include_usage: no choices, only usage.
Json usage_chunk(const std::string& id, int64_t created, const std::string& model, const char* object,
                 const Usage& usage);

// SSE framing: "data: <json>\n\n", or "event: <name>\ndata: <json>\n\n" for named events.
std::string sse_data(const Json& payload);
std::string sse_event(const std::string& event, const Json& payload);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace dg::server
