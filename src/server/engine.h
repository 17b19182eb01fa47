#pragma once
// The engine thread: the only thread that touches the Backend and the KV cache (DESIGN.md "Threading"). HTTP
// handlers and the chat REPL submit Jobs (token ids + options) to a bounded queue and read the Job's event stream:
// output ids as each block commits, optional per-step drafts, then Done or Error. A Job's CancelToken is checked
// between denoise steps; a job cancelled while still queued never runs.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "diffusion/generate.h"
#include "server/metrics.h"
#include "session/session.h"

namespace dg::server {

struct EngineEvent {
  enum class Kind { Tokens, Draft, Done, Error };
  Kind kind = Kind::Tokens;
  std::vector<int32_t> ids;  // Tokens: output ids just committed (stop token excluded); Draft: the canvas argmax
  int block = 0, step = 0, accepted = 0;  // Draft
  float mean_entropy = 0;                 // Draft
  diffusion::GenerationResult result;     // Done
  session::TurnStats stats;               // Done
  std::string error;                      // Error
};

class Job {
 public:
  std::vector<int32_t> prompt;
  diffusion::GenerationOptions options;
  bool want_drafts = false;
  // Test hook: the turn's output, used instead of generating (SessionPool::replay).
  std::optional<std::vector<int32_t>> injected_output;
  diffusion::CancelToken cancel;

  // Blocks until the next event; returns false once the terminal event (Done/Error) has been consumed.
  bool next(EngineEvent& event);
  // As next(), giving up after `timeout` (returns false and leaves `timed_out` set).
  bool next_for(EngineEvent& event, std::chrono::milliseconds timeout, bool& timed_out);
  void push(EngineEvent event);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineEvent> events_;
  bool terminal_pushed_ = false;
  bool terminal_taken_ = false;
};

struct EngineConfig {
  int queue_limit = 64;  // jobs waiting (not counting the running one)
  int slots = 4;         // cached conversations (SessionPool slots)
};

class QueueFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Engine {
 public:
  Engine(session::SessionPool::BackendFactory factory, EngineConfig config, Metrics* metrics = nullptr,
         session::SessionPool::Logger log = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Throws QueueFull when queue_limit jobs are already waiting.
  void submit(std::shared_ptr<Job> job);
  int64_t queue_depth() const;
  // Runs `fn` on the engine thread between jobs (e.g. reading slot token logs in tests) and waits for it.
  void run_sync(const std::function<void(session::SessionPool&)>& fn);

 private:
  void loop();
  void run_job(Job& job);

  EngineConfig config_;
  Metrics* metrics_;
  session::SessionPool pool_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace dg::server
