#pragma once
// Each CLI subcommand lives in its own file and registers itself with a static CommandRegistrar, so adding a
// command never touches main.cpp. `setup` adds options to the subcommand and returns the action to run.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace dg::cli {

using Action = std::function<int()>;  // returns the process exit code
using Setup = std::function<Action(CLI::App& sub)>;

struct CommandSpec {
  std::string name;
  std::string help;
  Setup setup;
};

std::vector<CommandSpec>& command_registry();

struct CommandRegistrar {
  CommandRegistrar(std::string name, std::string help, Setup setup) {
    command_registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

// Parses "1,2,3" (spaces allowed) into ids; throws dg::Error naming `what` on a bad entry.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what);

}  // namespace dg::cli
