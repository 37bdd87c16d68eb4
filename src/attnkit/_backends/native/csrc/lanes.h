// Lane arithmetic: the operations the kernel's row loops run on one float, on 8 lanes (AVX2
// __m256) and on 16 lanes (AVX-512 __m512), with exp and tanh built from them.
//
// Every form of a function is one definition over overloaded lane operations, so the forms
// compute the same operations in the same order and give the same bits: the AVX-512 build agrees
// with the AVX2 build, and the scalar row tails with the vectors. Lanes8 and Lanes16 are the
// traits the row templates (softmax.h) take: what differs between the ISAs (loads, masks,
// selects) lives here, once, and the loops are written once over them.
//
// No -ffast-math: the compiler must not assume there are no infinities or NaNs (a NaN score must
// reach its row's output, and -inf is how a masked score reads).

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace attnkit_native {
namespace {  // one translation unit (ops.cpp): internal linkage, as when this was one file

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- The lane operations, per form --------------------------------------------------------------

inline float fmadd(float a, float b, float c) { return std::fma(a, b, c); }
inline float fnmadd(float a, float b, float c) { return std::fma(-a, b, c); }
inline float sub(float a, float b) { return a - b; }
inline float mul(float a, float b) { return a * b; }
template <class V> V splat(float x);
template <> inline float splat<float>(float x) { return x; }

// The arithmetic of a vector type, whose intrinsics differ only by their prefix (_mm256, _mm512).
#define ATTNKIT_LANE_ARITHMETIC(V, P)                                              \
  inline V fmadd(V a, V b, V c) { return P##_fmadd_ps(a, b, c); }                  \
  inline V fnmadd(V a, V b, V c) { return P##_fnmadd_ps(a, b, c); }                \
  inline V sub(V a, V b) { return P##_sub_ps(a, b); }                               \
  inline V mul(V a, V b) { return P##_mul_ps(a, b); }                               \
  inline V add(V a, V b) { return P##_add_ps(a, b); }                               \
  inline V div(V a, V b) { return P##_div_ps(a, b); }                               \
  template <>                                                                       \
  inline V splat<V>(float x) {                                                      \
    return P##_set1_ps(x);                                                          \
  }

ATTNKIT_LANE_ARITHMETIC(__m256, _mm256)
// |y|, t with y's sign (t >= 0 or NaN), and |row + offset - key| as floats (tanh and ALiBi)
inline __m256 magnitude(__m256 y) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y); }
inline __m256 with_sign_of(__m256 t, __m256 y) { return _mm256_or_ps(t, _mm256_and_ps(_mm256_set1_ps(-0.0f), y)); }
inline __m256 below(__m256 magnitude, float limit, __m256 if_below, __m256 otherwise) {
  return _mm256_blendv_ps(otherwise, if_below, _mm256_cmp_ps(magnitude, _mm256_set1_ps(limit), _CMP_LT_OQ));
}
inline __m256 key_distance(__m256i rows, int64_t offset, __m256i keys) {
  return _mm256_cvtepi32_ps(
      _mm256_abs_epi32(_mm256_sub_epi32(_mm256_add_epi32(rows, _mm256_set1_epi32(static_cast<int>(offset))), keys)));
}

#if defined(__AVX512F__)
ATTNKIT_LANE_ARITHMETIC(__m512, _mm512)
// AVX512F has no float AND/OR: the integer ones on the same bits
inline __m512 magnitude(__m512 y) {
  return _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(static_cast<int>(0x80000000u)), _mm512_castps_si512(y)));
}
inline __m512 with_sign_of(__m512 t, __m512 y) {
  const __m512i sign = _mm512_and_si512(_mm512_set1_epi32(static_cast<int>(0x80000000u)), _mm512_castps_si512(y));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}
inline __m512 below(__m512 magnitude, float limit, __m512 if_below, __m512 otherwise) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(limit), _CMP_LT_OQ), otherwise, if_below);
}
inline __m512 key_distance(__m512i rows, int64_t offset, __m512i keys) {
  return _mm512_cvtepi32_ps(
      _mm512_abs_epi32(_mm512_sub_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(offset))), keys)));
}
#endif

// ---- exp(x) for x <= 0 --------------------------------------------------------------------------
//
// To about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (n rounded to nearest by adding and
// subtracting 1.5 * 2^23, two instructions where a round is three), r in two steps (Cody and
// Waite), exp(r) = 1 + r q(r) with q of degree 4 (fitted to the relative error of exp: 1.25 eps
// at most in float32 Horner, against 0.6 for the classic degree-6 polynomial that cost three
// instructions more), times 2^n. Below -87 (where expf turns subnormal) and at -inf the result is
// exactly 0; a NaN stays NaN, so a NaN score reaches the row's sum and output instead of passing
// for a weight of 0.
constexpr float kLog2e = 1.44269504088896341f, kRound = 12582912.0f;  // 1.5 * 2^23
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpQ0 = 0.9999997019767761f, kExpQ1 = 0.4999915063381195f, kExpQ2 = 0.1666763573884964f,
                kExpQ3 = 0.04189793020486832f, kExpQ4 = 0.008290314115583897f;

// The steps the three forms share: exp(r) for x = n ln2 + r, and n.
template <class V>
inline V exp_reduced(V x, V& n) {
  n = sub(fmadd(x, splat<V>(kLog2e), splat<V>(kRound)), splat<V>(kRound));
  V r = fnmadd(n, splat<V>(kLn2High), x);
  r = fnmadd(n, splat<V>(kLn2Low), r);
  V p = fmadd(splat<V>(kExpQ4), r, splat<V>(kExpQ3));
  p = fmadd(p, r, splat<V>(kExpQ2));
  p = fmadd(p, r, splat<V>(kExpQ1));
  p = fmadd(p, r, splat<V>(kExpQ0));
  return fmadd(p, r, splat<V>(1.0f));
}

inline float exp_nonpositive(float x) {
  if (!(x >= -87.0f)) return x < -87.0f ? 0.0f : x;  // underflow (and -inf) to 0; NaN stays
  float n;
  const float p = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return p * two_n;
}

inline __m256 exp_nonpositive(__m256 x) {
  const __m256 cut = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, cut, _CMP_LT_OQ);  // false for NaN
  x = _mm256_max_ps(cut, x);  // maxps returns its second operand, x, when x is NaN
  __m256 n;
  const __m256 p = exp_reduced(x, n);
  // p 2^n through the exponent bits (n >= -126: 2^n is normal, the product rounds as scalef's);
  // a NaN lane converts to INT_MIN, whose exponent bits give 2^0: p (NaN) passes unchanged
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

#if defined(__AVX512F__)
// The same steps, lane by lane the same bits, less the clamp at -87: the lanes below it (-inf
// too, whose steps give NaN) are zeroed by the last step's mask anyway.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);  // false for NaN
  __m512 n;
  const __m512 p = exp_reduced(x, n);
  // p 2^n in one instruction (the 8-lane form's product with the exponent bits, the same bits);
  // a NaN p stays NaN
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~underflow), p, n);
}
#endif

// ---- tanh, for soft-capping ---------------------------------------------------------------------
//
// tanh(y) for |y| < kTanhSeriesBelow: its Taylor series to y^11 (the first term left out is below
// 1e-9 of y there), because 1 - exp(-2 |y|) cancels near 0: it cost about eps / |y| of relative
// accuracy, so a cap far above the scores (1e5: error 2e-3; 1e7: 0.17) lost the scores themselves.
// Elsewhere tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|) <= 1 (at 0.25 the
// cancellation costs about 1.3 bits), exact at +-inf (+-1) and NaN (NaN). The scalar and vector
// forms compute the same operations, so the backward's weights match the forward's and both
// builds agree.
constexpr float kTanhSeriesBelow = 0.25f;
constexpr float kTanh3 = -1.0f / 3.0f, kTanh5 = 2.0f / 15.0f, kTanh7 = -17.0f / 315.0f,
                kTanh9 = 62.0f / 2835.0f, kTanh11 = -1382.0f / 155925.0f;

template <class V>
inline V tanh_series(V y) {
  const V y2 = mul(y, y);
  V p = fmadd(splat<V>(kTanh11), y2, splat<V>(kTanh9));
  p = fmadd(p, y2, splat<V>(kTanh7));
  p = fmadd(p, y2, splat<V>(kTanh5));
  p = fmadd(p, y2, splat<V>(kTanh3));
  return fmadd(mul(y, y2), p, y);  // y + y^3 p: the sign (and -0) of y kept
}

inline float tanh_via_exp(float y) {
  if (std::fabs(y) < kTanhSeriesBelow) return tanh_series(y);
  const float e = exp_nonpositive(-2.0f * std::fabs(y));
  return std::copysign((1.0f - e) / (1.0f + e), y);
}

template <class V>
inline V tanh_via_exp(V y) {
  const V one = splat<V>(1.0f);
  const V size = magnitude(y);
  const V e = exp_nonpositive(mul(splat<V>(-2.0f), size));
  return below(size, kTanhSeriesBelow, tanh_series(y), with_sign_of(div(sub(one, e), add(one, e)), y));
}

// ---- Tile shapes given at build time (tests only) -------------------------------------------------

// building.py's ATTNKIT_NATIVE_TILES=KxF compiles register tiles of K keys by F feature vectors in
// place of the lane traits' choice below, so that a test can check every shape gives the same bits.
#ifdef ATTNKIT_TILE_KEYS
constexpr int kTileKeysGiven = ATTNKIT_TILE_KEYS, kTileFeatureVectorsGiven = ATTNKIT_TILE_FEATURE_VECTORS;
#else
constexpr int kTileKeysGiven = 0, kTileFeatureVectorsGiven = 0;
#endif

// ---- Whole rows of floats (the exact paths and the output's normalisation) ----------------------

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s8 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) s8 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s8);
  float s = horizontal_sum(s8);
  for (; d < n; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

// y += a x (IEEE: a = 0 times an infinite x gives NaN).
inline void axpy(float* y, float a, const float* x, int64_t n) {
  const __m256 a8 = _mm256_set1_ps(a);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(a8, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
  for (; d < n; ++d) y[d] = std::fma(a, x[d], y[d]);
}

// Scales x by `factor` in place; true when every x was finite before. The test ORs x - x, which
// is +0 for a finite x and NaN otherwise, so the check adds no dependency chain to the loop.
inline bool scale_and_check(float* x, int64_t n, float factor) {
  const __m256 f8 = _mm256_set1_ps(factor);
  __m256 bad = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    bad = _mm256_or_ps(bad, _mm256_sub_ps(v, v));
    _mm256_storeu_ps(x + d, _mm256_mul_ps(v, f8));
  }
  bool finite = _mm256_testz_si256(_mm256_castps_si256(bad), _mm256_castps_si256(bad)) != 0;
  for (; d < n; ++d) {
    finite = finite && std::isfinite(x[d]);
    x[d] *= factor;
  }
  return finite;
}

// ---- Lane traits: what the row templates need of an ISA -----------------------------------------
//
// F float lanes, I int32 lanes (row and key indices, interval bounds, dropout keys), Mask the lanes
// a condition holds in. Loads and stores are unaligned; what a template computes is written with
// the overloads above (mul, sub, fmadd, exp_nonpositive, ...), these add what has no overload.

struct Lanes8 {
  static constexpr int kWidth = 8;
  using F = __m256;
  using I = __m256i;
  using Mask = __m256;  // all bits set in the lanes that are in

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static I load_int(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F zero() { return _mm256_setzero_ps(); }
  static I int_splat(int64_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I next(I key) { return _mm256_add_epi32(key, _mm256_set1_epi32(1)); }
  // the indices first .. first + 7
  static I iota(int64_t first) {
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  // minps returns its second operand, a NaN, when there is one
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  // the lanes whose row attends `key` (lo <= key < hi)
  static Mask attends(I lo, I hi, I key) {
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lo, key), _mm256_cmpgt_epi32(hi, key)));
  }
  static F select(Mask in, F x, F otherwise) { return _mm256_blendv_ps(otherwise, x, in); }
  static F zero_outside(Mask in, F x) { return _mm256_and_ps(in, x); }
  // `bad` ORed with x - x in the lanes not in `in` (NaN for an infinite or NaN x): a value that a
  // weight of 0 would otherwise hide
  static F check_outside(F bad, Mask in, F x) { return _mm256_or_ps(bad, _mm256_andnot_ps(in, _mm256_sub_ps(x, x))); }
  // x, but 0 in the lanes where `test` is -inf
  static F zero_where_neg_inf(F test, F x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(test, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ), x);
  }
  static F either(F a, F b) { return _mm256_or_ps(a, b); }  // the bits of both
  static bool any_bits(F x) { return _mm256_testz_si256(_mm256_castps_si256(x), _mm256_castps_si256(x)) == 0; }

  // For the register tiles (tiles.h): keys (or features) a tile takes at once, by 2 vectors of
  // rows, and by up to kFeatureVectors vectors of features in the backward's products over rows:
  // 12 accumulators of 16 registers, with the 2 row vectors and a broadcast; a partial last
  // vector's lanes.
  static constexpr int kKeysPerTile = kTileKeysGiven ? kTileKeysGiven : 6;
  static constexpr int kFeatureVectors = kTileFeatureVectorsGiven ? kTileFeatureVectorsGiven : 2;
  // unrolled by 4: with the earlier 2 x 4 tiles the window forward ran 15-30% slower; with these, level
  static constexpr bool kUnrollTiles = false;
  using Tail = __m256i;
  static F broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Tail first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F load_tail(const float* p, Tail lanes) { return _mm256_maskload_ps(p, lanes); }
  static void store_tail(float* p, Tail lanes, F x) { _mm256_maskstore_ps(p, lanes, x); }
};

#if defined(__AVX512F__)
struct Lanes16 {
  static constexpr int kWidth = 16;
  using F = __m512;
  using I = __m512i;
  using Mask = __mmask16;

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static I load_int(const int32_t* p) { return _mm512_loadu_si512(p); }
  static F zero() { return _mm512_setzero_ps(); }
  static I int_splat(int64_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I next(I key) { return _mm512_add_epi32(key, _mm512_set1_epi32(1)); }
  static I iota(int64_t first) {
    return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static Mask attends(I lo, I hi, I key) {
    return static_cast<__mmask16>(~_mm512_cmpgt_epi32_mask(lo, key)) & _mm512_cmpgt_epi32_mask(hi, key);
  }
  static F select(Mask in, F x, F otherwise) { return _mm512_mask_blend_ps(in, otherwise, x); }
  static F zero_outside(Mask in, F x) { return _mm512_maskz_mov_ps(in, x); }
  static F check_outside(F bad, Mask in, F x) {
    const __m512 not_finite = _mm512_maskz_sub_ps(static_cast<__mmask16>(~in), x, x);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(bad), _mm512_castps_si512(not_finite)));
  }
  static F zero_where_neg_inf(F test, F x) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(test, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ)), x);
  }
  static F either(F a, F b) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
  static bool any_bits(F x) { return _mm512_test_epi32_mask(_mm512_castps_si512(x), _mm512_castps_si512(x)) != 0; }

  // 6 keys by 2 vectors of rows in the scores' and values' tiles: 12 accumulators in flight (4 and
  // 8 keys were slower); by up to 4 vectors of features in the backward's products over rows: 24.
  static constexpr int kKeysPerTile = kTileKeysGiven ? kTileKeysGiven : 6;
  static constexpr int kFeatureVectors = kTileFeatureVectorsGiven ? kTileFeatureVectorsGiven : 4;
  static constexpr bool kUnrollTiles = true;  // a quarter of the tiles' loop branches (see tiles.h)
  using Tail = __mmask16;
  static F broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Tail first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static F load_tail(const float* p, Tail lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
  static void store_tail(float* p, Tail lanes, F x) { _mm512_mask_storeu_ps(p, lanes, x); }
};

// The row loops' width in this build: 16 rows at once where it targets AVX-512 (half the
// instructions of 8), else 8.
using RowLanes = Lanes16;
#else
using RowLanes = Lanes8;
#endif

}  // namespace
}  // namespace attnkit_native
