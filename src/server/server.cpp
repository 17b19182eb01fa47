#include "server/server.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <random>

#include "server/protocol.h"
#include "server/text_stream.h"
#include "util/error.h"

namespace dg::server {

namespace {

int64_t now_seconds() { return int64_t(std::time(nullptr)); }

const char* finish_reason(const diffusion::GenerationResult& r, bool stop_string, bool tool_calls) {
  if (tool_calls) return "tool_calls";
  if (stop_string) return "stop";
  switch (r.finish) {
    case diffusion::FinishReason::Stop: return "stop";
    case diffusion::FinishReason::Length:
    case diffusion::FinishReason::BlockLimit: return "length";
    case diffusion::FinishReason::Cancelled: return "stop";
  }
  return "stop";
}

Usage make_usage(const Job& job, const EngineEvent& done) {
  Usage u;
  u.prompt_tokens = int64_t(job.prompt.size());
  // HF counts the EOS it generated; OpenAI counts every sampled token. Both include the stop token.
  u.completion_tokens = int64_t(done.result.ids.size()) + (done.result.stop_token >= 0 ? 1 : 0);
  u.cached_tokens = done.stats.reused_tokens;
  return u;
}

// While a request waits in the queue nothing is written; a periodic SSE comment lets a dead client be noticed
// (its write fails) and its job cancelled before it reaches the engine.
constexpr auto kKeepAlive = std::chrono::milliseconds(2000);

}  // namespace

struct Server::Impl {
  const LoadedModel& model;
  text::Tokenizer tokenizer;
  ServerOptions opt;
  std::string model_id;
  Metrics metrics;
  std::unique_ptr<Engine> engine;
  httplib::Server http;
  std::atomic<uint64_t> counter{0};
  std::string id_salt;

  Impl(const LoadedModel& m, text::Tokenizer tok, session::SessionPool::BackendFactory factory, ServerOptions o)
      : model(m), tokenizer(std::move(tok)), opt(std::move(o)) {
    model_id = opt.model_id;
    if (model_id.empty()) {
      std::filesystem::path p = std::filesystem::absolute(model.dir).lexically_normal();
      if (p.filename().empty()) p = p.parent_path();
      model_id = p.filename().string();
    }
    std::random_device rd;
    id_salt = format("{:08x}", rd());
    EngineConfig ec;
    ec.queue_limit = opt.queue_limit;
    ec.slots = opt.slots;
    engine = std::make_unique<Engine>(std::move(factory), ec, &metrics,
                                      [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
    setup_routes();
  }

  std::string next_id(const char* prefix) { return format("{}-{}{:06x}", prefix, id_salt, counter.fetch_add(1)); }

  static void send_json(httplib::Response& res, int status, const Json& body) {
    res.status = status;
    res.set_content(body.dump(-1, ' ', false, Json::error_handler_t::replace), "application/json");
  }

  void send_error(httplib::Response& res, const ApiError& e) {
    send_json(res, e.status, error_body(e));
    if (e.status == 503 || e.status == 429) res.set_header("Retry-After", "1");
  }

  void check_auth(const httplib::Request& req) const {
    if (opt.api_key.empty()) return;
    const std::string auth = req.get_header_value("Authorization");
    if (auth.empty())
      throw ApiError(401, "invalid_request_error",
                     "missing API key: send 'Authorization: Bearer <key>' (the server was started with --api-key)", "",
                     "invalid_api_key");
    // Constant-time compare: the key must not leak through response timing.
    const std::string want = "Bearer " + opt.api_key;
    unsigned diff = auth.size() != want.size();
    for (size_t i = 0; i < std::min(auth.size(), want.size()); ++i) diff |= unsigned(auth[i] ^ want[i]);
    if (diff) throw ApiError(401, "invalid_request_error", "incorrect API key", "", "invalid_api_key");
  }

  void check_model(const std::string& requested) const {
    if (!requested.empty() && requested != model_id)
      throw ApiError(404, "invalid_request_error",
                     format("the model '{}' does not exist; this server serves '{}' (see GET /v1/models)", requested,
                            model_id),
                     "model", "model_not_found");
  }

  template <class Req>
  diffusion::GenerationOptions make_options(const Req& r) const {
    auto o = diffusion::GenerationOptions::from_config(model.generation);
    o.max_new_tokens = r.max_tokens.value_or(opt.default_max_tokens);
    if (r.seed) o.seed = *r.seed;
    else o.seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
    if (r.max_denoising_steps) o.max_steps = *r.max_denoising_steps;
    if (r.entropy_bound) o.entropy_bound = *r.entropy_bound;
    try {
      o.validate(model.config);
    } catch (const Error& e) {
      throw bad_request("", e.what());
    }
    return o;
  }

  void check_context(size_t prompt_tokens, int max_new, const char* param) const {
    if (prompt_tokens + size_t(max_new) > size_t(opt.max_context))
      throw ApiError(413, "invalid_request_error",
                     format("the prompt ({} tokens) plus max_tokens ({}) exceeds the context limit of {} tokens",
                            prompt_tokens, max_new, opt.max_context),
                     param, "context_length_exceeded");
  }

  std::optional<std::vector<int32_t>> injected(const std::optional<std::string>& test_output) const {
    if (!test_output) return std::nullopt;
    if (!opt.test_hooks)
      throw bad_request("x_test_output", "x_test_output is a test hook; start the server with --enable-test-hooks");
    return tokenizer.encode(*test_output, false, true);
  }

  void submit(const std::shared_ptr<Job>& job) {
    try {
      engine->submit(job);
    } catch (const QueueFull& e) {
      throw ApiError(503, "server_error", e.what(), "", "queue_full");
    }
  }

  // ---- chat ----
  struct ChatState {
    std::shared_ptr<Job> job;
    std::unique_ptr<OutputMapper> mapper;
    std::string id, model;
    int64_t created = 0;
    bool include_usage = false;
    size_t tool_index = 0;
    ChatMessageOut message;
  };

  std::shared_ptr<ChatState> start_chat(const httplib::Request& req, ChatRequest& r) {
    check_model(r.model);
    auto o = make_options(r);
    text::ChatRenderOptions ro;
    ro.enable_thinking = r.enable_thinking;
    std::vector<text::ChatSegment> segs;
    try {
      segs = text::render_chat_segments(r.messages, r.tool_choice == ToolChoice::None ? Json::array() : r.tools, ro);
    } catch (const Error& e) {
      throw bad_request("messages", e.what());
    }
    std::string forced;
    if (r.tool_choice == ToolChoice::Named || r.tool_choice == ToolChoice::Required) {
      // The model cannot be constrained, but its reply can be started inside a call: the named one, the only tool,
      // or (required, several tools) an open call whose name the model writes.
      std::string name = r.tool_choice_name;
      if (r.tool_choice == ToolChoice::Required && r.tools.size() == 1)
        name = r.tools[0]["function"]["name"].get<std::string>();  // validated by check_tools
      forced = name.empty() ? "<|tool_call>call:" : "<|tool_call>call:" + name + "{";
      segs.push_back({forced, true});
    }
    auto job = std::make_shared<Job>();
    job->prompt = encode_chat_segments(tokenizer, segs);
    check_context(job->prompt.size(), o.max_new_tokens, "messages");
    job->options = o;
    job->want_drafts = r.stream && r.include_drafts;
    job->injected_output = injected(r.test_output);
    auto st = std::make_shared<ChatState>();
    st->job = job;
    st->mapper = std::make_unique<OutputMapper>(tokenizer, r.stop, true, forced);
    st->id = next_id("chatcmpl");
    st->model = model_id;
    st->created = now_seconds();
    st->include_usage = r.include_usage;
    submit(job);
    return st;
  }

  ToolCallOut tool_call_out(ChatState& st, const text::ToolCall& c) {
    return {format("call_{}_{}", st.id.substr(st.id.find('-') + 1), st.tool_index++), c.name,
            c.arguments.dump(-1, ' ', false, Json::error_handler_t::replace)};
  }

  // Applies a delta to the accumulated message; returns the stream chunks it produces.
  std::string absorb(ChatState& st, OutputDelta d, bool streaming) {
    std::string out;
    if (!d.reasoning.empty()) {
      st.message.reasoning += d.reasoning;
      if (streaming) out += sse_data(chat_chunk(st.id, st.created, st.model, Json{{"reasoning_content", d.reasoning}}));
    }
    if (!d.content.empty()) {
      st.message.content += d.content;
      if (streaming) out += sse_data(chat_chunk(st.id, st.created, st.model, Json{{"content", d.content}}));
    }
    for (const auto& c : d.tool_calls) {
      const size_t index = st.tool_index;
      ToolCallOut t = tool_call_out(st, c);
      st.message.tool_calls.push_back(t);
      if (streaming)
        out += sse_data(chat_chunk(st.id, st.created, st.model,
                                   Json{{"tool_calls", Json::array({{{"index", index},
                                                                     {"id", t.id},
                                                                     {"type", "function"},
                                                                     {"function", {{"name", t.name}, {"arguments", t.arguments}}}}})}}));
    }
    for (const auto& e : d.errors) std::fprintf(stderr, "%s: unparsable model output: %s\n", st.id.c_str(), e.c_str());
    if (st.mapper->stopped()) st.job->cancel.cancel();
    return out;
  }

  std::string draft_event(const std::string& id, int64_t created, const EngineEvent& ev) {
    std::string text;
    try {
      text = tokenizer.decode(ev.ids, /*skip_special=*/false);
    } catch (const Error&) {
      text.clear();  // a canvas of ids outside the tokenizer's vocabulary: send the ids only
    }
    return sse_event("draft", Json{{"id", id},
                                   {"object", "chat.completion.draft"},
                                   {"created", created},
                                   {"model", model_id},
                                   {"choices", Json::array()},
                                   {"draft", {{"block", ev.block},
                                              {"step", ev.step},
                                              {"accepted", ev.accepted},
                                              {"mean_entropy", ev.mean_entropy},
                                              {"text", text}}}});
  }

  void handle_chat(const httplib::Request& req, httplib::Response& res) {
    check_auth(req);
    ChatRequest r = parse_chat_request(parse_body(req.body));
    auto st = start_chat(req, r);
    if (!r.stream) {
      EngineEvent ev;
      while (st->job->next(ev)) {
        if (ev.kind == EngineEvent::Kind::Tokens) absorb(*st, st->mapper->push(ev.ids), false);
        else if (ev.kind == EngineEvent::Kind::Error)
          throw ApiError(500, "server_error", "generation failed: " + ev.error);
        else if (ev.kind == EngineEvent::Kind::Done) {
          absorb(*st, st->mapper->finish(), false);
          const char* fr = finish_reason(ev.result, st->mapper->stopped(), !st->message.tool_calls.empty());
          send_json(res, 200, chat_completion_json(st->id, st->created, st->model, st->message, fr, make_usage(*st->job, ev)));
        }
      }
      return;
    }
    stream_events(res, st->job, st->id, st->created,
                  {[st] { return sse_data(chat_chunk(st->id, st->created, st->model,
                                                     Json{{"role", "assistant"}, {"content", ""}})); },
                   [this, st](const EngineEvent& ev) { return absorb(*st, st->mapper->push(ev.ids), true); },
                   [this, st](const EngineEvent& ev) {
                     std::string out = absorb(*st, st->mapper->finish(), true);
                     const char* fr = finish_reason(ev.result, st->mapper->stopped(), !st->message.tool_calls.empty());
                     out += sse_data(chat_chunk(st->id, st->created, st->model, Json::object(), fr));
                     if (st->include_usage)
                       out += sse_data(usage_chunk(st->id, st->created, st->model, "chat.completion.chunk",
                                                   make_usage(*st->job, ev)));
                     return out;
                   }});
  }

  // ---- completions ----
  void handle_completion(const httplib::Request& req, httplib::Response& res) {
    check_auth(req);
    CompletionRequest r = parse_completion_request(parse_body(req.body));
    check_model(r.model);
    auto o = make_options(r);
    auto job = std::make_shared<Job>();
    if (r.prompt_is_ids) {
      for (size_t i = 0; i < r.prompt_ids.size(); ++i)
        if (r.prompt_ids[i] >= model.config.vocab_size)
          throw bad_request(format("prompt[{}]", i),
                            format("token id {} is outside the vocabulary (size {})", r.prompt_ids[i], model.config.vocab_size));
      job->prompt = r.prompt_ids;
    } else {
      // A raw prompt is the caller's own text, special tokens included (it is how raw prompting works), with <bos>.
      job->prompt = tokenizer.encode(r.prompt_text, /*add_special_tokens=*/true, /*parse_special=*/true);
    }
    check_context(job->prompt.size(), o.max_new_tokens, "prompt");
    job->options = o;
    job->want_drafts = r.stream && r.include_drafts;
    job->injected_output = injected(r.test_output);
    auto mapper = std::make_shared<OutputMapper>(tokenizer, r.stop, false);
    const std::string id = next_id("cmpl");
    const int64_t created = now_seconds();
    submit(job);

    auto finish = [job, mapper](const EngineEvent& ev) {
      return std::string(finish_reason(ev.result, mapper->stopped(), false));
    };
    if (!r.stream) {
      EngineEvent ev;
      while (job->next(ev)) {
        if (ev.kind == EngineEvent::Kind::Tokens) {
          mapper->push(ev.ids);
          if (mapper->stopped()) job->cancel.cancel();
        } else if (ev.kind == EngineEvent::Kind::Error) {
          throw ApiError(500, "server_error", "generation failed: " + ev.error);
        } else if (ev.kind == EngineEvent::Kind::Done) {
          mapper->finish();
          send_json(res, 200, text_completion_json(id, created, model_id, mapper->text(), finish(ev), make_usage(*job, ev)));
        }
      }
      return;
    }
    const bool include_usage = r.include_usage;
    stream_events(res, job, id, created,
                  {nullptr,
                   [this, job, mapper, id, created](const EngineEvent& ev) {
                     auto d = mapper->push(ev.ids);
                     if (mapper->stopped()) job->cancel.cancel();
                     return d.content.empty() ? std::string() : sse_data(text_chunk(id, created, model_id, d.content));
                   },
                   [this, job, mapper, id, created, include_usage, finish](const EngineEvent& ev) {
                     std::string out;
                     auto d = mapper->finish();
                     if (!d.content.empty()) out += sse_data(text_chunk(id, created, model_id, d.content));
                     out += sse_data(text_chunk(id, created, model_id, "", finish(ev)));
                     if (include_usage)
                       out += sse_data(usage_chunk(id, created, model_id, "text_completion", make_usage(*job, ev)));
                     return out;
                   }});
  }

  // What one streaming endpoint writes for its events; the shared pump is stream_events.
  struct SseWriter {
    std::function<std::string()> preamble;                  // once before the first event (may be null)
    std::function<std::string(const EngineEvent&)> tokens;  // a committed block ("" writes nothing)
    std::function<std::string(const EngineEvent&)> done;    // the closing chunks, before [DONE]
  };

  // Server-Sent Events pumped from a job: keep-alive comments while it denoises, drafts, an error body on failure,
  // then [DONE]. A failed write means the client is gone: the job is cancelled (it stops at the next step).
  void stream_events(httplib::Response& res, std::shared_ptr<Job> job, std::string id, int64_t created,
                     SseWriter w) {
    res.set_header("Cache-Control", "no-cache");
    auto started = std::make_shared<bool>(false);
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job, id, created, w, started](size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) {
            if (s.empty() || sink.write(s.data(), s.size())) return true;
            job->cancel.cancel();
            return false;
          };
          if (!*started) {
            *started = true;
            if (w.preamble && !write(w.preamble())) return false;
          }
          EngineEvent ev;
          bool timed_out = false;
          if (!job->next_for(ev, kKeepAlive, timed_out)) return timed_out ? write(": keep-alive\n\n") : false;
          std::string last;
          switch (ev.kind) {
            case EngineEvent::Kind::Tokens: return write(w.tokens(ev));
            case EngineEvent::Kind::Draft: return write(draft_event(id, created, ev));
            case EngineEvent::Kind::Error:
              last = sse_data(error_body(ApiError(500, "server_error", "generation failed: " + ev.error)));
              break;
            case EngineEvent::Kind::Done: last = w.done(ev); break;
          }
          if (!write(last + kSseDone)) return false;
          sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancel.cancel();
        });
  }

  // Runs a handler, mapping every failure to an OpenAI error body; a request never takes the server down.
  template <class F>
  httplib::Server::Handler guarded(const char* endpoint, F f) {
    return [this, endpoint, f](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const Error& e) {
        send_error(res, bad_request("", e.what()));
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, "server_error", format("internal error: {}", e.what())));
      }
      // cpp-httplib leaves status at -1 for a handler that did not set one and fills in 200 after it returns.
      metrics.request(endpoint, res.status == -1 ? 200 : res.status);
    };
  }

  void setup_routes() {
    const size_t threads = size_t(std::max(8, std::min(opt.queue_limit + 8, 1024)));
    // Every queued streaming request holds a worker thread while it waits, so the pool must exceed the queue.
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    http.set_payload_max_length(opt.max_body);
    http.set_read_timeout(30);
    http.set_write_timeout(30);
    http.Post("/v1/chat/completions", guarded("chat", [this](auto& q, auto& s) { handle_chat(q, s); }));
    http.Post("/v1/completions", guarded("completions", [this](auto& q, auto& s) { handle_completion(q, s); }));
    http.Get("/v1/models", guarded("models", [this](const httplib::Request& q, httplib::Response& s) {
      check_auth(q);
      send_json(s, 200, Json{{"object", "list"},
                             {"data", Json::array({{{"id", model_id}, {"object", "model"}, {"created", 0},
                                                    {"owned_by", "diffgemma"}}})}});
    }));
    http.Get("/health", guarded("health", [this](const httplib::Request&, httplib::Response& s) {
      send_json(s, 200, Json{{"status", "ok"}, {"model", model_id}, {"queue_depth", engine->queue_depth()}});
    }));
    http.Get("/metrics", guarded("metrics", [this](const httplib::Request&, httplib::Response& s) {
      s.set_content(metrics.render(), "text/plain; version=0.0.4");
    }));
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 413)
        send_error(res, ApiError(413, "invalid_request_error",
                                 format("the request body exceeds the server's limit of {} bytes (--max-body)", opt.max_body),
                                 "", "request_too_large"));
      else if (res.status == 404)
        send_error(res, ApiError(404, "invalid_request_error", format("unknown endpoint {} {}", req.method, req.path),
                                 "", "unknown_url"));
      else
        send_error(res, ApiError(res.status, res.status >= 500 ? "server_error" : "invalid_request_error",
                                 format("HTTP {}", res.status)));
    });
    if (opt.log_requests)
      http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
        std::fprintf(stderr, "%s %s %d\n", req.method.c_str(), req.path.c_str(), res.status);
      });
  }
};

Server::Server(const LoadedModel& model, text::Tokenizer tokenizer, session::SessionPool::BackendFactory factory,
               ServerOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(tokenizer), std::move(factory), std::move(options))) {}

Server::~Server() {
  stop();
}

int Server::bind() {
  auto& i = *impl_;
  if (i.opt.port == 0) {
    const int port = i.http.bind_to_any_port(i.opt.host);
    if (port <= 0) fail("cannot bind {} on any port", i.opt.host);
    return port;
  }
  if (!i.http.bind_to_port(i.opt.host, i.opt.port))
    fail("cannot listen on {}:{} (address in use, or not a local address?)", i.opt.host, i.opt.port);
  return i.opt.port;
}

void Server::listen() { impl_->http.listen_after_bind(); }
void Server::stop() {
  if (impl_->http.is_running()) impl_->http.stop();
}
const std::string& Server::model_id() const { return impl_->model_id; }
Engine& Server::engine() { return *impl_->engine; }

}  // namespace dg::server
