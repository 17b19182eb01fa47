// Checkpoint and config loading: both config serializations, defaults, and every malformed-file error path.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>
#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "util/error.h"
#include "util/mmap_file.h"

namespace dg {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Every directory temp_dir makes is removed when the test program ends, so runs leave nothing in /tmp.
std::vector<fs::path>& made_temp_dirs() {
  static std::vector<fs::path> dirs;
  return dirs;
}

class RemoveTempDirs : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    for (const auto& d : made_temp_dirs()) fs::remove_all(d, ec);
  }
};
[[maybe_unused]] const auto* const kRemoveTempDirs = ::testing::AddGlobalTestEnvironment(new RemoveTempDirs);

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("diffgemma_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  made_temp_dirs().push_back(d);
  return d;
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

std::string safetensors_bytes(const json& header, size_t data_bytes, uint64_t header_len_override = 0) {
  std::string h = header.dump();
  uint64_t n = header_len_override ? header_len_override : h.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + h + std::string(data_bytes, '\x01');
}

// Expects loading `bytes` as a safetensors file to fail with a message containing every fragment.
void expect_error(const std::string& bytes, std::vector<std::string> fragments) {
  fs::path d = temp_dir("st");
  fs::path f = d / "model.safetensors";
  write_file(f, bytes);
  try {
    SafetensorsFile sf(f.string());
    FAIL() << "expected an error containing '" << fragments[0] << "'";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(f.string()), std::string::npos) << "message must name the file: " << msg;
    for (auto& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "missing '" << frag << "' in: " << msg;
  }
}

TEST(Safetensors, ValidFileParses) {
  json h = {{"a", {{"dtype", "BF16"}, {"shape", {2, 3}}, {"data_offsets", {0, 12}}}},
            {"b", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {12, 16}}}},
            {"__metadata__", {{"format", "pt"}}}};
  fs::path f = temp_dir("ok") / "model.safetensors";
  write_file(f, safetensors_bytes(h, 16));
  SafetensorsFile sf(f.string());
  ASSERT_EQ(sf.tensors().size(), 2u);
  EXPECT_EQ(sf.tensors().at("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(sf.metadata().at("format"), "pt");
}

TEST(Safetensors, TruncatedFile) { expect_error("abc", {"too short"}); }

TEST(Safetensors, HeaderLengthPastEof) {
  json h = {{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}}};
  expect_error(safetensors_bytes(h, 4, 1u << 20), {"header length", "past the end"});
}

TEST(Safetensors, HeaderNotJson) {
  std::string bytes = safetensors_bytes(json::object(), 0);
  bytes.replace(8, 2, "{x");
  expect_error(bytes, {"not valid JSON"});
}

TEST(Safetensors, BadDtype) {
  json h = {{"w", {{"dtype", "Q7"}, {"shape", {1}}, {"data_offsets", {0, 4}}}}};
  expect_error(safetensors_bytes(h, 4), {"'w'", "unsupported dtype 'Q7'"});
}

TEST(Safetensors, OverlappingOffsets) {
  json h = {{"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
            {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {4, 12}}}}};
  expect_error(safetensors_bytes(h, 12), {"'a'", "'b'", "overlap"});
}

TEST(Safetensors, ShapeDoesNotMatchByteLength) {
  json h = {{"a", {{"dtype", "BF16"}, {"shape", {3, 3}}, {"data_offsets", {0, 16}}}}};
  expect_error(safetensors_bytes(h, 16), {"'a'", "needs 18 bytes"});
}

TEST(Safetensors, OffsetsPastData) {
  json h = {{"a", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}}};
  expect_error(safetensors_bytes(h, 8), {"'a'", "truncated"});
}

TEST(Safetensors, ReversedOffsetsAndBadShape) {
  json h1 = {{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {8, 4}}}}};
  expect_error(safetensors_bytes(h1, 8), {"reversed"});
  json h2 = {{"a", {{"dtype", "F32"}, {"shape", {-1}}, {"data_offsets", {0, 4}}}}};
  expect_error(safetensors_bytes(h2, 4), {"bad dimension"});
  json h3 = {{"a", {{"dtype", "F32"}, {"shape", {1}}}}};
  expect_error(safetensors_bytes(h3, 4), {"data_offsets"});
}

const std::string kFixtures = DIFFGEMMA_FIXTURES_DIR;

// Copies a fixture model dir so a test can damage it.
fs::path copy_fixture(const std::string& name) {
  fs::path d = temp_dir("copy_" + name);
  for (auto f : {"config.json", "generation_config.json", "model.safetensors"})
    fs::copy_file(fs::path(kFixtures) / name / f, d / f);
  return d;
}

TEST(Checkpoint, LoadsFixtureAndMapsEveryLayer) {
  auto m = load_model(kFixtures + "/tiny-a");
  EXPECT_EQ(m->config.layer_pattern(), "SSSSSF");
  EXPECT_EQ(m->weights.layers.size(), 6u);
  EXPECT_EQ(m->weights.layers[5].v_proj, nullptr);  // full layer: no v_proj
  EXPECT_NE(m->weights.layers[0].v_proj, nullptr);
  EXPECT_NE(m->weights.layers[0].encoder_layer_scalar, m->weights.layers[0].decoder_layer_scalar);
}

TEST(Checkpoint, MissingTensorIsNamed) {
  // A config claiming one more layer than the file has.
  fs::path d = copy_fixture("tiny-a");
  json cfg = json::parse(read_text_file((d / "config.json").string()));
  cfg["text_config"]["num_hidden_layers"] = 7;
  cfg["text_config"]["layer_types"].push_back("sliding_attention");
  write_file(d / "config.json", cfg.dump());
  try {
    load_model(d.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.decoder.layers.6.self_attn.q_proj.weight"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, WrongShapeIsNamed) {
  fs::path d = copy_fixture("tiny-a");
  json cfg = json::parse(read_text_file((d / "config.json").string()));
  cfg["text_config"]["intermediate_size"] = 97;
  write_file(d / "config.json", cfg.dump());
  try {
    load_model(d.string());
    FAIL();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("has shape [96, 64], expected [97, 64]"), std::string::npos) << msg;
  }
}

TEST(Checkpoint, TruncatedWeightsFile) {
  fs::path d = copy_fixture("tiny-a");
  fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") / 2);
  EXPECT_THROW(load_model(d.string()), Error);
}

TEST(Checkpoint, BadJsonAndMissingFiles) {
  fs::path d = copy_fixture("tiny-a");
  write_file(d / "config.json", "{\"text_config\": {");
  try {
    load_model(d.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: invalid JSON"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_model((d / "nope").string()), Error);
  fs::remove(d / "model.safetensors");
  write_file(d / "config.json", read_text_file(kFixtures + "/tiny-a/config.json"));
  try {
    load_model(d.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("neither model.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, ShardedIndex) {
  fs::path d = temp_dir("sharded");
  for (auto f : {"config.json", "generation_config.json"}) fs::copy_file(fs::path(kFixtures) / "tiny-a" / f, d / f);
  fs::copy_file(fs::path(kFixtures) / "tiny-a" / "model.safetensors", d / "model-00001-of-00001.safetensors");
  SafetensorsFile src((d / "model-00001-of-00001.safetensors").string());
  json idx = {{"weight_map", json::object()}};
  for (auto& [name, t] : src.tensors()) idx["weight_map"][name] = "model-00001-of-00001.safetensors";
  write_file(d / "model.safetensors.index.json", idx.dump());
  auto m = load_model(d.string());
  EXPECT_EQ(m->weights.layers.size(), 6u);
  idx["weight_map"]["x"] = "../evil.safetensors";
  write_file(d / "model.safetensors.index.json", idx.dump());
  EXPECT_THROW(load_model(d.string()), Error);
}

json full_size_text_config() {
  json layer_types = json::array();
  for (int i = 0; i < 30; ++i) layer_types.push_back(i % 6 == 5 ? "full_attention" : "sliding_attention");
  return {{"vocab_size", 262144}, {"hidden_size", 2816}, {"intermediate_size", 2112},
          {"moe_intermediate_size", 704}, {"num_hidden_layers", 30}, {"num_attention_heads", 16},
          {"num_key_value_heads", 8}, {"head_dim", 256}, {"num_experts", 128}, {"top_k_experts", 8},
          {"sliding_window", 1024}, {"layer_types", layer_types},
          {"rope_parameters", {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                               {"full_attention", {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.25},
                                                   {"rope_theta", 1000000.0}}}}}};
}

TEST(Config, BothSerializationsOfTheFullModelAgreeWithTheBuiltInCopy) {
  json legacy = full_size_text_config();
  legacy["global_head_dim"] = 512;
  legacy["num_global_key_value_heads"] = 2;
  legacy["final_logit_softcapping"] = 30.0;
  json modern = full_size_text_config();
  for (int i : {5, 11, 17, 23, 29}) modern["per_layer_config"][std::to_string(i)] = {{"head_dim", 512}, {"num_key_value_heads", 2}};
  ModelConfig a = parse_model_config_json(json{{"text_config", legacy}, {"canvas_length", 256}}.dump(), "legacy");
  ModelConfig b = parse_model_config_json(json{{"text_config", modern}, {"canvas_length", 256}}.dump(), "modern");
  // and the built-in copy the synthetic benches use
  const ModelConfig d = diffusiongemma_26b_a4b_config();
  for (const ModelConfig* c : std::initializer_list<const ModelConfig*>{&a, &b, &d}) {
    EXPECT_EQ(c->hidden_size, 2816);
    EXPECT_EQ(c->intermediate_size, 2112);
    EXPECT_EQ(c->moe_intermediate_size, 704);
    EXPECT_EQ(c->num_experts, 128);
    EXPECT_EQ(c->top_k_experts, 8);
    EXPECT_EQ(c->sliding_window, 1024);
    EXPECT_EQ(c->canvas_length, 256);
    EXPECT_EQ(c->layers[0].n_kv_heads, 8);
    EXPECT_TRUE(c->layers[0].has_v_proj);
    EXPECT_FLOAT_EQ(c->layers[0].rope.theta, 10000.0f);
    EXPECT_FLOAT_EQ(c->layers[5].rope.theta, 1000000.0f);
    EXPECT_EQ(c->layer_pattern(), "SSSSSFSSSSSFSSSSSFSSSSSFSSSSSF");
    EXPECT_EQ(c->layers[5].head_dim, 512);
    EXPECT_EQ(c->layers[5].n_kv_heads, 2);
    EXPECT_FALSE(c->layers[5].has_v_proj);
    EXPECT_EQ(c->layers[5].rope.rotated_pairs, 64);
    EXPECT_EQ(c->layers[5].rope.exponent_dim, 512.0f);
    EXPECT_EQ(c->layers[0].rope.rotated_pairs, 128);
    EXPECT_EQ(c->layers[0].rope.exponent_dim, 256.0f);
    EXPECT_EQ(c->final_logit_softcapping, 30.0f);  // 5.17 configs omit the key
    // model-reference §2: all model.decoder.* tensors of the 26B-A4B, counted on the meta device.
    EXPECT_EQ(c->parameter_count(), 25250986782LL);
  }
}

TEST(Config, RejectsBadValuesWithFieldNames) {
  auto msg_of = [](json text) {
    try {
      parse_model_config_json(json{{"text_config", text}}.dump(), "cfg.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  json t = full_size_text_config();
  t["hidden_size"] = "big";
  EXPECT_NE(msg_of(t).find("'hidden_size' must be an integer"), std::string::npos);
  t = full_size_text_config();
  t.erase("num_experts");
  EXPECT_NE(msg_of(t).find("missing required field 'num_experts'"), std::string::npos);
  t = full_size_text_config();
  t["layer_types"][3] = "local";
  EXPECT_NE(msg_of(t).find("layer_types[3] = 'local'"), std::string::npos);
  t = full_size_text_config();
  t["top_k_experts"] = 129;
  EXPECT_NE(msg_of(t).find("top_k_experts (129) exceeds"), std::string::npos);
  t = full_size_text_config();
  t["num_key_value_heads"] = 3;
  EXPECT_NE(msg_of(t).find("not a multiple"), std::string::npos);
}

TEST(Config, GenerationConfigDefaultsAndOverrides) {
  GenerationConfig d = parse_generation_config_json("{\"t_min\": null}", "g");
  EXPECT_EQ(d.max_denoising_steps, 48);
  EXPECT_FLOAT_EQ(d.entropy_bound, 0.1f);
  EXPECT_EQ(d.eos_token_ids, (std::vector<int>{1, 106, 50}));
  GenerationConfig g = parse_generation_config_json(
      R"({"max_denoising_steps": 12, "sampler_config": {"entropy_bound": 0.3}, "eos_token_id": [1, 106]})", "g");
  EXPECT_EQ(g.max_denoising_steps, 12);
  EXPECT_FLOAT_EQ(g.entropy_bound, 0.3f);
  EXPECT_EQ(g.eos_token_ids, (std::vector<int>{1, 106}));
  EXPECT_THROW(parse_generation_config_json(R"({"max_denoising_steps": "x"})", "g"), Error);
}

}  // namespace
}  // namespace dg
