#include <algorithm>
#include <cstdio>
#include <map>

#include "cli/command.h"
#include "util/error.h"

namespace dg::cli {

std::vector<CommandSpec>& command_registry() {
  static std::vector<CommandSpec> registry;
  return registry;
}

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = text.find(',', i);
    if (j == std::string::npos) j = text.size();
    std::string tok = text.substr(i, j - i);
    tok.erase(0, tok.find_first_not_of(" \t\n"));
    tok.erase(tok.find_last_not_of(" \t\n") + 1);
    if (!tok.empty()) {
      try {
        size_t used = 0;
        long long v = std::stoll(tok, &used);
        if (used != tok.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(tok);
        ids.push_back(int32_t(v));
      } catch (const std::exception&) {
        fail("{}: '{}' is not a token id (expected comma-separated non-negative integers, e.g. 2,105,7)", what, tok);
      }
    }
    i = j + 1;
  }
  return ids;
}

}  // namespace dg::cli

int main(int argc, char** argv) {
  using namespace dg::cli;
  CLI::App app{"diffgemma: inference engine for DiffusionGemma (block diffusion Gemma 4 MoE)"};
  app.require_subcommand(1);
  auto specs = command_registry();
  std::sort(specs.begin(), specs.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::map<CLI::App*, Action> actions;
  for (auto& spec : specs) {
    CLI::App* sub = app.add_subcommand(spec.name, spec.help);
    actions[sub] = spec.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, action] : actions)
      if (sub->parsed()) return action();
  } catch (const dg::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
