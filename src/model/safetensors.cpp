#include "model/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "util/error.h"

namespace dg {

using json = nlohmann::json;

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::vector<float> TensorView::to_f32() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  convert_to_f32(dtype, data, out.data(), out.size());
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(std::make_unique<MappedFile>(path)) {
  const uint8_t* base = file_->data();
  const size_t size = file_->size();
  if (size < 8) fail("{}: file is {} bytes, too short for a safetensors header (truncated download?)", path, size);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | base[i];
  constexpr uint64_t kMaxHeader = 100ull << 20;
  if (header_len > size - 8)
    fail("{}: header length {} runs past the end of the file ({} bytes); the file is truncated or not safetensors",
         path, header_len, size);
  if (header_len > kMaxHeader) fail("{}: header length {} exceeds the 100 MiB limit", path, header_len);
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(base + 8), reinterpret_cast<const char*>(base + 8 + header_len));
  } catch (const json::parse_error& e) {
    fail("{}: header is not valid JSON ({})", path, e.what());
  }
  if (!header.is_object()) fail("{}: header must be a JSON object", path);

  const uint8_t* data = base + 8 + header_len;
  const size_t data_size = size - 8 - header_len;
  std::vector<std::pair<size_t, size_t>> ranges;
  std::vector<std::string> range_names;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (entry.is_object())
        for (auto& [k, v] : entry.items())
          if (v.is_string()) metadata_[k] = v.get<std::string>();
      continue;
    }
    auto bad = [&](const std::string& why) { fail("{}: tensor '{}': {}", path, name, why); };
    if (!entry.is_object()) bad("header entry is not an object");
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) bad("missing string field 'dtype'");
    TensorView t;
    t.name = name;
    t.file = path;
    std::string dt = entry["dtype"].get<std::string>();
    if (!parse_safetensors_dtype(dt, t.dtype))
      bad("unsupported dtype '" + dt + "' (expected BF16, F16, F32, I64, I32, U8 or BOOL)");
    if (!entry.contains("shape") || !entry["shape"].is_array()) bad("missing array field 'shape'");
    int64_t numel = 1;
    for (auto& d : entry["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) bad("shape " + entry["shape"].dump() + " has a bad dimension");
      int64_t v = d.get<int64_t>();
      if (v > 0 && numel > (int64_t(1) << 50) / v) bad("shape " + entry["shape"].dump() + " is absurdly large");
      numel *= v;
      t.shape.push_back(v);
    }
    const json& off = entry.contains("data_offsets") ? entry["data_offsets"] : json();
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad("'data_offsets' must be [begin, end] with non-negative integers");
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end) bad(dg::format("data_offsets [{}, {}] are reversed", begin, end));
    if (end > data_size)
      bad(dg::format("data_offsets [{}, {}] run past the data section ({} bytes); the file is truncated", begin, end,
                      data_size));
    uint64_t expect = uint64_t(numel) * dtype_size(t.dtype);
    if (end - begin != expect)
      bad(dg::format("{} x {} needs {} bytes but data_offsets [{}, {}] hold {}", dt, t.shape_str(), expect, begin,
                      end, end - begin));
    t.data = data + begin;
    t.nbytes = size_t(end - begin);
    if (t.nbytes) {
      ranges.emplace_back(size_t(begin), size_t(end));
      range_names.push_back(name);
    }
    tensors_.emplace(name, std::move(t));
  }
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    auto& prev = ranges[order[i - 1]];
    auto& cur = ranges[order[i]];
    if (cur.first < prev.second)
      fail("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap; the header is corrupt", path,
           range_names[order[i - 1]], prev.first, prev.second, range_names[order[i]], cur.first, cur.second);
  }
}

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& model_dir) {
  namespace fs = std::filesystem;
  auto ck = std::unique_ptr<Checkpoint>(new Checkpoint());
  ck->dir_ = model_dir;
  fs::path dir(model_dir);
  if (!fs::is_directory(dir)) fail("{}: not a directory (expected a Hugging Face snapshot of DiffusionGemma)", model_dir);
  std::vector<std::string> shard_files;
  fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    json idx;
    try {
      idx = json::parse(read_text_file(index.string()));
    } catch (const json::parse_error& e) {
      fail("{}: invalid JSON ({})", index.string(), e.what());
    }
    if (!idx.contains("weight_map") || !idx["weight_map"].is_object())
      fail("{}: missing object 'weight_map'", index.string());
    std::set<std::string> files;
    for (auto& [name, file] : idx["weight_map"].items()) {
      if (!file.is_string()) fail("{}: weight_map['{}'] must be a file name", index.string(), name);
      std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        fail("{}: weight_map['{}'] = '{}' must be a plain file name in the snapshot directory", index.string(), name, f);
      files.insert(f);
    }
    for (auto& f : files) shard_files.push_back((dir / f).string());
  } else if (fs::exists(single)) {
    shard_files.push_back(single.string());
  } else {
    fail("{}: neither model.safetensors nor model.safetensors.index.json found", model_dir);
  }
  for (auto& path : shard_files) {
    if (!fs::exists(path)) fail("{}: shard listed in model.safetensors.index.json is missing", path);
    ck->files_.push_back(std::make_unique<SafetensorsFile>(path));
    for (auto& [name, t] : ck->files_.back()->tensors()) {
      auto [it, inserted] = ck->index_.emplace(name, &t);
      if (!inserted) fail("tensor '{}' appears in both {} and {}", name, it->second->file, t.file);
    }
  }
  return ck;
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

const TensorView& Checkpoint::require(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorView* t = find(name);
  if (!t) fail("{}: required tensor '{}' is missing from the checkpoint (is this a DiffusionGemma snapshot?)", dir_, name);
  if (t->shape != shape) {
    TensorView want;
    want.shape = shape;
    fail("{}: tensor '{}' has shape {}, expected {} from config.json", t->file, name, t->shape_str(), want.shape_str());
  }
  if (t->dtype != DType::BF16 && t->dtype != DType::F16 && t->dtype != DType::F32)
    fail("{}: tensor '{}' has dtype {}, expected BF16, F16 or F32", t->file, name, dtype_name(t->dtype));
  return *t;
}

}  // namespace dg
