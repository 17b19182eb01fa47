// The HTTP server end to end on the tiny model: routes, auth, error statuses and shapes, non-streaming vs
// streaming equivalence, determinism per seed, drafts, tool calls through the test hook, KV reuse visible in
// usage, stop strings, queue limits and cancellation on disconnect.
#include <gtest/gtest.h>

#include <atomic>

#include "server_fixture.h"

namespace dg::testing {
namespace {

using Json = nlohmann::ordered_json;
constexpr const char* kKey = "test-key";

class ServerHttp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server::ServerOptions o;
    o.api_key = kKey;
    o.max_body = 64 * 1024;
    o.test_hooks = true;
    o.slots = 2;
    srv = new TestServer(o);
  }
  static void TearDownTestSuite() {
    delete srv;
    srv = nullptr;
  }

  static httplib::Result post(const std::string& path, const std::string& body, bool auth = true) {
    auto c = srv->client(auth ? kKey : "");
    return c.Post(path.c_str(), body, "application/json");
  }
  static Json post_json(const std::string& path, const Json& body, int want_status = 200) {
    auto r = post(path, body.dump());
    EXPECT_TRUE(r);
    if (!r) return Json();
    EXPECT_EQ(r->status, want_status) << r->body;
    return Json::parse(r->body);
  }
  static Json chat_body(uint64_t seed, int max_tokens = 12) {
    return Json{{"model", srv->server->model_id()},
                {"messages", Json::array({{{"role", "user"}, {"content", "Say something."}}})},
                {"seed", seed},
                {"max_tokens", max_tokens},
                {"max_denoising_steps", 3}};
  }
  static void expect_error(const httplib::Result& r, int status, const std::string& param, const std::string& code) {
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, status) << r->body;
    const Json j = Json::parse(r->body);
    ASSERT_TRUE(j.contains("error")) << r->body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"]["type"].is_string());
    if (param.empty()) EXPECT_TRUE(j["error"]["param"].is_null()) << r->body;
    else EXPECT_EQ(j["error"]["param"], param) << r->body;
    EXPECT_EQ(j["error"]["code"], code) << r->body;
  }

  static TestServer* srv;
};
TestServer* ServerHttp::srv = nullptr;

TEST_F(ServerHttp, HealthModelsAndMetrics) {
  auto c = srv->client(kKey);
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(Json::parse(h->body)["status"], "ok");
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  const Json models = Json::parse(m->body);
  EXPECT_EQ(models["object"], "list");
  EXPECT_EQ(models["data"][0]["id"], "tiny-v");
  auto p = c.Get("/metrics");
  ASSERT_TRUE(p);
  EXPECT_NE(p->body.find("# TYPE diffgemma_requests_total counter"), std::string::npos);
  EXPECT_NE(p->body.find("diffgemma_step_seconds_bucket{le=\"+Inf\"}"), std::string::npos);
  EXPECT_NE(p->body.find("diffgemma_queue_depth "), std::string::npos);
}

TEST_F(ServerHttp, ErrorStatusesAndShapes) {
  expect_error(post("/v1/chat/completions", "{\"messages\": [", true), 400, "", "invalid_json");
  Json wrong = chat_body(1);
  wrong["max_tokens"] = "ten";
  expect_error(post("/v1/chat/completions", wrong.dump()), 400, "max_tokens", "invalid_type");
  Json unknown = chat_body(1);
  unknown["model"] = "gpt-9";
  expect_error(post("/v1/chat/completions", unknown.dump()), 404, "model", "model_not_found");
  expect_error(post("/v1/chat/completions", chat_body(1).dump(), false), 401, "", "invalid_api_key");
  {
    auto c = srv->client("wrong-key");
    expect_error(c.Post("/v1/chat/completions", chat_body(1).dump(), "application/json"), 401, "", "invalid_api_key");
  }
  std::string big = chat_body(1).dump();
  big.insert(big.size() - 1, ",\"pad\":\"" + std::string(70 * 1024, 'x') + "\"");
  expect_error(post("/v1/chat/completions", big), 413, "", "request_too_large");
  Json huge = chat_body(1, 9000);
  expect_error(post("/v1/chat/completions", huge.dump()), 413, "messages", "context_length_exceeded");
  {
    auto c = srv->client(kKey);
    expect_error(c.Get("/v1/nothing"), 404, "", "unknown_url");
  }
  Json hook_off = chat_body(1);
  hook_off["messages"] = Json::array({{{"role", "tool"}, {"content", 5}}});
  expect_error(post("/v1/chat/completions", hook_off.dump()), 400, "messages[0].content", "invalid_type");
  expect_error(post("/v1/completions", R"({"prompt":[1,999999999]})"), 400, "prompt[1]", "invalid_value");
}

TEST_F(ServerHttp, ChatIsDeterministicPerSeedAndStreamEqualsNonStream) {
  const Json a = post_json("/v1/chat/completions", chat_body(42));
  const Json b = post_json("/v1/chat/completions", chat_body(42));
  EXPECT_EQ(a["object"], "chat.completion");
  EXPECT_EQ(a["model"], "tiny-v");
  EXPECT_EQ(a["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
  EXPECT_EQ(a["usage"]["completion_tokens"], b["usage"]["completion_tokens"]);
  EXPECT_LE(a["usage"]["completion_tokens"].get<int>(), 12);
  EXPECT_GT(a["usage"]["prompt_tokens"].get<int>(), 5);
  const std::string fr = a["choices"][0]["finish_reason"];
  EXPECT_TRUE(fr == "stop" || fr == "length") << fr;
  // The repeat was served from the cached conversation.
  EXPECT_GT(b["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);

  Json s = chat_body(42);
  s["stream"] = true;
  s["stream_options"] = {{"include_usage", true}};
  auto r = post("/v1/chat/completions", s.dump());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  auto events = sse_events(r->body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back().second, "[DONE]");
  std::string content, finish;
  Json usage;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const Json c = Json::parse(events[i].second);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_EQ(c["id"], Json::parse(events[0].second)["id"]);
    if (c.contains("usage")) {
      EXPECT_TRUE(c["choices"].empty());
      usage = c["usage"];
      continue;
    }
    const Json& ch = c["choices"][0];
    if (i == 0) {
      EXPECT_EQ(ch["delta"]["role"], "assistant");
    }
    if (ch["delta"].contains("content")) content += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(content, a["choices"][0]["message"]["content"]);
  EXPECT_EQ(finish, fr);
  EXPECT_EQ(usage["completion_tokens"], a["usage"]["completion_tokens"]);
}

TEST_F(ServerHttp, DifferentSeedsDiffer) {
  const Json a = post_json("/v1/chat/completions", chat_body(1, 24));
  const Json b = post_json("/v1/chat/completions", chat_body(2, 24));
  EXPECT_NE(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
}

TEST_F(ServerHttp, DraftEventsCarryTheCanvas) {
  Json s = chat_body(5);
  s["stream"] = true;
  s["stream_options"] = {{"include_drafts", true}};
  auto r = post("/v1/chat/completions", s.dump());
  ASSERT_TRUE(r);
  int drafts = 0;
  for (auto& [event, data] : sse_events(r->body)) {
    if (event != "draft") continue;
    ++drafts;
    const Json d = Json::parse(data);
    EXPECT_EQ(d["object"], "chat.completion.draft");
    EXPECT_TRUE(d["choices"].empty());
    EXPECT_GE(d["draft"]["step"].get<int>(), 1);
    EXPECT_LE(d["draft"]["step"].get<int>(), 3);
    EXPECT_TRUE(d["draft"]["text"].is_string());
  }
  EXPECT_GE(drafts, 1);
}

// tool_choice "required" with one tool starts the reply inside that call: the model output only continues it.
TEST_F(ServerHttp, RequiredToolChoiceStartsTheOnlyToolsCall) {
  const Json tools = Json::parse(R"([{"type":"function","function":{"name":"get_weather",
      "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])");
  Json req = {{"messages", Json::array({{{"role", "user"}, {"content", "Weather in Paris?"}}})},
              {"tools", tools},
              {"tool_choice", "required"},
              {"seed", 3},
              {"max_tokens", 40},
              {"x_test_output", "city:<|\"|>Paris<|\"|>}<tool_call|><|tool_response>"}};
  const Json r = post_json("/v1/chat/completions", req);
  const Json& msg = r["choices"][0]["message"];
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            Json::parse(R"({"city":"Paris"})"));
}

TEST_F(ServerHttp, ToolCallRoundTripThroughTheHook) {
  const Json tools = Json::parse(R"([{"type":"function","function":{"name":"get_weather","description":"Weather",
      "parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}}])");
  Json req = {{"messages", Json::array({{{"role", "user"}, {"content", "Weather in Paris?"}}})},
              {"tools", tools},
              {"seed", 3},
              {"max_tokens", 40},
              {"x_test_output", "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|><|tool_response>"}};
  const Json first = post_json("/v1/chat/completions", req);
  const Json& msg = first["choices"][0]["message"];
  EXPECT_EQ(first["choices"][0]["finish_reason"], "tool_calls");
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_TRUE(msg["content"].is_null());
  const Json call = msg["tool_calls"][0];
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(call["function"]["arguments"].get<std::string>()), Json::parse(R"({"city":"Paris","days":2})"));
  EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);

  // Streaming: the same call arrives as one tool_calls delta with index 0.
  Json sreq = req;
  sreq["stream"] = true;
  auto r = post("/v1/chat/completions", sreq.dump());
  ASSERT_TRUE(r);
  bool saw_call = false;
  std::string finish;
  for (auto& [event, data] : sse_events(r->body)) {
    if (data == "[DONE]") continue;
    const Json c = Json::parse(data);
    const Json& ch = c["choices"][0];
    if (ch["delta"].contains("tool_calls")) {
      EXPECT_EQ(ch["delta"]["tool_calls"][0]["index"], 0);
      EXPECT_EQ(ch["delta"]["tool_calls"][0]["function"]["name"], "get_weather");
      saw_call = true;
    }
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_TRUE(saw_call);
  EXPECT_EQ(finish, "tool_calls");

  // The tool result goes back; the continuation reuses the cached conversation up to the tool call.
  Json next = {{"messages", Json::array({{{"role", "user"}, {"content", "Weather in Paris?"}},
                                        {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", msg["tool_calls"]}},
                                        {{"role", "tool"}, {"tool_call_id", call["id"]}, {"content", "{\"temp_c\":18}"}}})},
               {"tools", tools},
               {"seed", 3},
               {"max_tokens", 8},
               {"max_denoising_steps", 3}};
  const Json cont = post_json("/v1/chat/completions", next);
  EXPECT_EQ(cont["object"], "chat.completion");
  const int cached = cont["usage"]["prompt_tokens_details"]["cached_tokens"];
  const int prompt = cont["usage"]["prompt_tokens"];
  EXPECT_GT(cached, prompt / 2) << "the tool round did not reuse the conversation's KV";
}

TEST_F(ServerHttp, StopStringEndsTheTurn) {
  Json req = chat_body(9);
  req["x_test_output"] = "alpha beta STOP gamma<turn|>";
  req["stop"] = "STOP";
  const Json j = post_json("/v1/chat/completions", req);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "alpha beta ");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerHttp, ReasoningIsSeparated) {
  Json req = chat_body(9);
  req["x_test_output"] = "<|channel>thought\nthink first\n<channel|>The answer.<turn|>";
  req["reasoning_effort"] = "high";
  const Json j = post_json("/v1/chat/completions", req);
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"], "think first");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "The answer.");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerHttp, CompletionsTextAndIds) {
  const Json body = {{"prompt", "Once upon a time"}, {"seed", 4}, {"max_tokens", 6}, {"max_denoising_steps", 2}};
  const Json a = post_json("/v1/completions", body);
  const Json b = post_json("/v1/completions", body);
  EXPECT_EQ(a["object"], "text_completion");
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
  EXPECT_LE(a["usage"]["completion_tokens"].get<int>(), 6);
  Json ids = body;
  ids["prompt"] = Json::array({2, 9259, 3409, 496, 990});
  const Json c = post_json("/v1/completions", ids);
  EXPECT_EQ(c["usage"]["prompt_tokens"], 5);
  Json st = body;
  st["stream"] = true;
  auto r = post("/v1/completions", st.dump());
  ASSERT_TRUE(r);
  std::string text;
  auto events = sse_events(r->body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().second, "[DONE]");
  for (size_t i = 0; i + 1 < events.size(); ++i) text += Json::parse(events[i].second)["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, a["choices"][0]["text"]);
}

TEST_F(ServerHttp, ClientDisconnectCancelsTheGeneration) {
  auto metric = [&](const std::string& name) {
    auto c = srv->client();
    auto r = c.Get("/metrics");
    const size_t at = r->body.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(r->body.substr(at + name.size() + 2));
  };
  const double before = metric("diffgemma_cancelled_total");
  Json s = chat_body(6, 2000);
  s["max_denoising_steps"] = 48;
  s["stream"] = true;
  s["stream_options"] = {{"include_drafts", true}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = s.dump();
  req.set_header("Content-Type", "application/json");
  req.set_header("Authorization", std::string("Bearer ") + kKey);
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
  auto c = srv->client();
  (void)c.send(req);
  EXPECT_GE(chunks, 3);
  // The engine notices at its next write and stops between steps; the server keeps serving.
  bool cancelled = false;
  for (int i = 0; i < 200 && !cancelled; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cancelled = metric("diffgemma_cancelled_total") > before;
  }
  EXPECT_TRUE(cancelled);
  const Json ok = post_json("/v1/chat/completions", chat_body(1, 4));
  EXPECT_EQ(ok["object"], "chat.completion");
}

TEST(ServerEngine, FullQueueIsRejected) {
  auto model = load_model(std::string(DIFFGEMMA_FIXTURES_DIR) + "/tiny-v");
  const LoadedModel* m = model.get();
  server::EngineConfig ec;
  ec.queue_limit = 1;
  ec.slots = 1;
  server::Engine engine([m] { return make_cpu_backend(*m); }, ec);
  auto make_job = [&] {
    auto j = std::make_shared<server::Job>();
    j->prompt = {2, 105, 2364, 107};
    j->options = diffusion::GenerationOptions::from_config(m->generation);
    j->options.max_new_tokens = 256;
    j->options.stop_ids = {};
    return j;
  };
  auto running = make_job();
  engine.submit(running);
  // Wait until the engine took it, so the queue is empty again.
  for (int i = 0; i < 200 && engine.queue_depth() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto waiting = make_job();
  engine.submit(waiting);
  EXPECT_THROW(engine.submit(make_job()), server::QueueFull);
  waiting->cancel.cancel();
  running->cancel.cancel();
  server::EngineEvent ev;
  while (running->next(ev)) {}
  EXPECT_EQ(ev.kind, server::EngineEvent::Kind::Done);
  EXPECT_EQ(ev.result.finish, diffusion::FinishReason::Cancelled);
  while (waiting->next(ev)) {}
  EXPECT_EQ(ev.result.finish, diffusion::FinishReason::Cancelled);
  EXPECT_TRUE(ev.result.ids.empty());
}

}  // namespace
}  // namespace dg::testing
