// `diffgemma chat-template`: prints the prompt the engine would feed the model for a conversation, byte for byte,
// so it can be diffed against HF's apply_chat_template output.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/command.h"
#include "text/chat_template.h"
#include "util/error.h"

namespace dg::cli {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{} '{}' cannot be opened (check the path)", what, path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

Json read_json(const std::string& path, const std::string& what) {
  const std::string text = read_file(path, what);
  Json parsed = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) fail("{} '{}' is not valid JSON", what, path);
  return parsed;
}

// The renderer implements one template; refuse to pretend a different revision renders the same.
void require_builtin_template(const std::string& path) {
  if (!text::is_builtin_chat_template(read_file(path, "chat template")))
    fail("chat template '{}' is not the DiffusionGemma template this build implements ({} bytes, md5 "
         "8c34cf93c7a7815b3fdb300a009c4c17); the renderer is built in and cannot follow another revision",
         path, text::kDiffusionGemmaTemplateSize);
}

struct ChatTemplateArgs {
  std::string model_dir;
  std::string template_path;
  std::string messages_path;
  std::string tools_path;
  bool thinking = false;
  bool no_generation_prompt = false;
};

int run_chat_template(const ChatTemplateArgs& args) {
  if (args.model_dir.empty() == args.template_path.empty())
    fail("chat-template: pass exactly one of -m DIR or --template FILE");
  if (!args.model_dir.empty()) {
    if (!fs::is_directory(args.model_dir)) fail("model directory '{}' does not exist", args.model_dir);
    const fs::path bundled = fs::path(args.model_dir) / "chat_template.jinja";
    if (fs::exists(bundled)) require_builtin_template(bundled.string());
  } else {
    require_builtin_template(args.template_path);
  }

  // Either a bare messages array or an OpenAI request body {"messages": [...], "tools": [...]}.
  Json messages = read_json(args.messages_path, "messages file");
  Json tools = nullptr;
  if (messages.is_object()) {
    if (messages.contains("tools")) tools = messages["tools"];
    if (!messages.contains("messages"))
      fail("messages file '{}' is an object without \"messages\"; give a JSON array of messages or a request body",
           args.messages_path);
    messages = Json(messages["messages"]);
  }
  if (!args.tools_path.empty()) {
    tools = read_json(args.tools_path, "tools file");
    if (tools.is_object() && tools.contains("tools")) tools = Json(tools["tools"]);
  }

  text::ChatRenderOptions options;
  options.enable_thinking = args.thinking;
  options.add_generation_prompt = !args.no_generation_prompt;
  const std::string prompt = text::render_chat(messages, tools, options);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  std::fflush(stdout);
  return 0;
}

const CommandRegistrar kRegistrar{
    "chat-template", "Render a conversation with the DiffusionGemma chat template (prints the exact prompt)",
    [](CLI::App& sub) -> Action {
      auto args = std::make_shared<ChatTemplateArgs>();
      sub.add_option("-m,--model", args->model_dir, "Model directory (the template is built in; checked if present)");
      sub.add_option("--template", args->template_path, "chat_template.jinja to verify against the built-in one");
      sub.add_option("--messages", args->messages_path, "JSON array of OpenAI messages, or a request body")
          ->required();
      sub.add_option("--tools", args->tools_path, "JSON array of tool declarations");
      sub.add_flag("--thinking", args->thinking, "enable_thinking=true");
      sub.add_flag("--no-generation-prompt", args->no_generation_prompt, "Do not open the model turn at the end");
      return [args] { return run_chat_template(*args); };
    }};

}  // namespace
}  // namespace dg::cli
