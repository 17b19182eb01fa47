// `diffgemma tokenize` / `diffgemma detokenize`: the engine's tokenizer from the command line, with the semantics of
// HF `tokenizer.encode(text, add_special_tokens=False)` / `tokenizer.decode(ids)`, so ids can be diffed against
// Python directly.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "cli/command.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dg::cli {
namespace {

struct TokenizerSource {
  std::string model_dir;
  std::string tokenizer_path;
};

void add_tokenizer_options(CLI::App& sub, TokenizerSource& source) {
  auto* model = sub.add_option("-m,--model", source.model_dir,
                               "Model directory containing tokenizer.json or tokenizer.json.xz");
  auto* file = sub.add_option("--tokenizer", source.tokenizer_path, "tokenizer.json or tokenizer.json.xz file");
  model->excludes(file);
}

text::Tokenizer load_tokenizer(const TokenizerSource& source, const char* command) {
  if (!source.tokenizer_path.empty()) return text::Tokenizer::from_file(source.tokenizer_path);
  if (!source.model_dir.empty()) return text::Tokenizer::from_model_dir(source.model_dir);
  fail("{}: pass -m DIR (a model directory) or --tokenizer FILE (tokenizer.json or tokenizer.json.xz)", command);
}

struct TokenizeArgs {
  TokenizerSource source;
  std::string text;
  bool have_text = false;
  bool add_special = false;
};

int run_tokenize(const TokenizeArgs& args) {
  text::Tokenizer tokenizer = load_tokenizer(args.source, "tokenize");
  std::string input = args.text;
  if (!args.have_text) input.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  std::vector<text::TokenId> ids = tokenizer.encode(input, args.add_special);
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(ids[i]);
  }
  out += "]\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

struct DetokenizeArgs {
  TokenizerSource source;
  std::string ids;
  bool skip_special = false;
};

int run_detokenize(const DetokenizeArgs& args) {
  text::Tokenizer tokenizer = load_tokenizer(args.source, "detokenize");
  std::vector<int32_t> ids = parse_id_list(args.ids, "detokenize --ids");
  for (int32_t id : ids)
    if (!tokenizer.is_valid_id(id))
      fail("detokenize --ids: {} is not a token id of this tokenizer (valid: 0..{})", id, tokenizer.vocab_size() - 1);
  // Written as raw bytes without a trailing newline, so the output is exactly HF's decode() string.
  std::string text = tokenizer.decode(ids, args.skip_special);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

const CommandRegistrar kTokenizeRegistrar{
    "tokenize", "Print the token ids of a text as a JSON array (HF encode, add_special_tokens=False by default)",
    [](CLI::App& sub) -> Action {
      auto args = std::make_shared<TokenizeArgs>();
      add_tokenizer_options(sub, args->source);
      auto* text = sub.add_option("--text", args->text, "Text to tokenize (default: read all of stdin)");
      sub.add_flag("--special", args->add_special,
                   "Add the special tokens HF adds with add_special_tokens=True (<bos>)");
      return [args, text] {
        args->have_text = text->count() > 0;
        return run_tokenize(*args);
      };
    }};

const CommandRegistrar kDetokenizeRegistrar{
    "detokenize", "Print the text of comma-separated token ids (HF decode)",
    [](CLI::App& sub) -> Action {
      auto args = std::make_shared<DetokenizeArgs>();
      add_tokenizer_options(sub, args->source);
      sub.add_option("--ids", args->ids, "Token ids, e.g. 2,105,2364")->required();
      sub.add_flag("--skip-special", args->skip_special, "Drop special tokens (HF skip_special_tokens=True)");
      return [args] { return run_detokenize(*args); };
    }};

}  // namespace
}  // namespace dg::cli
