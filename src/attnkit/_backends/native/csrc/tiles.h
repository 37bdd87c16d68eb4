// Register tiles: the kernel's seven products on its own tiles (no BLAS), and its transposes.
//
// A block's rows are padded to groups of 32 and everything it computes is laid out key-major (or
// feature-major) with the rows as the vector dimension: scores S[t][r], the scaled queries
// Qt[d][r], the output accumulator Ot[dv][r], each row of length `rs` (the padded row count). The
// forward's two products then broadcast one element of K or V, which are read in place (rows of D
// or Dv floats), against the row vectors: S[t][.] += K[t][d] Qt[d][.] (block_scores) and
// Ot[dv][.] += V[t][dv] P[t][.] (block_values). Nothing is packed per call (MKL's sgemm spent a
// fifth of its time copying the key span of every block), the softmax runs on whole vectors of
// rows (softmax.h: no horizontal max, masks by integer compares), and the running rescale is
// applied as the accumulators load.
//
// The backward's products over rows: dV += (f P)^T dO and dK += dS^T Q sum over a block's rows:
// out[t][c] += sum_r w[t][r] x[r][c] (block_rows_product), with w key-major (rows as lanes, as
// the scores' tiles leave P and dS) and x the rows of dO or Q as given. With these, dP = dO V^T
// (block_scores) and dQ^T += K^T dS^T (block_values), the backward calls no BLAS: MKL's sgemm on
// these shapes (a 32-row block: an inner dimension of 32) ran at ~40% of the FMA rate of the
// scores' tiles on an AMD Zen 5 (61% of a window backward's time, for 4 of its 5 products: the
// backward now takes half the time); the 256-bit build, level with MKL's 256-bit code there, took
// 0.89-0.99x its time with sgemm (L = 16384, 2 threads) and was level at GPT training shapes.
//
// Each tile is one template over the lane traits (lanes.h): 6 keys (or features) at once by 2
// vectors of rows, 12 accumulators, in both builds. With 512-bit vectors the 2 vectors are a
// group's 32 rows; with 256-bit ones they are 16 rows, and a group takes two tiles (the
// classic 6 x 16 AVX2 sgemm tile: 2 loads and 6 broadcasts per 12 FMA). The earlier 2 keys by 4
// vectors had 8 accumulators, exactly the 2 pipes x 4 cycles of latency an AMD Zen 3 needs in
// flight: alone in L1 (benchmarks/native_tiles.py, W = 32-256 keys, one thread, a 97-100
// GFLOP/s peak) its scores ran at 87-89 GFLOP/s and its values at 77-89, these at 89-97 and 87-95.
// Every row's sum runs over the same terms in the same order from the same start, one FMA per
// term, so the builds and the tile shapes give the same bits (test_native_builds.py compares a
// build of 4-key, 1-vector tiles, ATTNKIT_NATIVE_TILES=4x1, with the default on every machine).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "lanes.h"

namespace attnkit_native {
namespace {

constexpr int64_t kGroup = 32;  // rows a block is padded to a multiple of: one or two tiles of rows

// How the output accumulators start a chunk: zero, as they are, or rescaled row by row.
enum class Start { kZero, kKeep, kRescale };

// Vectors of rows a scores or values tile covers (2: 16 or 32 rows), and those rows.
constexpr int kRowVectors = 2;
template <class L>
constexpr int64_t kTileRows = kRowVectors * L::kWidth;
static_assert(kGroup % kTileRows<RowLanes> == 0, "a group is whole tiles of rows");

// tile(std::integral_constant<int, N>{}) for N = n where 0 < n < M: the last, partial step of a
// loop over keys (or features) M at a time.
template <int M, class Tile>
__attribute__((always_inline)) inline void partial_tile(int64_t n, Tile tile) {
  if constexpr (M > 1) {
    if (n == M - 1) {
      tile(std::integral_constant<int, M - 1>{});
    } else {
      partial_tile<M - 1>(n, tile);
    }
  }
}

// Both forward products: a[i][v][.] += sum_j src[i * item + j * step] rows[j][v][.] for i < N and the
// row vectors First .. First + Count - 1 of a tile (row stride rs), j = 0 .. count - 1 in order. The
// loops over i and v are unrolled by pragma: GCC then keeps a[N][V] in registers (left to itself
// it passed the accumulators through the stack at every tile's start and end: 72 spills in the
// library), and, in 512-bit tiles (L::kUnrollTiles), the loop over j by 4: a quarter of its
// branches (documents forward, one thread, 620-629 -> 609-614 ms; window 157-160 -> 154-156; the
// same FMAs in the same order; the 256-bit tiles, 16 registers, ran no faster so). The asm keeps
// the row vectors in registers: folded into each FMA as a memory operand (GCC's choice otherwise)
// they are loaded once per key and FMA (measured with the earlier 2 x 4 tiles: 10 loads per 8 FMA
// instead of 6, and the loop became load-bound).
template <class L, int N, int First = 0, int Count = kRowVectors>
__attribute__((always_inline)) inline void accumulate(typename L::F (&a)[N][kRowVectors], const float* src,
                                                      int64_t item, int64_t step, int64_t count, const float* rows,
                                                      int64_t rs) {
  static_assert(Count == 1 || (Count == 2 && First == 0), "one row vector or both");
  const auto term = [&](int64_t j) __attribute__((always_inline)) {
    // named vectors, not an array: GCC kept a copy of an array of them on the stack, 4 stores
    // per key in the values' tiles (the window forward ran ~40% slower)
    const float* row = rows + j * rs + First * L::kWidth;
    typename L::F r0 = L::load(row), r1 = Count > 1 ? L::load(row + L::kWidth) : r0;
    if constexpr (N > 1 && Count > 1) asm("" : "+v"(r0), "+v"(r1));
    if constexpr (N > 1 && Count == 1) asm("" : "+v"(r0));
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
      const typename L::F x = L::broadcast(src + i * item + j * step);
      a[i][First] = fmadd(x, r0, a[i][First]);
      if constexpr (Count > 1) a[i][1] = fmadd(x, r1, a[i][1]);
    }
  };
  if constexpr (L::kUnrollTiles) {
#pragma GCC unroll 4
    for (int64_t j = 0; j < count; ++j) term(j);
  } else {
    for (int64_t j = 0; j < count; ++j) term(j);
  }
}

// ---- Trimming a group's keys by halves of 16 rows -----------------------------------------------
//
// A block's span of keys is the union of its rows' intervals, so a window's or a diagonal's 32-row
// group multiplies two triangles of masked pairs (31 of the 543 keys of each row's span, window
// 512: 6% of the products). Each half of a group (16 rows: one vector of 16 lanes, one tile of
// 8-lane vectors) skips the keys outside the union of its own rows' intervals, in every product:
// the scores of a skipped pair are written as 0 (the masked pair's checks for a non-finite product
// then see nothing: its zero weight multiplies nothing either), and the products that sum over keys
// or over rows leave its terms out. The segments depend on the rows' intervals alone, not on the
// tiles' shapes, so every build skips the same pairs and keeps giving the same bits.
constexpr int64_t kHalf = 16;
static_assert(kTileRows<RowLanes> == kGroup || kTileRows<RowLanes> == kHalf, "a tile is a group or a half");

// A chunk's W keys for one group of rows as consecutive segments [from, to) covering [0, W) in
// order, `in` the halves (bit 0, bit 1) that reach every key of a segment: computed once per chunk
// and group (recomputed in each tile, the trimmed window forward took 1.04x the untrimmed one's time).
struct KeySegments {
  struct Segment {
    int64_t from, to;
    int in;
  };
  int count = 0;
  Segment part[5];
};

// The KeySegments of the chunk [key0, key0 + W) for each group of a block's rows, into
// segments[0 .. rs / kGroup), from the keys [first, last) each half of the rows reaches (spans[0 ..
// rs / kHalf), empty where first >= last: half_spans, params.h).
inline void chunk_segments(const std::pair<int64_t, int64_t>* spans, int64_t rs, int64_t key0, int64_t W,
                           KeySegments* segments) {
  for (int64_t g = 0; g < rs; g += kGroup) {
    int64_t from[2], to[2];
    for (int half = 0; half < 2; ++half) {
      const auto [first, last] = spans[g / kHalf + half];
      from[half] = std::clamp<int64_t>(first - key0, 0, W), to[half] = std::clamp<int64_t>(last - key0, from[half], W);
    }
    KeySegments& out = segments[g / kGroup];
    out.count = 0;
    if (from[0] == 0 && to[0] == W && from[1] == 0 && to[1] == W) {  // most chunks
      out.part[out.count++] = {0, W, 3};
      continue;
    }
    int64_t cut[6] = {0, from[0], to[0], from[1], to[1], W};
    std::sort(cut, cut + 6);
    for (int k = 0; k < 5; ++k) {
      const int64_t p = cut[k], q = cut[k + 1];
      if (p >= q) continue;
      const int in = (from[0] <= p && q <= to[0] ? 1 : 0) | (from[1] <= p && q <= to[1] ? 2 : 0);
      out.part[out.count++] = {p, q, in};
    }
  }
}

// fn(row offset, First, Count) for the tiles' row vectors of the halves `in` of a group: with
// 16-lane tiles one tile holds the group (a half is its vector First), with 8-lane ones each half
// is a tile of its own.
template <class L, class Fn>
__attribute__((always_inline)) inline void for_halves(int in, Fn fn) {
  using Zero = std::integral_constant<int, 0>;
  using One = std::integral_constant<int, 1>;
  using Both = std::integral_constant<int, kRowVectors>;
  if constexpr (kTileRows<L> == kGroup) {
    if (in == 3) {
      fn(int64_t{0}, Zero{}, Both{});
    } else if (in == 1) {
      fn(int64_t{0}, Zero{}, One{});
    } else if (in == 2) {
      fn(int64_t{0}, One{}, One{});
    }
  } else {
    if (in & 1) fn(int64_t{0}, Zero{}, Both{});
    if (in & 2) fn(kHalf, Zero{}, Both{});
  }
}

// s[i * ss][.] = sum_d k[i * k2s + d] qt[d][.] for i < N, over a tile's rows.
// (the row vectors First .. First + Count - 1 of a tile)
template <class L, int N, int First = 0, int Count = kRowVectors>
__attribute__((always_inline)) inline void scores_tile(const float* k, int64_t k2s, int64_t D, const float* qt,
                                                       int64_t rs, float* s, int64_t ss) {
  constexpr int V = kRowVectors;
  typename L::F a[N][V];
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = First; v < First + Count; ++v) a[i][v] = L::zero();
  }
  accumulate<L, N, First, Count>(a, k, k2s, 1, D, qt, rs);
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = First; v < First + Count; ++v) L::store(s + i * ss + L::kWidth * v, a[i][v]);
  }
}

// S[t][r] = sum_d K[t][d] Qt[d][r] for the W keys from k (row stride k2s), all `rs` rows; with
// `segments` (one per group), only the pairs each half reaches, the others' scores 0.
void block_scores(const float* k, int64_t k2s, int64_t W, int64_t D, const float* qt, int64_t rs, float* s,
                  const KeySegments* segments = nullptr) {
  using L = RowLanes;
  constexpr int N = L::kKeysPerTile;
  // a group's tiles of rows back to back for each tile of keys, so its key rows come from L2
  // once (the 256-bit build's 16-row tiles taken half a group at a time read a long span's keys
  // twice: the window forward on two threads took 1.1-1.3x the 2 x 4 tiles' time)
  for (int64_t g = 0; g < rs; g += kGroup) {
    const auto keys = [&](int64_t p, int64_t q, int in) __attribute__((always_inline)) {
      int64_t t = p;
      const auto keys_tile = [&](auto n) __attribute__((always_inline)) {  // n keys from t, the halves `in`
        for_halves<L>(in, [&](int64_t h, auto first, auto count) __attribute__((always_inline)) {
          scores_tile<L, decltype(n)::value, decltype(first)::value, decltype(count)::value>(
              k + t * k2s, k2s, D, qt + g + h, rs, s + t * rs + g + h, rs);
        });
      };
      for (; t + N <= q; t += N) keys_tile(std::integral_constant<int, N>{});
      partial_tile<N>(q - t, keys_tile);
      for (int half = 0; half < 2; ++half) {
        if (in & (1 << half)) continue;
        for (int64_t u = p; u < q; ++u) {
          for (int64_t v = 0; v < kHalf; v += L::kWidth) L::store(s + u * rs + g + half * kHalf + v, L::zero());
        }
      }
    };
    if (segments == nullptr) {
      keys(0, W, 3);
    } else {
      const KeySegments& group = segments[g / kGroup];
      for (int i = 0; i < group.count; ++i) keys(group.part[i].from, group.part[i].to, group.part[i].in);
    }
  }
}

// ot[i * rs][.] (features v + i, i < N) (+)= sum_t V[t][.] P[t][.] over a tile's rows; the
// accumulators start as `start` says (`rescale`: the rows' factors).
// With `segments` (the tile's group's), only the keys each half reaches (`half`: the tile's, where
// a tile is one half).
template <class L, int N>
__attribute__((always_inline)) inline void values_tile(const float* v, int64_t v2s, int64_t W, const float* p,
                                                       int64_t rs, float* ot, Start start, const float* rescale,
                                                       const KeySegments* segments, int half) {
  constexpr int V = kRowVectors;
  typename L::F a[N][V];
  if (start == Start::kZero) {
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
      _Pragma("GCC unroll 4") for (int u = 0; u < V; ++u) a[i][u] = L::zero();
    }
  } else {
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
      _Pragma("GCC unroll 4") for (int u = 0; u < V; ++u) a[i][u] = L::load(ot + i * rs + L::kWidth * u);
    }
    if (start == Start::kRescale) {
      typename L::F factor[V];
      _Pragma("GCC unroll 4") for (int u = 0; u < V; ++u) factor[u] = L::load(rescale + L::kWidth * u);
      _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
        _Pragma("GCC unroll 4") for (int u = 0; u < V; ++u) a[i][u] = mul(a[i][u], factor[u]);
      }
    }
  }
  if (segments == nullptr) {
    accumulate<L, N>(a, v, 1, v2s, W, p, rs);
  } else {
    for (int i = 0; i < segments->count; ++i) {
      const KeySegments::Segment& part = segments->part[i];
      const int64_t from = part.from, count = part.to - part.from;
      if constexpr (kTileRows<L> == kGroup) {
        for_halves<L>(part.in, [&](int64_t, auto first, auto vectors) __attribute__((always_inline)) {
          accumulate<L, N, decltype(first)::value, decltype(vectors)::value>(a, v + from * v2s, 1, v2s, count,
                                                                             p + from * rs, rs);
        });
      } else if (part.in & (1 << half)) {  // the tile is one half: its segments in key order
        accumulate<L, N>(a, v + from * v2s, 1, v2s, count, p + from * rs, rs);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int u = 0; u < V; ++u) L::store(ot + i * rs + L::kWidth * u, a[i][u]);
  }
}

// Ot[dv][r] (+)= sum_t V[t][dv] P[t][r] for the W keys from v (row stride v2s), all `rs` rows;
// `start[g / kGroup]` and `rescale + g` say how the accumulators of row g's group begin; with
// `segments` (one per group), each half takes the keys it reaches only.
void block_values(const float* v, int64_t v2s, int64_t W, int64_t Dv, const float* p, int64_t rs, float* ot,
                  const Start* start, const float* rescale, const KeySegments* segments = nullptr) {
  using L = RowLanes;
  constexpr int N = L::kKeysPerTile;
  for (int64_t g = 0; g < rs; g += kGroup) {
    const Start s = start[g / kGroup];
    int64_t d = 0;
    const auto features_tile = [&](auto n) __attribute__((always_inline)) {  // n features from d, all rows
      for (int64_t h = g; h < g + kGroup; h += kTileRows<L>) {
        values_tile<L, decltype(n)::value>(v + d, v2s, W, p + h, rs, ot + d * rs + h, s, rescale + h,
                                           segments ? segments + g / kGroup : nullptr, (h - g) / kHalf);
      }
    };
    for (; d + N <= Dv; d += N) features_tile(std::integral_constant<int, N>{});
    partial_tile<N>(Dv - d, features_tile);
  }
}

// ---- The backward's products over rows ----------------------------------------------------------
//
// out[i * os + c] += sum_{r < rows} w[i * rs + r] x[r * xs + c] for i < N, c < L::kWidth V (the
// last vector's lanes by `last` when `Partial`: a masked load or store is slow on some CPUs, whole
// vectors take plain ones), in row order from the value in `out`. Per row, V vector loads of x
// and N broadcasts of w for N V FMA.
template <class L, int N, int V, bool Partial>
__attribute__((always_inline)) inline void rows_tile(const float* w, int64_t rs, int64_t rows, const float* x,
                                                     int64_t xs, float* out, int64_t os, typename L::Tail last) {
  const auto load = [&](const float* from, int v) {
    return Partial && v == V - 1 ? L::load_tail(from, last) : L::load(from);
  };
  typename L::F a[N][V];
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) a[i][v] = load(out + i * os + L::kWidth * v, v);
  }
#pragma GCC unroll 2
  for (int64_t r = 0; r < rows; ++r) {
    typename L::F row[V];
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) row[v] = load(x + r * xs + L::kWidth * v, v);
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
      const typename L::F c = L::broadcast(w + i * rs + r);
      _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) a[i][v] = fmadd(c, row[v], a[i][v]);
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) {
      float* to = out + i * os + L::kWidth * v;
      if (Partial && v == V - 1) {
        L::store_tail(to, last, a[i][v]);
      } else {
        L::store(to, a[i][v]);
      }
    }
  }
}

template <int V, bool Partial>
void rows_tiles(const float* w, int64_t rs, int64_t W, int64_t rows, const float* x, int64_t xs, float* out,
                int64_t os, RowLanes::Tail last) {
  using L = RowLanes;
  constexpr int N = L::kKeysPerTile;
  int64_t t = 0;
  for (; t + N <= W; t += N) rows_tile<L, N, V, Partial>(w + t * rs, rs, rows, x, xs, out + t * os, os, last);
  partial_tile<N>(W - t, [&](auto n) {
    rows_tile<L, decltype(n)::value, V, Partial>(w + t * rs, rs, rows, x, xs, out + t * os, os, last);
  });
}

// rows_tiles<V, Partial> for the `vectors` (1 .. M) a chunk of features needs.
template <int M>
__attribute__((always_inline)) inline void rows_tiles_of(int64_t vectors, bool partial, const float* w, int64_t rs,
                                                         int64_t W, int64_t rows, const float* x, int64_t xs,
                                                         float* out, int64_t os, RowLanes::Tail last) {
  if (vectors == M) {
    if (partial) {
      rows_tiles<M, true>(w, rs, W, rows, x, xs, out, os, last);
    } else {
      rows_tiles<M, false>(w, rs, W, rows, x, xs, out, os, last);
    }
  } else if constexpr (M > 1) {
    rows_tiles_of<M - 1>(vectors, partial, w, rs, W, rows, x, xs, out, os, last);
  }
}

// Out[t][c] += sum_{r < rows} W[t][r] X[r][c] for the W keys of a chunk (w row stride rs, x row
// stride xs, out row stride os), C features, up to L::kFeatureVectors vectors of them at a time;
// with `segments` (one group of rows: rs == kGroup), each key sums over the rows of the halves
// that reach it only, in row order.
void block_rows_product(const float* w, int64_t rs, int64_t W, int64_t rows, const float* x, int64_t xs, int64_t C,
                        float* out, int64_t os, const KeySegments* segments = nullptr) {
  using L = RowLanes;
  constexpr int64_t kFeatures = L::kFeatureVectors * L::kWidth;
  const auto keys = [&](int64_t p, int64_t q, int64_t first, int64_t end) {  // rows [first, end)
    if (first >= end) return;
    for (int64_t c0 = 0; c0 < C; c0 += kFeatures) {
      const int64_t left = std::min<int64_t>(C - c0, kFeatures), vectors = (left + L::kWidth - 1) / L::kWidth;
      const int64_t tail = left - L::kWidth * (vectors - 1);
      rows_tiles_of<L::kFeatureVectors>(vectors, tail < L::kWidth, w + p * rs + first, rs, q - p, end - first,
                                        x + first * xs + c0, xs, out + p * os + c0, os, L::first_lanes(tail));
    }
  };
  if (segments == nullptr) {
    keys(0, W, 0, rows);
  } else {  // the caller's block is one group (rs == kGroup)
    for (int i = 0; i < segments->count; ++i) {
      const KeySegments::Segment& part = segments->part[i];
      if (part.in != 0) keys(part.from, part.to, part.in == 2 ? kHalf : 0, std::min(rows, part.in == 1 ? kHalf : kGroup));
    }
  }
}

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

}  // namespace
}  // namespace attnkit_native
