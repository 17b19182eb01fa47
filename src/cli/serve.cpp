// `diffgemma serve`: the OpenAI-compatible HTTP server (docs/SERVER.md).
#include <csignal>
#include <cstdio>
#include <pthread.h>
#include <thread>

#include "cli/backend_select.h"
#include "cli/command.h"
#include "server/server.h"
#include "util/error.h"

namespace dg::cli {
namespace {

struct ServeArgs {
  std::string model_dir;
  std::string tokenizer_path;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;
  BackendArgs engine;
  int queue_limit = 64;
  size_t max_body = 8u << 20;
  int slots = 4;
  int threads = 0;
  int max_context = 8192;
  int default_max_tokens = 512;
  std::string model_id;
  bool test_hooks = false;
  bool quiet = false;
};

int run_serve(const ServeArgs& a) {
  if (a.api_key.empty() && a.host != "127.0.0.1" && a.host != "localhost" && a.host != "::1")
    std::fprintf(stderr, "warning: listening on %s without --api-key: anyone who can reach it can use the model\n",
                 a.host.c_str());
  auto model = load_model(a.model_dir);
  auto tokenizer = a.tokenizer_path.empty() ? text::Tokenizer::from_model_dir(a.model_dir)
                                            : text::Tokenizer::from_file(a.tokenizer_path);
  server::ServerOptions o;
  o.host = a.host;
  o.port = a.port;
  o.api_key = a.api_key;
  o.max_body = a.max_body;
  o.queue_limit = a.queue_limit;
  const std::string backend = resolve_backend(a.engine.backend);
  // Each session slot owns a backend (its KV cache and scratch); CUDA slots share one copy of the weights.
  o.slots = a.slots;
  o.model_id = a.model_id;
  o.max_context = a.max_context;
  o.default_max_tokens = a.default_max_tokens;
  o.test_hooks = a.test_hooks;
  o.log_requests = !a.quiet;

  // Signals are taken by one dedicated thread (sigwait), so stopping never runs inside a signal handler.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client closing mid-stream must fail the write, not kill the process

  server::Server server(*model, std::move(tokenizer),
                        make_backend_factory(backend, *model, a.threads, a.engine.sc_sparse, a.max_context), o);
  const int port = server.bind();
  // The line tests and scripts wait for: the port is known and bound.
  std::printf("diffgemma serve: model '%s' on http://%s:%d (queue limit %d, %d session slots)\n",
              server.model_id().c_str(), a.host.c_str(), port, a.queue_limit, o.slots);
  std::fflush(stdout);
  std::thread signals([&] {
    int sig = 0;
    sigwait(&set, &sig);
    if (sig != 0) server.stop();
  });
  server.listen();
  // listen() also returns when the socket fails; wake the signal thread so it can be joined.
  pthread_kill(signals.native_handle(), SIGTERM);
  signals.join();
  return 0;
}

const CommandRegistrar kRegistrar{
    "serve", "OpenAI-compatible HTTP server (chat/completions, completions, models, health, metrics)",
    [](CLI::App& sub) -> Action {
      auto a = std::make_shared<ServeArgs>();
      sub.add_option("-m,--model", a->model_dir, "Model directory (HF snapshot)")->required();
      sub.add_option("--tokenizer", a->tokenizer_path, "tokenizer.json(.xz) when the model directory has none");
      sub.add_option("--host", a->host, "Address to bind (default 127.0.0.1: local only)");
      sub.add_option("--port", a->port, "Port (0: any free port, printed at startup)");
      sub.add_option("--api-key", a->api_key, "Require 'Authorization: Bearer KEY' on /v1/*");
      add_backend_options(sub, a->engine);
      sub.add_option("--queue-limit", a->queue_limit, "Requests that may wait for the engine; beyond it 503");
      sub.add_option("--max-body", a->max_body, "Largest request body in bytes; beyond it 413");
      sub.add_option("--sessions", a->slots, "Conversations whose KV cache is kept for reuse");
      sub.add_option("--threads", a->threads, "CPU backend threads (0: all cores)");
      sub.add_option("--ctx-size", a->max_context, "Largest prompt + max_tokens per request; beyond it 413");
      sub.add_option("--default-max-tokens", a->default_max_tokens, "max_tokens when a request gives none");
      sub.add_option("--model-id", a->model_id, "Model name in the API (default: the directory name)");
      sub.add_flag("--quiet", a->quiet, "Do not log requests");
      // Test-only: lets requests inject the model's output (x_test_output). Hidden from --help.
      sub.add_flag("--enable-test-hooks", a->test_hooks)->group("");
      return [a] { return run_serve(*a); };
    }};

}  // namespace
}  // namespace dg::cli
