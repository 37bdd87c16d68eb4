// attnkit's own CPU kernel: attention where each query row attends one interval of keys.
//
// Every structured mask in attnkit.masks gives each query row i one interval [lo[i], hi[i]) of
// keys (causal, sliding window, documents, prefix-LM, padding and their intersections). This
// kernel cuts the rows into blocks; a block computes scores only over the span of its rows'
// intervals, masks each row to its own interval while taking the softmax (no mask tensor), and
// multiplies by the values: two matrix products per block through the BLAS sgemm that PyTorch
// itself links (MKL on x86), with a flash-style running softmax when the span is longer than
// one chunk of keys. Compared with PyTorch's fused CPU kernel on the same blocks it avoids the
// kernel's fixed 512-key chunks (a 512 window's 543-key span would run as 512 + 31), the
// additive mask pass, and partial outputs merged in Python.
//
// Layout: query [B, H, Lq, D], key [B, Hkv, Lk, D], value [B, Hkv, Lk, Dv], float32, any strides
// with a unit last-dim stride; lo, hi int64 [S, Lq] with S = 1 (shared) or B. H % Hkv == 0 (GQA:
// query head h reads key/value head h / (H / Hkv)). Returns output [B, H, Lq, Dv] (contiguous)
// and the natural-log sum-exp [B, H, Lq] (before dropout); a row with no key gives zeros and -inf.
// Optional dropout on the weights, from a seed (see Dropout). interval_backward (further down)
// gives the gradients from the same intervals, seed and the saved lse.
//
// Built by attnkit/_backends/native/__init__.py with -O3 -mavx2 -mfma; the row loops use AVX2
// intrinsics (no -ffast-math, which would let the compiler assume there are no infinities).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Column-major C = alpha * op(A) op(B) + beta * C, as BLAS defines it.
void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const int LDA = static_cast<int>(lda), LDB = static_cast<int>(ldb), LDC = static_cast<int>(ldc);
  sgemm_(&transa, &transb, &M, &N, &K, &alpha, a, &LDA, b, &LDB, &beta, c, &LDC);
}

// exp(x) for x <= 0, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the classic
// degree-6 single-precision polynomial, 2^n put in the exponent bits. Below -87 (where expf turns
// subnormal) and at -inf the result is exactly 0; a NaN stays NaN, so a NaN score reaches the
// row's sum and output instead of passing for a weight of 0. The same steps on 8 lanes and on one
// float (row tails).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 cut = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, cut, _CMP_LT_OQ);  // false for NaN
  x = _mm256_max_ps(cut, x);  // maxps returns its second operand, x, when x is NaN
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // a NaN lane converts to INT_MIN, whose exponent bits give 2^0: p (NaN) passes unchanged
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float exp_nonpositive(float x) {
  if (!(x >= -87.0f)) return x < -87.0f ? 0.0f : x;  // underflow (and -inf) to 0; NaN stays
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return p * two_n;
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
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
};

struct DropoutRow {
  uint32_t a = 0, c = 0;
};

inline Dropout make_dropout(double p, int64_t seed) {
  Dropout d;
  if (p > 0.0) {
    d.active = true;
    d.threshold = static_cast<uint32_t>(std::min(std::floor(p * 4294967296.0), 4294967295.0));
    d.keep_scale = static_cast<float>(1.0 / (1.0 - p));
    d.seed_low = static_cast<uint32_t>(static_cast<uint64_t>(seed));
    d.seed_high = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  }
  return d;
}

inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

inline uint32_t mix(uint32_t x, uint32_t v) { return fmix32(x ^ fmix32(v + 0x9E3779B9u)); }

// The two keys of query row i of head h of sequence b.
inline DropoutRow dropout_row(const Dropout& d, int64_t b, int64_t h, int64_t i) {
  const auto chain = [&](uint32_t x) {
    return mix(mix(mix(x, static_cast<uint32_t>(b)), static_cast<uint32_t>(h)), static_cast<uint32_t>(i));
  };
  return {chain(d.seed_low), chain(d.seed_high)};
}

inline __m256i fmix32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// The factor of weight (row, key): 1 / (1 - p) when kept, 0 when dropped.
inline float dropout_factor(const Dropout& d, DropoutRow r, int64_t key) {
  const uint32_t bits = fmix32(fmix32(static_cast<uint32_t>(key) ^ r.a) ^ r.c);
  return bits >= d.threshold ? d.keep_scale : 0.0f;
}

// The factors of keys key .. key + 7.
inline __m256 dropout_factor8(const Dropout& d, DropoutRow r, int64_t key) {
  const __m256i keys = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(key)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i bits = fmix32(_mm256_xor_si256(keys, _mm256_set1_epi32(static_cast<int>(r.a))));
  bits = fmix32(_mm256_xor_si256(bits, _mm256_set1_epi32(static_cast<int>(r.c))));
  // unsigned bits >= threshold, as a signed comparison of both with the sign bit flipped
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i below = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(d.threshold)), sign),
                                           _mm256_xor_si256(bits, sign));
  return _mm256_andnot_ps(_mm256_castsi256_ps(below), _mm256_set1_ps(d.keep_scale));
}

// Softmax numerators of one row over its keys [lo, hi) of a chunk (scores elsewhere become 0),
// folded into the row's running max and sum, then dropped out (the sum is taken before: dropout
// acts on the normalised weights); returns the factor that rescales its accumulator. `key0` is the
// chunk's first key. A NaN or +inf score makes the sum NaN (exp(NaN) and exp(inf - inf)), which
// the caller turns into a NaN row; scores of -inf weigh 0, and a chunk whose scores are all -inf
// adds nothing (rather than exp(-inf + inf)). The max may skip a NaN (maxps returns its second
// operand): the NaN's own exp still reaches the sum.
inline float softmax_chunk_row(float* row, int64_t width, int64_t lo, int64_t hi, float& row_max, float& row_sum,
                               const Dropout& dropout, DropoutRow dropout_keys, int64_t key0) {
  if (lo >= hi) {
    std::fill(row, row + width, 0.0f);
    return 1.0f;
  }
  __m256 max8 = _mm256_set1_ps(kNegInf);
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(row + t));
  float chunk_max = horizontal_max(max8);
  for (; t < hi; ++t) chunk_max = std::max(chunk_max, row[t]);
  const float new_max = std::max(row_max, chunk_max);
  if (new_max == kNegInf) {  // the max passes over NaN: only -inf and NaN scores come here
    if (std::any_of(row + lo, row + hi, [](float x) { return std::isnan(x); })) {
      row_sum = std::numeric_limits<float>::quiet_NaN();
    }
    std::fill(row, row + width, 0.0f);
    return 1.0f;
  }
  const float rescale = row_max == kNegInf ? 0.0f : exp_nonpositive(row_max - new_max);
  std::fill(row, row + lo, 0.0f);
  const __m256 shift = _mm256_set1_ps(new_max);
  __m256 sum8 = _mm256_setzero_ps();
  for (t = lo; t + 8 <= hi; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + t), shift));
    sum8 = _mm256_add_ps(sum8, e);
    _mm256_storeu_ps(row + t, dropout.active ? _mm256_mul_ps(e, dropout_factor8(dropout, dropout_keys, key0 + t)) : e);
  }
  float sum = horizontal_sum(sum8);
  for (; t < hi; ++t) {
    const float e = exp_nonpositive(row[t] - new_max);
    sum += e;
    row[t] = dropout.active ? e * dropout_factor(dropout, dropout_keys, key0 + t) : e;
  }
  std::fill(row + hi, row + width, 0.0f);
  row_sum = row_sum * rescale + sum;
  row_max = new_max;
  return rescale;
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

// Zeroes x[0, n); ORs into `bad` what tells whether every x was finite before (see scale_and_check).
inline void zero_and_check(float* x, int64_t n, __m256& bad) {
  const __m256 zero = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 v = _mm256_loadu_ps(x + t);
    bad = _mm256_or_ps(bad, _mm256_sub_ps(v, v));
    _mm256_storeu_ps(x + t, zero);
  }
  for (; t < n; ++t) {
    bad = _mm256_or_ps(bad, _mm256_set1_ps(x[t] - x[t]));
    x[t] = 0.0f;
  }
}

// One query row by its attended pairs only, for rows where the block's products met a non-finite
// value: scores s_t = scale q . k_t for t in [lo, hi), weights exp(s_t - max) / sum, output
// sum_t w_t f_t v_t in IEEE arithmetic (a weight of 0 times an infinite value is NaN), lse. A NaN
// or +inf score makes the row NaN; all scores -inf (or none) make it zeros with lse -inf. `s` is
// scratch for the row's scores.
void exact_forward_row(const float* q_row, const float* k_head, int64_t k2s, const float* v_head, int64_t v2s,
                       int64_t D, int64_t Dv, int64_t lo, int64_t hi, float scale, const Dropout& dropout,
                       DropoutRow dropout_keys, std::vector<float>& s, float* out, float* lse) {
  float row_max = kNegInf;
  bool nan_row = false;
  if (static_cast<int64_t>(s.size()) < hi - lo) s.resize(hi - lo);
  for (int64_t t = lo; t < hi; ++t) {
    const float x = scale * dot(q_row, k_head + t * k2s, D);
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

std::tuple<at::Tensor, at::Tensor> interval_forward(const at::Tensor& query, const at::Tensor& key,
                                                    const at::Tensor& value, const at::Tensor& lo_rows,
                                                    const at::Tensor& hi_rows, double scale, int64_t block,
                                                    int64_t chunk, double dropout_p, int64_t seed) {
  at::Tensor lo, hi;
  const Sizes n = check_inputs("interval_forward", query, key, value, lo_rows, hi_rows, lo, hi);
  const int64_t B = n.B, H = n.H, Lq = n.Lq, D = n.D, Hkv = n.Hkv, Lk = n.Lk, Dv = n.Dv;  // the lambdas capture these
  TORCH_CHECK(block > 0 && chunk > 0, "interval_forward: block and chunk must be positive");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "interval_forward: dropout must be in [0, 1)");
  const Dropout dropout = make_dropout(dropout_p, seed);

  at::Tensor out = at::empty({B, H, Lq, Dv}, query.options());
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
  const int64_t shared_rows = lo.size(0) == 1;

  // Tasks run (batch, head, block) in order: a thread's consecutive blocks share most keys.
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block * chunk), row_max(block), row_sum(block), rescale(block);
    std::vector<int64_t> row_lo(block), row_hi(block);
    std::vector<DropoutRow> row_keys(block);
    std::vector<float> exact_scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (H * blocks), h = (task / blocks) % H, first = (task % blocks) * block;
      const int64_t rows = std::min(block, Lq - first);
      const int64_t* lo_seq = lo_data + (shared_rows ? 0 : b * Lq) + first;
      const int64_t* hi_seq = hi_data + (shared_rows ? 0 : b * Lq) + first;
      const auto [span_lo, span_hi] = block_span(lo_seq, hi_seq, rows, Lk, nullptr, row_lo.data(), row_hi.data());
      for (int64_t j = 0; j < rows; ++j) {
        row_max[j] = kNegInf;
        row_sum[j] = 0.0f;
        if (dropout.active) row_keys[j] = dropout_row(dropout, b, h, first + j);
      }
      const float* q_block = q + b * q0s + h * q1s + first * q2s;
      const float* k_head = k + b * k0s + (h / group) * k1s;
      const float* v_head = v + b * v0s + (h / group) * v1s;
      float* o_block = o + ((b * H + h) * Lq + first) * Dv;
      float* l_block = l + (b * H + h) * Lq + first;
      if (span_lo >= span_hi) {  // no row of the block attends any key
        std::fill(o_block, o_block + rows * Dv, 0.0f);
        std::fill(l_block, l_block + rows, kNegInf);
        continue;
      }
      for (int64_t c0 = span_lo; c0 < span_hi; c0 += chunk) {
        const int64_t width = std::min(chunk, span_hi - c0);
        float* s = scores.data();
        // scores[j][t] = scale * q_j . k_(c0+t): column-major S^T (width x rows) = K_chunk Q^T.
        gemm('T', 'N', width, rows, D, static_cast<float>(scale), k_head + c0 * k2s, k2s, q_block, q2s, 0.0f, s,
             width);
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t a = std::clamp<int64_t>(row_lo[j] - c0, 0, width);
          const int64_t z = std::clamp<int64_t>(row_hi[j] - c0, 0, width);
          rescale[j] = softmax_chunk_row(s + j * width, width, a, z, row_max[j], row_sum[j], dropout, row_keys[j], c0);
        }
        const bool first_chunk = c0 == span_lo;
        if (!first_chunk) {
          for (int64_t j = 0; j < rows; ++j) {
            if (rescale[j] != 1.0f) {
              float* acc = o_block + j * Dv;
              for (int64_t d = 0; d < Dv; ++d) acc[d] *= rescale[j];
            }
          }
        }
        // out[j] (+)= sum_t p[j][t] v_(c0+t): column-major O^T (Dv x rows) = V_chunk^T P^T.
        if (Dv > 0) {  // BLAS rejects a leading dimension of 0
          gemm('N', 'N', Dv, rows, width, 1.0f, v_head + c0 * v2s, v2s, s, width, first_chunk ? 0.0f : 1.0f,
               o_block, Dv);
        }
      }
      // A non-finite value in an accumulator came from a value the block multiplied by a weight:
      // a masked key's (weight 0, which must not count) or an attended one's, where the running
      // rescaling may have turned a weight into 0 early; such rows are redone by attended pairs.
      for (int64_t j = 0; j < rows; ++j) {
        float* acc = o_block + j * Dv;
        const float sum = row_sum[j];
        if (std::isnan(sum)) {  // a NaN or +inf score among the attended ones
          std::fill(acc, acc + Dv, std::numeric_limits<float>::quiet_NaN());
          l_block[j] = std::numeric_limits<float>::quiet_NaN();
        } else if (sum > 0.0f) {
          if (scale_and_check(acc, Dv, 1.0f / sum)) {
            l_block[j] = row_max[j] + std::log(sum);
          } else {
            exact_forward_row(q_block + j * q2s, k_head, k2s, v_head, v2s, D, Dv, row_lo[j], row_hi[j],
                              static_cast<float>(scale), dropout, row_keys[j], exact_scores, acc, l_block + j);
          }
        } else {  // no key, or only scores of -inf
          std::fill(acc, acc + Dv, 0.0f);
          l_block[j] = kNegInf;
        }
      }
    }
  });
  return {out, lse};
}

// P = exp(row - lse) on the row's keys [lo, hi) of a chunk, 0 elsewhere (the softmax weights,
// recomputed from the forward's log-sum-exp: no running max is needed). The scores it zeroes are
// checked into `bad` first: a non-finite one there would reach dQ or dK through a weight of 0.
inline void weights_chunk_row(float* row, int64_t width, int64_t lo, int64_t hi, float lse, __m256& bad) {
  zero_and_check(row, lo, bad);
  const __m256 shift = _mm256_set1_ps(lse), zero = _mm256_setzero_ps();
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) {
    // min(0, .): a recomputed score may exceed the forward's lse by a rounding error (minps
    // returns its second operand, a NaN, when there is one)
    const __m256 x = _mm256_min_ps(zero, _mm256_sub_ps(_mm256_loadu_ps(row + t), shift));
    _mm256_storeu_ps(row + t, exp_nonpositive(x));
  }
  for (; t < hi; ++t) row[t] = exp_nonpositive(std::min(row[t] - lse, 0.0f));  // std::min keeps a NaN first argument
  zero_and_check(row + hi, width - hi, bad);
}

// dS = scale * P * (f * dP - delta) in place of dP, for one row of a chunk, f the dropout factor
// of each key (0 or 1 / (1 - p); 1 without dropout): the output used f * P. With dropout P also
// becomes f * P, for dV. Outside the row's keys [lo, hi), P is 0 and so is dS; the dP it zeroes
// are checked into `bad` first (a non-finite one means a non-finite dO, which would reach dV
// through a weight of 0).
inline void score_grad_row(float* p, float* dp, int64_t width, int64_t lo, int64_t hi, float delta, float scale,
                           const Dropout& dropout, DropoutRow keys, int64_t key0, __m256& bad) {
  zero_and_check(dp, lo, bad);
  const __m256 d8 = _mm256_set1_ps(delta), s8 = _mm256_set1_ps(scale), one = _mm256_set1_ps(1.0f);
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) {
    const __m256 f = dropout.active ? dropout_factor8(dropout, keys, key0 + t) : one;
    const __m256 weight = _mm256_loadu_ps(p + t);
    const __m256 g = _mm256_mul_ps(weight, _mm256_sub_ps(_mm256_mul_ps(f, _mm256_loadu_ps(dp + t)), d8));
    _mm256_storeu_ps(dp + t, _mm256_mul_ps(g, s8));
    if (dropout.active) _mm256_storeu_ps(p + t, _mm256_mul_ps(weight, f));
  }
  for (; t < hi; ++t) {
    const float f = dropout.active ? dropout_factor(dropout, keys, key0 + t) : 1.0f;
    dp[t] = scale * (p[t] * (f * dp[t] - delta));
    p[t] *= f;
  }
  zero_and_check(dp + hi, width - hi, bad);
}

// One chunk's share of dQ, dK and dV by attended pairs only, from its P (with dropout f * P) and
// dS: for a chunk whose zeroed scores or dP held a non-finite value, which the three products
// would have multiplied by 0 into NaN. Within the attended pairs it is IEEE arithmetic like the
// products (0 * inf is NaN). `row_lo`, `row_hi` as block_span gives them (empty for rows whose lse
// is -inf).
void exact_backward_chunk(int64_t rows, int64_t width, int64_t c0, const int64_t* row_lo, const int64_t* row_hi,
                          const float* p, const float* ds, const float* q_block, int64_t q2s,
                          const float* go_block, int64_t g2s, const float* k_head, int64_t k2s, float* dq_block,
                          float* dk_head, float* dv_head, int64_t D, int64_t Dv, bool first_chunk) {
  if (first_chunk) std::fill(dq_block, dq_block + rows * D, 0.0f);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t a = std::clamp<int64_t>(row_lo[j] - c0, 0, width), z = std::clamp<int64_t>(row_hi[j] - c0, 0, width);
    const float* q_row = q_block + j * q2s;
    const float* go_row = go_block + j * g2s;
    float* dq_row = dq_block + j * D;
    for (int64_t t = a; t < z; ++t) {
      const float g = ds[j * width + t];
      const int64_t key = c0 + t;
      axpy(dq_row, g, k_head + key * k2s, D);
      axpy(dk_head + key * D, g, q_row, D);
      axpy(dv_head + key * Dv, p[j * width + t], go_row, Dv);
    }
  }
}

// Gradients of interval_forward: given grad_out [B, H, Lq, Dv], the forward's lse [B, H, Lq] and
// delta [B, H, Lq] = rowsum(grad_out * out) - grad_lse, returns (dq, dk, dv) in float32, each
// contiguous in the shape of its input. FlashAttention's backward, by query blocks: per block and
// chunk of keys, P from the lse, dP = dO V^T, dS = scale * P * (f dP - delta) with f the dropout
// factors (1 without dropout), dV += (f P)^T dO, dQ += dS K, dK += dS^T Q; five sgemm calls,
// nothing of size Lq x Lk is ever stored.
// Blocks of different rows add into the same key rows, so a task owns whole (batch, kv head)
// pairs; with fewer pairs than threads, each pair's rows are cut into `parts` that add into
// their own copy of dK and dV, summed at the end (`parts` copies: still O(L) memory).
std::tuple<at::Tensor, at::Tensor, at::Tensor> interval_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& lse_rows, const at::Tensor& delta_rows, const at::Tensor& lo_rows, const at::Tensor& hi_rows,
    double scale, int64_t block, int64_t chunk, int64_t parts, double dropout_p, int64_t seed) {
  at::Tensor lo, hi;
  const Sizes n = check_inputs("interval_backward", query, key, value, lo_rows, hi_rows, lo, hi);
  const int64_t B = n.B, H = n.H, Lq = n.Lq, D = n.D, Hkv = n.Hkv, Lk = n.Lk, Dv = n.Dv;  // the lambdas capture these
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == B && grad_out.size(1) == H && grad_out.size(2) == Lq &&
                  grad_out.size(3) == Dv, "interval_backward: grad_out must be [B, H, Lq, Dv]");
  TORCH_CHECK(grad_out.scalar_type() == at::kFloat && grad_out.device().is_cpu() && grad_out.stride(3) == 1,
              "interval_backward: grad_out must be float32 CPU with a unit stride along the head dimension");
  TORCH_CHECK(block > 0 && chunk > 0 && parts > 0, "interval_backward: block, chunk and parts must be positive");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "interval_backward: dropout must be in [0, 1)");
  const Dropout dropout = make_dropout(dropout_p, seed);
  const at::Tensor lse = lse_rows.contiguous(), delta = delta_rows.contiguous();
  TORCH_CHECK(lse.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat &&
                  lse.sizes() == at::IntArrayRef({B, H, Lq}) && delta.sizes() == lse.sizes(),
              "interval_backward: lse and delta must be float32 [B, H, Lq]");

  at::Tensor dq = at::empty({B, H, Lq, D}, query.options());  // each block writes its rows
  at::Tensor dk = at::zeros({B, Hkv, parts, Lk, D}, query.options());
  at::Tensor dv = at::zeros({B, Hkv, parts, Lk, Dv}, query.options());
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
    const bool shared_rows = lo.size(0) == 1;

    at::parallel_for(0, B * Hkv * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> weights(block * chunk), grads(block * chunk);
      std::vector<int64_t> row_lo(block), row_hi(block);
      std::vector<DropoutRow> row_keys(block);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / (Hkv * parts), kv = (task / parts) % Hkv, part = task % parts;
        const int64_t* lo_seq = lo_data + (shared_rows ? 0 : b * Lq);
        const int64_t* hi_seq = hi_data + (shared_rows ? 0 : b * Lq);
        const float* k_head = k + b * k0s + kv * k1s;
        const float* v_head = v + b * v0s + kv * v1s;
        float* dk_head = dk_data + ((b * Hkv + kv) * parts + part) * Lk * D;
        float* dv_head = dv_data + ((b * Hkv + kv) * parts + part) * Lk * Dv;
        const int64_t block_end = std::min(blocks, (part + 1) * blocks_per_part);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          for (int64_t index = part * blocks_per_part; index < block_end; ++index) {
            const int64_t first = index * block, rows = std::min(block, Lq - first);
            const float* l_block = l + (b * H + h) * Lq + first;
            const auto [span_lo, span_hi] = block_span(lo_seq + first, hi_seq + first, rows, Lk, l_block,
                                                       row_lo.data(), row_hi.data());
            for (int64_t j = 0; j < rows && dropout.active; ++j) {
              row_keys[j] = dropout_row(dropout, b, h, first + j);
            }
            float* dq_block = dq_data + ((b * H + h) * Lq + first) * D;
            if (span_lo >= span_hi) {  // no row of the block attends any key
              std::fill(dq_block, dq_block + rows * D, 0.0f);
              continue;
            }
            const float* q_block = q + b * q0s + h * q1s + first * q2s;
            const float* go_block = go + b * g0s + h * g1s + first * g2s;
            const float* delta_block = dl + (b * H + h) * Lq + first;
            for (int64_t c0 = span_lo; c0 < span_hi; c0 += chunk) {
              const int64_t width = std::min(chunk, span_hi - c0);
              float* p = weights.data();
              float* ds = grads.data();
              __m256 bad = _mm256_setzero_ps();
              // Row-major [rows][width] buffers are column-major (width x rows) for BLAS.
              gemm('T', 'N', width, rows, D, static_cast<float>(scale), k_head + c0 * k2s, k2s, q_block, q2s, 0.0f,
                   p, width);
              for (int64_t j = 0; j < rows; ++j) {
                const int64_t a = std::clamp<int64_t>(row_lo[j] - c0, 0, width);
                weights_chunk_row(p + j * width, width, a, std::clamp<int64_t>(row_hi[j] - c0, a, width), l_block[j],
                                  bad);
              }
              if (Dv > 0) {  // BLAS rejects a leading dimension of 0
                // dP^T (width x rows) = V_chunk (width x Dv) dO^T (Dv x rows)
                gemm('T', 'N', width, rows, Dv, 1.0f, v_head + c0 * v2s, v2s, go_block, g2s, 0.0f, ds, width);
              } else {
                std::fill(ds, ds + rows * width, 0.0f);
              }
              for (int64_t j = 0; j < rows; ++j) {  // with dropout, also turns P into the weights the output used
                const int64_t a = std::clamp<int64_t>(row_lo[j] - c0, 0, width);
                score_grad_row(p + j * width, ds + j * width, width, a, std::clamp<int64_t>(row_hi[j] - c0, a, width),
                               delta_block[j], static_cast<float>(scale), dropout, row_keys[j], c0, bad);
              }
              const bool first_chunk = c0 == span_lo;
              if (any_bits(bad)) {
                exact_backward_chunk(rows, width, c0, row_lo.data(), row_hi.data(), p, ds, q_block, q2s,
                                     go_block, g2s, k_head, k2s, dq_block, dk_head, dv_head, D, Dv, first_chunk);
                continue;
              }
              if (Dv > 0) {
                // dV_chunk^T (Dv x width) += dO^T (Dv x rows) P (rows x width)
                gemm('N', 'T', Dv, width, rows, 1.0f, go_block, g2s, p, width, 1.0f, dv_head + c0 * Dv, Dv);
              }
              if (D > 0) {
                // dQ^T (D x rows) (+)= K_chunk^T (D x width) dS^T (width x rows)
                gemm('N', 'N', D, rows, width, 1.0f, k_head + c0 * k2s, k2s, ds, width, first_chunk ? 0.0f : 1.0f,
                     dq_block, D);
                // dK_chunk^T (D x width) += Q^T (D x rows) dS (rows x width)
                gemm('N', 'T', D, width, rows, 1.0f, q_block, q2s, ds, width, 1.0f, dk_head + c0 * D, D);
              }
            }
          }
        }
      }
    });
  }
  return {dq, parts == 1 ? dk.squeeze(2) : dk.sum(2), parts == 1 ? dv.squeeze(2) : dv.sum(2)};
}

}  // namespace

TORCH_LIBRARY(attnkit_native, m) {
  m.def("interval_forward(Tensor query, Tensor key, Tensor value, Tensor lo, Tensor hi, float scale, int block, "
        "int chunk, float dropout, int seed) -> (Tensor, Tensor)");
  m.def("interval_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor lse, Tensor delta, "
        "Tensor lo, Tensor hi, float scale, int block, int chunk, int parts, float dropout, int seed) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit_native, CPU, m) {
  m.impl("interval_forward", &interval_forward);
  m.impl("interval_backward", &interval_backward);
}
