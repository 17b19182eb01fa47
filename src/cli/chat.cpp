// `diffgemma chat`: a terminal conversation. The REPL keeps the OpenAI-style history, renders it with the chat
// template each turn and lets the session pool reuse the KV of everything already said, so a turn only prefills
// the new message. While a canvas denoises, one terminal line shows its current argmax text (--no-live hides it).
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <iostream>

#include "cli/backend_select.h"
#include "cli/command.h"
#include "server/text_stream.h"
#include "session/session.h"
#include "util/error.h"

namespace dg::cli {
namespace {

using Json = nlohmann::ordered_json;

struct ChatArgs {
  std::string model_dir;
  std::string tokenizer_path;
  std::string system;
  int max_tokens = 512;
  int max_steps = 0;  // 0: the model's generation_config
  uint64_t seed = 0;
  int threads = 0;
  BackendArgs engine;
  bool thinking = false;
  bool no_live = false;
};

diffusion::CancelToken* g_cancel = nullptr;

// Ctrl-C during a turn stops it between denoise steps; at the prompt it exits as usual.
extern "C" void on_sigint(int) {
  if (g_cancel) g_cancel->cancel();
  else std::_Exit(130);
}

int terminal_width() {
  winsize w{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &w) == 0 && w.ws_col > 0) return w.ws_col;
  return 80;
}

// The canvas as one line: newlines and tabs shown as spaces, cut to the terminal width without splitting UTF-8.
std::string one_line(std::string s, size_t width) {
  for (char& c : s)
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  size_t cols = 0, i = 0;
  while (i < s.size() && cols < width) {
    ++i;
    while (i < s.size() && (uint8_t(s[i]) & 0xC0) == 0x80) ++i;
    ++cols;
  }
  s.resize(i);
  return s;
}

void help() {
  std::printf("commands: /reset (forget the conversation)  /system TEXT (set the system prompt, resets)\n"
              "          /thinking on|off  /help  /quit   (Ctrl-C stops a reply)\n");
}

int run_chat(const ChatArgs& a) {
  auto model = load_model(a.model_dir);
  auto tok = a.tokenizer_path.empty() ? text::Tokenizer::from_model_dir(a.model_dir)
                                      : text::Tokenizer::from_file(a.tokenizer_path);
  const LoadedModel* m = model.get();
  session::SessionPool pool(make_backend_factory(a.engine.backend, *m, a.threads, a.engine.sc_sparse), 1,
                            [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  const bool live = !a.no_live && isatty(STDOUT_FILENO);
  std::string system = a.system;
  bool thinking = a.thinking;
  Json history = Json::array();
  uint64_t seed = a.seed;
  std::signal(SIGINT, on_sigint);

  std::printf("diffgemma chat (%s). /help for commands.\n", a.model_dir.c_str());
  std::string line;
  for (;;) {
    std::printf("\n> ");
    std::fflush(stdout);
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    if (line[0] == '/') {
      if (line == "/quit" || line == "/exit") break;
      if (line == "/help") help();
      else if (line == "/reset") {
        history = Json::array();
        pool.reset();
        std::printf("(conversation cleared)\n");
      } else if (line.rfind("/system", 0) == 0) {
        system = line.size() > 8 ? line.substr(8) : "";
        history = Json::array();
        std::printf("(system prompt %s; conversation cleared)\n", system.empty() ? "removed" : "set");
      } else if (line == "/thinking on" || line == "/thinking off") {
        thinking = line == "/thinking on";
        std::printf("(thinking %s)\n", thinking ? "on" : "off");
      } else {
        std::printf("unknown command %s\n", line.c_str());
        help();
      }
      continue;
    }

    history.push_back({{"role", "user"}, {"content", line}});
    Json messages = Json::array();
    if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
    for (const auto& msg : history) messages.push_back(msg);
    text::ChatRenderOptions ro;
    ro.enable_thinking = thinking;
    const auto prompt = server::encode_chat_segments(tok, text::render_chat_segments(messages, Json::array(), ro));

    auto opts = diffusion::GenerationOptions::from_config(model->generation);
    opts.max_new_tokens = a.max_tokens;
    if (a.max_steps > 0) opts.max_steps = a.max_steps;
    opts.seed = seed++;
    server::OutputMapper mapper(tok, {}, true);
    std::string reasoning, content;
    bool in_reasoning = false;
    const size_t width = size_t(std::max(20, terminal_width() - 16));
    // Column where the committed text ends, so the live line (drawn below it) can return there.
    int col = 0;
    const int term_cols = terminal_width();
    auto advance = [&](const std::string& t) {
      for (size_t i = 0; i < t.size(); ++i) {
        if (t[i] == '\n') col = 0;
        else if ((uint8_t(t[i]) & 0xC0) != 0x80 && ++col >= term_cols) col = 0;
      }
    };
    auto out = [&](const std::string& t) {
      std::fwrite(t.data(), 1, t.size(), stdout);
      advance(t);
    };
    auto print = [&](const server::OutputDelta& d) {
      if (!d.reasoning.empty()) {
        if (!in_reasoning) std::printf("\033[2m");
        in_reasoning = true;
        out(d.reasoning);
        reasoning += d.reasoning;
      }
      if (!d.content.empty()) {
        if (in_reasoning) {
          std::printf("\033[0m");
          out("\n");
        }
        in_reasoning = false;
        out(d.content);
        content += d.content;
      }
      for (const auto& c : d.tool_calls) out("\n[tool call " + c.name + " " + c.arguments.dump() + "]");
      std::fflush(stdout);
    };
    // The live line sits on the row below the committed text: the cursor position at the end of the text is saved
    // (after making sure that row exists, so no later scroll invalidates it) and restored before more text.
    diffusion::Observers obs;
    bool line_open = false;
    obs.on_step = [&](const diffusion::StepEvent& s) {
      if (!live) return;
      std::string draft;
      try {
        draft = tok.decode(s.argmax, /*skip_special=*/true);
      } catch (const Error&) {
        return;
      }
      if (!line_open) std::printf("\n\033[1A\033[%dG\0337", col + 1);
      line_open = true;
      std::printf("\0338\n\033[2K\033[2m[block %d step %2d/%d]\033[0m %s", s.block + 1, s.step, opts.max_steps,
                  one_line(draft, width).c_str());
      std::fflush(stdout);
    };
    auto close_live = [&] {
      if (line_open) std::printf("\0338\033[J");
      line_open = false;
    };
    obs.on_block = [&](const diffusion::BlockEvent& b) {
      close_live();
      if (b.stats.discarded) return;
      std::vector<int32_t> ids;
      for (int i = 0; i < b.stats.tokens_committed && i < int(b.tokens.size()); ++i) {
        const int32_t id = b.tokens[size_t(i)];
        if (std::find(opts.stop_ids.begin(), opts.stop_ids.end(), id) != opts.stop_ids.end()) break;
        ids.push_back(id);
      }
      print(mapper.push(ids));
    };
    diffusion::CancelToken cancel;
    g_cancel = &cancel;
    session::Turn turn;
    try {
      turn = pool.generate(prompt, opts, obs, &cancel);
    } catch (...) {
      g_cancel = nullptr;
      throw;
    }
    g_cancel = nullptr;
    close_live();
    print(mapper.finish());
    if (in_reasoning) std::printf("\033[0m");
    std::printf("\n");
    std::fprintf(stderr, "\033[2m[%zu tokens, %zu blocks, %.2f tokens/forward, prefilled %lld of %zu prompt tokens%s]\033[0m\n",
                 turn.result.ids.size(), turn.result.steps_per_block().size(), turn.result.tokens_per_forward(),
                 (long long)turn.stats.prefilled_tokens, prompt.size(),
                 turn.result.finish == diffusion::FinishReason::Cancelled ? ", stopped" : "");
    if (turn.result.finish == diffusion::FinishReason::Cancelled) {
      history.erase(history.size() - 1);  // the interrupted exchange is not part of the conversation
      continue;
    }
    Json reply = {{"role", "assistant"}, {"content", content}};
    history.push_back(reply);
  }
  return 0;
}

const CommandRegistrar kRegistrar{
    "chat", "Interactive terminal chat with live canvas view and KV reuse across turns",
    [](CLI::App& sub) -> Action {
      auto a = std::make_shared<ChatArgs>();
      sub.add_option("-m,--model", a->model_dir, "Model directory (HF snapshot)")->required();
      sub.add_option("--tokenizer", a->tokenizer_path, "tokenizer.json(.xz) when the model directory has none");
      sub.add_option("--system", a->system, "System prompt");
      add_backend_options(sub, a->engine);
      sub.add_option("--max-tokens", a->max_tokens, "Longest reply in tokens");
      sub.add_option("--max-steps", a->max_steps, "Denoising steps per block (default: generation_config)");
      sub.add_option("--seed", a->seed, "Seed of the first turn (each turn adds 1)");
      sub.add_option("--threads", a->threads, "CPU threads (0: all cores)");
      sub.add_flag("--thinking", a->thinking, "Start with thinking on");
      sub.add_flag("--no-live", a->no_live, "Do not show the canvas while it denoises");
      return [a] { return run_chat(*a); };
    }};

}  // namespace
}  // namespace dg::cli
