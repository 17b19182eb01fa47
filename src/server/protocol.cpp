#include "server/protocol.h"

#include <cmath>
#include <limits>

#include "util/error.h"

namespace dg::server {

namespace {

const char* type_name(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::object: return "object";
    case Json::value_t::array: return "array";
    case Json::value_t::string: return "string";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::number_float: return "number";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "integer";
    default: return "value";
  }
}

ApiError wrong_type(const std::string& param, const char* expected, const Json& got) {
  return bad_request(param, format("'{}' must be {}, got {}", param, expected, type_name(got)), "invalid_type");
}

// Absent and null mean "not given" everywhere, as OpenAI treats them.
const Json* field(const Json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const Json& body, const char* name, const std::string& param) {
  const Json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw wrong_type(param, "a boolean", *v);
  return v->get<bool>();
}

// Integers only: 1.5 or "3" are type errors, 3.0 is accepted (JSON has one number type and JS clients send it).
std::optional<int64_t> get_int(const Json& body, const char* name, const std::string& param, int64_t lo, int64_t hi) {
  const Json* v = field(body, name);
  if (!v) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      throw bad_request(param, format("'{}' is out of range [{}, {}]", param, lo, hi));
    x = v->get<int64_t>();
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e15) throw wrong_type(param, "an integer", *v);
    x = int64_t(d);
  } else {
    throw wrong_type(param, "an integer", *v);
  }
  if (x < lo || x > hi) throw bad_request(param, format("'{}' must be in [{}, {}], got {}", param, lo, hi, x));
  return x;
}

std::optional<double> get_number(const Json& body, const char* name, const std::string& param, double lo,
                                 double hi) {
  const Json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw wrong_type(param, "a number", *v);
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) throw bad_request(param, format("'{}' must be in [{}, {}], got {}", param, lo, hi, x));
  return x;
}

std::optional<std::string> get_string(const Json& body, const char* name, const std::string& param) {
  const Json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) throw wrong_type(param, "a string", *v);
  return v->get<std::string>();
}

std::vector<std::string> get_stop(const Json& body) {
  const Json* v = field(body, "stop");
  if (!v) return {};
  std::vector<std::string> out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    if (v->size() > 4) throw bad_request("stop", "'stop' takes at most 4 sequences");
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string()) throw wrong_type(format("stop[{}]", i), "a string", (*v)[i]);
      out.push_back((*v)[i].get<std::string>());
    }
  } else {
    throw wrong_type("stop", "a string or an array of strings", *v);
  }
  for (const auto& s : out)
    if (s.empty()) throw bad_request("stop", "stop sequences must not be empty");
  return out;
}

// Fields shared by both endpoints.
template <class Req>
void parse_common(const Json& body, Req& r) {
  if (!body.is_object()) throw bad_request("", "the request body must be a JSON object", "invalid_type");
  if (auto m = get_string(body, "model", "model")) r.model = *m;
  // OpenAI renamed max_tokens to max_completion_tokens; accept both, the newer one wins.
  constexpr int64_t kMaxTokens = 1 << 20;
  if (auto v = get_int(body, "max_tokens", "max_tokens", 1, kMaxTokens)) r.max_tokens = int(*v);
  if (auto v = get_int(body, "max_completion_tokens", "max_completion_tokens", 1, kMaxTokens)) r.max_tokens = int(*v);
  // OpenAI seeds are signed 64-bit; the engine's RNG takes the same bits.
  if (auto v = get_int(body, "seed", "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()))
    r.seed = uint64_t(*v);
  r.stop = get_stop(body);
  r.stream = get_bool(body, "stream", "stream").value_or(false);
  if (const Json* so = field(body, "stream_options")) {
    if (!so->is_object()) throw wrong_type("stream_options", "an object", *so);
    r.include_usage = get_bool(*so, "include_usage", "stream_options.include_usage").value_or(false);
    r.include_drafts = get_bool(*so, "include_drafts", "stream_options.include_drafts").value_or(false);
  }
  if (auto v = get_int(body, "n", "n", 1, 1000); v && *v != 1)
    throw bad_request("n", "only n=1 is supported (one choice per request)", "unsupported_value");
  // Sampling temperature/top_p have no meaning for the entropy-bound denoiser; they are checked, then ignored.
  get_number(body, "temperature", "temperature", 0, 2);
  get_number(body, "top_p", "top_p", 0, 1);
  if (auto v = get_int(body, "max_denoising_steps", "max_denoising_steps", 1, 1024)) r.max_denoising_steps = int(*v);
  if (auto v = get_number(body, "entropy_bound", "entropy_bound", 0, 1e6)) r.entropy_bound = *v;
  if (auto v = get_string(body, "x_test_output", "x_test_output")) r.test_output = *v;
}

void check_tools(const Json& tools) {
  for (size_t i = 0; i < tools.size(); ++i) {
    const Json& t = tools[i];
    const std::string p = format("tools[{}]", i);
    if (!t.is_object()) throw wrong_type(p, "an object", t);
    if (auto type = get_string(t, "type", p + ".type"); !type || *type != "function")
      throw bad_request(p + ".type", "only tools of type 'function' are supported");
    const Json* fn = field(t, "function");
    if (!fn || !fn->is_object()) throw bad_request(p + ".function", "'function' must be an object");
    auto name = get_string(*fn, "name", p + ".function.name");
    if (!name || name->empty()) throw bad_request(p + ".function.name", "a tool needs a non-empty name");
    if (const Json* params = field(*fn, "parameters"); params && !params->is_object())
      throw wrong_type(p + ".function.parameters", "an object (a JSON schema)", *params);
  }
}

void check_messages(const Json& messages) {
  static const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& m = messages[i];
    const std::string p = format("messages[{}]", i);
    if (!m.is_object()) throw wrong_type(p, "an object", m);
    auto role = get_string(m, "role", p + ".role");
    if (!role) throw bad_request(p + ".role", "every message needs a 'role'");
    bool known = false;
    for (const char* r : kRoles) known |= *role == r;
    if (!known)
      throw bad_request(p + ".role",
                        format("unknown role '{}' (expected system, developer, user, assistant or tool)", *role));
    if (const Json* c = field(m, "content"); c && !c->is_string() && !c->is_array())
      throw wrong_type(p + ".content", "a string or an array of content parts", *c);
    if (const Json* c = field(m, "content"); c && c->is_array()) {
      for (size_t k = 0; k < c->size(); ++k) {
        const Json& part = (*c)[k];
        const std::string pp = format("{}.content[{}]", p, k);
        if (!part.is_object()) throw wrong_type(pp, "an object", part);
        auto type = get_string(part, "type", pp + ".type");
        if (!type || *type != "text")
          throw bad_request(pp + ".type", "only text content parts are supported", "unsupported_value");
        if (!get_string(part, "text", pp + ".text")) throw bad_request(pp + ".text", "a text part needs 'text'");
      }
    }
    if (const Json* tc = field(m, "tool_calls")) {
      if (!tc->is_array()) throw wrong_type(p + ".tool_calls", "an array", *tc);
      for (size_t k = 0; k < tc->size(); ++k) {
        const Json& call = (*tc)[k];
        const std::string pc = format("{}.tool_calls[{}]", p, k);
        if (!call.is_object()) throw wrong_type(pc, "an object", call);
        const Json* fn = field(call, "function");
        if (!fn || !fn->is_object()) throw bad_request(pc + ".function", "a tool call needs a 'function' object");
        if (!get_string(*fn, "name", pc + ".function.name"))
          throw bad_request(pc + ".function.name", "a tool call needs a function name");
        if (const Json* a = field(*fn, "arguments"); a && !a->is_string() && !a->is_object())
          throw wrong_type(pc + ".function.arguments", "a JSON string or an object", *a);
      }
    }
    if (*role == "tool") get_string(m, "tool_call_id", p + ".tool_call_id");
  }
}

}  // namespace

ApiError bad_request(std::string param, std::string message, std::string code) {
  return ApiError(400, "invalid_request_error", std::move(message), std::move(param), std::move(code));
}

Json error_body(const ApiError& e) {
  Json err = Json::object();
  err["message"] = e.what();
  err["type"] = e.type;
  err["param"] = e.param.empty() ? Json(nullptr) : Json(e.param);
  err["code"] = e.code.empty() ? Json(nullptr) : Json(e.code);
  return Json{{"error", err}};
}

Json parse_body(const std::string& body) {
  // nlohmann reports syntax errors as parse_error but a number beyond double range (1e999) as out_of_range; both
  // are the client's malformed JSON.
  try {
    return Json::parse(body);
  } catch (const Json::parse_error& e) {
    throw ApiError(400, "invalid_request_error", format("the request body is not valid JSON (byte {})", e.byte), "",
                   "invalid_json");
  } catch (const Json::exception& e) {
    throw ApiError(400, "invalid_request_error", format("the request body is not valid JSON: {}", e.what()), "",
                   "invalid_json");
  }
}

ChatRequest parse_chat_request(const Json& body) {
  ChatRequest r;
  parse_common(body, r);
  const Json* messages = field(body, "messages");
  if (!messages) throw bad_request("messages", "'messages' is required", "missing_required_parameter");
  if (!messages->is_array()) throw wrong_type("messages", "an array", *messages);
  if (messages->empty()) throw bad_request("messages", "'messages' must not be empty");
  check_messages(*messages);
  r.messages = *messages;
  if (const Json* tools = field(body, "tools")) {
    if (!tools->is_array()) throw wrong_type("tools", "an array", *tools);
    check_tools(*tools);
    r.tools = *tools;
  }
  if (const Json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      const std::string s = tc->get<std::string>();
      if (s == "auto") r.tool_choice = ToolChoice::Auto;
      else if (s == "none") r.tool_choice = ToolChoice::None;
      else if (s == "required") r.tool_choice = ToolChoice::Required;
      else throw bad_request("tool_choice", format("unknown tool_choice '{}' (auto, none, required or a named function)", s));
    } else if (tc->is_object()) {
      const Json* fn = field(*tc, "function");
      auto name = fn && fn->is_object() ? get_string(*fn, "name", "tool_choice.function.name") : std::nullopt;
      if (!name) throw bad_request("tool_choice.function.name", "a named tool_choice needs function.name");
      bool found = false;
      for (const auto& t : r.tools) found |= t["function"]["name"] == *name;
      if (!found) throw bad_request("tool_choice", format("tool_choice names '{}', which is not in 'tools'", *name));
      r.tool_choice = ToolChoice::Named;
      r.tool_choice_name = *name;
    } else {
      throw wrong_type("tool_choice", "a string or an object", *tc);
    }
    if (r.tool_choice != ToolChoice::None && r.tool_choice != ToolChoice::Auto && r.tools.empty())
      throw bad_request("tool_choice", "tool_choice requires 'tools'");
  }
  // Thinking: chat_template_kwargs.enable_thinking (vLLM/llama.cpp) wins over reasoning_effort (OpenAI).
  if (auto effort = get_string(body, "reasoning_effort", "reasoning_effort")) {
    if (*effort == "none") r.enable_thinking = false;
    else if (*effort == "minimal" || *effort == "low" || *effort == "medium" || *effort == "high") r.enable_thinking = true;
    else throw bad_request("reasoning_effort", format("unknown reasoning_effort '{}' (none, minimal, low, medium, high)", *effort));
  }
  if (const Json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) throw wrong_type("chat_template_kwargs", "an object", *kw);
    if (auto t = get_bool(*kw, "enable_thinking", "chat_template_kwargs.enable_thinking")) r.enable_thinking = *t;
  }
  return r;
}

CompletionRequest parse_completion_request(const Json& body) {
  CompletionRequest r;
  parse_common(body, r);
  const Json* prompt = field(body, "prompt");
  if (!prompt) throw bad_request("prompt", "'prompt' is required", "missing_required_parameter");
  if (prompt->is_string()) {
    r.prompt_text = prompt->get<std::string>();
    if (r.prompt_text.empty()) throw bad_request("prompt", "'prompt' must not be empty");
  } else if (prompt->is_array()) {
    if (prompt->empty()) throw bad_request("prompt", "'prompt' must not be empty");
    if ((*prompt)[0].is_string()) {
      if (prompt->size() != 1) throw bad_request("prompt", "only one prompt per request is supported", "unsupported_value");
      r.prompt_text = (*prompt)[0].get<std::string>();
    } else {
      r.prompt_is_ids = true;
      for (size_t i = 0; i < prompt->size(); ++i) {
        const Json& id = (*prompt)[i];
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())
          throw bad_request(format("prompt[{}]", i), "'prompt' must be a string or an array of token ids", "invalid_type");
        r.prompt_ids.push_back(int32_t(id.get<int64_t>()));
      }
    }
  } else {
    throw wrong_type("prompt", "a string or an array of token ids", *prompt);
  }
  return r;
}

Json usage_json(const Usage& u) {
  return Json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

Json chat_completion_json(const std::string& id, int64_t created, const std::string& model,
                          const ChatMessageOut& message, const std::string& finish_reason, const Usage& usage) {
  Json msg = {{"role", "assistant"}, {"content", message.content}};
  if (!message.reasoning.empty()) msg["reasoning_content"] = message.reasoning;
  if (!message.tool_calls.empty()) {
    Json calls = Json::array();
    for (const auto& c : message.tool_calls)
      calls.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    msg["tool_calls"] = calls;
    // OpenAI sends null content alongside tool calls when the model wrote no prose.
    if (message.content.empty()) msg["content"] = nullptr;
  }
  return Json{{"id", id},
              {"object", "chat.completion"},
              {"created", created},
              {"model", model},
              {"choices", Json::array({{{"index", 0}, {"message", msg}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}})},
              {"usage", usage_json(usage)}};
}

Json text_completion_json(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                          const std::string& finish_reason, const Usage& usage) {
  return Json{{"id", id},
              {"object", "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", Json::array({{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}})},
              {"usage", usage_json(usage)}};
}

Json chat_chunk(const std::string& id, int64_t created, const std::string& model, const Json& delta,
                const std::string& finish_reason) {
  return Json{{"id", id},
              {"object", "chat.completion.chunk"},
              {"created", created},
              {"model", model},
              {"choices", Json::array({{{"index", 0},
                                         {"delta", delta},
                                         {"logprobs", nullptr},
                                         {"finish_reason", finish_reason.empty() ? Json(nullptr) : Json(finish_reason)}}})}};
}

Json text_chunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                const std::string& finish_reason) {
  return Json{{"id", id},
              {"object", "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", Json::array({{{"index", 0},
                                         {"text", text},
                                         {"logprobs", nullptr},
                                         {"finish_reason", finish_reason.empty() ? Json(nullptr) : Json(finish_reason)}}})}};
}

Json usage_chunk(const std::string& id, int64_t created, const std::string& model, const char* object,
                 const Usage& usage) {
  return Json{{"id", id}, {"object", object}, {"created", created}, {"model", model},
              {"choices", Json::array()}, {"usage", usage_json(usage)}};
}

std::string sse_data(const Json& payload) {
  // dump() escapes control characters, so a payload never contains the raw newline that would end the event.
  return "data: " + payload.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n";
}

std::string sse_event(const std::string& event, const Json& payload) {
  return "event: " + event + "\n" + sse_data(payload);
}

}  // namespace dg::server
