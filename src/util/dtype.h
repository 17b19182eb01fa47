#pragma once
// Storage dtypes of checkpoint tensors and their conversion to f32 (compute precision on CPU).
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dg {

enum class DType : uint8_t { F32, F16, BF16, I64, I32, U8, Bool };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
// Parses a safetensors dtype string ("BF16", "F32", ...); returns false when unknown.
bool parse_safetensors_dtype(std::string_view s, DType& out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round-to-nearest-even, NaN preserved (as torch does).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Converts n elements of a float-typed tensor (F32/F16/BF16) to f32.
void convert_to_f32(DType t, const void* src, float* dst, size_t n);

}  // namespace dg
