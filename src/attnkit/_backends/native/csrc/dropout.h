// Dropout on the attention weights: a counter-based hash, so nothing is stored between passes.
//
// Whether weight (b, h, i, j) is kept is a hash of the position and the call's seed (like Philox
// in PyTorch's CUDA kernels), so the backward regenerates the forward's pattern without storing
// it, and attnkit's other paths compute the same pattern in tensor ops
// (attnkit/_backends/dropout.py holds the definition; the tests compare the two bit for bit). Per
// query row, three keyed rounds of fmix32 turn (seed, b, h, i) into two 32-bit keys; per key, two
// more rounds give 32 bits, kept when >= p * 2^32. Kept weights are scaled by 1 / (1 - p).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lanes.h"

namespace attnkit_native {
namespace {

struct Dropout {
  bool active = false;
  uint32_t threshold = 0;  // keep when bits >= threshold
  float keep_scale = 1.0f;
  uint32_t seed_low = 0, seed_high = 0;
  // Where this call's query heads, rows and keys sit in the pattern (a piece of a larger call,
  // such as a sequence-parallel shard, draws the pattern of its positions in the whole).
  int64_t head_start = 0, row_start = 0, key_start = 0;
};

struct DropoutRow {
  uint32_t a = 0, c = 0;
};

inline Dropout make_dropout(double p, int64_t seed, int64_t head_start, int64_t row_start, int64_t key_start) {
  Dropout d;
  d.head_start = head_start, d.row_start = row_start, d.key_start = key_start;
  if (p > 0.0) {
    d.active = true;
    d.threshold = static_cast<uint32_t>(std::min(std::floor(p * 4294967296.0), 4294967295.0));
    d.keep_scale = static_cast<float>(1.0 / (1.0 - p));
    d.seed_low = static_cast<uint32_t>(static_cast<uint64_t>(seed));
    d.seed_high = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  }
  return d;
}

// fmix32 (MurmurHash3's finaliser) on one word or on 8 or 16 lanes: one definition of its steps,
// so every form gives the same pattern.
template <int N> inline uint32_t xor_shifted(uint32_t x) { return x ^ (x >> N); }
inline uint32_t times(uint32_t x, uint32_t c) { return x * c; }
template <int N> inline __m256i xor_shifted(__m256i x) { return _mm256_xor_si256(x, _mm256_srli_epi32(x, N)); }
inline __m256i times(__m256i x, uint32_t c) { return _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(c))); }
#if defined(__AVX512F__)
template <int N> inline __m512i xor_shifted(__m512i x) { return _mm512_xor_si512(x, _mm512_srli_epi32(x, N)); }
inline __m512i times(__m512i x, uint32_t c) { return _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(c))); }
#endif

template <class U>
inline U fmix32(U x) {
  x = times(xor_shifted<16>(x), 0x85EBCA6Bu);
  x = times(xor_shifted<13>(x), 0xC2B2AE35u);
  return xor_shifted<16>(x);
}

inline uint32_t mix(uint32_t x, uint32_t v) { return fmix32(x ^ fmix32(v + 0x9E3779B9u)); }

// The two keys of query row i of head h of sequence b.
inline DropoutRow dropout_row(const Dropout& d, int64_t b, int64_t h, int64_t i) {
  const auto chain = [&](uint32_t x) {
    return mix(mix(mix(x, static_cast<uint32_t>(b)), static_cast<uint32_t>(h + d.head_start)),
               static_cast<uint32_t>(i + d.row_start));
  };
  return {chain(d.seed_low), chain(d.seed_high)};
}

// The factor of weight (row, key): 1 / (1 - p) when kept, 0 when dropped.
inline float dropout_factor(const Dropout& d, DropoutRow r, int64_t key) {
  const uint32_t bits = fmix32(fmix32(static_cast<uint32_t>(key + d.key_start) ^ r.a) ^ r.c);
  return bits >= d.threshold ? d.keep_scale : 0.0f;
}

// The factors of a vector of rows (their keys a, c as lanes) for one key: the same integer steps.
inline __m256 dropout_factor_rows(const Dropout& d, __m256i a, __m256i c, int64_t key) {
  __m256i bits = fmix32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(key + d.key_start)), a));
  bits = fmix32(_mm256_xor_si256(bits, c));
  // AVX2 compares signed: flipping both sign bits makes it the unsigned bits < threshold
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i below = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(d.threshold)), sign),
                                           _mm256_xor_si256(bits, sign));
  return _mm256_andnot_ps(_mm256_castsi256_ps(below), _mm256_set1_ps(d.keep_scale));
}

#if defined(__AVX512F__)
inline __m512 dropout_factor_rows(const Dropout& d, __m512i a, __m512i c, int64_t key) {
  __m512i bits = fmix32(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(key + d.key_start)), a));
  bits = fmix32(_mm512_xor_si512(bits, c));
  const __mmask16 kept = _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(static_cast<int>(d.threshold)));
  return _mm512_maskz_mov_ps(kept, _mm512_set1_ps(d.keep_scale));
}
#endif

}  // namespace
}  // namespace attnkit_native
