// The bfloat16 products on AMX tiles (bfloat16 in, float32 accumulated), the forward's two and the
// backward's five, where the CPU has AMX-BF16 and the OS grants the tile state; and the packed
// layouts they read, which the AVX512-BF16 dot products (dots.h) read too where there are no tiles.
// products.h chooses among the two and the float32-convert path (half.h).
//
// The products keep the float32 kernel's layouts, so everything between them (softmax.h: masks,
// soft-capping, ALiBi, dropout, the running max) is the same code:
//   scores  S[t][r] = sum_d K[t][d] Q[r][d]: S^T = K Q^T, tiles of 16 keys x 16 rows. A is the key
//           rows as the call holds them (read in place), B the block's query rows packed once per
//           block into the tile layout (pairs of features, 32-bit words [pair][row]).
//   values  Ot[dv][r] += sum_t V[t][dv] P[t][r]: tiles of 16 features x 16 rows. A is V^T, which a
//           thread keeps for the (sequence, head) it works on (TransposedRows, extended as its
//           blocks move along the keys, so each key is transposed about once per thread), B the
//           chunk's weights, rounded to bfloat16 and packed by pairs of keys.
// The backward's dP = dO V^T is the scores' product (dO packed as the queries are), dQ^T the values'
// (K^T kept like V^T), and dV += (f P)^T dO, dK += dS^T Q the products over rows below.
// The forward's weights are rounded to bfloat16 for P V where PyTorch's fused bf16 CPU kernel
// rounds them so too (D == Dv, no score modifier, no dropout; forward.h), else taken as two
// bfloat16 parts (split_halves: 2^-16 of the value instead of 2^-9). The backward's dV takes P by
// the same rule (two parts also where the caller asks, for sinks), and dQ and dK take dS in two
// parts always. Both keep the results within twice PyTorch's error where rounding once did not.
// The softmax, its sums, delta and the lse stay float32. A call takes this path when its dtype is
// bfloat16 and D % 32 == Dv % 32 == 0 (whole tiles; others convert). float16 takes it too, each
// value as two bfloat16 parts (below: "float16 on the bfloat16 tiles"), on the tiles only.
//
// Every tile is 16 rows x 64 bytes: tmm0-3 accumulate (2 x 2 tiles), tmm4-5 hold A, tmm6-7 B.
// The functions carry their ISA in a target attribute, so the library still loads on CPUs without
// it; matrix_units_available() asks at run time (CPUID, XCR0, and Linux's per-process tile permission).

#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "aligned.h"
#include "half.h"
#include "tiles.h"

#define ATTNKIT_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace attnkit_native {
namespace {

// The OS's saved vector state (XCR0), read once the CPU says it can be (OSXSAVE); 0 otherwise.
inline unsigned saved_state() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  // OSXSAVE
  unsigned xcr0 = 0, high = 0;
  asm volatile("xgetbv" : "=a"(xcr0), "=d"(high) : "c"(0));
  return xcr0;
}

// AVX-512 (F, BW, VL) and AVX512-BF16 on the CPU, and the OS saving the vector state they use
// (XCR0: SSE, AVX, opmask and both halves of the upper ZMM registers): the dot products of dots.h,
// and the conversions the AMX path packs its operands with.
bool cpu_has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31)))) return false;  // F, BW, VL
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;  // AVX512-BF16
  return (saved_state() & 0xE6u) == 0xE6u;
}

// AMX-BF16 and AVX512-BF16 (its conversions) on the CPU, the tile state enabled by the OS (XCR0
// bits 17-18), and Linux's permission to use it in this process (arch_prctl ARCH_REQ_XCOMP_PERM;
// refused on kernels before 5.16 and where a hypervisor hides the state).
bool cpu_grants_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!cpu_has_avx512_bf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d & (1u << 24)) && (d & (1u << 22)))) return false;  // AMX-TILE, AMX-BF16
  if ((saved_state() & (3u << 17)) != (3u << 17)) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

bool matrix_units_available() {
  static const bool granted = cpu_grants_amx_bf16();
  return granted;
}

constexpr int64_t kTile = 16;     // rows of a tile, and float32 columns of an accumulator
constexpr int64_t kTileK = 32;    // bfloat16 elements in a tile row: the products' inner step
constexpr int64_t kMaxTransposedBytes = int64_t{64} << 20;  // per thread; longer keys convert instead

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The call's bfloat16 products can run on the packed layouts below (the AMX tiles', or the dot
// products' of dots.h): bfloat16, whole tiles of features (D and Dv multiples of 32: the backward's
// dP = dO V^T steps over Dv as the scores step over D, and both passes must compute the scores
// alike), V^T (and the backward's K^T) within bounds, query, key and value rows an even number of
// elements apart (they are moved by pairs of features). products.h decides which units multiply.
bool bf16_layouts_fit(at::ScalarType type, int64_t D, int64_t Dv, int64_t Lk, int64_t q_row_stride,
                      int64_t k_row_stride, int64_t v_row_stride) {
  return type == at::kBFloat16 && D % kTileK == 0 && Dv % kTileK == 0 && q_row_stride % 2 == 0 &&
         k_row_stride % 2 == 0 && v_row_stride % 2 == 0 &&
         std::max(D, Dv) * (round_up(Lk, kTileK) + kTileK) * 2 <= kMaxTransposedBytes;
}

// float16's two-part layouts fit the call (the rows split below): whole tiles of features, K^T
// and V^T (the backward's and the forward's) in two parts within bounds, key and value rows an
// even number of elements apart (transposed by pairs of features).
bool float16_layouts_fit(at::ScalarType type, int64_t D, int64_t Dv, int64_t Lk, int64_t k_row_stride,
                         int64_t v_row_stride) {
  return type == at::kHalf && D % kTileK == 0 && Dv % kTileK == 0 && k_row_stride % 2 == 0 && v_row_stride % 2 == 0 &&
         std::max(D, Dv) * (round_up(Lk, kTileK) + kTileK) * 2 * 2 <= kMaxTransposedBytes;
}

// Keys a chunk takes on the tiles at least: the accumulators then load and store once per block
// where the float32 tiles' 64-key chunks did so at every chunk (Xeon with AMX, L = 16384, H = 8,
// D = 64, 2 threads, bf16 forward: window 512 66 / 57 / 56 / 53-57 / 44-54 / 53-58 ms with chunks
// of 64 / 128 / 256 / 512 / 1024 / 2048 keys, 8 documents 109 / 102 / 99 / 95 / 78-92 / 88-96).
constexpr int64_t kAmxChunk = 1024;

// A thread's tile configuration, set for its work and released after (the OS then need not save
// the tile data on a context switch).
class TileScope {
 public:
  explicit TileScope(bool on) : on_(on) {
    if (on_) configure();
  }
  ~TileScope() {
    if (on_) release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  ATTNKIT_AMX static void configure() {
    Config config;
    for (int i = 0; i < 8; ++i) config.colsb[i] = 64, config.rows[i] = kTile;
    // the whole object as the operand: GCC 12's _tile_loadconfig names only its first 8 bytes, and
    // the stores of the tiles' shapes were dropped as dead (every tile instruction then faulted)
    asm volatile("ldtilecfg %0" : : "m"(config));
  }
  ATTNKIT_AMX static void release() { _tile_release(); }
  bool on_;
};

// Row i of (b, h) of a bfloat16 tensor, as its 16-bit elements.
inline const uint16_t* bf16_row(const Rows& t, int64_t b, int64_t h, int64_t i) {
  return reinterpret_cast<const uint16_t*>(t.at(b, h, i));
}

// Two rows of 16 bfloat16 each (elements 0-15 and 16-31) as 16 pairs of 32-bit words (a0, b0, a1,
// b1, ...): B's layout for products over those two rows' index.
ATTNKIT_AMX inline __m512i pairs_of_halves(__m512i both) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, both);
}

// The block's query rows in B's layout: for query tile qt (rows 16 qt ..) the 32-bit word
// [qt][pair][r] holds q[16 qt + r][2 pair .. 2 pair + 1]; rows past `rows` are 0. q2s in elements
// (even): pairs of features as 32-bit words, transposed 8 x 8 at a time (tiles.h, bit for bit;
// word by word this took about as long as the block's scores on the tiles).
void pack_queries(const uint16_t* q, int64_t q2s, int64_t rows, int64_t D, int64_t rs, uint32_t* packed) {
  const int64_t pairs = D / 2;
  if (rows < rs) std::fill(packed, packed + rs * pairs, 0u);
  for (int64_t qt = 0; qt * kTile < rows; ++qt) {
    transpose(reinterpret_cast<const float*>(q + qt * kTile * q2s), q2s / 2, std::min(kTile, rows - qt * kTile),
              pairs, reinterpret_cast<float*>(packed + qt * pairs * kTile), kTile);
  }
}

// S[t][r] = sum_d K[t][d] Q[r][d] for t < round_up(W, 16) (rows past W are scratch), r < rs. `k`:
// the chunk's first key row (k2s elements apart), `readable` rows of it exist; a last tile reaching
// past them is read from `spare` (16 x D), padded with zeros.
ATTNKIT_AMX void amx_scores(const uint16_t* k, int64_t k2s, int64_t W, int64_t readable, int64_t D,
                            const uint32_t* queries, int64_t rs, float* s, uint16_t* spare) {
  const int64_t key_tiles = (W + kTile - 1) / kTile, steps = D / kTileK, pairs = D / 2;
  const int64_t ss = rs * 4;
  const auto rows_of = [&](int64_t kt, const uint16_t*& at, int64_t& stride) {
    if ((kt + 1) * kTile <= readable) {
      at = k + kt * kTile * k2s, stride = k2s * 2;
      return;
    }
    const int64_t have = std::max<int64_t>(0, readable - kt * kTile);
    for (int64_t j = 0; j < kTile; ++j) {
      if (j < have) {
        std::memcpy(spare + j * D, k + (kt * kTile + j) * k2s, D * 2);
      } else {
        std::memset(spare + j * D, 0, D * 2);
      }
    }
    at = spare, stride = D * 2;
  };
  for (int64_t kt = 0; kt < key_tiles; kt += 2) {
    const bool two = kt + 1 < key_tiles;
    const uint16_t *a0 = nullptr, *a1 = nullptr;
    int64_t s0 = 0, s1 = 0;
    rows_of(kt, a0, s0);
    if (two) rows_of(kt + 1, a1, s1);  // the spare holds at most the last tile, which is kt + 1 here
    for (int64_t qt = 0; qt < rs / kTile; qt += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint32_t* b0 = queries + qt * pairs * kTile;
      const uint32_t* b1 = b0 + pairs * kTile;
      for (int64_t step = 0; step < steps; ++step) {
        _tile_loadd(4, a0 + step * kTileK, s0);
        _tile_loadd(6, b0 + step * kTile * kTile, 64);
        _tile_loadd(7, b1 + step * kTile * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a1 + step * kTileK, s1);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* out = s + kt * kTile * rs + qt * kTile;
      _tile_stored(0, out, ss);
      _tile_stored(1, out + kTile, ss);
      if (two) {
        _tile_stored(2, out + kTile * rs, ss);
        _tile_stored(3, out + kTile * rs + kTile, ss);
      }
    }
  }
}

// Two vectors of float32 as two parts of bfloat16 each, 32 elements (first's in 0-15): `high`, each
// element cut to its upper 16 bits, and `low`, what the cut left (exact in float32), rounded to
// nearest even. high + low holds the elements to 2^-16 of themselves, where rounding them once holds
// them to 2^-9. Cutting instead of rounding the high part leaves the low part one subtraction
// (elements here are finite: non-finite ones take the exact path). Elements below 2^-100 keep the
// high part alone: their low part could be subnormal, and a subnormal result or input costs the
// vector units a microcode assist (the window's weights, many near 0: the guard took a quarter off
// the packing's cycles). They add at most 2^-108 each to sums of weights that reach 1.
struct SplitHalves {
  __m512i high, low;
};
ATTNKIT_AMX inline __m512 cut_remainder(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i exponent = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000));
  const __mmask16 large = _mm512_cmpge_epu32_mask(exponent, _mm512_set1_epi32((127 - 100) << 23));
  const __m512 high = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm512_maskz_sub_ps(large, x, high);
}
ATTNKIT_AMX inline SplitHalves split_halves(__m512 first, __m512 second) {
  const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                             27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return {_mm512_permutex2var_epi16(_mm512_castps_si512(first), odd_words, _mm512_castps_si512(second)),
          (__m512i)_mm512_cvtne2ps_pbh(cut_remainder(second), cut_remainder(first))};
}

// ---- float16 on the bfloat16 tiles ----------------------------------------------------------------
//
// A float16 value has 11 significant bits: its upper 8 (cut) are a bfloat16 `high`, and the 3 left
// are exactly a bfloat16 `low` (split_halves, whose guard below 2^-100 no float16 meets: the least
// is 2^-24). So each product of two float16 rows is exact as x_h y_h + x_h y_l + x_l y_h + x_l y_l
// on the tiles, which sum each in float32. The forward keeps the first three and drops x_l y_l,
// at most 2^-18 of |x| |y| per term (the float32-convert path's sums round 64 terms to about 2^-18
// of their magnitude too). The rows are laid side by side so the scores' product runs unchanged
// over three times the features: keys [high | low | high] . queries [high | high | low]. Values
// take V^T's two parts (TransposedRows) against the weights' two: Vh Ph + Vh Pl + Vl Ph.
// A non-finite value does not split (inf - inf): a call that meets one runs again converted
// (products.h, run_on_units).

// Set when a split met a float16 NaN or inf on this thread (products.h's SplitWatch resets and reads it).
thread_local bool split_met_nonfinite = false;

// 32 float16 as their two bfloat16 parts (elements in order), noting a non-finite one.
ATTNKIT_AMX inline SplitHalves split_float16_lanes(__m512i x) {
  const __m512i exponent = _mm512_set1_epi16(0x7C00);
  if (_mm512_cmpeq_epi16_mask(_mm512_and_si512(x, exponent), exponent) != 0) split_met_nonfinite = true;
  return split_halves(_mm512_cvtph_ps(_mm512_castsi512_si256(x)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1)));
}

// n float16 (n a multiple of 32) from src as their two bfloat16 parts, into `high` and `low`.
ATTNKIT_AMX inline void split_float16(const uint16_t* src, int64_t n, uint16_t* high, uint16_t* low) {
  for (int64_t i = 0; i < n; i += kTileK) {
    const SplitHalves parts = split_float16_lanes(_mm512_loadu_si512(src + i));
    _mm512_storeu_si512(high + i, parts.high);
    _mm512_storeu_si512(low + i, parts.low);
  }
}

// A float16 row of n as the parts kLayout names in order ('h' high, 'l' low), n bfloat16 each
// (HeldRows' conversions; `type` is float16). The scores take keys as "hlh" against queries as
// "hhl": three of the four products. The backward's dP = dO V^T takes all four, values as "hlhl"
// against dO as "hhll": FlashAttention's row term delta = dO . O is exact to float32 there, and
// dS = P (dP - delta) takes their difference; a row on one key, whose dS is 0 in exact arithmetic,
// read the dropped dO_l V_l as a dq of 5e-5 where PyTorch's is 0.
template <char... kLayout>
ATTNKIT_AMX void split_row(const void* src, at::ScalarType, int64_t n, uint16_t* dst) {
  constexpr char layout[] = {kLayout...};
  constexpr int64_t parts = sizeof...(kLayout);
  int64_t high = 0, low = 0;
  while (layout[high] != 'h') ++high;
  while (layout[low] != 'l') ++low;
  split_float16(static_cast<const uint16_t*>(src), n, dst + high * n, dst + low * n);
  for (int64_t i = 0; i < parts; ++i) {
    if (i != high && i != low) std::memcpy(dst + i * n, dst + (layout[i] == 'h' ? high : low) * n, n * 2);
  }
}
constexpr auto split_key_row = split_row<'h', 'l', 'h'>;
constexpr auto split_query_row = split_row<'h', 'h', 'l'>;
constexpr auto split_value_row = split_row<'h', 'l', 'h', 'l'>;
constexpr auto split_grad_row = split_row<'h', 'h', 'l', 'l'>;

// Two keys' weights for a query tile's 16 rows (`first` the even key's) as the 16 words of one
// pair at `at`: rounded to bfloat16 (nearest even), or with kParts in two parts (split_halves),
// `packed` their upper 16 bits and `low` what those leave.
template <bool kParts>
ATTNKIT_AMX inline void store_weight_pair(__m512 first, __m512 second, uint32_t* packed, uint32_t* low) {
  if constexpr (kParts) {
    const SplitHalves parts = split_halves(first, second);  // first in lanes 0-15 of each part
    _mm512_storeu_si512(packed, pairs_of_halves(parts.high));
    _mm512_storeu_si512(low, pairs_of_halves(parts.low));
  } else {
    _mm512_storeu_si512(packed, pairs_of_halves((__m512i)_mm512_cvtne2ps_pbh(second, first)));  // first in 0-15
  }
}

// The chunk's weights P[t][r] (key-major, t < W, rows as given in s) in B's layout for the values:
// for query tile qt the 32-bit word [qt][pair][r] holds (P[2 pair][r], P[2 pair + 1][r]) rounded to
// bfloat16 (nearest even), pairs up to round_up(W, 32) / 2, keys past W as 0. With kParts, in two
// parts instead (store_weight_pair). The AVX2 build's step after its softmax; the AVX-512 build's
// softmax writes this layout itself (packed_softmax.h).
template <bool kParts>
ATTNKIT_AMX void pack_weights_as(const float* s, int64_t rs, int64_t W, uint32_t* packed, uint32_t* low) {
  const int64_t pairs = round_up(W, kTileK) / 2;
  for (int64_t qt = 0; qt < rs / kTile; ++qt) {
    const int64_t tile = qt * pairs * kTile;
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t t = 2 * p;
      const __m512 first = t < W ? _mm512_loadu_ps(s + t * rs + qt * kTile) : _mm512_setzero_ps();
      const __m512 second = t + 1 < W ? _mm512_loadu_ps(s + (t + 1) * rs + qt * kTile) : _mm512_setzero_ps();
      store_weight_pair<kParts>(first, second, packed + tile + p * kTile, kParts ? low + tile + p * kTile : nullptr);
    }
  }
}

// pack_weights_as: in two parts where `low` is given, else rounded once (the choice made once per
// chunk, not per pair).
ATTNKIT_AMX void pack_weights(const float* s, int64_t rs, int64_t W, uint32_t* packed, uint32_t* low = nullptr) {
  if (low != nullptr) {
    pack_weights_as<true>(s, rs, W, packed, low);
  } else {
    pack_weights_as<false>(s, rs, W, packed, nullptr);
  }
}

// One step of the values' 2 x 2 accumulators: tmm0-1 += A's first 16 features (tmm4) times B's
// two query tiles (tmm6-7), and with `two` tmm2-3 += the next 16 (tmm5) times the same; A is a
// 1 KiB block of 32 keys, rows 64 bytes apart.
ATTNKIT_AMX inline void accumulate_2x2(const uint16_t* a, const uint32_t* b0, const uint32_t* b1, bool two) {
  _tile_loadd(4, a, 64);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    _tile_loadd(5, a + kTile * kTileK, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Ot[dv][r] (+)= sum_t V^T[dv][t] P[t][r] over the chunk's W keys: `vt` is V^T's block of the
// chunk's first key (TransposedRows: blocks of 32 keys, Dv x 32 each), `weights` from pack_weights.
// The accumulators of group g start as start[g] says (rescaled in memory first). A last block
// reaching past W is read from `spare` (Dv x 32) with those keys as 0: they are keys no row of the
// chunk attends, and their weight of 0 times a NaN or inf there would reach the rows (the
// backward's dQ has no redo to catch it). `weights_low`, where given, is the weights' low part in
// the same layout (split_halves), joining each step's product.
ATTNKIT_AMX void amx_values(const uint16_t* vt, int64_t W, int64_t Dv, const uint32_t* weights, int64_t rs,
                            float* ot, const Start* start, const float* rescale, uint16_t* spare,
                            const uint32_t* weights_low = nullptr, const uint16_t* vt_low = nullptr) {
  const int64_t pairs = round_up(W, kTileK) / 2, steps = pairs / kTile, feature_tiles = Dv / kTile;
  const int64_t os = rs * 4, block = Dv * kTileK;
  const uint16_t* last = vt + (steps - 1) * block;  // the last step's block
  const uint16_t* last_low = vt_low ? vt_low + (steps - 1) * block : nullptr;
  if (W % kTileK != 0) {
    const __mmask32 keys = (1u << (W % kTileK)) - 1u;
    for (int64_t f = 0; f < Dv; ++f) {
      _mm512_storeu_si512(spare + f * kTileK, _mm512_maskz_loadu_epi16(keys, last + f * kTileK));
      if (vt_low) _mm512_storeu_si512(spare + block + f * kTileK, _mm512_maskz_loadu_epi16(keys, last_low + f * kTileK));
    }
    last = spare, last_low = spare + block;
  }
  const auto a_block = [&](int64_t step) { return step == steps - 1 ? last : vt + step * block; };
  const auto a_low_block = [&](int64_t step) { return step == steps - 1 ? last_low : vt_low + step * block; };
  for (int64_t g = 0; g < rs / kGroup; ++g) {
    if (start[g] == Start::kRescale) {
      const __m512 f0 = _mm512_loadu_ps(rescale + g * kGroup), f1 = _mm512_loadu_ps(rescale + g * kGroup + kTile);
      for (int64_t dv = 0; dv < Dv; ++dv) {
        float* row = ot + dv * rs + g * kGroup;
        _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), f0));
        _mm512_storeu_ps(row + kTile, _mm512_mul_ps(_mm512_loadu_ps(row + kTile), f1));
      }
    }
    const uint32_t* b0 = weights + 2 * g * pairs * kTile;
    const uint32_t* b1 = b0 + pairs * kTile;
    for (int64_t ft = 0; ft < feature_tiles; ft += 2) {
      const bool two = ft + 1 < feature_tiles;
      float* acc = ot + ft * kTile * rs + g * kGroup;
      if (start[g] == Start::kZero) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, acc, os);
        _tile_loadd(1, acc + kTile, os);
        if (two) {
          _tile_loadd(2, acc + kTile * rs, os);
          _tile_loadd(3, acc + kTile * rs + kTile, os);
        }
      }
      for (int64_t step = 0; step < steps; ++step) {
        const uint32_t *b0_step = b0 + step * kTile * kTile, *b1_step = b1 + step * kTile * kTile;
        accumulate_2x2(a_block(step) + ft * kTile * kTileK, b0_step, b1_step, two);
        if (weights_low != nullptr) {
          _tile_loadd(6, weights_low + (b0_step - weights), 64);
          _tile_loadd(7, weights_low + (b1_step - weights), 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        if (vt_low != nullptr) {  // float16: V's low part against the weights' high part
          accumulate_2x2(a_low_block(step) + ft * kTile * kTileK, b0_step, b1_step, two);
        }
      }
      _tile_stored(0, acc, os);
      _tile_stored(1, acc + kTile, os);
      if (two) {
        _tile_stored(2, acc + kTile * rs, os);
        _tile_stored(3, acc + kTile * rs + kTile, os);
      }
    }
  }
}

// ---- The backward's products over rows: dV += (f P)^T dO and dK += dS^T Q ------------------------
//
// Out[t][c] += sum_r W[t][r] X[r][c]: tiles of 16 keys x 16 features, A the chunk's key-major
// weights (or score gradients) rounded to bfloat16 (pack_key_rows), B the block's rows of dO (or Q)
// by pairs of rows (pack_rows), one step per 32 rows.

// X's rows (bf16, x2s elements apart; `rows` of them, 0 past) in B's layout: for feature tile ft the
// 32-bit word [ft][pair][c] holds (X[2 pair][16 ft + c], X[2 pair + 1][16 ft + c]), rs / 2 pairs.
ATTNKIT_AMX void pack_rows(const uint16_t* x, int64_t x2s, int64_t rows, int64_t C, int64_t rs, uint32_t* packed) {
  const int64_t pairs = rs / 2;
  for (int64_t ft = 0; ft < C / kTile; ++ft) {
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t r = 2 * p;
      const auto row = [&](int64_t i) {
        return i < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * x2s + ft * kTile))
                        : _mm256_setzero_si256();
      };
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(row(r)), row(r + 1), 1);
      _mm512_storeu_si512(packed + (ft * pairs + p) * kTile, pairs_of_halves(both));
    }
  }
}

// 32 lanes from `at` in two parts (split_halves), zeros where the key is not `present` (a function,
// not a lambda: GCC gives a lambda no target attribute, and the AVX2 build then cannot inline).
ATTNKIT_AMX inline SplitHalves split_lanes(const float* at, bool present) {
  if (!present) return {_mm512_setzero_si512(), _mm512_setzero_si512()};
  return split_halves(_mm512_loadu_ps(at), _mm512_loadu_ps(at + kTile));
}

// The same lanes rounded to bfloat16 once (nearest even), as `high` (`low` unused).
ATTNKIT_AMX inline SplitHalves rounded_lanes(const float* at, bool present) {
  if (!present) return {_mm512_setzero_si512(), _mm512_setzero_si512()};
  return {(__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(at + kTile), _mm512_loadu_ps(at)), _mm512_setzero_si512()};
}

// The chunk's key-major w[t][r] (t < W, rs lanes) as bfloat16 rows [t][rs] in two parts
// (split_halves), `high` and `low`, rows up to round_up(W, 16) (0 past W): A's layout, one tile per
// 16 keys and 32 rows; without `low` (and without pairs), w rounded once into `high`. With
// `pairs_high` and `pairs_low`, the same parts also in B's layout over the keys (pack_weights': for
// query tile qt the 32-bit word [qt][pair][r] holds keys 2 pair and 2 pair + 1 of row 16 qt + r,
// pairs up to round_up(W, 32) / 2), as the score gradients' dQ takes them, from the same split (a
// second pass over the rows took ~5% of a window backward).
ATTNKIT_AMX void pack_key_rows(const float* w, int64_t rs, int64_t W, uint16_t* high, uint16_t* low,
                               uint32_t* pairs_high = nullptr, uint32_t* pairs_low = nullptr) {
  // B's words from two keys' 32 lanes: lanes 0-15 (query tile 2 q) and 16-31 (2 q + 1), key by key
  const __m512i lanes_0_15 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                              6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i lanes_16_31 = _mm512_add_epi16(lanes_0_15, _mm512_set1_epi16(16));
  const bool pairs = pairs_high != nullptr;
  const int64_t rows = round_up(W, kTile), keys = pairs ? round_up(W, kTileK) : rows, words = round_up(W, kTileK) / 2;
  for (int64_t t = 0; t < keys; t += 2) {
    for (int64_t r = 0; r < rs; r += kTileK) {
      const SplitHalves first = low ? split_lanes(w + t * rs + r, t < W) : rounded_lanes(w + t * rs + r, t < W);
      const SplitHalves second =
          low ? split_lanes(w + (t + 1) * rs + r, t + 1 < W) : rounded_lanes(w + (t + 1) * rs + r, t + 1 < W);
      if (t < rows) {  // rows is even: t + 1 is a row too
        _mm512_storeu_si512(high + t * rs + r, first.high);
        _mm512_storeu_si512(high + (t + 1) * rs + r, second.high);
        if (low) {
          _mm512_storeu_si512(low + t * rs + r, first.low);
          _mm512_storeu_si512(low + (t + 1) * rs + r, second.low);
        }
      }
      if (pairs) {
        const int64_t at = ((r / kTile) * words + t / 2) * kTile, next = at + words * kTile;
        _mm512_storeu_si512(pairs_high + at, _mm512_permutex2var_epi16(first.high, lanes_0_15, second.high));
        _mm512_storeu_si512(pairs_high + next, _mm512_permutex2var_epi16(first.high, lanes_16_31, second.high));
        _mm512_storeu_si512(pairs_low + at, _mm512_permutex2var_epi16(first.low, lanes_0_15, second.low));
        _mm512_storeu_si512(pairs_low + next, _mm512_permutex2var_epi16(first.low, lanes_16_31, second.low));
      }
    }
  }
}

// Out[t][c] += sum_r W[t][r] X[r][c] for t < W, c < C (out: float32 rows os apart): W as its two
// parts `a` and `a_low` from pack_key_rows (a_low null: W in one part), `b` from pack_rows (and
// `b_low`, float16's low part of X, where given: X_l joins against W's high part). A last
// tile of fewer than 16 keys goes through `spare` (16 x 32 floats: two tiles of features), so no
// row past W is read or written.
ATTNKIT_AMX void amx_rows_product(const uint16_t* a, const uint16_t* a_low, int64_t rs, int64_t W, const uint32_t* b,
                                  int64_t C, float* out, int64_t os, float* spare, const uint32_t* b_low = nullptr) {
  const int64_t pairs = rs / 2, steps = rs / kTileK, key_tiles = (W + kTile - 1) / kTile;
  for (int64_t kt = 0; kt < key_tiles; ++kt) {
    const int64_t keys = std::min(kTile, W - kt * kTile);
    const uint16_t* a_tile = a + kt * kTile * rs;
    for (int64_t ft = 0; ft < C / kTile; ft += 2) {
      const bool two = ft + 1 < C / kTile;
      float* acc = out + kt * kTile * os + ft * kTile;
      float* at = acc;
      int64_t stride = os * 4;
      if (keys < kTile) {  // the partial tile through the spare rows, zeros past W
        at = spare, stride = 2 * kTile * 4;
        for (int64_t t = 0; t < kTile; ++t) {
          for (int64_t c = 0; c < (two ? 2 : 1) * kTile; ++c) spare[t * 2 * kTile + c] = t < keys ? acc[t * os + c] : 0.0f;
        }
      }
      _tile_loadd(0, at, stride);
      if (two) _tile_loadd(1, at + kTile, stride);
      const uint32_t* b0 = b + ft * pairs * kTile;
      const uint32_t* b1 = b0 + pairs * kTile;
      for (int64_t step = 0; step < steps; ++step) {
        _tile_loadd(4, a_tile + step * kTileK, rs * 2);
        _tile_loadd(6, b0 + step * kTile * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, b1 + step * kTile * kTile, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (a_low) {
          _tile_loadd(5, a_low + kt * kTile * rs + step * kTileK, rs * 2);
          _tile_dpbf16ps(0, 5, 6);
          if (two) _tile_dpbf16ps(1, 5, 7);
        }
        if (b_low) {  // float16: X's low part against W's high part (still in tmm4)
          _tile_loadd(6, b_low + (b0 - b) + step * kTile * kTile, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two) {
            _tile_loadd(7, b_low + (b1 - b) + step * kTile * kTile, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
        }
      }
      _tile_stored(0, at, stride);
      if (two) _tile_stored(1, at + kTile, stride);
      if (keys < kTile) {
        for (int64_t t = 0; t < keys; ++t) {
          for (int64_t c = 0; c < (two ? 2 : 1) * kTile; ++c) acc[t * os + c] = spare[t * 2 * kTile + c];
        }
      }
    }
  }
}

// V^T (or K^T, for the backward's dQ) of the (sequence, head) a thread works on, as bfloat16 in
// blocks of 32 keys, each block [Dv][32] (a tile of 16 features x 32 keys is 1 KiB in one piece: rows of V^T a whole sequence
// long put each tile row on its own page). Blocks are filled as the thread's chunks ask for them:
// a request starting inside the filled blocks extends them, any other starts over. Blocks never
// filled are 0, so the tiles past the last key read zeros.
class TransposedRows {
 public:
  // float16 rows are held as their two bfloat16 parts (split_float16): `from` gives the high part's
  // blocks and `low_at` the low part's at the same offset.
  TransposedRows(const Rows& values, int64_t keys)
      : v_(values),
        keys_(keys),
        data_(values.width * (round_up(keys, kTileK) + kTileK), 0),
        low_(split() ? data_.size() : 0, 0) {}

  // The block of key `first` (a multiple of 32), blocks up to key `last` filled.
  const uint16_t* from(int64_t b, int64_t kv, int64_t first, int64_t last) {
    last = std::min(last, keys_);
    if (b != b_ || kv != kv_ || first < lo_ || first > hi_) b_ = b, kv_ = kv, lo_ = hi_ = first;
    for (; hi_ < last; hi_ += kTileK) fill(b, kv, hi_);  // hi_ stays a multiple of 32
    return data_.data() + first * v_.width;
  }
  const uint16_t* low_at(int64_t first) const { return low_.data() + first * v_.width; }

 private:
  // The block of keys [t0, t0 + 32): pairs of features as 32-bit words, transposed 8 x 8 at a time
  // (tiles.h, bit for bit), then each row of pairs split into its two features' rows.
  ATTNKIT_AMX void fill(int64_t b, int64_t kv, int64_t t0) {
    const int64_t Dv = v_.width, keys = std::min(kTileK, keys_ - t0);
    if (pairs_.empty()) pairs_.resize(Dv / 2 * kTileK);
    if (keys < kTileK) std::fill(pairs_.begin(), pairs_.end(), 0.0f);  // keys past the last read as 0
    transpose(reinterpret_cast<const float*>(v_.at(b, kv, t0)), v_.s2 / 2, keys, Dv / 2, pairs_.data(), kTileK);
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                          24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int64_t p = 0; p < Dv / 2; ++p) {
      const __m512i first = _mm512_loadu_si512(pairs_.data() + p * kTileK);  // keys 0-15, two features each
      const __m512i second = _mm512_loadu_si512(pairs_.data() + p * kTileK + kTile);
      store(_mm512_permutex2var_epi16(first, even, second), t0 * Dv + 2 * p * kTileK);
      store(_mm512_permutex2var_epi16(first, odd, second), t0 * Dv + (2 * p + 1) * kTileK);
    }
  }

  // One feature's 32 keys at element `at` of the blocks (float16: their two parts).
  ATTNKIT_AMX void store(__m512i keys, int64_t at) {
    if (!split()) {
      _mm512_storeu_si512(data_.data() + at, keys);
      return;
    }
    const SplitHalves parts = split_float16_lanes(keys);
    _mm512_storeu_si512(data_.data() + at, parts.high);
    _mm512_storeu_si512(low_.data() + at, parts.low);
  }

  bool split() const { return v_.type == at::kHalf; }

  Rows v_;
  int64_t keys_;
  LineVector<uint16_t> data_, low_;  // from a cache line: each 1 KiB block is whole tile rows
  Floats pairs_;  // one block as 32-bit words [Dv / 2][32]
  int64_t b_ = -1, kv_ = -1, lo_ = 0, hi_ = 0;
};

}  // namespace
}  // namespace attnkit_native
