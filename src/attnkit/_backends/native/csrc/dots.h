// The bfloat16 products on AVX512-BF16 dot products, for CPUs that have them but no AMX tiles (AMD
// Zen 4 and 5, Intel Cooper Lake): the five products of amx.h over the same packed layouts, so the
// forward and the backward change only which function multiplies (products.h, which takes them
// only when asked: unmeasured where they could win).
//
// VDPBF16PS adds to each float32 lane the products of two bfloat16 pairs, each product exact in
// float32 and each addition rounded to nearest even, denormals read and written as zero, as the
// tiles' TDPBF16PS does. The layouts put the query rows (or features) in the lanes and a pair of
// the other operand's elements in one 32-bit word, broadcast to every lane:
//   scores  S[t][r] (+)= K[t][2p..2p+1] . Q[r][2p..2p+1]: the key pair read in place, the query
//           rows' pairs from pack_queries ([tile][pair][16 rows]);
//   values  Ot[dv][r] += V^T[dv][2p..2p+1] . P[2p..2p+1][r]: V^T from TransposedRows (blocks of
//           32 keys, [Dv][32]), the weights' pairs from pack_weights;
//   rows    Out[t][c] += W[t][2p..2p+1] . X[2p..2p+1][c]: W's pairs of rows from pack_key_rows (two
//           parts), X's from pack_rows ([feature tile][pair][16 features]).
// Each tile keeps 16 accumulators (zmm0-15) over two vectors of rows (or four of features), as the
// float32 tiles keep 12: enough in flight for the instruction's latency at one or two a cycle.
// Their sums run in another order than the AMX tiles' (which add 16 pairs inside an instruction),
// so the two paths agree to float32 rounding, not bit for bit; each is held to the oracle.
// The functions carry their ISA in a target attribute, like amx.h's.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "tiles.h"

#define ATTNKIT_DOTS __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace attnkit_native {
namespace {

bool dot_products_available() {
  static const bool has = cpu_has_avx512_bf16();
  return has;
}

// The 32-bit word (a pair of bfloat16) at p, broadcast to every lane.
ATTNKIT_DOTS inline __m512i pair_at(const uint16_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(static_cast<int>(word));
}

ATTNKIT_DOTS inline __m512 dot(__m512 sum, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(sum, (__m512bh)a, (__m512bh)b);
}

// S[t][r] for kKeys keys from `k` (rows k2s elements apart) and the 32 rows of b0 and b1 (two
// query tiles of pack_queries' layout), over `pairs` pairs of features.
template <int kKeys>
ATTNKIT_DOTS void dot_scores_tile(const uint16_t* k, int64_t k2s, int64_t pairs, const uint32_t* b0,
                                  const uint32_t* b1, float* s, int64_t rs) {
  __m512 sum[kKeys][2];
  _Pragma("GCC unroll 16") for (int t = 0; t < kKeys; ++t) sum[t][0] = sum[t][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i q0 = _mm512_loadu_si512(b0 + p * kTile), q1 = _mm512_loadu_si512(b1 + p * kTile);
    _Pragma("GCC unroll 16") for (int t = 0; t < kKeys; ++t) {
      const __m512i key = pair_at(k + t * k2s + 2 * p);
      sum[t][0] = dot(sum[t][0], key, q0);
      sum[t][1] = dot(sum[t][1], key, q1);
    }
  }
  _Pragma("GCC unroll 16") for (int t = 0; t < kKeys; ++t) {
    _mm512_storeu_ps(s + t * rs, sum[t][0]);
    _mm512_storeu_ps(s + t * rs + kTile, sum[t][1]);
  }
}

// amx_scores' product: S[t][r] = sum_d K[t][d] Q[r][d] for t < W, r < rs (rs a multiple of 32),
// `queries` from pack_queries. Only the W key rows are read (amx_scores reads whole tiles of keys).
ATTNKIT_DOTS void dot_scores(const uint16_t* k, int64_t k2s, int64_t W, int64_t D, const uint32_t* queries,
                             int64_t rs, float* s) {
  constexpr int kKeys = 8;
  const int64_t pairs = D / 2;
  for (int64_t qt = 0; qt < rs / kTile; qt += 2) {
    const uint32_t* b0 = queries + qt * pairs * kTile;
    const uint32_t* b1 = b0 + pairs * kTile;
    float* out = s + qt * kTile;
    int64_t t = 0;
    for (; t + kKeys <= W; t += kKeys) dot_scores_tile<kKeys>(k + t * k2s, k2s, pairs, b0, b1, out + t * rs, rs);
    partial_tile<kKeys>(W - t, [&](auto n) {
      dot_scores_tile<decltype(n)::value>(k + t * k2s, k2s, pairs, b0, b1, out + t * rs, rs);
    });
  }
}

// Ot[f][r] for kFeatures features over the 32 rows of w0 and w1 (two tiles of pack_weights' layout)
// and `pairs` pairs of keys; with kLow, `low0` and `low1` are the weights' low parts too. The
// accumulators start as `start` says (rescaled by `rescale`'s two vectors). With `odd`, the last
// pair's second key is past the chunk: its value is read as 0, since a weight of 0 times a NaN or
// inf there would reach the row.
// One pair p of keys into dot_values_tile's sums: pair p's column of V^T (block p / 16 of 32 keys,
// word p % 16 of each feature's row), of which `keep` selects what multiplies (all, or the lower
// half: the pair's first key). A function, not a lambda: GCC gives a lambda no target attribute.
template <int kFeatures, bool kLow>
ATTNKIT_DOTS inline __attribute__((always_inline)) void dot_values_pair(
    __m512 (&sum)[kFeatures][2], const uint16_t* vt, int64_t Dv, int64_t p, __m512i keep, const uint32_t* w0,
    const uint32_t* w1, const uint32_t* low0, const uint32_t* low1) {
  const __m512i p0 = _mm512_loadu_si512(w0 + p * kTile), p1 = _mm512_loadu_si512(w1 + p * kTile);
  const uint16_t* column = vt + (p / kTile) * Dv * kTileK + 2 * (p % kTile);
  _Pragma("GCC unroll 16") for (int f = 0; f < kFeatures; ++f) {
    const __m512i v = _mm512_and_si512(pair_at(column + f * kTileK), keep);
    sum[f][0] = dot(sum[f][0], v, p0);
    sum[f][1] = dot(sum[f][1], v, p1);
    if constexpr (kLow) {
      sum[f][0] = dot(sum[f][0], v, _mm512_loadu_si512(low0 + p * kTile));
      sum[f][1] = dot(sum[f][1], v, _mm512_loadu_si512(low1 + p * kTile));
    }
  }
}

template <int kFeatures, bool kLow>
ATTNKIT_DOTS void dot_values_tile(const uint16_t* vt, int64_t Dv, int64_t pairs, bool odd, const uint32_t* w0,
                                  const uint32_t* w1, const uint32_t* low0, const uint32_t* low1, float* ot,
                                  int64_t rs, Start start, const float* rescale) {
  __m512 sum[kFeatures][2];
  const __m512 f0 = _mm512_loadu_ps(rescale), f1 = _mm512_loadu_ps(rescale + kTile);
  _Pragma("GCC unroll 16") for (int f = 0; f < kFeatures; ++f) {
    if (start == Start::kZero) {
      sum[f][0] = sum[f][1] = _mm512_setzero_ps();
    } else {
      sum[f][0] = _mm512_loadu_ps(ot + f * rs), sum[f][1] = _mm512_loadu_ps(ot + f * rs + kTile);
      if (start == Start::kRescale) sum[f][0] = _mm512_mul_ps(sum[f][0], f0), sum[f][1] = _mm512_mul_ps(sum[f][1], f1);
    }
  }
  const int64_t whole = odd ? pairs - 1 : pairs;
  for (int64_t p = 0; p < whole; ++p) {
    dot_values_pair<kFeatures, kLow>(sum, vt, Dv, p, _mm512_set1_epi32(-1), w0, w1, low0, low1);
  }
  if (odd) dot_values_pair<kFeatures, kLow>(sum, vt, Dv, whole, _mm512_set1_epi32(0xFFFF), w0, w1, low0, low1);
  _Pragma("GCC unroll 16") for (int f = 0; f < kFeatures; ++f) {
    _mm512_storeu_ps(ot + f * rs, sum[f][0]);
    _mm512_storeu_ps(ot + f * rs + kTile, sum[f][1]);
  }
}

// amx_values' product: Ot[dv][r] (+)= sum_t V^T[dv][t] P[t][r] over the chunk's W keys, `vt` V^T's
// block of the chunk's first key, `weights` (and `weights_low`) from pack_weights / pack_key_rows,
// start[g] for each group of 32 rows. Keys past W are never read.
ATTNKIT_DOTS void dot_values(const uint16_t* vt, int64_t W, int64_t Dv, const uint32_t* weights, int64_t rs,
                             float* ot, const Start* start, const float* rescale, const uint32_t* weights_low) {
  constexpr int kFeatures = 8;  // Dv is a multiple of 32
  const int64_t stride = round_up(W, kTileK) / 2, pairs = (W + 1) / 2;
  const bool odd = W % 2 != 0;
  for (int64_t g = 0; g < rs / kGroup; ++g) {
    const int64_t at = 2 * g * stride * kTile;
    const uint32_t *w0 = weights + at, *w1 = w0 + stride * kTile;
    for (int64_t f = 0; f < Dv; f += kFeatures) {
      float* out = ot + f * rs + g * kGroup;
      if (weights_low != nullptr) {
        const uint32_t *low0 = weights_low + at, *low1 = low0 + stride * kTile;
        dot_values_tile<kFeatures, true>(vt + f * kTileK, Dv, pairs, odd, w0, w1, low0, low1, out, rs, start[g],
                                         rescale + g * kGroup);
      } else {
        dot_values_tile<kFeatures, false>(vt + f * kTileK, Dv, pairs, odd, w0, w1, nullptr, nullptr, out, rs,
                                          start[g], rescale + g * kGroup);
      }
    }
  }
}

// Out[t][c] += for kKeys keys over kTiles tiles of 16 features: W's two parts `a`, `a_low` ([t][rs]
// bfloat16; `a` alone without kLow) by pairs of rows against X's pairs `b` (pack_rows' layout,
// `pairs` pairs a tile).
template <int kKeys, int kTiles, bool kLow>
ATTNKIT_DOTS void dot_rows_tile(const uint16_t* a, const uint16_t* a_low, int64_t rs, const uint32_t* b,
                                int64_t pairs, float* out, int64_t os) {
  __m512 sum[kKeys][kTiles];
  _Pragma("GCC unroll 16") for (int t = 0; t < kKeys; ++t) {
    _Pragma("GCC unroll 16") for (int f = 0; f < kTiles; ++f) sum[t][f] = _mm512_loadu_ps(out + t * os + f * kTile);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i x[kTiles];
    _Pragma("GCC unroll 16") for (int f = 0; f < kTiles; ++f) x[f] = _mm512_loadu_si512(b + (f * pairs + p) * kTile);
    _Pragma("GCC unroll 16") for (int t = 0; t < kKeys; ++t) {
      const __m512i high = pair_at(a + t * rs + 2 * p);
      _Pragma("GCC unroll 16") for (int f = 0; f < kTiles; ++f) sum[t][f] = dot(sum[t][f], high, x[f]);
      if constexpr (kLow) {
        const __m512i low = pair_at(a_low + t * rs + 2 * p);
        _Pragma("GCC unroll 16") for (int f = 0; f < kTiles; ++f) sum[t][f] = dot(sum[t][f], low, x[f]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int t = 0; t < kKeys; ++t) {
    _Pragma("GCC unroll 16") for (int f = 0; f < kTiles; ++f) _mm512_storeu_ps(out + t * os + f * kTile, sum[t][f]);
  }
}

// amx_rows_product's product: Out[t][c] += sum_r W[t][r] X[r][c] for t < W, c < C (C a multiple of
// 32; out: float32 rows os apart), W as pack_key_rows' two parts (or its high part alone, a_low
// null), X from pack_rows. Rows past W are never read or written.
ATTNKIT_DOTS void dot_rows_product(const uint16_t* a, const uint16_t* a_low, int64_t rs, int64_t W, const uint32_t* b,
                                   int64_t C, float* out, int64_t os) {
  constexpr int kKeys = 4;
  const int64_t pairs = rs / 2;
  for (int64_t ft = 0; ft < C / kTile; ft += 2) {
    // four tiles of features where two more remain (C = 64, 128), else two
    const bool four = ft + 4 <= C / kTile;
    const uint32_t* x = b + ft * pairs * kTile;
    const auto keys = [&](int64_t t, auto n) {
      constexpr int kN = decltype(n)::value;
      const uint16_t* low = a_low ? a_low + t * rs : nullptr;
      float* at = out + t * os + ft * kTile;
      if (four) {
        low ? dot_rows_tile<kN, 4, true>(a + t * rs, low, rs, x, pairs, at, os)
            : dot_rows_tile<kN, 4, false>(a + t * rs, low, rs, x, pairs, at, os);
      } else {
        low ? dot_rows_tile<kN, 2, true>(a + t * rs, low, rs, x, pairs, at, os)
            : dot_rows_tile<kN, 2, false>(a + t * rs, low, rs, x, pairs, at, os);
      }
    };
    int64_t t = 0;
    for (; t + kKeys <= W; t += kKeys) keys(t, std::integral_constant<int, kKeys>{});
    partial_tile<kKeys>(W - t, [&](auto n) { keys(t, n); });
    if (four) ft += 2;
  }
}

}  // namespace
}  // namespace attnkit_native
