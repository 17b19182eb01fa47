#pragma once
// Input problems (files, configs, requests, tokenizer data) are reported as dg::Error with a message that names the
// file/field/value and how to fix it. The CLI prints it and exits non-zero; the server maps it to an OpenAI error.
#include <stdexcept>
#include <string>
#include <fmt/format.h>

namespace dg {

// g++ 12 ships no <format>: dg::format is {fmt} (header-only), the same syntax as std::format.
using fmt::format;

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <class... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

// Internal invariant: a bug in diffgemma, not bad input.
#define DG_CHECK(cond, ...)                                                                           \
  do {                                                                                                \
    if (!(cond)) ::dg::fail("internal error at {}:{}: {} ({})", __FILE__, __LINE__, #cond,             \
                            ::fmt::format(__VA_ARGS__));                                                \
  } while (0)

}  // namespace dg
