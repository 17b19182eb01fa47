#include "server/engine.h"

#include <algorithm>
#include <future>

#include "util/error.h"

namespace dg::server {

using Clock = std::chrono::steady_clock;

void Job::push(EngineEvent event) {
  {
    std::lock_guard lock(mu_);
    if (terminal_pushed_) return;
    // A slow reader only ever needs the newest draft; coalescing keeps memory bounded under a stalled client.
    if (event.kind == EngineEvent::Kind::Draft && !events_.empty() && events_.back().kind == EngineEvent::Kind::Draft)
      events_.back() = std::move(event);
    else {
      if (event.kind == EngineEvent::Kind::Done || event.kind == EngineEvent::Kind::Error) terminal_pushed_ = true;
      events_.push_back(std::move(event));
    }
  }
  cv_.notify_all();
}

bool Job::next(EngineEvent& event) {
  bool timed_out = false;
  return next_for(event, std::chrono::milliseconds::max(), timed_out);
}

bool Job::next_for(EngineEvent& event, std::chrono::milliseconds timeout, bool& timed_out) {
  std::unique_lock lock(mu_);
  timed_out = false;
  if (terminal_taken_) return false;
  auto ready = [&] { return !events_.empty(); };
  if (timeout == std::chrono::milliseconds::max()) cv_.wait(lock, ready);
  else if (!cv_.wait_for(lock, timeout, ready)) {
    timed_out = true;
    return false;
  }
  event = std::move(events_.front());
  events_.pop_front();
  if (event.kind == EngineEvent::Kind::Done || event.kind == EngineEvent::Kind::Error) terminal_taken_ = true;
  return true;
}

Engine::Engine(session::SessionPool::BackendFactory factory, EngineConfig config, Metrics* metrics,
               session::SessionPool::Logger log)
    : config_(config), metrics_(metrics), pool_(std::move(factory), config.slots, std::move(log)) {
  if (config_.queue_limit < 1) fail("--queue-limit must be >= 1 (got {})", config_.queue_limit);
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (auto& job : queue_) job->cancel.cancel();
  }
  cv_.notify_all();
  thread_.join();
}

void Engine::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) throw QueueFull("the server is shutting down");
    if (int64_t(queue_.size()) >= config_.queue_limit)
      throw QueueFull(format("the request queue is full ({} waiting); retry later", queue_.size()));
    queue_.push_back(std::move(job));
    if (metrics_) metrics_->queue_depth(int64_t(queue_.size()));
  }
  cv_.notify_all();
}

int64_t Engine::queue_depth() const {
  std::lock_guard lock(mu_);
  return int64_t(queue_.size());
}

void Engine::run_sync(const std::function<void(session::SessionPool&)>& fn) {
  std::promise<void> done;
  {
    std::lock_guard lock(mu_);
    tasks_.push_back([&] {
      try {
        fn(pool_);
        done.set_value();
      } catch (...) {
        done.set_exception(std::current_exception());
      }
    });
  }
  cv_.notify_all();
  done.get_future().get();
}

void Engine::loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !tasks_.empty(); });
      if (!tasks_.empty()) {
        task = std::move(tasks_.front());
        tasks_.pop_front();
      } else if (!queue_.empty()) {
        job = std::move(queue_.front());
        queue_.pop_front();
        if (metrics_) metrics_->queue_depth(int64_t(queue_.size()));
      } else if (stopping_) {
        return;
      }
    }
    if (task) {
      task();
      continue;
    }
    if (job) run_job(*job);
  }
}

void Engine::run_job(Job& job) {
  if (job.cancel.cancelled()) {
    // The client left while queued: nothing ran, the KV is untouched.
    EngineEvent done;
    done.kind = EngineEvent::Kind::Done;
    done.result.finish = diffusion::FinishReason::Cancelled;
    if (metrics_) metrics_->cancelled();
    job.push(std::move(done));
    return;
  }
  const auto& stops = job.options.stop_ids;
  std::vector<int32_t> emitted;
  bool ended = false;  // a stop id or max_new_tokens was reached in the streamed blocks
  auto last_step = Clock::now();

  diffusion::Observers obs;
  obs.on_block = [&](const diffusion::BlockEvent& b) {
    if (metrics_ && !b.stats.discarded) metrics_->block(b.stats.steps);
    if (b.stats.discarded || ended) return;
    EngineEvent e;
    const int n = std::min<int>(b.stats.tokens_committed, int(b.tokens.size()));
    for (int i = 0; i < n; ++i) {
      const int32_t id = b.tokens[size_t(i)];
      if (std::find(stops.begin(), stops.end(), id) != stops.end() ||
          int(emitted.size()) >= job.options.max_new_tokens) {
        ended = true;
        break;
      }
      e.ids.push_back(id);
      emitted.push_back(id);
    }
    if (!e.ids.empty()) job.push(std::move(e));
    last_step = Clock::now();
  };
  obs.on_step = [&](const diffusion::StepEvent& s) {
    const auto now = Clock::now();
    // Step 1 of a block also pays for the prefill or commit pass before it; only later steps time one denoise.
    if (metrics_ && s.step > 1) metrics_->step_seconds(std::chrono::duration<double>(now - last_step).count());
    last_step = now;
    if (!job.want_drafts) return;
    EngineEvent e;
    e.kind = EngineEvent::Kind::Draft;
    e.ids.assign(s.argmax.begin(), s.argmax.end());
    e.block = s.block;
    e.step = s.step;
    e.accepted = s.accepted;
    e.mean_entropy = s.mean_entropy;
    job.push(std::move(e));
  };

  EngineEvent done;
  done.kind = EngineEvent::Kind::Done;
  try {
    session::Turn turn;
    if (job.injected_output) {
      std::vector<int32_t> out = *job.injected_output;
      int32_t stop = -1;
      if (!out.empty() && std::find(stops.begin(), stops.end(), out.back()) != stops.end()) {
        stop = out.back();
        out.pop_back();
      }
      turn = pool_.replay(job.prompt, out, stop);
      // Stream the injected output in canvas-sized pieces, as blocks would commit.
      const size_t L = 32;
      for (size_t i = 0; i < out.size(); i += L) {
        EngineEvent e;
        e.ids.assign(out.begin() + long(i), out.begin() + long(std::min(out.size(), i + L)));
        emitted.insert(emitted.end(), e.ids.begin(), e.ids.end());
        job.push(std::move(e));
      }
    } else {
      turn = pool_.generate(job.prompt, job.options, obs, &job.cancel);
    }
    // The result is authoritative; blocks streamed above are its prefix. Send whatever the blocks did not cover.
    const auto& ids = turn.result.ids;
    if (emitted.size() < ids.size() && std::equal(emitted.begin(), emitted.end(), ids.begin())) {
      EngineEvent e;
      e.ids.assign(ids.begin() + long(emitted.size()), ids.end());
      job.push(std::move(e));
    }
    if (metrics_) {
      metrics_->kv(turn.stats.reused_tokens, turn.stats.prefilled_tokens, turn.stats.reprefill);
      metrics_->tokens(int64_t(job.prompt.size()), int64_t(ids.size()));
      if (turn.result.finish == diffusion::FinishReason::Cancelled) metrics_->cancelled();
    }
    done.result = std::move(turn.result);
    done.stats = turn.stats;
    job.push(std::move(done));
  } catch (const std::exception& e) {
    EngineEvent err;
    err.kind = EngineEvent::Kind::Error;
    err.error = e.what();
    job.push(std::move(err));
  }
}

}  // namespace dg::server
