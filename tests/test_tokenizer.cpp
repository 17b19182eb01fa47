// Exactness of dg::text::Tokenizer against the Hugging Face `tokenizers` library. The reference ids come from
// tools/text/make_tokenizer_fixtures.mjs (tokenizers 0.22.2) and are vendored with the tokenizer under
// tests/fixtures/tokenizer/.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_command.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/xz.h"

namespace {

using dg::text::IncrementalDecoder;
using dg::text::TokenId;
using dg::text::Tokenizer;
using nlohmann::json;
namespace fs = std::filesystem;

const fs::path kFixtureDir = fs::path(DIFFGEMMA_FIXTURES_DIR) / "tokenizer";

const Tokenizer& gemma() {
  static const Tokenizer tokenizer = Tokenizer::from_file(kFixtureDir / "tokenizer.json.xz");
  return tokenizer;
}

struct Corpus {
  json header;
  std::vector<json> strings;       // {"text", "ids", ...}
  std::vector<json> decode_cases;  // {"decode_ids", "decoded", "decoded_skip"}
};

const Corpus& corpus() {
  static const Corpus c = [] {
    Corpus out;
    std::string text = dg::read_file_maybe_xz((kFixtureDir / "corpus.jsonl.xz").string());
    size_t start = 0;
    bool first = true;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      json line = json::parse(text.substr(start, end - start));
      start = end + 1;
      if (first) {
        out.header = std::move(line);
        first = false;
      } else if (line.contains("text")) {
        out.strings.push_back(std::move(line));
      } else {
        out.decode_cases.push_back(std::move(line));
      }
    }
    return out;
  }();
  return c;
}

std::string ids_to_string(const std::vector<TokenId>& ids) { return json(ids).dump(); }

std::string escaped(const std::string& s) { return json(s).dump(); }

// ---- corpus exactness ---------------------------------------------------------------------------------------

TEST(TokenizerCorpus, FixtureIsLargeAndComplete) {
  const Corpus& c = corpus();
  EXPECT_GE(c.strings.size(), 20000u);
  EXPECT_EQ(c.strings.size(), c.header["strings"].get<size_t>());
  EXPECT_EQ(c.decode_cases.size(), c.header["decode_cases"].get<size_t>());
  EXPECT_EQ(gemma().vocab_size(), c.header["vocab_size"].get<size_t>());
}

TEST(TokenizerCorpus, EncodeIdsMatchHuggingFace) {
  size_t mismatches = 0;
  for (const json& rec : corpus().strings) {
    std::string text = rec["text"];
    std::vector<TokenId> expected = rec["ids"];
    std::vector<TokenId> got = gemma().encode(text);
    if (got != expected && ++mismatches <= 10)
      ADD_FAILURE() << "text " << escaped(text) << "\n  expected " << ids_to_string(expected) << "\n  got      "
                    << ids_to_string(got);
  }
  EXPECT_EQ(mismatches, 0u) << "of " << corpus().strings.size() << " strings";
}

TEST(TokenizerCorpus, AddSpecialTokensMatchesHuggingFace) {
  size_t checked = 0;
  for (const json& rec : corpus().strings) {
    if (!rec.contains("ids_bos")) continue;
    std::vector<TokenId> expected = rec["ids_bos"];
    EXPECT_EQ(gemma().encode(rec["text"].get<std::string>(), /*add_special_tokens=*/true), expected)
        << escaped(rec["text"]);
    ++checked;
  }
  EXPECT_GT(checked, 100u);
}

TEST(TokenizerCorpus, PlainTextModeMatchesTokenizerWithoutAddedTokens) {
  size_t differing = 0, mismatches = 0;
  for (const json& rec : corpus().strings) {
    std::vector<TokenId> expected = rec.contains("plain_ids") ? rec["plain_ids"] : rec["ids"];
    differing += rec.contains("plain_ids");
    std::vector<TokenId> got = gemma().encode(rec["text"].get<std::string>(), false, /*parse_special=*/false);
    if (got != expected && ++mismatches <= 10)
      ADD_FAILURE() << "text " << escaped(rec["text"]) << "\n  expected " << ids_to_string(expected)
                    << "\n  got      " << ids_to_string(got);
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GT(differing, 1000u) << "the corpus should contain plenty of special-token text";
}

TEST(TokenizerCorpus, DecodeMatchesHuggingFace) {
  size_t mismatches = 0;
  for (const json& rec : corpus().strings) {
    std::vector<TokenId> ids = rec["ids"];
    std::string expected = rec.contains("decoded") ? rec["decoded"] : rec["text"];
    std::string expected_skip = rec.contains("decoded_skip") ? rec["decoded_skip"].get<std::string>() : expected;
    std::string got = gemma().decode(ids), got_skip = gemma().decode(ids, /*skip_special=*/true);
    if ((got != expected || got_skip != expected_skip) && ++mismatches <= 10)
      ADD_FAILURE() << "ids " << ids_to_string(ids) << "\n  expected " << escaped(expected) << " / "
                    << escaped(expected_skip) << "\n  got      " << escaped(got) << " / " << escaped(got_skip);
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(TokenizerCorpus, DecodeOfArbitraryIdsMatchesHuggingFace) {
  size_t mismatches = 0, replacement_cases = 0;
  for (const json& rec : corpus().decode_cases) {
    std::vector<TokenId> ids = rec["decode_ids"];
    std::string expected = rec["decoded"], expected_skip = rec["decoded_skip"];
    replacement_cases += expected.find("\xEF\xBF\xBD") != std::string::npos;
    std::string got = gemma().decode(ids), got_skip = gemma().decode(ids, true);
    if ((got != expected || got_skip != expected_skip) && ++mismatches <= 10)
      ADD_FAILURE() << "ids " << ids_to_string(ids) << "\n  expected " << escaped(expected) << " / "
                    << escaped(expected_skip) << "\n  got      " << escaped(got) << " / " << escaped(got_skip);
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GT(replacement_cases, 500u) << "the decode cases should exercise invalid byte runs";
}

TEST(TokenizerCorpus, IncrementalDecoderEqualsFullDecode) {
  for (bool skip : {false, true}) {
    for (const json& rec : corpus().decode_cases) {
      std::vector<TokenId> ids = rec["decode_ids"];
      IncrementalDecoder decoder(gemma(), skip);
      std::string streamed;
      for (TokenId id : ids) streamed += decoder.push(id);
      streamed += decoder.finish();
      ASSERT_EQ(streamed, rec[skip ? "decoded_skip" : "decoded"].get<std::string>()) << ids_to_string(ids);
      EXPECT_FALSE(decoder.has_pending());
    }
  }
}

// ---- documented vectors (shared/reference/tokenizer-and-chat.md §2.3, §4) ----------------------------------

TEST(TokenizerVectors, ReferenceDocumentVectors) {
  const Tokenizer& t = gemma();
  auto enc = [&](const std::string& s) { return t.encode(s); };
  using V = std::vector<TokenId>;
  EXPECT_EQ(enc("a  b"), (V{236746, 138, 236763}));
  EXPECT_EQ(enc("    x = 1"), (V{140, 236781, 578, 236743, 236770}));
  EXPECT_EQ(enc("𓀀"), (V{478, 385, 366, 366}));
  EXPECT_EQ(enc("\r\n"), (V{251, 107}));
  EXPECT_EQ(enc("x" + std::string(40, '\n') + "y"), (V{236781, 137, 115, 236762}));
  EXPECT_EQ(enc(std::string(40, ' ') + "z"), (V{167, 145, 236802}));
  EXPECT_EQ(enc(std::string(40, '\t')), (V{255998, 255976}));
  EXPECT_EQ(enc("Hello,"), (V{9259, 236764}));
  EXPECT_EQ(t.decode(V{478, 385}), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(TokenizerVectors, ChatTemplateGoldens) {
  const Tokenizer& t = gemma();
  using V = std::vector<TokenId>;
  struct Case {
    std::string text;
    V ids;
  };
  const Case cases[] = {
      {"<bos><|turn>user\nWrite a long essay about Portugal.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
       {2, 105, 2364, 107, 6974, 496, 1440, 20494, 1003, 23613, 236761, 106, 107, 105, 4368, 107, 100, 45518, 107,
        101}},
      {"<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nWrite a long essay about Portugal.<turn|>\n<|turn>model\n",
       {2, 105, 9731, 107, 98, 107, 106, 107, 105, 2364, 107, 6974, 496, 1440, 20494, 1003, 23613, 236761, 106, 107,
        105, 4368, 107}},
      {"<bos><|turn>system\nYou are a pirate.<turn|>\n<|turn>user\nHello!<turn|>\n<|turn>model\nArr!<turn|>\n<|turn>"
       "user\nBye<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
       {2,     105, 9731, 107,   3048,   659, 496, 72650, 236761, 106, 107,   105, 2364, 107, 9259, 236888, 106, 107,
        105,   4368, 107,  15581, 236888, 106, 107,   105,    2364, 107, 98874, 106, 107,  105, 4368, 107,    100,
        45518, 107,  101}},
      {"<bos><|turn>user\nweather?<turn|>\n<|turn>model\n<|channel>thought\nI should call the tool\n<channel|>"
       "<|tool_call>call:get_weather{location:<|\"|>Tokyo<|\"|>}<tool_call|><|tool_response>response:get_weather{"
       "value:<|\"|>Sunny<|\"|>}<tool_response|>It is sunny.<turn|>\n",
       {2,      105,    2364,   107,    19323, 236881, 106,    107,    105,    4368,   107,   100,    45518, 107,
        236777, 1374,   2246,   506,    5904,  107,    101,    48,     6639,   236787, 828,   236779, 19323, 236782,
        7125,   236787, 52,     89265,  52,    236783, 49,     50,     6275,   236787, 828,   236779, 19323, 236782,
        2394,   236787, 52,     118538, 52,    236783, 51,     1509,   563,    17635,  236761, 106,  107}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(t.encode(c.text), c.ids) << escaped(c.text);
    EXPECT_EQ(t.decode(c.ids), c.text);
  }
}

TEST(TokenizerVectors, VocabularyAccessors) {
  const Tokenizer& t = gemma();
  EXPECT_EQ(t.vocab_size(), 262144u);
  EXPECT_EQ(t.bos_id(), 2);
  EXPECT_EQ(t.eos_id(), 1);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.token_to_id("<|turn>"), 105);
  EXPECT_EQ(t.token_to_id("<turn|>"), 106);
  EXPECT_EQ(t.token_to_id("▁"), 236743);
  EXPECT_EQ(t.token_to_id("<0x0D>"), 251);
  EXPECT_EQ(t.token_to_id("no such token anywhere"), std::nullopt);
  EXPECT_EQ(t.id_to_token(236743), "▁");
  EXPECT_EQ(t.id_to_token(50), "<|tool_response>");
  EXPECT_TRUE(t.is_special(106));
  EXPECT_TRUE(t.is_special(258884));
  EXPECT_FALSE(t.is_special(4)) << "<mask> is an added token but not special in this tokenizer.json";
  EXPECT_TRUE(t.is_added(4));
  EXPECT_FALSE(t.is_special(236743));
  EXPECT_EQ(t.fallback_byte(238 + 0xE2), 0xE2);
  EXPECT_EQ(t.fallback_byte(236743), -1);
  EXPECT_EQ(t.decoded_text(236743), " ");
  EXPECT_THROW(t.id_to_token(262144), dg::Error);
  EXPECT_THROW(t.id_to_token(-1), dg::Error);
}

TEST(TokenizerVectors, SpecialTokenTextIsInertWhenParsingIsOff) {
  const Tokenizer& t = gemma();
  for (TokenId id = 0; id < TokenId(t.vocab_size()); ++id) {
    if (!t.is_added(id)) continue;
    std::string text = std::string(t.id_to_token(id));
    EXPECT_EQ(t.encode(text), std::vector<TokenId>{id}) << text;
    std::vector<TokenId> plain = t.encode("x" + text + "y", false, /*parse_special=*/false);
    for (TokenId p : plain) EXPECT_FALSE(t.is_added(p)) << text << " produced added token " << p;
    EXPECT_EQ(t.decode(plain), "x" + text + "y");
  }
}

TEST(TokenizerVectors, LeftmostLongestAddedTokenMatch) {
  const Tokenizer& t = gemma();
  using V = std::vector<TokenId>;
  EXPECT_EQ(t.encode("<|tool_call><|tool>"), (V{48, 46}));
  EXPECT_EQ(t.encode("<|tool_response>"), (V{50}));
  EXPECT_EQ(t.encode("<|image|><|image>"), (V{258880, 255999}));
}

TEST(TokenizerVectors, MatchAddedTokenIsLeftmostLongest) {
  const Tokenizer& t = gemma();
  TokenId id = -1;
  std::string text = "x<|tool_call>y";
  EXPECT_EQ(t.match_added_token(text, 0, id), 0u);
  EXPECT_EQ(t.match_added_token(text, 1, id), std::string("<|tool_call>").size());
  EXPECT_EQ(id, 48);
  EXPECT_EQ(t.match_added_token("<|tool>", 0, id), 7u);
  EXPECT_EQ(id, 46);
  EXPECT_EQ(t.match_added_token("<|tur", 0, id), 0u);
  EXPECT_EQ(t.match_added_token("abc", 3, id), 0u);
}

TEST(TokenizerVectors, RejectsInvalidUtf8Input) {
  try {
    gemma().encode("ok \xC3(");
    FAIL() << "expected dg::Error";
  } catch (const dg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("offset 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gemma().encode("\xED\xA0\x80"), dg::Error) << "UTF-8 encoded surrogate";
  EXPECT_THROW(gemma().encode("\xC0\x80"), dg::Error) << "overlong NUL";
}

TEST(TokenizerVectors, DecodeRejectsUnknownIds) {
  std::vector<TokenId> ids = {9259, 262144};
  EXPECT_THROW(gemma().decode(ids), dg::Error);
}

// ---- incremental decoding --------------------------------------------------------------------------------------

TEST(TokenizerIncremental, HoldsBackSplitUtf8UntilTheByteRunEnds) {
  IncrementalDecoder decoder(gemma());
  // "𓀀" (F0 93 80 80) has no token of its own and is spelled with four byte tokens.
  EXPECT_EQ(decoder.push(478), "");
  EXPECT_TRUE(decoder.has_pending());
  EXPECT_EQ(decoder.push(385), "");
  EXPECT_EQ(decoder.push(366), "");
  EXPECT_EQ(decoder.push(366), "");
  EXPECT_EQ(decoder.push(9259), "𓀀Hello");
  EXPECT_FALSE(decoder.has_pending());
  EXPECT_EQ(decoder.push(236743), " ");
  EXPECT_EQ(decoder.finish(), "");
}

TEST(TokenizerIncremental, IncompleteRunAtEndBecomesReplacementCharacters) {
  IncrementalDecoder decoder(gemma());
  std::vector<TokenId> ids = {9259, 478, 385};
  EXPECT_EQ(decoder.push(ids), "Hello");
  EXPECT_EQ(decoder.finish(), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(gemma().decode(ids), "Hello\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(TokenizerIncremental, SkippedSpecialDoesNotSplitAByteRun) {
  std::vector<TokenId> ids = {478, 106, 385, 366, 366};
  IncrementalDecoder skipping(gemma(), /*skip_special=*/true);
  std::string streamed = skipping.push(ids);
  streamed += skipping.finish();
  EXPECT_EQ(streamed, "𓀀");
  EXPECT_EQ(gemma().decode(ids, true), "𓀀");
  IncrementalDecoder keeping(gemma());
  streamed = keeping.push(ids);
  streamed += keeping.finish();
  EXPECT_EQ(streamed, "\xEF\xBF\xBD<turn|>\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(TokenizerIncremental, StreamsCorpusTextExactly) {
  size_t checked = 0;
  for (const json& rec : corpus().strings) {
    if (checked++ % 7) continue;
    std::vector<TokenId> ids = rec["ids"];
    IncrementalDecoder decoder(gemma());
    std::string streamed;
    for (TokenId id : ids) streamed += decoder.push(id);
    streamed += decoder.finish();
    ASSERT_EQ(streamed, gemma().decode(ids)) << escaped(rec["text"]);
  }
}

// ---- loading ---------------------------------------------------------------------------------------------------

TEST(TokenizerLoad, LoadsVendoredXzAndReportsTime) {
  auto start = std::chrono::steady_clock::now();
  Tokenizer t = Tokenizer::from_file(kFixtureDir / "tokenizer.json.xz");
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  // Timing is informational (see bench/bench_tokenizer.cpp); the assertions check the load produced a full vocab.
  std::printf("[ info ] tokenizer.json.xz load: %.0f ms\n", ms);
  EXPECT_EQ(t.vocab_size(), 262144u);
  EXPECT_EQ(t.encode("Hello,"), (std::vector<TokenId>{9259, 236764}));
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("dg_tok_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path write(const std::string& name, const std::string& content) const {
    std::ofstream(path / name, std::ios::binary) << content;
    return path / name;
  }
};

TEST(TokenizerLoad, FromModelDirFindsCompressedTokenizer) {
  TempDir dir;
  fs::copy_file(kFixtureDir / "tokenizer.json.xz", dir.path / "tokenizer.json.xz");
  Tokenizer t = Tokenizer::from_model_dir(dir.path);
  EXPECT_EQ(t.encode("<|turn>user\n"), (std::vector<TokenId>{105, 2364, 107}));
}

TEST(TokenizerLoad, FromModelDirWithoutTokenizerNamesBothFiles) {
  TempDir dir;
  try {
    Tokenizer::from_model_dir(dir.path);
    FAIL() << "expected dg::Error";
  } catch (const dg::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("tokenizer.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tokenizer.json.xz"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir.path.string()), std::string::npos) << msg;
  }
}

// A minimal tokenizer.json of the Gemma shape: 256 byte tokens, a few characters and merges.
json tiny_tokenizer(bool legacy_merges) {
  json vocab = json::object();
  vocab["<pad>"] = 0;
  vocab["<eos>"] = 1;
  vocab["<bos>"] = 2;
  vocab["<unk>"] = 3;
  for (int b = 0; b < 256; ++b) vocab[dg::format("<0x{:02X}>", b)] = 4 + b;
  int next = 260;
  for (const char* s : {"a", "b", "c", "▁", "ab", "abc", "▁a", "bc", "<x>"}) vocab[s] = next++;
  std::vector<std::pair<std::string, std::string>> merges = {{"a", "b"}, {"▁", "a"}, {"b", "c"}, {"ab", "c"}};
  json merge_list = json::array();
  for (auto& [l, r] : merges) merge_list.push_back(legacy_merges ? json(l + " " + r) : json::array({l, r}));
  auto added = [](int id, const char* content, bool special) {
    return json{{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", false},
                {"rstrip", false},  {"normalized", false}, {"special", special}};
  };
  return json{
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({added(0, "<pad>", true), added(1, "<eos>", true), added(2, "<bos>", true),
                                    added(268, "<x>", true)})},
      {"normalizer", {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}},
      {"pre_tokenizer",
       {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "MergedWithPrevious"}, {"invert", false}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<bos>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{"<bos>", {{"id", "<bos>"}, {"ids", {2}}, {"tokens", {"<bos>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                  {{"type", "ByteFallback"}},
                                  {{"type", "Fuse"}}})}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", true}, {"byte_fallback", true}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merge_list}}},
  };
}

TEST(TokenizerLoad, AcceptsBothMergeEncodings) {
  for (bool legacy : {false, true}) {
    Tokenizer t = Tokenizer::from_json(tiny_tokenizer(legacy).dump(), "tiny.json");
    // "ab" (rank 0) wins over "bc" (rank 2); then "ab"+"c" (rank 3). "▁a" (rank 1) merges the space.
    EXPECT_EQ(t.encode("abc a<x>é", true), (std::vector<TokenId>{2, 265, 266, 268, 4 + 0xC3, 4 + 0xA9}))
        << (legacy ? "legacy \"a b\" merges" : "pair merges");
    EXPECT_EQ(t.decode(t.encode("abc a<x>é")), "abc a<x>é");
  }
}

void expect_load_error(const std::string& text, const std::vector<std::string>& fragments) {
  try {
    Tokenizer::from_json(text, "broken.json");
    ADD_FAILURE() << "expected dg::Error for: " << text.substr(0, 200);
  } catch (const dg::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("broken.json"), std::string::npos) << msg;
    for (const std::string& f : fragments)
      EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
  }
}

TEST(TokenizerLoad, MalformedFilesGiveClearErrors) {
  std::string good = tiny_tokenizer(false).dump();
  expect_load_error("", {"unexpected end of file"});
  expect_load_error("not json", {"line 1, column 1"});
  expect_load_error(good.substr(0, good.size() / 2), {"invalid tokenizer JSON"});
  expect_load_error(good + "x", {"trailing data"});
  expect_load_error("{\"version\": \"1.0\"}", {"missing field 'model'"});
  expect_load_error("\xFF\xFE{}", {"not valid UTF-8"});

  auto with = [&](auto&& edit) {
    json j = tiny_tokenizer(false);
    edit(j);
    return j.dump();
  };
  expect_load_error(with([](json& j) { j["model"]["type"] = "Unigram"; }), {"model.type", "Unigram"});
  expect_load_error(with([](json& j) { j["model"].erase("merges"); }), {"model.merges"});
  expect_load_error(with([](json& j) { j["model"]["vocab"]["a"] = -5; }), {"model.vocab['a']", "-5"});
  expect_load_error(with([](json& j) { j["model"]["vocab"]["zz"] = 260; }), {"id 260 is used twice"});
  expect_load_error(with([](json& j) { j["model"]["vocab"]["bad"] = "x"; }), {"expected an integer"});
  expect_load_error(with([](json& j) { j["model"]["merges"].push_back(json::array({"a", "q"})); }),
                    {"model.merges[4]", "'q'", "not in model.vocab"});
  expect_load_error(with([](json& j) { j["model"]["merges"] = json::array({"ab"}); }),
                    {"model.merges[0]", "\"left right\""});
  expect_load_error(with([](json& j) { j["model"]["vocab"].erase("<0x41>"); }), {"<0x41>", "byte"});
  expect_load_error(with([](json& j) { j["model"]["byte_fallback"] = false; }), {"model.byte_fallback"});
  expect_load_error(with([](json& j) { j["added_tokens"][3]["id"] = 260; }), {"added_tokens[3]", "'<x>'", "260"});
  expect_load_error(with([](json& j) { j["added_tokens"][3]["lstrip"] = true; }), {"lstrip"});
  expect_load_error(with([](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }), {"unsupported normalizer"});
  expect_load_error(with([](json& j) { j["decoder"]["decoders"].erase(1); }), {"unsupported decoder"});
  expect_load_error(with([](json& j) { j["truncation"] = {{"max_length", 8}}; }), {"truncation"});
  expect_load_error(with([](json& j) {
                      j["model"]["vocab"].erase("<bos>");
                      j["added_tokens"].erase(2);
                      j["post_processor"] = nullptr;
                    }),
                    {"<bos>"});
}

TEST(TokenizerLoad, CorruptXzGivesClearError) {
  TempDir dir;
  std::ifstream in(kFixtureDir / "tokenizer.json.xz", std::ios::binary);
  std::string head(4096, '\0');
  in.read(head.data(), std::streamsize(head.size()));
  fs::path truncated = dir.write("tokenizer.json.xz", head);
  try {
    Tokenizer::from_file(truncated);
    FAIL() << "expected dg::Error";
  } catch (const dg::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(truncated.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("xz"), std::string::npos) << msg;
  }
  EXPECT_THROW(Tokenizer::from_file(dir.path / "missing.json"), dg::Error);
}

// ---- CLI ---------------------------------------------------------------------------------------------------------

#ifdef DIFFGEMMA_BINARY

std::string tokenizer_arg() {
  return std::string(" --tokenizer '") + (kFixtureDir / "tokenizer.json.xz").string() + "'";
}

TEST(TokenizerCli, TokenizeParsesSpecialTokensLikeHf) {
  // The single-quoted shell argument carries a real newline.
  CommandResult r = run_command(std::string(DIFFGEMMA_BINARY) + " tokenize" + tokenizer_arg() +
                                " --text '<|turn>user\nWrite a long essay about Portugal.<turn|>'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "[105,2364,107,6974,496,1440,20494,1003,23613,236761,106]\n");
}

TEST(TokenizerCli, TokenizeStdinWithSpecialAddsBos) {
  TempDir dir;
  fs::copy_file(kFixtureDir / "tokenizer.json.xz", dir.path / "tokenizer.json.xz");
  CommandResult r = run_command("printf 'Hello,\\n' | " + std::string(DIFFGEMMA_BINARY) + " tokenize -m '" +
                                dir.path.string() + "' --special");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "[2,9259,236764,107]\n");
}

TEST(TokenizerCli, DetokenizeRoundTripsAndSkipsSpecials) {
  CommandResult r = run_command(std::string(DIFFGEMMA_BINARY) + " detokenize" + tokenizer_arg() +
                                " --ids 2,9259,236764,478,385,366,366");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "<bos>Hello,𓀀");
  r = run_command(std::string(DIFFGEMMA_BINARY) + " detokenize" + tokenizer_arg() + " --skip-special --ids 2,9259");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "Hello");
}

TEST(TokenizerCli, DetokenizeRejectsUnknownIds) {
  CommandResult r = run_command(std::string(DIFFGEMMA_BINARY) + " detokenize" + tokenizer_arg() + " --ids 1,999999");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("999999"), std::string::npos) << r.output;
}
#endif

}  // namespace
