#include "backend/backend.h"

namespace dg {

uint64_t Backend::kv_fingerprint() const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  const int64_t n = kv_len();
  mix(&n, sizeof n);
  for (int l = 0; l < config().num_layers; ++l) {
    KvSnapshot s = kv_snapshot(l);
    mix(&s.first_pos, sizeof s.first_pos);
    mix(s.k.data(), s.k.size() * sizeof(float));
    mix(s.v.data(), s.v.size() * sizeof(float));
  }
  return h;
}

}  // namespace dg
