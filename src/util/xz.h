#pragma once
// xz (LZMA2) decompression, so large text assets such as tokenizer.json can be shipped compressed (~5x smaller).
#include <cstdint>
#include <span>
#include <string>

namespace dg {

bool is_xz_data(std::span<const uint8_t> bytes);

// `source` names the data in error messages (usually the file path).
std::string decompress_xz(std::span<const uint8_t> compressed, const std::string& source);

// Reads a whole file, transparently decompressing it when its content starts with the xz magic bytes.
std::string read_file_maybe_xz(const std::string& path);

}  // namespace dg
