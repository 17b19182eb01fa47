#pragma once
// Read-only memory map of a whole file; the mapping lives as long as the object.
#include <cstddef>
#include <cstdint>
#include <string>

namespace dg {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws dg::Error naming the path on failure
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

std::string read_text_file(const std::string& path);  // throws dg::Error naming the path

}  // namespace dg
