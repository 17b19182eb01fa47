#pragma once
// Runs a shell command for the CLI tests (the diffgemma binary is DIFFGEMMA_BINARY): its output and exit status.
#include <cstdio>
#include <string>

struct CommandResult {
  std::string output;  // stdout, and stderr too unless the command redirects it
  int status = -1;     // pclose's status: 0 for a zero exit
};

inline CommandResult run_command(const std::string& command, bool with_stderr = true) {
  CommandResult result;
  FILE* pipe = ::popen((with_stderr ? command + " 2>&1" : command).c_str(), "r");
  if (!pipe) return result;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) result.output.append(buffer, n);
  result.status = ::pclose(pipe);
  return result;
}
