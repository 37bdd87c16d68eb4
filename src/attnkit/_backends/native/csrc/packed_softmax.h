// The forward's running softmax writing its weights straight into the packed bfloat16 layout that
// the values' product reads (amx.h's pack_weights), on 16 lanes: one vector of rows is one query
// tile's 16 rows.
//
// softmax_rows then pack_weights made three passes over a chunk's float32 S (scores, weights,
// packing); this makes two (scores' max, then weights packed by pairs of keys as they are
// computed), and where the scores are plain its first pass only reads. The same operations on
// each weight, and the sum in the same order, as softmax_rows followed by pack_weights: the same
// bits (the AVX2 build, whose 8 lanes are half a tile, still takes those two steps).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "dropout.h"
#include "lanes.h"
#include "score_mods.h"
#include "softmax.h"

namespace attnkit_native {
namespace {

// One call's packed_softmax_rows (null in a build without 16 lanes: it packs after softmax_rows).
using PackedSoftmaxRows = void (*)(float*, int64_t, int64_t, int64_t, BlockRows&, int64_t, const ScoreMods&, int64_t,
                                   const Dropout&, uint32_t*, uint32_t*);

#if defined(__AVX512F__)
// RunningSoftmax over the rows j .. j + 15 of a block (query tile j / 16) and a chunk of W keys from
// key0, the weights into `packed` (and `low` with kParts) as pack_weights lays them out: pairs of
// keys up to round_up(W, 32), keys past W as 0. S keeps the products (or the scores).
template <bool Rescore, bool Dropped, bool kParts>
ATTNKIT_AMX void packed_softmax_rows(float* s, int64_t rs, int64_t W, int64_t key0, BlockRows& r, int64_t j,
                                     const ScoreMods& mods, int64_t row, const Dropout& dropout, uint32_t* packed,
                                     uint32_t* low) {
  using L = Lanes16;
  static_assert(L::kWidth == kTile, "a vector of rows is a query tile");
  const RunningSoftmax<L, Rescore, Dropped> chunk(s, rs, W, key0, r, j, mods, row, dropout);
  const int64_t pairs = round_up(W, kTileK) / 2, tile = (j / kTile) * pairs * kTile;
  __m512 sum = L::zero();
  const auto put = [&](int64_t p, __m512 e0, __m512 e1) ATTNKIT_AMX {
    sum = add(add(sum, e0), e1);
    store_weight_pair<kParts>(chunk.kept(2 * p, e0), chunk.kept(2 * p + 1, e1), packed + tile + p * kTile,
                              kParts ? low + tile + p * kTile : nullptr);
  };
  // a key some rows may not attend, or past the chunk (0; adding it leaves the sum's bits)
  const auto edge = [&](int64_t t) {
    return t < W ? chunk.masked_weight(t, L::attends(chunk.lo, chunk.hi, L::int_splat(key0 + t))) : L::zero();
  };
  // the pairs whose two keys every row attends
  const auto [a, z] = attended_by_all(r.all_lo[j / kTile], r.all_hi[j / kTile], key0, W);
  const int64_t whole_from = (a + 1) / 2, whole_to = std::max(whole_from, z / 2);
  int64_t p = 0;
  for (; p < whole_from; ++p) put(p, edge(2 * p), edge(2 * p + 1));
  for (; p < whole_to; ++p) put(p, chunk.weight(2 * p), chunk.weight(2 * p + 1));
  for (; p < pairs; ++p) put(p, edge(2 * p), edge(2 * p + 1));
  chunk.finish(sum);
}

template <bool kParts>
PackedSoftmaxRows pick_packed_softmax_parts(bool rescore, bool dropped) {
  return rescore ? (dropped ? packed_softmax_rows<true, true, kParts> : packed_softmax_rows<true, false, kParts>)
                 : (dropped ? packed_softmax_rows<false, true, kParts> : packed_softmax_rows<false, false, kParts>);
}
inline PackedSoftmaxRows pick_packed_softmax_rows(bool rescore, bool dropped, bool parts) {
  return parts ? pick_packed_softmax_parts<true>(rescore, dropped) : pick_packed_softmax_parts<false>(rescore, dropped);
}
#else
inline PackedSoftmaxRows pick_packed_softmax_rows(bool, bool, bool) { return nullptr; }
#endif

}  // namespace
}  // namespace attnkit_native
