#pragma once
// The OpenAI-compatible HTTP front end (cpp-httplib). Thin by design (DESIGN.md): it validates requests, renders
// and encodes prompts, submits Jobs to the Engine and turns the Job's events into JSON or SSE. See docs/SERVER.md.
#include <cstdint>
#include <memory>
#include <string>

#include "model/weights.h"
#include "server/engine.h"
#include "text/tokenizer.h"

namespace dg::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port (bind() returns it)
  std::string api_key;  // empty: no authentication
  size_t max_body = 8u << 20;
  int queue_limit = 64;
  int slots = 4;
  std::string model_id;        // empty: the model directory's name
  int default_max_tokens = 512;
  int max_context = 8192;      // prompt + max_tokens; beyond it a request gets 413
  bool test_hooks = false;     // honour x_test_output (tests only)
  bool log_requests = true;
};

class Server {
 public:
  // `model` must outlive the server; `factory` creates one backend per session slot.
  Server(const LoadedModel& model, text::Tokenizer tokenizer, session::SessionPool::BackendFactory factory,
         ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port. Throws dg::Error when the address is unusable.
  int bind();
  // Serves until stop(); call after bind().
  void listen();
  void stop();
  const std::string& model_id() const;
  Engine& engine();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dg::server
