// attnkit's own CPU kernel: attention where each query row attends one interval of keys.
//
// Every structured mask in attnkit.masks gives each query row i one interval [lo[i], hi[i]) of
// keys (causal, sliding window, documents, prefix-LM, padding and their intersections). This
// kernel cuts the rows into blocks; a block computes scores only over the span of its rows'
// intervals, masks each row to its own interval while taking the softmax (no mask tensor), and
// multiplies by the values, with a flash-style running softmax over chunks of keys. The forward's
// two products are register-tiled here (see "The forward's products"); the backward recomputes
// the scores with the same tiles, and its four other products run on register tiles too (see
// "The backward's products over rows"): no BLAS. Compared with PyTorch's fused CPU
// kernel on the same blocks it avoids the kernel's fixed 512-key chunks (a 512 window's 543-key
// span would run as 512 + 31), the additive mask pass, and partial outputs merged in Python.
//
// Layout: query [B, H, Lq, D], key [B, Hkv, Lk, D], value [B, Hkv, Lk, Dv], float32, any strides
// with a unit last-dim stride; lo, hi int64 [S, Lq] with S = 1 (shared) or B. H % Hkv == 0 (GQA:
// query head h reads key/value head h / (H / Hkv)). Returns output [B, H, Lq, Dv] (laid out as the
// query: see like_layout) and the natural-log sum-exp [B, H, Lq] (before dropout); a row with no
// key gives zeros and -inf.
// Optional dropout on the weights, from a seed (see Dropout). interval_backward (further down)
// gives the gradients from the same intervals, seed and the saved lse.
//
// Built by attnkit/_backends/native/building.py with -O3 -mavx2 -mfma (and -mavx512f on a CPU with
// AVX-512); the row loops use AVX2 or AVX-512 intrinsics (no -ffast-math, which would let the
// compiler assume there are no infinities).

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/mman.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (n rounded to nearest by
// adding and subtracting 1.5 * 2^23, two instructions where a round is three), r in two steps
// (Cody and Waite), exp(r) = 1 + r q(r) with q of degree 4 (fitted to the relative error of exp:
// 1.25 eps at most in float32 Horner, against 0.6 for the classic degree-6 polynomial that cost
// three instructions more), times 2^n. Below -87 (where expf turns subnormal) and at -inf the
// result is exactly 0; a NaN stays NaN, so a NaN score reaches the row's sum and output instead of
// passing for a weight of 0. The same steps on 8 lanes, 16 lanes and one float (row tails), so the
// same bits.
constexpr float kLog2e = 1.44269504088896341f, kRound = 12582912.0f;  // 1.5 * 2^23
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpQ0 = 0.9999997019767761f, kExpQ1 = 0.4999915063381195f, kExpQ2 = 0.1666763573884964f,
                kExpQ3 = 0.04189793020486832f, kExpQ4 = 0.008290314115583897f;

// The steps the three forms share (one definition, so the same bits): exp(r) for x = n ln2 + r,
// and n.
inline float fmadd(float a, float b, float c) { return std::fma(a, b, c); }
inline float fnmadd(float a, float b, float c) { return std::fma(-a, b, c); }
inline float sub(float a, float b) { return a - b; }
inline float mul(float a, float b) { return a * b; }
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
inline __m256 sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
template <class V> V splat(float x);
template <> inline float splat<float>(float x) { return x; }
template <> inline __m256 splat<__m256>(float x) { return _mm256_set1_ps(x); }
#if defined(__AVX512F__)
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
inline __m512 sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
template <> inline __m512 splat<__m512>(float x) { return _mm512_set1_ps(x); }
#endif

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

inline float exp_nonpositive(float x) {
  if (!(x >= -87.0f)) return x < -87.0f ? 0.0f : x;  // underflow (and -inf) to 0; NaN stays
  float n;
  const float p = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return p * two_n;
}

// tanh(y) for |y| < kTanhSeriesBelow: its Taylor series to y^11 (the first term left out is below
// 1e-9 of y there), because 1 - exp(-2 |y|) cancels near 0: it cost about eps / |y| of relative
// accuracy, so a cap far above the scores (1e5: error 2e-3; 1e7: 0.17) lost the scores themselves.
// Elsewhere tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|) <= 1 (at 0.25 the cancellation
// costs about 1.3 bits), exact at +-inf (+-1) and NaN (NaN). The scalar and vector forms compute
// the same operations, so the backward's weights match the forward's and both builds agree.
constexpr float kTanhSeriesBelow = 0.25f;
constexpr float kTanh3 = -1.0f / 3.0f, kTanh5 = 2.0f / 15.0f, kTanh7 = -17.0f / 315.0f,
                kTanh9 = 62.0f / 2835.0f, kTanh11 = -1382.0f / 155925.0f;

template <class V>
inline V tanh_series(V y);  // below, once every lane form of mul is declared

inline float tanh_via_exp(float y) {
  if (std::fabs(y) < kTanhSeriesBelow) return tanh_series(y);
  const float e = exp_nonpositive(-2.0f * std::fabs(y));
  return std::copysign((1.0f - e) / (1.0f + e), y);
}

// The lane operations the 8- and 16-lane forms of tanh_via_exp and ScoreMods::apply share (one
// definition of each form's steps, so the same bits): |y|, t with y's sign (t >= 0 or NaN), and
// |row + offset - key| as floats.
inline __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 div(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
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
inline __m512 exp_nonpositive(__m512 x);  // further down, with the other 16-lane forms
inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 div(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
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

template <class V>
inline V tanh_series(V y) {
  const V y2 = mul(y, y);
  V p = fmadd(splat<V>(kTanh11), y2, splat<V>(kTanh9));
  p = fmadd(p, y2, splat<V>(kTanh7));
  p = fmadd(p, y2, splat<V>(kTanh5));
  p = fmadd(p, y2, splat<V>(kTanh3));
  return fmadd(mul(y, y2), p, y);  // y + y^3 p: the sign (and -0) of y kept
}

template <class V>
inline V tanh_via_exp(V y) {
  const V one = splat<V>(1.0f);
  const V size = magnitude(y);
  const V e = exp_nonpositive(mul(splat<V>(-2.0f), size));
  return below(size, kTanhSeriesBelow, tanh_series(y), with_sign_of(div(sub(one, e), add(one, e)), y));
}

// What turns a product q . k into a score: the scale, then Gemma 2's soft-capping
// cap * tanh(x / cap) when `cap` > 0, then ALiBi's -slope * |p - j| (FlashAttention's: p the
// row's key position i + Lk - Lq, bottom-right) when `alibi`. One per (sequence, head).
struct ScoreMods {
  float scale = 1.0f, cap = 0.0f, slope = 0.0f;
  bool alibi = false;
  int64_t offset = 0;  // Lk - Lq: row i sits at key position i + offset

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

// ScoreMods::apply for 8 or 16 pairs at once: rows `rows` and keys `keys` (int32 lanes), the same
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


inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Dropout on the attention weights. Whether weight (b, h, i, j) is kept is a hash of the position
// and the call's seed (counter-based, like Philox in PyTorch's CUDA kernels), so the backward
// regenerates the forward's pattern without storing it, and attnkit's other paths compute the same
// pattern in tensor ops (attnkit/_backends/dropout.py holds the definition; the tests compare the
// two bit for bit). Per query row, three keyed rounds of fmix32 turn (seed, b, h, i) into two
// 32-bit keys; per key, two more rounds give 32 bits, kept when >= p * 2^32. Kept weights are scaled
// by 1 / (1 - p).
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

inline bool any_bits(__m256 x) { return _mm256_testz_si256(_mm256_castps_si256(x), _mm256_castps_si256(x)) == 0; }

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
  bool finite = !any_bits(bad);
  for (; d < n; ++d) {
    finite = finite && std::isfinite(x[d]);
    x[d] *= factor;
  }
  return finite;
}

// One query row by its attended pairs only, for rows where the block's products met a non-finite
// value: scores s_t = scale q . k_t for t in [lo, hi), weights exp(s_t - max) / sum, output
// sum_t w_t f_t v_t in IEEE arithmetic (a weight of 0 times an infinite value is NaN), lse. A NaN
// or +inf score makes the row NaN; all scores -inf (or none) make it zeros with lse -inf. `s` is
// scratch for the row's scores.
void exact_forward_row(const float* q_row, const float* k_head, int64_t k2s, const float* v_head, int64_t v2s,
                       int64_t D, int64_t Dv, int64_t lo, int64_t hi, const ScoreMods& mods, int64_t row,
                       const Dropout& dropout, DropoutRow dropout_keys, std::vector<float>& s, float* out,
                       float* lse) {
  float row_max = kNegInf;
  bool nan_row = false;
  if (static_cast<int64_t>(s.size()) < hi - lo) s.resize(hi - lo);
  for (int64_t t = lo; t < hi; ++t) {
    const float x = mods.apply(dot(q_row, k_head + t * k2s, D), row, t, nullptr);
    s[t - lo] = x;
    nan_row = nan_row || std::isnan(x) || x == std::numeric_limits<float>::infinity();
    row_max = std::max(row_max, x);
  }
  if (nan_row) {
    std::fill(out, out + Dv, std::numeric_limits<float>::quiet_NaN());
    *lse = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  std::fill(out, out + Dv, 0.0f);
  if (row_max == kNegInf) {
    *lse = kNegInf;
    return;
  }
  float sum = 0.0f;
  for (int64_t t = lo; t < hi; ++t) {
    const float e = exp_nonpositive(s[t - lo] - row_max);
    sum += e;
    axpy(out, dropout.active ? e * dropout_factor(dropout, dropout_keys, t) : e, v_head + t * v2s, Dv);
  }
  const float inverse = 1.0f / sum;
  for (int64_t d = 0; d < Dv; ++d) out[d] *= inverse;
  *lse = row_max + std::log(sum);
}

// Where transparent huge pages can be asked for without stalls: not where the kernel compacts
// memory synchronously to find them for advised regions (transparent_hugepage/defrag "always",
// "madvise" or "defer+madvise"): after a large free (SDPA's dense-mask call, 1.3 GiB) the next
// window call stalled in that compaction, 111 ms against 86 unadvised (L = 16384, 2 threads),
// where the advice gained ~4% (81-83 ms against 85) on an unfragmented machine.
bool huge_pages_without_stalls() {
  std::FILE* file = std::fopen("/sys/kernel/mm/transparent_hugepage/defrag", "r");
  if (file == nullptr) return false;
  char line[128] = {0};
  const bool read = std::fgets(line, sizeof line, file) != nullptr;
  std::fclose(file);
  return read && (std::strstr(line, "[defer]") != nullptr || std::strstr(line, "[never]") != nullptr);
}

// ---- Output memory kept for the next call ---------------------------------------------------------
//
// glibc maps every allocation of 32 MiB or more afresh and unmaps it when it is freed, so such an
// output (a [1, 8, 16384, 64] float32 output or gradient is exactly 32 MiB) faults in each of its
// 4 KiB pages on first touch: 7.4 ms per 32 MiB with 2 threads writing, where the window forward
// at L = 16384 takes ~80 ms. The kernel's outputs and gradients of that size come from this
// allocator instead, which keeps the mappings of freed ones (the most recently freed first, at
// most kKeptBytes in all) and hands one out again to a request of the same size: the next call,
// or the next training step's output and gradients, writes to pages already there (window
// forward 82-84 -> 75-77 ms, training step 317-319 -> 282-289 ms). attnkit.kernel.release_memory()
// unmaps what is kept. A fresh mapping gets the huge-page advice where that cannot stall.
// (MADV_FREE on the kept mappings, to let the system reclaim them, cost half the gain.)
class KeptMappings final : public c10::Allocator {
 public:
  static constexpr size_t kFromBytes = size_t{32} << 20, kKeptBytes = size_t{256} << 20;

  static KeptMappings& instance() {
    static KeptMappings* const pool = [] {
      auto* created = new KeptMappings;  // never destroyed: tensors may outlive statics
      // A fork while another thread holds the lock (freeing a tensor) would leave it held forever
      // in the child (a DataLoader worker): hold it across fork, release it on both sides.
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
      return created;
    }();
    return *pool;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kFromBytes) return c10::GetCPUAllocator()->allocate(n);
    const size_t page = 4096, bytes = (n + page - 1) / page * page;
    void* data = take(bytes);
    if (data == nullptr) data = fresh(bytes);
    return {data, new Mapping{data, bytes}, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Unmaps every kept mapping; returns the bytes released.
  int64_t release() {
    std::deque<Mapping> kept;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept.swap(kept_);
      kept_bytes_ = 0;
    }
    int64_t bytes = 0;
    for (const Mapping& m : kept) munmap(m.data, m.bytes), bytes += static_cast<int64_t>(m.bytes);
    return bytes;
  }

 private:
  struct Mapping {
    void* data;
    size_t bytes;
  };

  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes == bytes) {
        void* data = it->data;
        kept_bytes_ -= bytes;
        kept_.erase(it);
        return data;
      }
    }
    return nullptr;
  }

  static void* fresh(size_t bytes) {
    void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK_WITH(OutOfMemoryError, data != MAP_FAILED, "attnkit native kernel: cannot map ", bytes,
                     " bytes for an output");
#ifdef MADV_HUGEPAGE
    static const bool advise = huge_pages_without_stalls();
    if (advise) madvise(data, bytes, MADV_HUGEPAGE);  // advice: failure is harmless
#endif
    return data;
  }

  static void give_back(void* context) {
    const Mapping m = *static_cast<Mapping*>(context);
    delete static_cast<Mapping*>(context);
    std::deque<Mapping> evicted;
    if (m.bytes <= kKeptBytes) {
      KeptMappings& pool = instance();
      std::lock_guard<std::mutex> lock(pool.mutex_);
      pool.kept_.push_front(m);
      pool.kept_bytes_ += m.bytes;
      while (pool.kept_bytes_ > kKeptBytes) {
        evicted.push_back(pool.kept_.back());
        pool.kept_bytes_ -= pool.kept_.back().bytes;
        pool.kept_.pop_back();
      }
    } else {
      evicted.push_back(m);
    }
    for (const Mapping& e : evicted) munmap(e.data, e.bytes);  // outside the lock
  }

  std::mutex mutex_;
  std::deque<Mapping> kept_;  // most recently freed first
  size_t kept_bytes_ = 0;
};

int64_t release_kept_memory() { return KeptMappings::instance().release(); }

// A fresh [B, heads, L, C] tensor (C the last dim), with its rows outer to its heads where `like`
// has them so ([B, L, H, D] in memory, as a model's projections viewed as heads give): then the
// caller's view back to [B, L, H * C] needs no copy, as with SDPA's outputs and gradients.
at::Tensor like_layout(const at::Tensor& like, int64_t B, int64_t heads, int64_t L, int64_t C) {
  const bool rows_outer = like.size(1) > 1 && like.size(2) > 1 && like.stride(1) < like.stride(2);
  const auto empty = [](std::initializer_list<int64_t> sizes) {
    return at::Tensor(at::detail::empty_generic(sizes, &KeptMappings::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                at::kFloat, std::nullopt));
  };
  return rows_outer ? empty({B, L, heads, C}).transpose(1, 2) : empty({B, heads, L, C});
}

// Zero `rows` rows of `width` floats, `stride` apart (a block of an output laid out by like_layout).
void zero_rows(float* first, int64_t rows, int64_t stride, int64_t width) {
  for (int64_t j = 0; j < rows; ++j) std::fill(first + j * stride, first + j * stride + width, 0.0f);
}

// The sizes of a call, from inputs checked alike for both directions: query [B, H, Lq, D], key
// [B, Hkv, Lk, D], value [B, Hkv, Lk, Dv], float32 CPU with a unit last-dim stride; lo, hi int64
// [1 or B, Lq] (returned contiguous).
struct Sizes {
  int64_t B, H, Lq, D, Hkv, Lk, Dv;
};

Sizes check_inputs(const char* op, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& lo_rows, const at::Tensor& hi_rows, at::Tensor& lo, at::Tensor& hi) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, op, ": 4-D inputs");
  for (const at::Tensor* t : {&query, &key, &value}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(3) == 1, op,
                ": float32 CPU inputs with a unit stride along the head dimension");
  }
  const Sizes n{query.size(0), query.size(1), query.size(2), query.size(3), key.size(1), key.size(2), value.size(3)};
  TORCH_CHECK(key.size(0) == n.B && value.size(0) == n.B && value.size(1) == n.Hkv && value.size(2) == n.Lk &&
                  key.size(3) == n.D && n.Hkv > 0 && n.H % n.Hkv == 0, op, ": mismatched shapes");
  lo = lo_rows.contiguous();
  hi = hi_rows.contiguous();
  TORCH_CHECK(lo.scalar_type() == at::kLong && hi.scalar_type() == at::kLong && lo.dim() == 2 &&
                  lo.sizes() == hi.sizes() && lo.size(1) == n.Lq && (lo.size(0) == 1 || lo.size(0) == n.B),
              op, ": lo, hi must be int64 [1 or B, Lq]");
  return n;
}

// ALiBi slopes as float32 [1 or B, H] (contiguous), or undefined when there are none.
at::Tensor checked_slopes(const char* op, const std::optional<at::Tensor>& slopes, int64_t B, int64_t H, double softcap) {
  TORCH_CHECK(softcap >= 0.0, op, ": softcap must be >= 0 (0: none)");
  if (!slopes.has_value() || !slopes->defined()) return {};
  TORCH_CHECK(slopes->scalar_type() == at::kFloat && slopes->device().is_cpu() && slopes->dim() == 2 &&
                  (slopes->size(0) == 1 || slopes->size(0) == B) && slopes->size(1) == H,
              op, ": alibi_slopes must be float32 CPU [1 or B, H]");
  return slopes->contiguous();
}

// The intervals of a block's `rows` rows clipped to the keys [0, Lk) into row_lo, row_hi (a row
// whose lse is -inf, when `lse` is given, gets none: it has no weights, and takes no part in the
// gradients); returns the span [first, last) of the non-empty ones, empty (first >= last) when
// there are none.
std::pair<int64_t, int64_t> block_span(const int64_t* lo, const int64_t* hi, int64_t rows, int64_t Lk,
                                       const float* lse, int64_t* row_lo, int64_t* row_hi) {
  int64_t first = Lk, last = 0;
  for (int64_t j = 0; j < rows; ++j) {
    row_lo[j] = std::max<int64_t>(lo[j], 0);
    row_hi[j] = std::min<int64_t>(hi[j], Lk);
    if (lse != nullptr && lse[j] == kNegInf) row_hi[j] = row_lo[j];
    if (row_lo[j] < row_hi[j]) {
      first = std::min(first, row_lo[j]);
      last = std::max(last, row_hi[j]);
    }
  }
  return {first, last};
}

// ---- The forward's products, register-tiled (no BLAS) --------------------------------------------
//
// A block's rows are padded to groups of 32 (4 vectors of 8 rows) and everything it computes is
// laid out key-major (or feature-major) with the rows as the vector dimension: scores S[t][r],
// the scaled queries Qt[d][r], the output accumulator Ot[dv][r], each row of length `rs` (the
// padded row count). Both products then broadcast one element of K or V, which are read in place
// (rows of D or Dv floats), against 4 row vectors: S[t][.] += K[t][d] Qt[d][.] and
// Ot[dv][.] += V[t][dv] P[t][.]. Nothing is packed per call (MKL's sgemm spent a fifth of its time
// copying the key span of every block), the softmax runs on whole vectors of rows (no horizontal
// max, masks by integer compares), and the running rescale is applied as the accumulators load.

constexpr int64_t kGroup = 32;  // rows per register tile: 4 vectors of 8

// The asm makes GCC keep the four row vectors in registers: folded into each FMA as a memory
// operand (its choice otherwise) they are loaded once per key, 10 loads per 8 FMA instead of 6,
// and the loop becomes load-bound.
#define ATTNKIT_IN_REGISTERS(a, b, c, d) asm("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d))

// s[0][.] = sum_d k0[d] qt[d][.], s[ss][.] = sum_d k1[d] qt[d][.] over 32 rows (qt row stride rs).
inline void scores_tile2(const float* k0, const float* k1, int64_t D, const float* qt, int64_t rs, float* s,
                         int64_t ss) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t d = 0; d < D; ++d) {
    const float* row = qt + d * rs;
    __m256 q0 = _mm256_loadu_ps(row), q1 = _mm256_loadu_ps(row + 8), q2 = _mm256_loadu_ps(row + 16),
           q3 = _mm256_loadu_ps(row + 24);
    ATTNKIT_IN_REGISTERS(q0, q1, q2, q3);
    const __m256 x = _mm256_broadcast_ss(k0 + d), y = _mm256_broadcast_ss(k1 + d);
    a0 = _mm256_fmadd_ps(x, q0, a0), a1 = _mm256_fmadd_ps(x, q1, a1);
    a2 = _mm256_fmadd_ps(x, q2, a2), a3 = _mm256_fmadd_ps(x, q3, a3);
    b0 = _mm256_fmadd_ps(y, q0, b0), b1 = _mm256_fmadd_ps(y, q1, b1);
    b2 = _mm256_fmadd_ps(y, q2, b2), b3 = _mm256_fmadd_ps(y, q3, b3);
  }
  _mm256_storeu_ps(s, a0), _mm256_storeu_ps(s + 8, a1), _mm256_storeu_ps(s + 16, a2), _mm256_storeu_ps(s + 24, a3);
  s += ss;
  _mm256_storeu_ps(s, b0), _mm256_storeu_ps(s + 8, b1), _mm256_storeu_ps(s + 16, b2), _mm256_storeu_ps(s + 24, b3);
}

inline void scores_tile1(const float* k0, int64_t D, const float* qt, int64_t rs, float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; ++d) {
    const float* row = qt + d * rs;
    const __m256 x = _mm256_broadcast_ss(k0 + d);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row), a0), a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 8), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 16), a2), a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 24), a3);
  }
  _mm256_storeu_ps(s, a0), _mm256_storeu_ps(s + 8, a1), _mm256_storeu_ps(s + 16, a2), _mm256_storeu_ps(s + 24, a3);
}

#if defined(__AVX512F__)
// ---- The same products in 512-bit vectors, where the build targets AVX-512 ----------------------
//
// On a CPU with AVX-512 the 256-bit tiles above reach half its FMA rate (measured: the forward at
// 36-39% of a same-run matmul that MKL runs in 512-bit vectors). Here a group's 32 rows are 2
// vectors of 16 and N = 6 keys (or features) go at once, 12 accumulators in flight (4 and 8 were
// slower). Every row's sum still runs over d (or t) in the same order, from the same start, with
// one FMA per term: the results are the same bits as the 256-bit tiles'.

#define ATTNKIT_IN_REGISTERS2(a, b) asm("" : "+v"(a), "+v"(b))

// Both products: a[i][.] += sum_j src[i * item + j * step] rows[j][.] for i < N over 32 rows (row
// stride rs), j = 0 .. count - 1 in order. The loops over i here and in the tiles are unrolled by
// pragma: GCC then keeps a[N][2] in registers (left to itself it passed the accumulators through
// the stack at every tile's start and end: 72 spills in the library). (The callers' switches over
// N stay written out: one dispatch through a generic lambda ran the scores 5-10% slower at D = 16
// and 32.)
template <int N>
__attribute__((always_inline)) inline void accumulate16(__m512 (&a)[N][2], const float* src, int64_t item, int64_t step, int64_t count,
                         const float* rows, int64_t rs) {
  // unrolled: a quarter of the loop's branches (documents forward, one thread, 620-629 -> 609-614
  // ms; window 157-160 -> 154-156; the same FMAs in the same order)
#pragma GCC unroll 4
  for (int64_t j = 0; j < count; ++j) {
    const float* row = rows + j * rs;
    __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16);
    ATTNKIT_IN_REGISTERS2(r0, r1);
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
      const __m512 x = _mm512_set1_ps(src[i * item + j * step]);
      a[i][0] = _mm512_fmadd_ps(x, r0, a[i][0]), a[i][1] = _mm512_fmadd_ps(x, r1, a[i][1]);
    }
  }
}

// s[i * ss][.] = sum_d k[i * k2s + d] qt[d][.] for i < N, over 32 rows.
template <int N>
__attribute__((always_inline)) inline void scores_tile16(const float* k, int64_t k2s, int64_t D, const float* qt, int64_t rs, float* s, int64_t ss) {
  __m512 a[N][2];
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  accumulate16<N>(a, k, k2s, 1, D, qt, rs);
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) _mm512_storeu_ps(s + i * ss, a[i][0]), _mm512_storeu_ps(s + i * ss + 16, a[i][1]);
}

// S[t][r] = sum_d K[t][d] Qt[d][r] for the W keys from k (row stride k2s), all `rs` rows.
void block_scores(const float* k, int64_t k2s, int64_t W, int64_t D, const float* qt, int64_t rs, float* s) {
  for (int64_t g = 0; g < rs; g += kGroup) {
    int64_t t = 0;
    for (; t + 6 <= W; t += 6) scores_tile16<6>(k + t * k2s, k2s, D, qt + g, rs, s + t * rs + g, rs);
    const float* kt = k + t * k2s;
    float* st = s + t * rs + g;
    switch (W - t) {
      case 5: scores_tile16<5>(kt, k2s, D, qt + g, rs, st, rs); break;
      case 4: scores_tile16<4>(kt, k2s, D, qt + g, rs, st, rs); break;
      case 3: scores_tile16<3>(kt, k2s, D, qt + g, rs, st, rs); break;
      case 2: scores_tile16<2>(kt, k2s, D, qt + g, rs, st, rs); break;
      case 1: scores_tile16<1>(kt, k2s, D, qt + g, rs, st, rs); break;
      default: break;
    }
  }
}
#else
// S[t][r] = sum_d K[t][d] Qt[d][r] for the W keys from k (row stride k2s), all `rs` rows.
void block_scores(const float* k, int64_t k2s, int64_t W, int64_t D, const float* qt, int64_t rs, float* s) {
  for (int64_t g = 0; g < rs; g += kGroup) {
    int64_t t = 0;
    for (; t + 2 <= W; t += 2) scores_tile2(k + t * k2s, k + (t + 1) * k2s, D, qt + g, rs, s + t * rs + g, rs);
    if (t < W) scores_tile1(k + t * k2s, D, qt + g, rs, s + t * rs + g);
  }
}
#endif

// How the output accumulators start a chunk: zero, as they are, or rescaled row by row.
enum class Start { kZero, kKeep, kRescale };

inline void load_accumulators(const float* ot, Start start, const __m256* rescale, __m256& a0, __m256& a1,
                              __m256& a2, __m256& a3) {
  if (start == Start::kZero) {
    a0 = a1 = a2 = a3 = _mm256_setzero_ps();
    return;
  }
  a0 = _mm256_loadu_ps(ot), a1 = _mm256_loadu_ps(ot + 8), a2 = _mm256_loadu_ps(ot + 16), a3 = _mm256_loadu_ps(ot + 24);
  if (start == Start::kRescale) {
    a0 = _mm256_mul_ps(a0, rescale[0]), a1 = _mm256_mul_ps(a1, rescale[1]);
    a2 = _mm256_mul_ps(a2, rescale[2]), a3 = _mm256_mul_ps(a3, rescale[3]);
  }
}

// ot[0][.] and ot[rs][.] (two features, v and v + 1) (+)= sum_t V[t][.] P[t][.] over 32 rows.
inline void values_tile2(const float* v, int64_t v2s, int64_t W, const float* p, int64_t rs, float* ot, Start start,
                         const __m256* rescale) {
  __m256 a0, a1, a2, a3, b0, b1, b2, b3;
  load_accumulators(ot, start, rescale, a0, a1, a2, a3);
  load_accumulators(ot + rs, start, rescale, b0, b1, b2, b3);
  for (int64_t t = 0; t < W; ++t) {
    const float* row = p + t * rs;
    __m256 p0 = _mm256_loadu_ps(row), p1 = _mm256_loadu_ps(row + 8), p2 = _mm256_loadu_ps(row + 16),
           p3 = _mm256_loadu_ps(row + 24);
    ATTNKIT_IN_REGISTERS(p0, p1, p2, p3);
    const __m256 x = _mm256_broadcast_ss(v + t * v2s), y = _mm256_broadcast_ss(v + t * v2s + 1);
    a0 = _mm256_fmadd_ps(x, p0, a0), a1 = _mm256_fmadd_ps(x, p1, a1);
    a2 = _mm256_fmadd_ps(x, p2, a2), a3 = _mm256_fmadd_ps(x, p3, a3);
    b0 = _mm256_fmadd_ps(y, p0, b0), b1 = _mm256_fmadd_ps(y, p1, b1);
    b2 = _mm256_fmadd_ps(y, p2, b2), b3 = _mm256_fmadd_ps(y, p3, b3);
  }
  _mm256_storeu_ps(ot, a0), _mm256_storeu_ps(ot + 8, a1), _mm256_storeu_ps(ot + 16, a2), _mm256_storeu_ps(ot + 24, a3);
  ot += rs;
  _mm256_storeu_ps(ot, b0), _mm256_storeu_ps(ot + 8, b1), _mm256_storeu_ps(ot + 16, b2), _mm256_storeu_ps(ot + 24, b3);
}

inline void values_tile1(const float* v, int64_t v2s, int64_t W, const float* p, int64_t rs, float* ot, Start start,
                         const __m256* rescale) {
  __m256 a0, a1, a2, a3;
  load_accumulators(ot, start, rescale, a0, a1, a2, a3);
  for (int64_t t = 0; t < W; ++t) {
    const float* row = p + t * rs;
    const __m256 x = _mm256_broadcast_ss(v + t * v2s);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row), a0), a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 8), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 16), a2), a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 24), a3);
  }
  _mm256_storeu_ps(ot, a0), _mm256_storeu_ps(ot + 8, a1), _mm256_storeu_ps(ot + 16, a2), _mm256_storeu_ps(ot + 24, a3);
}

#if defined(__AVX512F__)
inline __m512 join(__m256 low, __m256 high) {  // AVX512F alone (insertf32x8 would need DQ)
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1));
}

// ot[i * rs][.] (features v + i, i < N) (+)= sum_t V[t][.] P[t][.] over 32 rows.
template <int N>
inline void values_tile16(const float* v, int64_t v2s, int64_t W, const float* p, int64_t rs, float* ot, Start start,
                          const __m256* rescale) {
  __m512 a[N][2];
  if (start == Start::kZero) {
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  } else {
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) a[i][0] = _mm512_loadu_ps(ot + i * rs), a[i][1] = _mm512_loadu_ps(ot + i * rs + 16);
    if (start == Start::kRescale) {
      const __m512 r0 = join(rescale[0], rescale[1]), r1 = join(rescale[2], rescale[3]);
      _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) a[i][0] = _mm512_mul_ps(a[i][0], r0), a[i][1] = _mm512_mul_ps(a[i][1], r1);
    }
  }
  accumulate16<N>(a, v, 1, v2s, W, p, rs);
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) _mm512_storeu_ps(ot + i * rs, a[i][0]), _mm512_storeu_ps(ot + i * rs + 16, a[i][1]);
}

// Ot[dv][r] (+)= sum_t V[t][dv] P[t][r] for the W keys from v (row stride v2s), all `rs` rows;
// `start[g]` and `rescale + 4 g` say how group g's accumulators begin.
void block_values(const float* v, int64_t v2s, int64_t W, int64_t Dv, const float* p, int64_t rs, float* ot,
                  const Start* start, const __m256* rescale) {
  for (int64_t g = 0; g < rs; g += kGroup) {
    const Start s = start[g / kGroup];
    const __m256* r = rescale + g / kGroup * 4;
    int64_t d = 0;
    for (; d + 6 <= Dv; d += 6) values_tile16<6>(v + d, v2s, W, p + g, rs, ot + d * rs + g, s, r);
    float* od = ot + d * rs + g;
    switch (Dv - d) {
      case 5: values_tile16<5>(v + d, v2s, W, p + g, rs, od, s, r); break;
      case 4: values_tile16<4>(v + d, v2s, W, p + g, rs, od, s, r); break;
      case 3: values_tile16<3>(v + d, v2s, W, p + g, rs, od, s, r); break;
      case 2: values_tile16<2>(v + d, v2s, W, p + g, rs, od, s, r); break;
      case 1: values_tile16<1>(v + d, v2s, W, p + g, rs, od, s, r); break;
      default: break;
    }
  }
}
#else
// Ot[dv][r] (+)= sum_t V[t][dv] P[t][r] for the W keys from v (row stride v2s), all `rs` rows;
// `start[g]` and `rescale + 4 g` say how group g's accumulators begin.
void block_values(const float* v, int64_t v2s, int64_t W, int64_t Dv, const float* p, int64_t rs, float* ot,
                  const Start* start, const __m256* rescale) {
  for (int64_t g = 0; g < rs; g += kGroup) {
    const Start s = start[g / kGroup];
    const __m256* r = rescale + g / kGroup * 4;
    int64_t d = 0;
    for (; d + 2 <= Dv; d += 2) values_tile2(v + d, v2s, W, p + g, rs, ot + d * rs + g, s, r);
    if (d < Dv) values_tile1(v + d, v2s, W, p + g, rs, ot + d * rs + g, s, r);
  }
}
#endif

// dst[c][r] = src[r][c] for r < rows, c < cols (src row stride ss, dst row stride ds),
// by 8 x 8 tiles in registers where whole, element by element at the edges.
void transpose(const float* src, int64_t ss, int64_t rows, int64_t cols, float* dst, int64_t ds) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) {
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      __m256 x[8];
      for (int i = 0; i < 8; ++i) x[i] = _mm256_loadu_ps(src + (r + i) * ss + c);
      const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
      const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
      const __m256 t4 = _mm256_unpacklo_ps(x[4], x[5]), t5 = _mm256_unpackhi_ps(x[4], x[5]);
      const __m256 t6 = _mm256_unpacklo_ps(x[6], x[7]), t7 = _mm256_unpackhi_ps(x[6], x[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 y[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                           _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                           _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                           _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (c + i) * ds + r, y[i]);
    }
    for (; c < cols; ++c) {
      for (int64_t i = r; i < r + 8; ++i) dst[c * ds + i] = src[i * ss + c];
    }
  }
  for (; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ds + r] = src[r * ss + c];
  }
}

// A vector of 8 rows' values, value(i) for lane i (int32 or float lanes).
template <class Value>
inline __m256i int_lanes(Value value) {
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = static_cast<int32_t>(value(i));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}

template <class Value>
inline __m256 float_lanes(Value value) {
  alignas(32) float lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = value(i);
  return _mm256_load_ps(lanes);
}

// The row indices first .. first + 7 as lanes.
inline __m256i row_lanes(int64_t first) {
  return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The lanes whose row attends `key` (lo <= key < hi), 8 rows as lanes.
inline __m256i attends8(__m256i lo, __m256i hi, __m256i key) {
  return _mm256_andnot_si256(_mm256_cmpgt_epi32(lo, key), _mm256_cmpgt_epi32(hi, key));
}

// `bad` ORed with x - x in the lanes not in `in` (NaN for an infinite or NaN x): a value that a
// weight of 0 would otherwise hide.
inline __m256 check_outside8(__m256 bad, __m256 in, __m256 x) {
  return _mm256_or_ps(bad, _mm256_andnot_ps(in, _mm256_sub_ps(x, x)));
}

// The dropout factors of 8 rows (their keys a, c as lanes) for one key.
inline __m256 dropout_factor_rows(const Dropout& d, __m256i a, __m256i c, int64_t key) {
  __m256i bits = fmix32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(key + d.key_start)), a));
  bits = fmix32(_mm256_xor_si256(bits, c));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i below = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(d.threshold)), sign),
                                           _mm256_xor_si256(bits, sign));
  return _mm256_andnot_ps(_mm256_castsi256_ps(below), _mm256_set1_ps(d.keep_scale));
}

// The keys [a, z) of a chunk of W keys from key0 that all of a vector's rows attend: [all_lo,
// all_hi) clipped to the chunk (most keys of a block: no mask and nothing to check there).
inline std::pair<int64_t, int64_t> attended_by_all(int64_t all_lo, int64_t all_hi, int64_t key0, int64_t W) {
  const int64_t a = std::clamp<int64_t>(all_lo - key0, 0, W);
  return {a, std::clamp<int64_t>(all_hi - key0, a, W)};
}

// The running softmax of 8 rows (one vector) over a chunk of W keys from key0, in place in
// S[t][.] (row stride rs): the products q . k become scores by `mods` (the scale after the product,
// as the definition orders them: scaling q first would overflow where the score does not; `rows`
// the lanes' row indices), scores outside each row's [lo, hi) become -inf, then the weights
// exp(s - max) (times the dropout factors; the sum is taken before). Keys [all_lo, all_hi)
// (chunk-relative) are attended by all 8 rows and need no mask (most keys of a block: all but
// the two triangles at a window's or a diagonal's ends). Folds the chunk into the rows' running
// max and sum and returns the factor that rescales their accumulators. Lanes whose max is still
// -inf shift by 0 (all weights 0, no exp(-inf + inf)); a NaN or +inf score makes the sum NaN,
// which becomes a NaN row.
inline __m256 softmax_rows(float* s, int64_t rs, int64_t W, int64_t key0, __m256i lo, __m256i hi, int64_t all_lo,
                           int64_t all_hi, const ScoreMods& mods, __m256i rows, __m256& row_max, __m256& row_sum,
                           const Dropout& dropout, __m256i drop_a, __m256i drop_c) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf), scale = _mm256_set1_ps(mods.scale);
  const bool plain = mods.cap <= 0.0f && !mods.alibi;
  const auto score = [&](int64_t t) {
    const __m256 product = _mm256_loadu_ps(s + t * rs);
    return plain ? _mm256_mul_ps(product, scale)
                 : apply_lanes(mods, product, rows, _mm256_set1_epi32(static_cast<int>(key0 + t)));
  };
  __m256 chunk_max = row_max;
  const auto masked = [&](int64_t from, int64_t to) {
    __m256i key = _mm256_set1_epi32(static_cast<int>(key0 + from));
    for (int64_t t = from; t < to; ++t, key = _mm256_add_epi32(key, _mm256_set1_epi32(1))) {
      const __m256i in = attends8(lo, hi, key);
      const __m256 x = _mm256_blendv_ps(neg_inf, score(t), _mm256_castsi256_ps(in));
      _mm256_storeu_ps(s + t * rs, x);
      chunk_max = _mm256_max_ps(chunk_max, x);
    }
  };
  const auto [a, z] = attended_by_all(all_lo, all_hi, key0, W);
  masked(0, a);
  for (int64_t t = a; t < z; ++t) {
    const __m256 x = score(t);
    _mm256_storeu_ps(s + t * rs, x);
    chunk_max = _mm256_max_ps(chunk_max, x);
  }
  masked(z, W);
  const __m256 shift = _mm256_andnot_ps(_mm256_cmp_ps(chunk_max, neg_inf, _CMP_EQ_OQ), chunk_max);
  const __m256 rescale =
      _mm256_andnot_ps(_mm256_cmp_ps(row_max, neg_inf, _CMP_EQ_OQ), exp_nonpositive(_mm256_sub_ps(row_max, shift)));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < W; ++t) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t * rs), shift));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + t * rs, dropout.active ? _mm256_mul_ps(e, dropout_factor_rows(dropout, drop_a, drop_c, key0 + t)) : e);
  }
  row_sum = _mm256_fmadd_ps(row_sum, rescale, sum);
  row_max = chunk_max;
  return rescale;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same steps, lane by lane the same bits, less the clamp at -87:
// the lanes below it (-inf too, whose steps give NaN) are zeroed by the last step's mask anyway.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);  // false for NaN
  __m512 n;
  const __m512 p = exp_reduced(x, n);
  // p 2^n in one instruction (the 8-lane form's product with the exponent bits, the same bits);
  // a NaN p stays NaN
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~underflow), p, n);
}

inline __m256 low_half(__m512 x) { return _mm512_castps512_ps256(x); }
inline __m256 high_half(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }
inline __m512i join(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// attends8 and check_outside8 on 16 lanes (AVX512F has no float OR: integer one).
inline __mmask16 attends16(__m512i lo, __m512i hi, __m512i key) {
  return static_cast<__mmask16>(~_mm512_cmpgt_epi32_mask(lo, key)) & _mm512_cmpgt_epi32_mask(hi, key);
}

inline __m512 check_outside16(__m512 bad, __mmask16 in, __m512 x) {
  const __m512 not_finite = _mm512_maskz_sub_ps(static_cast<__mmask16>(~in), x, x);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(bad), _mm512_castps_si512(not_finite)));
}

// dropout_factor_rows on 16 lanes: the same integer steps, so the same pattern.
inline __m512 dropout_factor_rows(const Dropout& d, __m512i a, __m512i c, int64_t key) {
  __m512i bits = fmix32(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(key + d.key_start)), a));
  bits = fmix32(_mm512_xor_si512(bits, c));
  const __mmask16 kept = _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(static_cast<int>(d.threshold)));
  return _mm512_maskz_mov_ps(kept, _mm512_set1_ps(d.keep_scale));
}

// The row indices first .. first + 15 as lanes.
inline __m512i row_lanes16(int64_t first) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// A chunk of W keys from key0 for 16 rows, in key order: masked(t, in) on each key that some of
// the rows do not attend (`in`: the rows that do), plain(from, to) on the keys all 16 attend.
template <class Masked, class Plain>
inline void split_keys16(int64_t W, int64_t key0, __m512i lo, __m512i hi, int64_t all_lo, int64_t all_hi,
                         Masked masked, Plain plain) {
  const auto [a, z] = attended_by_all(all_lo, all_hi, key0, W);
  const auto each_masked = [&](int64_t from, int64_t to) {
    __m512i key = _mm512_set1_epi32(static_cast<int>(key0 + from));
    for (int64_t t = from; t < to; ++t, key = _mm512_add_epi32(key, _mm512_set1_epi32(1))) {
      masked(t, attends16(lo, hi, key));
    }
  };
  each_masked(0, a);
  plain(a, z);
  each_masked(z, W);
}

// softmax_rows on 16 rows (two of its vectors, a then b; `rows` their indices): plain scores or
// modified by `mods` (`Plain`), with dropout or not (`Dropped`; `dropout` and the rows' keys a, c):
// the same steps lane by lane, in the same order, so the same bits; half the instructions.
// `all_lo, all_hi`: keys all 16 rows attend.
template <bool Plain, bool Dropped>
inline void softmax_rows16(float* s, int64_t rs, int64_t W, int64_t key0, __m512i lo, __m512i hi, int64_t all_lo,
                           int64_t all_hi, const ScoreMods& mods, __m512i rows, __m256& max_a, __m256& max_b,
                           __m256& sum_a, __m256& sum_b, __m256& rescale_a, __m256& rescale_b,
                           const Dropout& dropout, __m512i drop_a, __m512i drop_c) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), scale = _mm512_set1_ps(mods.scale);
  const auto score = [&](int64_t t) {
    const __m512 product = _mm512_loadu_ps(s + t * rs);
    return Plain ? _mm512_mul_ps(product, scale)
                 : apply_lanes(mods, product, rows, _mm512_set1_epi32(static_cast<int>(key0 + t)));
  };
  const __m512 row_max = join(max_a, max_b);
  __m512 chunk_max = row_max;
  const auto masked = [&](int64_t t, __mmask16 in) {
    const __m512 x = _mm512_mask_blend_ps(in, neg_inf, score(t));
    _mm512_storeu_ps(s + t * rs, x);
    chunk_max = _mm512_max_ps(chunk_max, x);
  };
  const auto plain = [&](int64_t from, int64_t to) {
    // Four running maxima, not one: a chain of dependent max instructions waits their latency on
    // every key (max is exact, so any order gives the same bits).
    __m512 max1 = neg_inf, max2 = neg_inf, max3 = neg_inf;
    int64_t t = from;
    for (; t + 4 <= to; t += 4) {
      const __m512 x0 = score(t), x1 = score(t + 1), x2 = score(t + 2), x3 = score(t + 3);
      _mm512_storeu_ps(s + t * rs, x0), _mm512_storeu_ps(s + (t + 1) * rs, x1);
      _mm512_storeu_ps(s + (t + 2) * rs, x2), _mm512_storeu_ps(s + (t + 3) * rs, x3);
      chunk_max = _mm512_max_ps(chunk_max, x0), max1 = _mm512_max_ps(max1, x1);
      max2 = _mm512_max_ps(max2, x2), max3 = _mm512_max_ps(max3, x3);
    }
    for (; t < to; ++t) {
      const __m512 x = score(t);
      _mm512_storeu_ps(s + t * rs, x);
      chunk_max = _mm512_max_ps(chunk_max, x);
    }
    chunk_max = _mm512_max_ps(_mm512_max_ps(chunk_max, max1), _mm512_max_ps(max2, max3));
  };
  split_keys16(W, key0, lo, hi, all_lo, all_hi, masked, plain);
  const __m512 shift = _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(chunk_max, neg_inf, _CMP_EQ_OQ)),
                                           chunk_max);
  const __m512 rescale = _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(row_max, neg_inf, _CMP_EQ_OQ)),
                                             exp_nonpositive(_mm512_sub_ps(row_max, shift)));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < W; ++t) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t * rs), shift));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(s + t * rs, Dropped ? _mm512_mul_ps(e, dropout_factor_rows(dropout, drop_a, drop_c, key0 + t)) : e);
  }
  const __m512 row_sum = _mm512_fmadd_ps(join(sum_a, sum_b), rescale, sum);
  max_a = low_half(chunk_max), max_b = high_half(chunk_max);
  sum_a = low_half(row_sum), sum_b = high_half(row_sum);
  rescale_a = low_half(rescale), rescale_b = high_half(rescale);
}
#endif

// Cache hints for the rows a block reads or writes once: its query rows and its output rows, 8 KiB
// each of a 32 MiB tensor for a 32-row block, far from anything the hardware prefetchers follow.
// The next block's query rows into L2 as a block starts, its own output rows into L1 for writing
// (PREFETCHW where the CPU has it, a read hint elsewhere) as its last chunk starts. Window,
// L = 16384: the forward 141-143 -> 136-141 ms on one thread, 74-75 -> 71-73 ms on two (4
// alternating rounds; with every block reading and writing one block's rows, timing only,
// 132-134 ms: the bound); documents level.
bool has_prefetchw() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(0x80000001u, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 8)) != 0;  // PRFCHW
}

inline void prefetch_rows(const float* first, int64_t rows, int64_t stride, int64_t width, bool for_writing) {
  static const bool prefetchw = has_prefetchw();  // asked of the CPU: the build flags do not imply it
  for_writing = for_writing && prefetchw;
  for (int64_t j = 0; j < rows; ++j) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(first + j * stride);
    const uintptr_t end = begin + static_cast<uintptr_t>(width) * sizeof(float);
    for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
      const char* at = reinterpret_cast<const char*>(line);
      if (for_writing) {
        asm volatile("prefetchw %0" : : "m"(*at));
      } else {
        _mm_prefetch(at, _MM_HINT_T1);
      }
    }
  }
}

// Keys and values for the forward's products: as given, or copied into [B, Hkv, Lk, C] when a head's
// rows are not adjacent in memory (a model's projections give [B, L, Hkv, C], Hkv * C floats apart)
// and enough query rows read them that the copy pays: the register tiles read 6 rows at once, and
// rows spread over many pages ran the forward 8-20% slower (causal, 8 query heads, D = 64, L = 2048
// and 8192, 1 and 2 threads, 2 or 8 kv heads); from 1024 rows down it was level or a loss.
at::Tensor rows_together(const at::Tensor& t, int64_t query_rows) {
  return query_rows >= 2048 && t.size(2) > 1 && t.stride(2) != t.size(3) ? t.contiguous() : t;
}

std::tuple<at::Tensor, at::Tensor> interval_forward(const at::Tensor& query, const at::Tensor& key_given,
                                                    const at::Tensor& value_given, const at::Tensor& lo_rows,
                                                    const at::Tensor& hi_rows, double scale, int64_t block,
                                                    int64_t chunk, double dropout_p, int64_t seed, double softcap,
                                                    const std::optional<at::Tensor>& alibi_slopes,
                                                    int64_t dropout_head_start, int64_t dropout_row_start,
                                                    int64_t dropout_key_start) {
  at::Tensor lo, hi;
  const Sizes n = check_inputs("interval_forward", query, key_given, value_given, lo_rows, hi_rows, lo, hi);
  const int64_t B = n.B, H = n.H, Lq = n.Lq, D = n.D, Hkv = n.Hkv, Lk = n.Lk, Dv = n.Dv;  // the lambdas capture these
  const at::Tensor key = rows_together(key_given, Lq), value = rows_together(value_given, Lq);
  TORCH_CHECK(block > 0 && chunk > 0, "interval_forward: block and chunk must be positive");
  TORCH_CHECK(Lk < (int64_t{1} << 31), "interval_forward: at most 2^31 - 1 keys");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "interval_forward: dropout must be in [0, 1)");
  const Dropout dropout = make_dropout(dropout_p, seed, dropout_head_start, dropout_row_start, dropout_key_start);
  const at::Tensor slopes = checked_slopes("interval_forward", alibi_slopes, B, H, softcap);

  at::Tensor out = like_layout(query, B, H, Lq, Dv);
  at::Tensor lse = at::empty({B, H, Lq}, query.options());
  if (lse.numel() == 0) return {out, lse};
  const int64_t group = H / Hkv, blocks = (Lq + block - 1) / block;
  const float* q = query.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const int64_t* lo_data = lo.data_ptr<int64_t>();
  const int64_t* hi_data = hi.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const int64_t q0s = query.stride(0), q1s = query.stride(1), q2s = query.stride(2);
  const int64_t k0s = key.stride(0), k1s = key.stride(1), k2s = key.stride(2);
  const int64_t v0s = value.stride(0), v1s = value.stride(1), v2s = value.stride(2);
  const int64_t o0s = out.stride(0), o1s = out.stride(1), o2s = out.stride(2);
  const int64_t shared_rows = lo.size(0) == 1;
#if defined(__AVX512F__)
  // which 16-lane softmax: plain scores or modified (ScoreMods), with dropout or not (one per call)
  const bool plain = static_cast<float>(softcap) <= 0.0f && !slopes.defined();
  const auto softmax16 = plain ? (dropout.active ? softmax_rows16<true, true> : softmax_rows16<true, false>)
                               : (dropout.active ? softmax_rows16<false, true> : softmax_rows16<false, false>);
#endif

  const int64_t padded = (block + kGroup - 1) / kGroup * kGroup;
  // Tasks are (batch, head, block) in order, and threads claim runs of `claim` consecutive ones as
  // they go (consecutive blocks share most keys): a range split in halves waits for the slower
  // thread, and on a shared machine one core often is (window, L = 16384, 2 threads: 84-87 or
  // 136-143 ms a call split in halves, 83-98 ms claimed; 167-178 ms on one thread). Runs are short
  // enough that the last one leaves little to wait for where blocks differ in cost: a causal head's
  // last blocks are its heaviest (causal, L = 8192, 8 heads, 2 threads: 322-325 ms with runs of 64
  // blocks, 307-309 with 16; window and documents unchanged).
  const int64_t tasks = B * H * blocks;
  const int64_t claim = std::clamp<int64_t>(tasks / (32 * at::get_num_threads()), 1, 64);
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qt(D * padded), scores(chunk * padded), ot(Dv * padded), row_max(padded), row_sum(padded);
    std::vector<__m256> max8(padded / 8), sum8(padded / 8), rescale8(padded / 8);
    std::vector<__m256i> lo8(padded / 8), hi8(padded / 8), drop_a8(padded / 8), drop_c8(padded / 8);
    std::vector<Start> start(padded / kGroup);
    std::vector<int64_t> row_lo(padded), row_hi(padded), all_lo(padded / 8), all_hi(padded / 8);
    std::vector<DropoutRow> row_keys(padded);
    std::vector<float> exact_scores;
    for (int64_t begin; (begin = next_task.fetch_add(claim)) < tasks;) {
      const int64_t end = std::min(tasks, begin + claim);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / (H * blocks), h = (task / blocks) % H, first = (task % blocks) * block;
        const ScoreMods mods = score_mods(scale, softcap, slopes, b, h, Lq, Lk);
        const int64_t rows = std::min(block, Lq - first), rs = (rows + kGroup - 1) / kGroup * kGroup;
        const int64_t* lo_seq = lo_data + (shared_rows ? 0 : b * Lq) + first;
        const int64_t* hi_seq = hi_data + (shared_rows ? 0 : b * Lq) + first;
        const auto [span_lo, span_hi] = block_span(lo_seq, hi_seq, rows, Lk, nullptr, row_lo.data(), row_hi.data());
        const float* q_block = q + b * q0s + h * q1s + first * q2s;
        const float* k_head = k + b * k0s + (h / group) * k1s;
        const float* v_head = v + b * v0s + (h / group) * v1s;
        float* o_block = o + b * o0s + h * o1s + first * o2s;
        float* l_block = l + (b * H + h) * Lq + first;
        if (task + 1 < tasks) {
          const int64_t next_b = (task + 1) / (H * blocks), next_h = ((task + 1) / blocks) % H;
          const int64_t next_first = ((task + 1) % blocks) * block;
          prefetch_rows(q + next_b * q0s + next_h * q1s + next_first * q2s, std::min(block, Lq - next_first), q2s, D,
                        false);
        }
        if (span_lo >= span_hi) {  // no row of the block attends any key
          zero_rows(o_block, rows, o2s, Dv);
          std::fill(l_block, l_block + rows, kNegInf);
          continue;
        }
        // Rows past the block's last (padding up to a whole group, queries 0) attend the whole span, so
        // that they do not narrow the keys all rows of their vector attend; their results are dropped.
        for (int64_t j = rows; j < rs; ++j) row_lo[j] = span_lo, row_hi[j] = span_hi;
        for (int64_t j = 0; j < rs; ++j) {
          if (dropout.active) row_keys[j] = j < rows ? dropout_row(dropout, b, h, first + j) : DropoutRow{};
        }
        for (int64_t u = 0; u < rs / 8; ++u) {
          const int64_t* lo_u = row_lo.data() + 8 * u;
          const int64_t* hi_u = row_hi.data() + 8 * u;
          const DropoutRow* keys_u = row_keys.data() + 8 * u;
          all_lo[u] = std::max<int64_t>(0, *std::max_element(lo_u, lo_u + 8)), all_hi[u] = std::min<int64_t>(Lk, *std::min_element(hi_u, hi_u + 8));
          lo8[u] = int_lanes([&](int i) { return lo_u[i]; });
          hi8[u] = int_lanes([&](int i) { return hi_u[i]; });
          drop_a8[u] = int_lanes([&](int i) { return keys_u[i].a; });
          drop_c8[u] = int_lanes([&](int i) { return keys_u[i].c; });
          max8[u] = _mm256_set1_ps(kNegInf);
          sum8[u] = _mm256_setzero_ps();
        }
        // Qt[d][r] = q_r[d], padding rows 0
        transpose(q_block, q2s, rows, D, qt.data(), rs);
        for (int64_t d = 0; d < D; ++d) std::fill(qt.data() + d * rs + rows, qt.data() + (d + 1) * rs, 0.0f);
        for (int64_t c0 = span_lo; c0 < span_hi; c0 += chunk) {
          const int64_t width = std::min(chunk, span_hi - c0);
          if (c0 + chunk >= span_hi) prefetch_rows(o_block, rows, o2s, Dv, true);  // written next
          float* s = scores.data();
          block_scores(k_head + c0 * k2s, k2s, width, D, qt.data(), rs, s);
  #if defined(__AVX512F__)
          for (int64_t u = 0; u < rs / 8; u += 2) {  // rs / 8 is a multiple of 4
            softmax16(s + 8 * u, rs, width, c0, join(lo8[u], lo8[u + 1]), join(hi8[u], hi8[u + 1]),
                      std::max(all_lo[u], all_lo[u + 1]), std::min(all_hi[u], all_hi[u + 1]), mods,
                      row_lanes16(first + 8 * u), max8[u], max8[u + 1], sum8[u], sum8[u + 1], rescale8[u],
                      rescale8[u + 1], dropout, join(drop_a8[u], drop_a8[u + 1]), join(drop_c8[u], drop_c8[u + 1]));
          }
  #else
          for (int64_t u = 0; u < rs / 8; ++u) {
            rescale8[u] = softmax_rows(s + 8 * u, rs, width, c0, lo8[u], hi8[u], all_lo[u], all_hi[u], mods,
                                       row_lanes(first + 8 * u), max8[u], sum8[u], dropout, drop_a8[u], drop_c8[u]);
          }
  #endif
          for (int64_t g = 0; g < rs / kGroup; ++g) {
            bool ones = true;
            for (int i = 0; i < 4; ++i) {
              ones = ones && _mm256_movemask_ps(_mm256_cmp_ps(rescale8[4 * g + i], _mm256_set1_ps(1.0f), _CMP_EQ_OQ)) == 0xFF;
            }
            start[g] = c0 == span_lo ? Start::kZero : ones ? Start::kKeep : Start::kRescale;
          }
          block_values(v_head + c0 * v2s, v2s, width, Dv, s, rs, ot.data(), start.data(), rescale8.data());
        }
        transpose(ot.data(), rs, Dv, rows, o_block, o2s);  // out[r][dv] = Ot[dv][r], normalised below
        for (int64_t u = 0; u < rs / 8; ++u) {
          _mm256_storeu_ps(row_max.data() + 8 * u, max8[u]);
          _mm256_storeu_ps(row_sum.data() + 8 * u, sum8[u]);
        }
        // A non-finite value in an accumulator came from a value the block multiplied by a weight:
        // a masked key's (weight 0, which must not count) or an attended one's, where the running
        // rescaling may have turned a weight into 0 early; such rows are redone by attended pairs.
        for (int64_t j = 0; j < rows; ++j) {
          float* acc = o_block + j * o2s;
          const float sum = row_sum[j];
          if (std::isnan(sum)) {  // a NaN or +inf score among the attended ones
            std::fill(acc, acc + Dv, std::numeric_limits<float>::quiet_NaN());
            l_block[j] = std::numeric_limits<float>::quiet_NaN();
          } else if (sum > 0.0f) {
            if (scale_and_check(acc, Dv, 1.0f / sum)) {
              l_block[j] = row_max[j] + std::log(sum);
            } else {
              exact_forward_row(q_block + j * q2s, k_head, k2s, v_head, v2s, D, Dv, row_lo[j], row_hi[j], mods,
                                first + j, dropout, row_keys[j], exact_scores, acc, l_block + j);
            }
          } else {  // no key, or only scores of -inf
            std::fill(acc, acc + Dv, 0.0f);
            l_block[j] = kNegInf;
          }
        }
      }
    }
  });
  return {out, lse};
}

// The backward's buffers hold a chunk key-major, rows as lanes, as the forward's scores: X[t][r]
// (row stride rs) for keys key0 + t and the block's rows r. `in` below is the lanes whose row
// attends key key0 + t (lo <= key < hi); every other lane becomes 0, its value checked into `bad`
// first (x - x is NaN for an infinite or NaN x): a non-finite product there would reach dQ or dK,
// a non-finite dP (from dO) dV, through a weight of 0.

// P = exp(score - lse) for 8 rows over a chunk of W keys, in place of the products in S (the
// softmax weights recomputed from the forward's log-sum-exp: no running max is needed); the score is
// the product's by `mods` for lanes `rows` (the forward's operations, in its order). With
// soft-capping, cap_grad[t][.] gets 1 - t^2 (the cap's derivative).
inline void weights_rows8(float* s, int64_t rs, int64_t W, int64_t key0, __m256i lo, __m256i hi, __m256 lse,
                          const ScoreMods& mods, __m256i rows, float* cap_grad, __m256& bad) {
  const bool plain = mods.cap <= 0.0f && !mods.alibi;
  const __m256 zero = _mm256_setzero_ps(), scale8 = _mm256_set1_ps(mods.scale);
  __m256i key = _mm256_set1_epi32(static_cast<int>(key0));
  for (int64_t t = 0; t < W; ++t, key = _mm256_add_epi32(key, _mm256_set1_epi32(1))) {
    const __m256 in = _mm256_castsi256_ps(attends8(lo, hi, key));
    const __m256 product = _mm256_loadu_ps(s + t * rs);
    bad = check_outside8(bad, in, product);
    __m256 grad;
    // not fused: the forward rounded scale * q.k before subtracting (an fma would leave that
    // rounding, huge for huge scores, in the weight)
    const __m256 x = plain ? _mm256_mul_ps(product, scale8) : apply_lanes(mods, product, rows, key, &grad);
    if (mods.cap > 0.0f) _mm256_storeu_ps(cap_grad + t * rs, grad);
    // min(0, .): a recomputed score may exceed the forward's lse by a rounding error (minps
    // returns its second operand, a NaN, when there is one)
    _mm256_storeu_ps(s + t * rs, _mm256_and_ps(in, exp_nonpositive(_mm256_min_ps(zero, _mm256_sub_ps(x, lse)))));
  }
}

// dS = scale * P * (f * dP - delta) in place of dP for 8 rows over a chunk of W keys (times 1 - t^2
// from `cap_grad` under soft-capping, when not null), f the dropout factor of each pair (0 or
// 1 / (1 - p); 1 without dropout; `drop_a`, `drop_c` the rows' keys): the output used f * P. With
// dropout P also becomes f * P, for dV.
inline void score_grads_rows8(float* p, float* dp, int64_t rs, int64_t W, int64_t key0, __m256i lo, __m256i hi,
                              __m256 delta, float scale, const float* cap_grad, const Dropout& dropout,
                              __m256i drop_a, __m256i drop_c, __m256& bad) {
  const __m256 s8 = _mm256_set1_ps(scale), one = _mm256_set1_ps(1.0f);
  __m256i key = _mm256_set1_epi32(static_cast<int>(key0));
  for (int64_t t = 0; t < W; ++t, key = _mm256_add_epi32(key, _mm256_set1_epi32(1))) {
    const __m256 in = _mm256_castsi256_ps(attends8(lo, hi, key));
    const __m256 d = _mm256_loadu_ps(dp + t * rs);
    bad = check_outside8(bad, in, d);
    const __m256 f = dropout.active ? dropout_factor_rows(dropout, drop_a, drop_c, key0 + t) : one;
    const __m256 weight = _mm256_loadu_ps(p + t * rs);
    const __m256 g = _mm256_mul_ps(weight, _mm256_sub_ps(_mm256_mul_ps(f, d), delta));
    const __m256 chain = cap_grad ? _mm256_mul_ps(s8, _mm256_loadu_ps(cap_grad + t * rs)) : s8;
    _mm256_storeu_ps(dp + t * rs, _mm256_and_ps(in, _mm256_mul_ps(g, chain)));
    if (dropout.active) _mm256_storeu_ps(p + t * rs, _mm256_mul_ps(weight, f));
  }
}

#if defined(__AVX512F__)
// Both for 16 rows (`rows` their indices): the same operations lane by lane, so the same bits;
// plain scores (`Plain`) or modified by `mods`. Keys [all_lo, all_hi) are attended by all 16 rows:
// no mask and nothing to check there (most keys of a block, as in the forward; the masks and checks
// were ~40% of these loops' instructions).
template <bool Plain>
inline void weights_rows16(float* s, int64_t rs, int64_t W, int64_t key0, __m512i lo, __m512i hi, int64_t all_lo,
                           int64_t all_hi, __m512 lse, const ScoreMods& mods, __m512i rows, float* cap_grad,
                           __m256& bad) {
  const __m512 zero = _mm512_setzero_ps(), scale16 = _mm512_set1_ps(mods.scale);
  __m512 bad16 = _mm512_setzero_ps();
  // the weight of key t from its product (the cap's derivative into cap_grad under soft-capping)
  const auto weight = [&](int64_t t, __m512 product) {
    __m512 grad;
    const __m512 x = Plain ? _mm512_mul_ps(product, scale16)
                           : apply_lanes(mods, product, rows, _mm512_set1_epi32(static_cast<int>(key0 + t)), &grad);
    if (!Plain && mods.cap > 0.0f) _mm512_storeu_ps(cap_grad + t * rs, grad);
    return exp_nonpositive(_mm512_min_ps(zero, _mm512_sub_ps(x, lse)));
  };
  const auto masked = [&](int64_t t, __mmask16 in) {
    const __m512 product = _mm512_loadu_ps(s + t * rs);
    bad16 = check_outside16(bad16, in, product);
    _mm512_storeu_ps(s + t * rs, _mm512_maskz_mov_ps(in, weight(t, product)));
  };
  const auto plain = [&](int64_t from, int64_t to) {
    for (int64_t t = from; t < to; ++t) _mm512_storeu_ps(s + t * rs, weight(t, _mm512_loadu_ps(s + t * rs)));
  };
  split_keys16(W, key0, lo, hi, all_lo, all_hi, masked, plain);
  bad = _mm256_or_ps(bad, _mm256_or_ps(low_half(bad16), high_half(bad16)));
}

// With dropout (`Dropped`), dS = scale P (f dP - delta) and P becomes f P, the weights the
// output used; under soft-capping (`Capped`) times cap_grad: as score_grads_rows8 computes them.
template <bool Dropped, bool Capped>
inline void score_grads_rows16(float* p, float* dp, int64_t rs, int64_t W, int64_t key0, __m512i lo,
                               __m512i hi, int64_t all_lo, int64_t all_hi, __m512 delta, float scale,
                               const float* cap_grad, __m256& bad, const Dropout& dropout, __m512i drop_a,
                               __m512i drop_c) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  const auto chain = [&](int64_t t) {
    return Capped ? _mm512_mul_ps(scale16, _mm512_loadu_ps(cap_grad + t * rs)) : scale16;
  };
  __m512 bad16 = _mm512_setzero_ps();
  // g = P (f dP - delta) at key t (f P into p with dropout)
  const auto gradient = [&](int64_t t, __m512 d) {
    const __m512 weight = _mm512_loadu_ps(p + t * rs);
    if (!Dropped) return _mm512_mul_ps(weight, _mm512_sub_ps(d, delta));
    const __m512 f = dropout_factor_rows(dropout, drop_a, drop_c, key0 + t);
    _mm512_storeu_ps(p + t * rs, _mm512_mul_ps(weight, f));
    return _mm512_mul_ps(weight, _mm512_sub_ps(_mm512_mul_ps(f, d), delta));
  };
  const auto masked = [&](int64_t t, __mmask16 in) {
    const __m512 d = _mm512_loadu_ps(dp + t * rs);
    bad16 = check_outside16(bad16, in, d);
    _mm512_storeu_ps(dp + t * rs, _mm512_maskz_mul_ps(in, gradient(t, d), chain(t)));
  };
  const auto plain = [&](int64_t from, int64_t to) {
    for (int64_t t = from; t < to; ++t) {
      _mm512_storeu_ps(dp + t * rs, _mm512_mul_ps(gradient(t, _mm512_loadu_ps(dp + t * rs)), chain(t)));
    }
  };
  split_keys16(W, key0, lo, hi, all_lo, all_hi, masked, plain);
  bad = _mm256_or_ps(bad, _mm256_or_ps(low_half(bad16), high_half(bad16)));
}
#endif

// ---- The backward's products over rows, register-tiled -------------------------------------------
//
// dV += (f P)^T dO and dK += dS^T Q sum over a block's rows: out[t][c] += sum_r w[t][r] x[r][c],
// with w key-major (rows as lanes, as the scores' tiles leave P and dS) and x the rows of dO or Q
// as given. With these, dP = dO V^T (block_scores) and dQ^T += K^T dS^T (block_values), the
// backward calls no BLAS: MKL's sgemm on these shapes (a 32-row block: an inner dimension of 32)
// ran at ~40% of the FMA rate of the scores' tiles on an AMD Zen 5 (61% of a window backward's
// time, for 4 of its 5 products: the backward now takes half the time); the 256-bit build, level
// with MKL's 256-bit code there, took 0.89-0.99x its time with sgemm (L = 16384, 2 threads) and
// was level at GPT training shapes.

#if defined(__AVX512F__)
// N = 6 keys by up to 64 features (4 vectors) per tile, 24 accumulators: per row, 4 vector loads
// of x and 6 broadcasts of w for 24 FMA.

// out[i * os + c] += sum_{r < rows} w[i * rs + r] x[r * xs + c] for i < N, c < 16 V (the last
// vector's lanes by `last`), in row order from the value in `out`.
template <int N, int V>
__attribute__((always_inline)) inline void rows_tile16(const float* w, int64_t rs, int64_t rows, const float* x, int64_t xs,
                                                       float* out, int64_t os, __mmask16 last) {
  const auto lanes = [&](int v) { return v == V - 1 ? last : static_cast<__mmask16>(0xFFFF); };
  __m512 a[N][V];
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) a[i][v] = _mm512_maskz_loadu_ps(lanes(v), out + i * os + 16 * v);
  }
#pragma GCC unroll 2
  for (int64_t r = 0; r < rows; ++r) {
    __m512 row[V];
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) row[v] = _mm512_maskz_loadu_ps(lanes(v), x + r * xs + 16 * v);
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
      const __m512 c = _mm512_set1_ps(w[i * rs + r]);
      _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) a[i][v] = _mm512_fmadd_ps(c, row[v], a[i][v]);
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(out + i * os + 16 * v, lanes(v), a[i][v]);
  }
}

template <int V>
void rows_tiles16(const float* w, int64_t rs, int64_t W, int64_t rows, const float* x, int64_t xs, float* out,
                  int64_t os, __mmask16 last) {
  int64_t t = 0;
  for (; t + 6 <= W; t += 6) rows_tile16<6, V>(w + t * rs, rs, rows, x, xs, out + t * os, os, last);
  const float* wt = w + t * rs;
  float* ot = out + t * os;
  switch (W - t) {
    case 5: rows_tile16<5, V>(wt, rs, rows, x, xs, ot, os, last); break;
    case 4: rows_tile16<4, V>(wt, rs, rows, x, xs, ot, os, last); break;
    case 3: rows_tile16<3, V>(wt, rs, rows, x, xs, ot, os, last); break;
    case 2: rows_tile16<2, V>(wt, rs, rows, x, xs, ot, os, last); break;
    case 1: rows_tile16<1, V>(wt, rs, rows, x, xs, ot, os, last); break;
    default: break;
  }
}

// Out[t][c] += sum_{r < rows} W[t][r] X[r][c] for the W keys of a chunk (w row stride rs, x row
// stride xs, out row stride os), C features.
void block_rows_product(const float* w, int64_t rs, int64_t W, int64_t rows, const float* x, int64_t xs, int64_t C,
                        float* out, int64_t os) {
  for (int64_t c0 = 0; c0 < C; c0 += 64) {
    const int64_t left = std::min<int64_t>(C - c0, 64), vectors = (left + 15) / 16;
    const __mmask16 last = static_cast<__mmask16>((1u << (left - 16 * (vectors - 1))) - 1u);
    switch (vectors) {
      case 4: rows_tiles16<4>(w, rs, W, rows, x + c0, xs, out + c0, os, last); break;
      case 3: rows_tiles16<3>(w, rs, W, rows, x + c0, xs, out + c0, os, last); break;
      case 2: rows_tiles16<2>(w, rs, W, rows, x + c0, xs, out + c0, os, last); break;
      default: rows_tiles16<1>(w, rs, W, rows, x + c0, xs, out + c0, os, last); break;
    }
  }
}
#else
// The same in 256-bit vectors: 2 keys by 32 features (4 vectors), 8 accumulators (3 keys would
// spill: 16 registers); the last vector masked when it is partial (`Partial`: a masked store is
// slow on some CPUs, whole vectors take plain ones).
template <int N, int V, bool Partial>
__attribute__((always_inline)) inline void rows_tile8(const float* w, int64_t rs, int64_t rows, const float* x, int64_t xs,
                                                      float* out, int64_t os, __m256i last) {
  const auto load = [&](const float* from, int v) {
    return Partial && v == V - 1 ? _mm256_maskload_ps(from, last) : _mm256_loadu_ps(from);
  };
  __m256 a[N][V];
  _Pragma("GCC unroll 4") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) a[i][v] = load(out + i * os + 8 * v, v);
  }
#pragma GCC unroll 2
  for (int64_t r = 0; r < rows; ++r) {
    __m256 row[V];
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) row[v] = load(x + r * xs + 8 * v, v);
    _Pragma("GCC unroll 4") for (int i = 0; i < N; ++i) {
      const __m256 c = _mm256_broadcast_ss(w + i * rs + r);
      _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) a[i][v] = _mm256_fmadd_ps(c, row[v], a[i][v]);
    }
  }
  _Pragma("GCC unroll 4") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) {
      float* to = out + i * os + 8 * v;
      if (Partial && v == V - 1) {
        _mm256_maskstore_ps(to, last, a[i][v]);
      } else {
        _mm256_storeu_ps(to, a[i][v]);
      }
    }
  }
}

template <int V, bool Partial>
void rows_tiles8(const float* w, int64_t rs, int64_t W, int64_t rows, const float* x, int64_t xs, float* out,
                 int64_t os, __m256i last) {
  int64_t t = 0;
  for (; t + 2 <= W; t += 2) rows_tile8<2, V, Partial>(w + t * rs, rs, rows, x, xs, out + t * os, os, last);
  if (t < W) rows_tile8<1, V, Partial>(w + t * rs, rs, rows, x, xs, out + t * os, os, last);
}

// Out[t][c] += sum_{r < rows} W[t][r] X[r][c] for the W keys of a chunk (w row stride rs, x row
// stride xs, out row stride os), C features.
void block_rows_product(const float* w, int64_t rs, int64_t W, int64_t rows, const float* x, int64_t xs, int64_t C,
                        float* out, int64_t os) {
  for (int64_t c0 = 0; c0 < C; c0 += 32) {
    const int64_t left = std::min<int64_t>(C - c0, 32), vectors = (left + 7) / 8, tail = left - 8 * (vectors - 1);
    const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tail)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const float* xc = x + c0;
    float* oc = out + c0;
    switch (vectors * 2 + (tail < 8)) {
      case 8: rows_tiles8<4, false>(w, rs, W, rows, xc, xs, oc, os, last); break;
      case 9: rows_tiles8<4, true>(w, rs, W, rows, xc, xs, oc, os, last); break;
      case 6: rows_tiles8<3, false>(w, rs, W, rows, xc, xs, oc, os, last); break;
      case 7: rows_tiles8<3, true>(w, rs, W, rows, xc, xs, oc, os, last); break;
      case 4: rows_tiles8<2, false>(w, rs, W, rows, xc, xs, oc, os, last); break;
      case 5: rows_tiles8<2, true>(w, rs, W, rows, xc, xs, oc, os, last); break;
      case 2: rows_tiles8<1, false>(w, rs, W, rows, xc, xs, oc, os, last); break;
      default: rows_tiles8<1, true>(w, rs, W, rows, xc, xs, oc, os, last); break;
    }
  }
}
#endif

// One chunk's share of dQ, dK and dV by attended pairs only, from its P (with dropout f * P) and
// dS: for a chunk whose zeroed scores or dP held a non-finite value, which the three products
// would have multiplied by 0 into NaN. Within the attended pairs it is IEEE arithmetic like the
// products (0 * inf is NaN). `row_lo`, `row_hi` as block_span gives them (empty for rows whose lse
// is -inf). dQ goes into the block's transposed accumulator dQt[d][j] (row stride rs), zeroed
// first when `zero_dq`.
void exact_backward_chunk(int64_t rows, int64_t width, int64_t c0, const int64_t* row_lo, const int64_t* row_hi,
                          const float* p, const float* ds, const float* q_block, int64_t q2s,
                          const float* go_block, int64_t g2s, const float* k_head, int64_t k2s, float* dqt,
                          int64_t rs, float* dk_head, int64_t dk2s, float* dv_head, int64_t dv2s, int64_t D,
                          int64_t Dv, bool zero_dq) {
  if (zero_dq) std::fill(dqt, dqt + D * rs, 0.0f);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t a = std::clamp<int64_t>(row_lo[j] - c0, 0, width), z = std::clamp<int64_t>(row_hi[j] - c0, 0, width);
    const float* q_row = q_block + j * q2s;
    const float* go_row = go_block + j * g2s;
    for (int64_t t = a; t < z; ++t) {
      const float g = ds[j * width + t];
      const int64_t key = c0 + t;
      const float* k_row = k_head + key * k2s;
      for (int64_t d = 0; d < D; ++d) dqt[d * rs + j] = std::fma(g, k_row[d], dqt[d * rs + j]);
      axpy(dk_head + key * dk2s, g, q_row, D);
      axpy(dv_head + key * dv2s, p[j * width + t], go_row, Dv);
    }
  }
}

// Gradients of interval_forward: given grad_out [B, H, Lq, Dv], the forward's lse [B, H, Lq] and
// delta [B, H, Lq] = rowsum(grad_out * out) - grad_lse, returns (dq, dk, dv) in float32, each
// in the shape of its input, laid out as like_layout gives. FlashAttention's backward, by query
// blocks: per block and chunk of keys, P from the lse, dP = dO V^T, dS = scale * P * (f dP - delta)
// with f the dropout factors (1 without dropout), dV += (f P)^T dO, dQ += dS K, dK += dS^T Q; the
// scores from the forward's register tiles, the other four products on register tiles too (dQ
// accumulated transposed, like Qt, and transposed out at the block's end; see block_rows_product);
// nothing of size Lq x Lk is ever stored.
// Blocks of different rows add into the same key rows, so a task owns whole (batch, kv head)
// pairs; with fewer pairs than threads, each pair's rows are cut into `parts` that add into
// their own copy of dK and dV, summed at the end (`parts` copies: still O(L) memory).
std::tuple<at::Tensor, at::Tensor, at::Tensor> interval_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& lse_rows, const at::Tensor& delta_rows, const at::Tensor& lo_rows, const at::Tensor& hi_rows,
    double scale, int64_t block, int64_t chunk, int64_t parts, double dropout_p, int64_t seed, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t dropout_head_start, int64_t dropout_row_start,
    int64_t dropout_key_start) {
  at::Tensor lo, hi;
  const Sizes n = check_inputs("interval_backward", query, key, value, lo_rows, hi_rows, lo, hi);
  const int64_t B = n.B, H = n.H, Lq = n.Lq, D = n.D, Hkv = n.Hkv, Lk = n.Lk, Dv = n.Dv;  // the lambdas capture these
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == B && grad_out.size(1) == H && grad_out.size(2) == Lq &&
                  grad_out.size(3) == Dv, "interval_backward: grad_out must be [B, H, Lq, Dv]");
  TORCH_CHECK(grad_out.scalar_type() == at::kFloat && grad_out.device().is_cpu() && grad_out.stride(3) == 1,
              "interval_backward: grad_out must be float32 CPU with a unit stride along the head dimension");
  TORCH_CHECK(block > 0 && chunk > 0 && parts > 0, "interval_backward: block, chunk and parts must be positive");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "interval_backward: dropout must be in [0, 1)");
  const Dropout dropout = make_dropout(dropout_p, seed, dropout_head_start, dropout_row_start, dropout_key_start);
  const at::Tensor slopes = checked_slopes("interval_backward", alibi_slopes, B, H, softcap);
  const at::Tensor lse = lse_rows.contiguous(), delta = delta_rows.contiguous();
  TORCH_CHECK(lse.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat &&
                  lse.sizes() == at::IntArrayRef({B, H, Lq}) && delta.sizes() == lse.sizes(),
              "interval_backward: lse and delta must be float32 [B, H, Lq]");

  at::Tensor dq = like_layout(query, B, H, Lq, D);  // each block writes its rows
  // [B, Hkv, parts, Lk, C]: each part's copy laid out like key (value), summed over parts at the end
  at::Tensor dk = like_layout(key, B, Hkv, parts * Lk, D).view({B, Hkv, parts, Lk, D}).zero_();
  at::Tensor dv = like_layout(value, B, Hkv, parts * Lk, Dv).view({B, Hkv, parts, Lk, Dv}).zero_();
  const int64_t group = H / Hkv, blocks = (Lq + block - 1) / block;
  const int64_t blocks_per_part = (blocks + parts - 1) / parts;
  if (dq.numel() > 0 && Lk > 0) {
    const float* q = query.data_ptr<float>();
    const float* k = key.data_ptr<float>();
    const float* v = value.data_ptr<float>();
    const float* go = grad_out.data_ptr<float>();
    const float* l = lse.data_ptr<float>();
    const float* dl = delta.data_ptr<float>();
    const int64_t* lo_data = lo.data_ptr<int64_t>();
    const int64_t* hi_data = hi.data_ptr<int64_t>();
    float* dq_data = dq.data_ptr<float>();
    float* dk_data = dk.data_ptr<float>();
    float* dv_data = dv.data_ptr<float>();
    const int64_t q0s = query.stride(0), q1s = query.stride(1), q2s = query.stride(2);
    const int64_t k0s = key.stride(0), k1s = key.stride(1), k2s = key.stride(2);
    const int64_t v0s = value.stride(0), v1s = value.stride(1), v2s = value.stride(2);
    const int64_t g0s = grad_out.stride(0), g1s = grad_out.stride(1), g2s = grad_out.stride(2);
    const int64_t dq0s = dq.stride(0), dq1s = dq.stride(1), dq2s = dq.stride(2);
    const int64_t dk0s = dk.stride(0), dk1s = dk.stride(1), dk2s = dk.stride(2), dk3s = dk.stride(3);
    const int64_t dv0s = dv.stride(0), dv1s = dv.stride(1), dv2s = dv.stride(2), dv3s = dv.stride(3);
    const bool shared_rows = lo.size(0) == 1;
    // Soft-capping as ScoreMods sees it (a float cap > 0): the cap's derivative is stored then
    const bool capped = static_cast<float>(softcap) > 0.0f;
#if defined(__AVX512F__)
    // which 16-lane weights and score gradients (one per call)
    const auto weights16 = capped || slopes.defined() ? weights_rows16<false> : weights_rows16<true>;
    const auto grads16 = capped ? (dropout.active ? score_grads_rows16<true, true> : score_grads_rows16<false, true>)
                                : (dropout.active ? score_grads_rows16<true, false> : score_grads_rows16<false, false>);
#endif

    at::parallel_for(0, B * Hkv * parts, 1, [&](int64_t begin, int64_t end) {
      // The scores come from the forward's register tiles, bit for bit the forward's: the weights
      // recomputed from its lse must round alike (a score one ulp lower under a huge scale would
      // weigh 0 here where the forward gave it 1). P (in place of the scores), dP, dS and the cap's
      // derivative stay key-major with the rows as lanes, as the tiles give them, and the other
      // four products read them so (a transpose of each chunk's scores into rows took 6-9% of a
      // causal backward).
      const int64_t padded = (block + kGroup - 1) / kGroup * kGroup;
      std::vector<float> qt(D * padded, 0.0f), scores(chunk * padded), grads(chunk * padded, 0.0f);
      std::vector<float> got(Dv * padded), dqt(D * padded);  // dO^T and dQ^T: rows as lanes, like Qt
      std::vector<Start> dq_start(padded / kGroup);
      const std::vector<__m256> no_rescale(padded / 8);
      std::vector<float> cap_grads(capped ? chunk * padded : 0);
      std::vector<float> weights_rows, grads_rows;  // [rows][width] copies for the exact path
      std::vector<int64_t> row_lo(padded), row_hi(padded);
      std::vector<DropoutRow> row_keys(padded);
      std::vector<__m256i> lo8(padded / 8), hi8(padded / 8), drop_a8(padded / 8), drop_c8(padded / 8);
      std::vector<__m256> lse8(padded / 8), delta8(padded / 8);
      std::vector<int64_t> all_lo16(padded / 16), all_hi16(padded / 16);  // keys all 16 rows attend
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / (Hkv * parts), kv = (task / parts) % Hkv, part = task % parts;
        const int64_t* lo_seq = lo_data + (shared_rows ? 0 : b * Lq);
        const int64_t* hi_seq = hi_data + (shared_rows ? 0 : b * Lq);
        const float* k_head = k + b * k0s + kv * k1s;
        const float* v_head = v + b * v0s + kv * v1s;
        float* dk_head = dk_data + b * dk0s + kv * dk1s + part * dk2s;
        float* dv_head = dv_data + b * dv0s + kv * dv1s + part * dv2s;
        const int64_t block_end = std::min(blocks, (part + 1) * blocks_per_part);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          const ScoreMods mods = score_mods(scale, softcap, slopes, b, h, Lq, Lk);
          for (int64_t index = part * blocks_per_part; index < block_end; ++index) {
            const int64_t first = index * block, rows = std::min(block, Lq - first);
            const float* l_block = l + (b * H + h) * Lq + first;
            const auto [span_lo, span_hi] = block_span(lo_seq + first, hi_seq + first, rows, Lk, l_block,
                                                       row_lo.data(), row_hi.data());
            for (int64_t j = 0; j < rows && dropout.active; ++j) {
              row_keys[j] = dropout_row(dropout, b, h, first + j);
            }
            float* dq_block = dq_data + b * dq0s + h * dq1s + first * dq2s;
            if (span_lo >= span_hi) {  // no row of the block attends any key
              zero_rows(dq_block, rows, dq2s, D);
              continue;
            }
            const float* q_block = q + b * q0s + h * q1s + first * q2s;
            const float* go_block = go + b * g0s + h * g1s + first * g2s;
            const int64_t rs = (rows + kGroup - 1) / kGroup * kGroup;
            transpose(q_block, q2s, rows, D, qt.data(), rs);  // Qt[d][r], padding rows 0
            for (int64_t d = 0; d < D; ++d) std::fill(qt.data() + d * rs + rows, qt.data() + (d + 1) * rs, 0.0f);
            transpose(go_block, g2s, rows, Dv, got.data(), rs);  // dOt[dv][r], padding rows 0
            for (int64_t d = 0; d < Dv; ++d) std::fill(got.data() + d * rs + rows, got.data() + (d + 1) * rs, 0.0f);
            bool dq_started = false;  // dQt holds this block's sum so far
            const float* delta_block = dl + (b * H + h) * Lq + first;
            // The rows' lanes; padding rows (up to a whole group) attend nothing
            for (int64_t u = 0; u < rs / 8; ++u) {
              const auto real = [&](int i) { return 8 * u + i < rows; };
              lo8[u] = int_lanes([&](int i) { return real(i) ? row_lo[8 * u + i] : 0; });
              hi8[u] = int_lanes([&](int i) { return real(i) ? row_hi[8 * u + i] : 0; });
              drop_a8[u] = int_lanes([&](int i) { return real(i) && dropout.active ? row_keys[8 * u + i].a : 0; });
              drop_c8[u] = int_lanes([&](int i) { return real(i) && dropout.active ? row_keys[8 * u + i].c : 0; });
              lse8[u] = float_lanes([&](int i) { return real(i) ? l_block[8 * u + i] : 0.0f; });
              delta8[u] = float_lanes([&](int i) { return real(i) ? delta_block[8 * u + i] : 0.0f; });
            }
            for (int64_t u = 0; u < rs / 16; ++u) {
              const int64_t end16 = std::min(rows, 16 * u + 16);
              all_lo16[u] = 0, all_hi16[u] = end16 - 16 * u < 16 ? 0 : Lk;  // padding rows attend nothing
              for (int64_t j = 16 * u; j < end16; ++j) {
                all_lo16[u] = std::max(all_lo16[u], row_lo[j]), all_hi16[u] = std::min(all_hi16[u], row_hi[j]);
              }
            }
            for (int64_t c0 = span_lo; c0 < span_hi; c0 += chunk) {
              const int64_t width = std::min(chunk, span_hi - c0);
              float* p = scores.data();  // S, then P in its place: [t][r], row stride rs
              float* ds = grads.data();  // dP, then dS in its place, the same layout
              float* cap = cap_grads.empty() ? nullptr : cap_grads.data();
              __m256 bad = _mm256_setzero_ps();
              block_scores(k_head + c0 * k2s, k2s, width, D, qt.data(), rs, p);
  #if defined(__AVX512F__)
              for (int64_t u = 0; u < rs / 8; u += 2) {
                weights16(p + 8 * u, rs, width, c0, join(lo8[u], lo8[u + 1]), join(hi8[u], hi8[u + 1]), all_lo16[u / 2],
                          all_hi16[u / 2], join(lse8[u], lse8[u + 1]), mods, row_lanes16(first + 8 * u),
                          cap ? cap + 8 * u : nullptr, bad);
              }
  #else
              for (int64_t u = 0; u < rs / 8; ++u) {
                weights_rows8(p + 8 * u, rs, width, c0, lo8[u], hi8[u], lse8[u], mods, row_lanes(first + 8 * u),
                              cap ? cap + 8 * u : nullptr, bad);
              }
  #endif
              // dP[t][r] = sum_dv V[t][dv] dOt[dv][r]: the scores' tiles (padding rows of dOt are 0)
              block_scores(v_head + c0 * v2s, v2s, width, Dv, got.data(), rs, ds);
              // lanes past the block's rows: 0 (0 times an infinite value there would read as a
              // masked non-finite value below)
              for (int64_t t = 0; t < width && rows < rs; ++t) std::fill(ds + t * rs + rows, ds + (t + 1) * rs, 0.0f);
  #if defined(__AVX512F__)
              for (int64_t u = 0; u < rs / 8; u += 2) {  // with dropout, also turns P into the weights the output used
                grads16(p + 8 * u, ds + 8 * u, rs, width, c0, join(lo8[u], lo8[u + 1]), join(hi8[u], hi8[u + 1]),
                        all_lo16[u / 2], all_hi16[u / 2], join(delta8[u], delta8[u + 1]), static_cast<float>(scale),
                        cap ? cap + 8 * u : nullptr, bad, dropout, join(drop_a8[u], drop_a8[u + 1]),
                        join(drop_c8[u], drop_c8[u + 1]));
              }
  #else
              for (int64_t u = 0; u < rs / 8; ++u) {  // with dropout, also turns P into the weights the output used
                score_grads_rows8(p + 8 * u, ds + 8 * u, rs, width, c0, lo8[u], hi8[u], delta8[u],
                                  static_cast<float>(scale), cap ? cap + 8 * u : nullptr, dropout, drop_a8[u],
                                  drop_c8[u], bad);
              }
  #endif
              if (any_bits(bad)) {
                weights_rows.resize(rows * width), grads_rows.resize(rows * width);
                transpose(p, rs, width, rows, weights_rows.data(), width);
                transpose(ds, rs, width, rows, grads_rows.data(), width);
                exact_backward_chunk(rows, width, c0, row_lo.data(), row_hi.data(), weights_rows.data(),
                                     grads_rows.data(), q_block, q2s, go_block, g2s, k_head, k2s, dqt.data(), rs,
                                     dk_head, dk3s, dv_head, dv3s, D, Dv, !dq_started);
                dq_started = true;
                continue;
              }
              // dV_chunk += (f P)^T dO, dQt (+)= K_chunk^T dS^T, dK_chunk += dS^T Q
              block_rows_product(p, rs, width, rows, go_block, g2s, Dv, dv_head + c0 * dv3s, dv3s);
              std::fill(dq_start.begin(), dq_start.end(), dq_started ? Start::kKeep : Start::kZero);
              block_values(k_head + c0 * k2s, k2s, width, D, ds, rs, dqt.data(), dq_start.data(), no_rescale.data());
              dq_started = true;
              block_rows_product(ds, rs, width, rows, q_block, q2s, D, dk_head + c0 * dk3s, dk3s);
            }
            transpose(dqt.data(), rs, D, rows, dq_block, dq2s);  // dq[r][d] = dQt[d][r]
          }
        }
      }
    });
  }
  const auto summed = [&](const at::Tensor& copies, const at::Tensor& like) {
    if (parts == 1) return copies.squeeze(2);
    at::Tensor total = like_layout(like, B, Hkv, Lk, copies.size(4));
    return at::sum_out(total, copies, {2});
  };
  return {dq, summed(dk, key), summed(dv, value)};
}

}  // namespace

TORCH_LIBRARY(attnkit_native, m) {
  m.def("interval_forward(Tensor query, Tensor key, Tensor value, Tensor lo, Tensor hi, float scale, int block, "
        "int chunk, float dropout, int seed, float softcap, Tensor? alibi_slopes, int dropout_head_start, "
        "int dropout_row_start, int dropout_key_start) -> (Tensor, Tensor)");
  m.def("interval_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor lse, Tensor delta, "
        "Tensor lo, Tensor hi, float scale, int block, int chunk, int parts, float dropout, int seed, "
        "float softcap, Tensor? alibi_slopes, int dropout_head_start, int dropout_row_start, int dropout_key_start) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("release_kept_memory() -> int", &release_kept_memory);
}

TORCH_LIBRARY_IMPL(attnkit_native, CPU, m) {
  m.impl("interval_forward", &interval_forward);
  m.impl("interval_backward", &interval_backward);
}
