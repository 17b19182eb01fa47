#pragma once
// mmap-based safetensors reader. The header is validated before any tensor is exposed: header length inside the
// file, every tensor's byte range inside the data section, dtype x shape == byte length, no two tensors overlapping.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "util/dtype.h"
#include "util/mmap_file.h"

namespace dg {

struct TensorView {
  std::string name;
  std::string file;  // for error messages
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  std::string shape_str() const;  // "[4096, 2816]"
  // Copies the tensor (F32/F16/BF16) into f32.
  std::vector<float> to_f32() const;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws dg::Error naming the file, tensor and problem
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return file_->path(); }

 private:
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All safetensors files of an HF snapshot: model.safetensors, or model.safetensors.index.json + shards.
class Checkpoint {
 public:
  static std::unique_ptr<Checkpoint> open(const std::string& model_dir);

  const TensorView* find(const std::string& name) const;
  // Throws a clear error when the tensor is missing or its shape differs from `shape`.
  const TensorView& require(const std::string& name, const std::vector<int64_t>& shape) const;
  const std::map<std::string, const TensorView*>& all() const { return index_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace dg
