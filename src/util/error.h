#pragma once
// Input problems (files, configs, requests, tokenizer data) are reported as dg::Error with a message that names the
// file/field/value and how to fix it. The CLI prints it and exits non-zero; the server maps it to an OpenAI error.
#include <stdexcept>
#include <string>
#include <format>

namespace dg {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <class... Args>
[[noreturn]] inline void fail(std::format_string<Args...> fmt, Args&&... args) {
  throw Error(std::format(fmt, std::forward<Args>(args)...));
}

// Internal invariant: a bug in diffgemma, not bad input.
#define DG_CHECK(cond, ...)                                                                           \
  do {                                                                                                \
    if (!(cond)) ::dg::fail("internal error at {}:{}: {} ({})", __FILE__, __LINE__, #cond,             \
                            std::format(__VA_ARGS__));                                                \
  } while (0)

}  // namespace dg
