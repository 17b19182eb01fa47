#pragma once
// An in-process `diffgemma serve` on tests/fixtures/tiny-v (real CPU backend, real tokenizer) on a free port, plus
// small HTTP/SSE helpers for the server tests.
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/weights.h"
#include "server/server.h"

namespace dg::testing {

struct TestServer {
  std::unique_ptr<LoadedModel> model;
  std::unique_ptr<server::Server> server;
  std::thread thread;
  int port = 0;

  explicit TestServer(server::ServerOptions o) {
    const std::string dir = std::string(DIFFGEMMA_FIXTURES_DIR) + "/tiny-v";
    model = load_model(dir);
    o.host = "127.0.0.1";
    o.port = 0;
    o.log_requests = false;
    const LoadedModel* m = model.get();
    server = std::make_unique<server::Server>(*model, text::Tokenizer::from_model_dir(dir),
                                              [m] { return make_cpu_backend(*m); }, o);
    port = server->bind();
    thread = std::thread([this] { server->listen(); });
  }
  ~TestServer() {
    server->stop();
    thread.join();
  }

  httplib::Client client(const std::string& key = {}) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120);
    if (!key.empty()) c.set_bearer_token_auth(key.c_str());
    return c;
  }
};

// Splits an SSE body into (event name, data) pairs; comments and blank lines are dropped.
inline std::vector<std::pair<std::string, std::string>> sse_events(const std::string& body) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    std::string block = body.substr(pos, end - pos);
    pos = end + 2;
    std::string event, data;
    size_t lp = 0;
    while (lp < block.size()) {
      size_t le = block.find('\n', lp);
      if (le == std::string::npos) le = block.size();
      std::string line = block.substr(lp, le - lp);
      lp = le + 1;
      if (line.rfind("event: ", 0) == 0) event = line.substr(7);
      else if (line.rfind("data: ", 0) == 0) data = line.substr(6);
    }
    if (!data.empty()) out.emplace_back(event, data);
  }
  return out;
}

}  // namespace dg::testing
