#include "util/xz.h"

#include <lzma.h>

#include <algorithm>
#include <cstring>

#include "util/error.h"
#include "util/mmap_file.h"

namespace dg {

namespace {

constexpr uint8_t kXzMagic[6] = {0xFD, '7', 'z', 'X', 'Z', 0x00};

const char* describe_lzma_error(lzma_ret ret) {
  switch (ret) {
    case LZMA_MEM_ERROR: return "out of memory";
    case LZMA_FORMAT_ERROR: return "not in the .xz format";
    case LZMA_OPTIONS_ERROR: return "unsupported compression options";
    case LZMA_DATA_ERROR: return "compressed data is corrupt";
    case LZMA_BUF_ERROR: return "compressed data is truncated";
    case LZMA_UNSUPPORTED_CHECK: return "unsupported integrity check";
    default: return "unexpected liblzma error";
  }
}

}  // namespace

bool is_xz_data(std::span<const uint8_t> bytes) {
  return bytes.size() >= sizeof(kXzMagic) && std::memcmp(bytes.data(), kXzMagic, sizeof(kXzMagic)) == 0;
}

std::string decompress_xz(std::span<const uint8_t> compressed, const std::string& source) {
  lzma_stream stream = LZMA_STREAM_INIT;
  // LZMA_CONCATENATED accepts multi-stream files as produced by `xz` when appending; no memory limit because
  // the inputs are our own assets.
  lzma_ret ret = lzma_stream_decoder(&stream, UINT64_MAX, LZMA_CONCATENATED);
  if (ret != LZMA_OK) fail("{}: cannot start xz decoder: {}", source, describe_lzma_error(ret));

  std::string out;
  // xz text assets typically expand ~5x; a good first guess avoids most regrowth copies.
  out.resize(std::max<size_t>(compressed.size() * 6, 1 << 16));
  stream.next_in = compressed.data();
  stream.avail_in = compressed.size();
  stream.next_out = reinterpret_cast<uint8_t*>(out.data());
  stream.avail_out = out.size();
  lzma_action action = LZMA_RUN;
  for (;;) {
    if (stream.avail_in == 0) action = LZMA_FINISH;
    ret = lzma_code(&stream, action);
    if (ret == LZMA_STREAM_END) break;
    if (ret != LZMA_OK) {
      lzma_end(&stream);
      fail("{}: xz decompression failed after {} input bytes: {} (re-create the file with `xz -k FILE`)", source,
           stream.total_in, describe_lzma_error(ret));
    }
    if (stream.avail_out == 0) {
      size_t used = out.size();
      out.resize(used * 2);
      stream.next_out = reinterpret_cast<uint8_t*>(out.data()) + used;
      stream.avail_out = out.size() - used;
    }
  }
  out.resize(stream.total_out);
  lzma_end(&stream);
  return out;
}

std::string read_file_maybe_xz(const std::string& path) {
  MappedFile file(path);
  std::span<const uint8_t> bytes(file.data(), file.size());
  if (is_xz_data(bytes)) return decompress_xz(bytes, path);
  return std::string(reinterpret_cast<const char*>(file.data()), file.size());
}

}  // namespace dg
