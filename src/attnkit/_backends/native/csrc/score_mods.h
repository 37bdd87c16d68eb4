// Score modifiers: what turns a product q . k into a score, per pair, inside the kernel.
//
// The scale, then Gemma 2's soft-capping cap * tanh(x / cap) when `cap` > 0, then ALiBi's
// -slope * |p - j| (FlashAttention's: p the row's key position i + Lk - Lq, bottom-right) when
// `alibi`. The scalar form (exact paths) and the lane form (the row templates, any width) run the
// same operations in the same order, so the backward's recomputed weights match the forward's
// and every path agrees to the bit.

#pragma once

#include <torch/types.h>

#include <cstdint>
#include <cstdlib>

#include "lanes.h"

namespace attnkit_native {
namespace {

// One per (sequence, head).
struct ScoreMods {
  float scale = 1.0f, cap = 0.0f, slope = 0.0f;
  bool alibi = false;
  int64_t offset = 0;  // Lk - Lq: row i sits at key position i + offset

  // Neither soft-capping nor ALiBi: the score is scale * product (the row templates' fast case).
  bool plain() const { return cap <= 0.0f && !alibi; }

  // `cap_grad` (when not null, under soft-capping) receives 1 - t^2, the cap's derivative.
  float apply(float product, int64_t row, int64_t key, float* cap_grad) const {
    float x = product * scale;
    if (cap > 0.0f) {
      const float t = tanh_via_exp(x / cap);
      x = cap * t;
      if (cap_grad) *cap_grad = 1.0f - t * t;
    }
    if (alibi) x -= slope * static_cast<float>(std::llabs(row + offset - key));
    return x;
  }
};

// The call's modifiers for sequence b, head h: `slopes` [S, H] float32 (S = 1 or B) or undefined.
ScoreMods score_mods(double scale, double softcap, const at::Tensor& slopes, int64_t b, int64_t h, int64_t Lq,
                            int64_t Lk) {
  ScoreMods m;
  m.scale = static_cast<float>(scale);
  m.cap = static_cast<float>(softcap);
  m.offset = Lk - Lq;
  if (slopes.defined()) {
    m.alibi = true;
    m.slope = slopes.data_ptr<float>()[(slopes.size(0) == 1 ? 0 : b) * slopes.size(1) + h];
  }
  return m;
}

// ScoreMods::apply for a vector of pairs: rows `rows` and keys `keys` (int32 lanes), the same
// operations in the same order; `cap_grad` receives 1 - t^2.
template <class V, class I>
inline V apply_lanes(const ScoreMods& m, V product, I rows, I keys, V* cap_grad = nullptr) {
  V x = mul(product, splat<V>(m.scale));
  if (m.cap > 0.0f) {
    const V cap = splat<V>(m.cap);
    const V t = tanh_via_exp(div(x, cap));
    x = mul(cap, t);
    if (cap_grad) *cap_grad = sub(splat<V>(1.0f), mul(t, t));
  }
  if (m.alibi) x = sub(x, mul(splat<V>(m.slope), key_distance(rows, m.offset, keys)));
  return x;
}

}  // namespace
}  // namespace attnkit_native
