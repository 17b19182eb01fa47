#include <cmath>

#include "backend/backend.h"

namespace dg {

RowStats compute_row_stats(const float* logits, int vocab, float temperature) {
  RowStats s;
  float best = -INFINITY;
  int32_t arg = 0;
  for (int i = 0; i < vocab; ++i) {
    float z = logits[i] / temperature;  // division, as HF's logits / T
    if (z > best) { best = z; arg = i; }
  }
  // Double accumulation: entropy drives the accept rule, whose threshold comparisons should not hinge on f32 order.
  double sum = 0, weighted = 0;
  for (int i = 0; i < vocab; ++i) {
    float d = logits[i] / temperature - best;  // exact in f32: both terms are f32 and d <= 0 is well scaled
    double e = std::exp(d);
    sum += e;
    weighted += e * d;
  }
  s.argmax = arg;
  s.max_z = best;
  s.logsumexp = float(best + std::log(sum));
  // H = log(sum) - E[d]
  s.entropy = float(std::max(0.0, std::log(sum) - weighted / sum));
  return s;
}

}  // namespace dg
