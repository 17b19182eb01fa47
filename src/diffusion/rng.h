#pragma once
// The seeded random stream of the diffusion loop (seed §2.1). One stream per generation call: canvas init, renoise
// and (in categorical mode) the Gumbel draws all consume it in a fixed order, so a seed pins the whole trajectory and
// tools/reference/make_generation_fixtures.py can replay the identical stream inside HF's generate.
#include <cstdint>

namespace dg::diffusion {

class Rng {
 public:
  static constexpr uint64_t kMul = 6966169279ull;
  static constexpr uint64_t kInc = 1039523323ull;

  // seed+1 so that seed 0 does not start the stream at state 0 (the seed's Rng::new).
  explicit Rng(uint64_t seed) : state_(seed + 1) {}

  // Advance first, then output the high 32 bits: the low bits of a power-of-two-modulus LCG have short periods.
  uint32_t next_u32() {
    state_ = state_ * kMul + kInc;  // mod 2^64 by unsigned wrap-around
    return uint32_t(state_ >> 32);
  }

  // A token id in [0, vocab): floor(u32 * vocab / 2^32) (multiply-shift). One draw per id, never a rejection
  // loop, so the number of draws per canvas is fixed (L) and a python replay stays in lock-step. The bias is at
  // most vocab / 2^32 per id, irrelevant for noise.
  int32_t uniform_token(int32_t vocab) { return int32_t((uint64_t(next_u32()) * uint64_t(uint32_t(vocab))) >> 32); }

  // A uniform in the open interval (0, 1): (u32 + 0.5) / 2^32, never 0 or 1, so -log(-log(u)) is finite.
  double uniform_open01() { return (double(next_u32()) + 0.5) * 0x1p-32; }

  uint64_t state() const { return state_; }

 private:
  uint64_t state_;
};

}  // namespace dg::diffusion
