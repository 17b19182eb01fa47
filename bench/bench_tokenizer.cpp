// Tokenizer throughput and load time. Encoding must stay >= 5 MB/s on one core (issue #4).
#include <benchmark/benchmark.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "text/tokenizer.h"
#include "util/xz.h"

namespace {

using dg::text::Tokenizer;
namespace fs = std::filesystem;

const fs::path kFixtureDir = fs::path(DIFFGEMMA_FIXTURES_DIR) / "tokenizer";

const Tokenizer& gemma() {
  static const Tokenizer tokenizer = Tokenizer::from_file(kFixtureDir / "tokenizer.json.xz");
  return tokenizer;
}

// The exactness corpus (multilingual prose, code, emoji, whitespace runs, special-token text), concatenated.
const std::string& corpus_text() {
  static const std::string text = [] {
    std::string raw = dg::read_file_maybe_xz((kFixtureDir / "corpus.jsonl.xz").string());
    std::string out;
    for (size_t start = 0; start < raw.size();) {
      size_t end = raw.find('\n', start);
      if (end == std::string::npos) end = raw.size();
      auto line = nlohmann::json::parse(raw.substr(start, end - start));
      if (line.contains("text")) out += line["text"].get<std::string>() + "\n";
      start = end + 1;
    }
    return out;
  }();
  return text;
}

void BM_TokenizerEncodeCorpus(benchmark::State& state) {
  const Tokenizer& t = gemma();
  const std::string& text = corpus_text();
  size_t tokens = 0;
  for (auto _ : state) {
    auto ids = t.encode(text);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations() * text.size()));
  state.counters["tokens"] = double(tokens);
}
BENCHMARK(BM_TokenizerEncodeCorpus)->Unit(benchmark::kMillisecond);

// English prose: the common case for prompts.
void BM_TokenizerEncodeProse(benchmark::State& state) {
  const Tokenizer& t = gemma();
  std::string text;
  while (text.size() < (1 << 20))
    text += "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times; "
            "numbers like 1,234.56 and code such as `for (int i = 0; i < n; ++i)` appear too.\n";
  for (auto _ : state) benchmark::DoNotOptimize(t.encode(text).data());
  state.SetBytesProcessed(int64_t(state.iterations() * text.size()));
}
BENCHMARK(BM_TokenizerEncodeProse)->Unit(benchmark::kMillisecond);

void BM_TokenizerDecodeCorpus(benchmark::State& state) {
  const Tokenizer& t = gemma();
  const auto ids = t.encode(corpus_text());
  for (auto _ : state) benchmark::DoNotOptimize(t.decode(ids).data());
  state.SetBytesProcessed(int64_t(state.iterations() * corpus_text().size()));
}
BENCHMARK(BM_TokenizerDecodeCorpus)->Unit(benchmark::kMillisecond);

void BM_TokenizerLoadXz(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(Tokenizer::from_file(kFixtureDir / "tokenizer.json.xz").vocab_size());
}
BENCHMARK(BM_TokenizerLoadXz)->Unit(benchmark::kMillisecond)->Iterations(3);

// Uncompressed tokenizer.json, as found in HF snapshots (decompressed once, outside the timing).
void BM_TokenizerLoadJson(benchmark::State& state) {
  static const std::string json = dg::read_file_maybe_xz((kFixtureDir / "tokenizer.json.xz").string());
  for (auto _ : state) benchmark::DoNotOptimize(Tokenizer::from_json(json, "tokenizer.json").vocab_size());
}
BENCHMARK(BM_TokenizerLoadJson)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace
