// Which units multiply a half-precision call's products: the AMX tiles (amx.h; float16 as two
// bfloat16 parts), the AVX512-BF16 dot products (dots.h; bfloat16 only), or neither (the
// float32-convert path, half.h, which shapes off the packed layouts take). Both units read the same packed layouts,
// so the forward and the backward call the three products below and only these choose.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "amx.h"
#include "dots.h"

namespace attnkit_native {
namespace {

enum class HalfProducts : int64_t { kConvert = 0, kDots = 1, kTiles = 2 };

// The units bfloat16 calls ask for, each where the CPU has them, else the float32-convert path
// (attnkit_native::use_half_products). The tiles by default; the dot products only when asked: on
// the one CPU measured (a Xeon with AMX, tiles turned off) they took 1.5-1.8x the convert path's
// time forward and 2.2-2.8x backward, as VDPBF16PS ran at half the float32 FMA's flops there
// (docs/performance.md, "AVX512-BF16's dot products"); no CPU whose dot product outruns its FMA
// (AMD Zen 4 and 5, by their instruction tables) was at hand to measure.
std::atomic<int64_t> half_products_asked{static_cast<int64_t>(HalfProducts::kTiles)};

// Sets the units bfloat16 calls ask for (0 convert, 1 dot products, 2 tiles); returns the previous.
int64_t use_half_products(int64_t units) {
  TORCH_CHECK(units >= 0 && units <= 2, "use_half_products: units must be 0, 1 or 2, got ", units);
  return half_products_asked.exchange(units);
}

// The units this call's half-precision products run on. bfloat16: bf16_layouts_fit's conditions,
// then the units asked for where the CPU has them. float16: the tiles, as two bfloat16 parts per
// value (amx.h), where they are asked for and granted and float16_layouts_fit holds (a call that
// meets a NaN or inf runs again converted: run_on_units below); the dot products would take
// three products where the float32 FMA takes one at twice their rate. Else converted.
HalfProducts half_products(at::ScalarType type, int64_t D, int64_t Dv, int64_t Lk, int64_t q_row_stride,
                           int64_t k_row_stride, int64_t v_row_stride) {
  const auto asked = static_cast<HalfProducts>(half_products_asked.load(std::memory_order_relaxed));
  if (float16_layouts_fit(type, D, Dv, Lk, k_row_stride, v_row_stride)) {
    return asked == HalfProducts::kTiles && matrix_units_available() ? HalfProducts::kTiles : HalfProducts::kConvert;
  }
  if (!bf16_layouts_fit(type, D, Dv, Lk, q_row_stride, k_row_stride, v_row_stride)) return HalfProducts::kConvert;
  if (asked == HalfProducts::kTiles && matrix_units_available()) return HalfProducts::kTiles;
  if (asked == HalfProducts::kDots && dot_products_available()) return HalfProducts::kDots;
  return HalfProducts::kConvert;
}

// The units a backward's products run on: the forward's, where dO's rows move by pairs too.
HalfProducts backward_half_products(at::ScalarType type, int64_t D, int64_t Dv, int64_t Lk, int64_t q_row_stride,
                                    int64_t k_row_stride, int64_t v_row_stride, int64_t go_row_stride) {
  if (go_row_stride % 2 != 0) return HalfProducts::kConvert;
  return half_products(type, D, Dv, Lk, q_row_stride, k_row_stride, v_row_stride);
}

// attnkit_native::backward_packs: whether interval_backward over these [B, heads, L, C] tensors runs
// its bfloat16 products on the packed layouts (ops.py picks the backward's tile table by it).
bool backward_packs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& grad_out) {
  return backward_half_products(query.scalar_type(), query.size(-1), value.size(-1), key.size(-2), query.stride(-2),
                                key.stride(-2), value.stride(-2), grad_out.stride(-2)) != HalfProducts::kConvert;
}

// The keys a chunk of the kernel takes: `asked` (the tile table's), or on the packed layouts at
// least kAmxChunk, in whole blocks of kTileK keys (K^T's and V^T's blocks).
inline int64_t chunk_keys(HalfProducts units, int64_t asked) {
  return units == HalfProducts::kConvert ? asked : round_up(std::max(asked, kAmxChunk), kTileK);
}

// Whether a call's float16 splits met a NaN or inf (amx.h's split_float16_lanes notes one per
// thread): each thread calls begin() before its work, claims work only while !stopped(), and calls
// note() after each piece of it; met() afterwards.
class SplitWatch {
 public:
  void begin() const { split_met_nonfinite = false; }
  bool stopped() const { return met_.load(std::memory_order_relaxed); }
  void note() {
    if (split_met_nonfinite) met_.store(true, std::memory_order_relaxed);
  }
  bool met() const { return met_.load(); }

 private:
  std::atomic<bool> met_{false};
};

// Runs a call, `run(units, watch)`, on `units`. float16 on the tiles meets a NaN or inf only as it
// splits the rows it reads (they do not split: inf - inf): the threads then stop claiming work and
// the call runs again converted, every output row written again (a scan of the inputs before each
// call took 2-3% of a window forward).
template <class Run>
void run_on_units(HalfProducts units, Run run) {
  for (;; units = HalfProducts::kConvert) {
    SplitWatch watch;
    run(units, watch);
    if (units == HalfProducts::kConvert || !watch.met()) return;
  }
}

// S[t][r] = sum_d K[t][d] Q[r][d] (amx_scores, dot_scores).
void scores_product(HalfProducts units, const uint16_t* k, int64_t k2s, int64_t W, int64_t readable, int64_t D,
                    const uint32_t* queries, int64_t rs, float* s, uint16_t* spare) {
  if (units == HalfProducts::kTiles) {
    amx_scores(k, k2s, W, readable, D, queries, rs, s, spare);
  } else {
    dot_scores(k, k2s, W, D, queries, rs, s);
  }
}

// Ot[dv][r] (+)= sum_t V^T[dv][t] P[t][r] (amx_values, dot_values).
void values_product(HalfProducts units, const uint16_t* vt, int64_t W, int64_t Dv, const uint32_t* weights,
                    int64_t rs, float* ot, const Start* start, const float* rescale, uint16_t* spare,
                    const uint32_t* weights_low = nullptr, const uint16_t* vt_low = nullptr) {
  if (units == HalfProducts::kTiles) {
    amx_values(vt, W, Dv, weights, rs, ot, start, rescale, spare, weights_low, vt_low);
  } else {
    TORCH_CHECK(vt_low == nullptr, "values_product: V^T in two parts runs on the tiles only");
    dot_values(vt, W, Dv, weights, rs, ot, start, rescale, weights_low);
  }
}

// Out[t][c] += sum_r W[t][r] X[r][c] (amx_rows_product, dot_rows_product).
void rows_product(HalfProducts units, const uint16_t* a, const uint16_t* a_low, int64_t rs, int64_t W,
                  const uint32_t* b, int64_t C, float* out, int64_t os, float* spare,
                  const uint32_t* b_low = nullptr) {
  if (units == HalfProducts::kTiles) {
    amx_rows_product(a, a_low, rs, W, b, C, out, os, spare, b_low);
  } else {
    TORCH_CHECK(b_low == nullptr, "rows_product: X in two parts runs on the tiles only");
    dot_rows_product(a, a_low, rs, W, b, C, out, os);
  }
}

}  // namespace
}  // namespace attnkit_native
