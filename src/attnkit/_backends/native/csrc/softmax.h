// Softmax rows: the row loops between the products, on a vector of rows at a time.
//
// The scores' tiles leave a chunk key-major with the rows as lanes (S[t][r], row stride rs), so
// these loops take one vector of rows (8 or 16 lanes, the lane traits L of lanes.h) down a chunk
// of W keys from key0: the forward's running softmax, the backward's weights recomputed from the
// lse, and its score gradients. Each is one template over L, so the AVX2 and AVX-512 builds run
// the same operations lane by lane in the same order (the same bits), and over what a call
// switches on (score modifiers, dropout, soft-capping) as template flags, picked once per call:
// no per-key branch on them.
//
// Masks by integer compares of each lane's interval [lo, hi) against the key; keys [all_lo,
// all_hi) are attended by every row of the vector and need no mask and no check (most keys of a
// block: all but the two triangles at a window's or a diagonal's ends; the masks and checks were
// ~40% of the backward loops' instructions).

#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "aligned.h"
#include "dropout.h"
#include "lanes.h"
#include "score_mods.h"

namespace attnkit_native {
namespace {

// The per-row values a block's row loops read as lanes (one array per quantity, padding rows up
// to a whole group included), and, per vector of rows, the keys all of them attend.
struct BlockRows {
  std::vector<int32_t> lo, hi, drop_a, drop_c;  // the interval, the dropout keys
  Floats max, sum, rescale;                     // the forward's running softmax
  Floats lse, delta;                            // the backward's
  std::vector<int64_t> all_lo, all_hi;          // per vector of rows

  explicit BlockRows(int64_t padded)
      : lo(padded), hi(padded), drop_a(padded), drop_c(padded), max(padded), sum(padded), rescale(padded),
        lse(padded), delta(padded), all_lo(padded), all_hi(padded) {}
};

// The keys [a, z) of a chunk of W keys from key0 that all of a vector's rows attend: [all_lo,
// all_hi) clipped to the chunk.
inline std::pair<int64_t, int64_t> attended_by_all(int64_t all_lo, int64_t all_hi, int64_t key0, int64_t W) {
  const int64_t a = std::clamp<int64_t>(all_lo - key0, 0, W);
  return {a, std::clamp<int64_t>(all_hi - key0, a, W)};
}

// A chunk of W keys from key0 for one vector of rows, in key order: masked(t, in) on each key that
// some of the rows do not attend (`in`: the rows that do), plain(from, to) on the keys all attend.
template <class L, class Masked, class Plain>
inline void split_keys(int64_t W, int64_t key0, typename L::I lo, typename L::I hi, int64_t all_lo, int64_t all_hi,
                       Masked masked, Plain plain) {
  const auto [a, z] = attended_by_all(all_lo, all_hi, key0, W);
  const auto each_masked = [&](int64_t from, int64_t to) {
    typename L::I key = L::int_splat(key0 + from);
    for (int64_t t = from; t < to; ++t, key = L::next(key)) masked(t, L::attends(lo, hi, key));
  };
  each_masked(0, a);
  plain(a, z);
  each_masked(z, W);
}

// The running softmax of the rows j .. j + L::kWidth - 1 of a block (row indices row ..) over a
// chunk of W keys from key0, S[t][.] holding the products q . k (s: the rows' first lane, row
// stride rs), in two passes: the constructor's finds the chunk's max, weight(t) then gives
// exp(score - max) key by key, and the caller puts the weights where its product over the values
// reads them (softmax_rows: in place, float32; packed_softmax.h: bfloat16 pairs) and hands their
// sum to finish(). The products become scores by `mods` (the scale after the product, as the
// definition orders them: scaling q first would overflow where the score does not), scores
// outside each row's [lo, hi) count as -inf. Lanes whose max is still -inf shift by 0 (all weights
// 0, no exp(-inf + inf)); a NaN or +inf score makes the sum NaN, which becomes a NaN row.
//
// `Rescore`: plain scores at a positive scale. Then the first pass stores nothing: it takes the max
// of the products and scales it, which is the max of the scores to the bit (rounding is monotone,
// so fl(scale x) is too), and weight(t) multiplies the product by the scale again. Otherwise the
// first pass writes the scores (masked ones as -inf) over the products: tanh and ALiBi once per
// pair, not twice.
template <class L, bool Rescore, bool Dropped>
struct RunningSoftmax {
  using F = typename L::F;
  using I = typename L::I;
  float* s;  // the first pass writes scores here unless Rescore; weight() reads it
  int64_t rs, key0;
  BlockRows& r;
  int64_t j;
  const Dropout& dropout;
  I lo, hi, drop_a, drop_c;
  F scale, chunk_max, shift, rescale;

  RunningSoftmax(float* s_, int64_t rs_, int64_t W, int64_t key0_, BlockRows& r_, int64_t j_, const ScoreMods& mods,
                 int64_t row, const Dropout& dropout_)
      : s(s_), rs(rs_), key0(key0_), r(r_), j(j_), dropout(dropout_), lo(L::load_int(&r.lo[j])),
        hi(L::load_int(&r.hi[j])), drop_a(L::load_int(&r.drop_a[j])), drop_c(L::load_int(&r.drop_c[j])),
        scale(splat<F>(mods.scale)) {
    const I rows = L::iota(row);
    const F neg_inf = splat<F>(kNegInf);
    const auto score = [&](int64_t t) {
      const F product = L::load(s + t * rs);
      return Rescore ? product : apply_lanes(mods, product, rows, L::int_splat(key0 + t));
    };
    F top = neg_inf;  // of the scores, or of the products with Rescore
    const auto masked = [&](int64_t t, typename L::Mask in) {
      const F x = L::select(in, score(t), neg_inf);
      if (!Rescore) L::store(s + t * rs, x);
      top = L::max(top, x);
    };
    const auto plain = [&](int64_t from, int64_t to) {
      // Four running maxima, not one: a chain of dependent max instructions waits their latency on
      // every key (max is exact, so any order gives the same bits where there is no NaN; a NaN
      // score makes its row NaN in any order). Not for modified scores in 8 lanes: four keys' tanh
      // and ALiBi at once spill AVX2's 16 registers.
      constexpr bool kFourChains = Rescore || L::kWidth == 16;
      F max1 = neg_inf, max2 = neg_inf, max3 = neg_inf;
      int64_t t = from;
      for (; kFourChains && t + 4 <= to; t += 4) {
        const F x0 = score(t), x1 = score(t + 1), x2 = score(t + 2), x3 = score(t + 3);
        if (!Rescore) {
          L::store(s + t * rs, x0), L::store(s + (t + 1) * rs, x1);
          L::store(s + (t + 2) * rs, x2), L::store(s + (t + 3) * rs, x3);
        }
        top = L::max(top, x0), max1 = L::max(max1, x1);
        max2 = L::max(max2, x2), max3 = L::max(max3, x3);
      }
      for (; t < to; ++t) {
        const F x = score(t);
        if (!Rescore) L::store(s + t * rs, x);
        top = L::max(top, x);
      }
      top = L::max(L::max(top, max1), L::max(max2, max3));
    };
    split_keys<L>(W, key0, lo, hi, r.all_lo[j / L::kWidth], r.all_hi[j / L::kWidth], masked, plain);
    const F row_max = L::load(&r.max[j]);
    chunk_max = L::max(row_max, Rescore ? mul(top, scale) : top);
    shift = L::zero_where_neg_inf(chunk_max, chunk_max);
    rescale = L::zero_where_neg_inf(row_max, exp_nonpositive(sub(row_max, shift)));
  }

  // exp(score - shift) at key t, one every row attends (or any key without Rescore: a masked one's
  // stored score is -inf, its weight 0)
  F weight(int64_t t) const {
    const F x = L::load(s + t * rs);
    return exp_nonpositive(sub(Rescore ? mul(x, scale) : x, shift));
  }
  // at a key the rows `in` attend: the others' weights 0
  F masked_weight(int64_t t, typename L::Mask in) const {
    return Rescore ? L::zero_outside(in, weight(t)) : weight(t);
  }
  // the weight P V takes: e times the pair's dropout factor with `Dropped` (the sum takes e)
  F kept(int64_t t, F e) const { return Dropped ? mul(e, dropout_factor_rows(dropout, drop_a, drop_c, key0 + t)) : e; }
  // folds the chunk's sum of weights into the rows' running sum and max; `rescale` is left for
  // their accumulators
  void finish(F sum) const {
    L::store(&r.sum[j], fmadd(L::load(&r.sum[j]), rescale, sum));
    L::store(&r.max[j], chunk_max);
    L::store(&r.rescale[j], rescale);
  }
};

// The forward's running softmax over a chunk (RunningSoftmax), its weights in place of the
// products in S (float32, times the dropout factors with `Dropped`), key by key in order.
template <class L, bool Rescore, bool Dropped>
void softmax_rows(float* s, int64_t rs, int64_t W, int64_t key0, BlockRows& r, int64_t j, const ScoreMods& mods,
                  int64_t row, const Dropout& dropout) {
  const RunningSoftmax<L, Rescore, Dropped> chunk(s, rs, W, key0, r, j, mods, row, dropout);
  typename L::F sum = L::zero();
  const auto put = [&](int64_t t, typename L::F e) {
    sum = add(sum, e);
    L::store(s + t * rs, chunk.kept(t, e));
  };
  if constexpr (Rescore) {
    split_keys<L>(
        W, key0, chunk.lo, chunk.hi, r.all_lo[j / L::kWidth], r.all_hi[j / L::kWidth],
        [&](int64_t t, typename L::Mask in) { put(t, chunk.masked_weight(t, in)); },
        [&](int64_t from, int64_t to) {
          for (int64_t t = from; t < to; ++t) put(t, chunk.weight(t));
        });
  } else {
    for (int64_t t = 0; t < W; ++t) put(t, chunk.weight(t));
  }
  chunk.finish(sum);
}

// Whether a call's scores take RunningSoftmax's `Rescore` form: plain (no soft-capping, no ALiBi)
// at a positive scale. Others go through apply_lanes, whose scale alone is the same product.
inline bool rescored(bool plain, float scale) { return plain && scale > 0.0f; }

// One call's softmax_rows: rescored scores or modified, with dropout or not.
template <class L>
using SoftmaxRows = void (*)(float*, int64_t, int64_t, int64_t, BlockRows&, int64_t, const ScoreMods&, int64_t,
                             const Dropout&);
template <class L>
SoftmaxRows<L> pick_softmax_rows(bool rescore, bool dropped) {
  return rescore ? (dropped ? softmax_rows<L, true, true> : softmax_rows<L, true, false>)
                 : (dropped ? softmax_rows<L, false, true> : softmax_rows<L, false, false>);
}

// The backward's weights P = exp(score - lse) for the rows j .. of a block over a chunk of W keys,
// in place of the products in S (the softmax recomputed from the forward's log-sum-exp: no running
// max); the score is the product's by `mods` (plain with `Plain`) for rows `row` .., the forward's
// operations in its order; under soft-capping cap_grad[t][.] gets 1 - t^2 (the cap's
// derivative). Lanes outside a row's interval become 0, their products checked into `bad` first
// (x - x is NaN for an infinite or NaN x): a non-finite product there would reach dQ or dK through
// a weight of 0.
template <class L, bool Plain>
void weights_rows(float* s, int64_t rs, int64_t W, int64_t key0, const BlockRows& r, int64_t j, const ScoreMods& mods,
                  int64_t row, float* cap_grad, typename L::F& bad) {
  using F = typename L::F;
  const typename L::I lo = L::load_int(&r.lo[j]), hi = L::load_int(&r.hi[j]), rows = L::iota(row);
  const F zero = L::zero(), scale = splat<F>(mods.scale), lse = L::load(&r.lse[j]);
  F masked_bad = zero;  // a local, ORed into `bad` once: in a register, not read and written each key
  const auto weight = [&](int64_t t, F product) {
    F grad;
    // not fused: the forward rounded scale * q.k before subtracting (an fma would leave that
    // rounding, huge for huge scores, in the weight)
    const F x = Plain ? mul(product, scale) : apply_lanes(mods, product, rows, L::int_splat(key0 + t), &grad);
    if (!Plain && mods.cap > 0.0f) L::store(cap_grad + t * rs, grad);
    // min(0, .): a recomputed score may exceed the forward's lse by a rounding error
    return exp_nonpositive(L::min(zero, sub(x, lse)));
  };
  const auto masked = [&](int64_t t, typename L::Mask in) {
    const F product = L::load(s + t * rs);
    masked_bad = L::check_outside(masked_bad, in, product);
    L::store(s + t * rs, L::zero_outside(in, weight(t, product)));
  };
  const auto plain = [&](int64_t from, int64_t to) {
    for (int64_t t = from; t < to; ++t) L::store(s + t * rs, weight(t, L::load(s + t * rs)));
  };
  split_keys<L>(W, key0, lo, hi, r.all_lo[j / L::kWidth], r.all_hi[j / L::kWidth], masked, plain);
  bad = L::either(bad, masked_bad);
}

// dS = scale P (f dP - delta) in place of dP for the rows j .. over a chunk of W keys (times
// cap_grad under soft-capping, `Capped`), f the dropout factor of each pair with `Dropped` (0 or
// 1 / (1 - p); 1 without): the output used f P, which then also replaces P, for dV. Lanes outside
// a row's interval become 0, their dP checked into `bad` first (a non-finite dP, from dO, would
// reach dV through a weight of 0).
template <class L, bool Dropped, bool Capped>
void score_grads_rows(float* p, float* dp, int64_t rs, int64_t W, int64_t key0, const BlockRows& r, int64_t j,
                      float scale, const float* cap_grad, typename L::F& bad, const Dropout& dropout) {
  using F = typename L::F;
  const typename L::I lo = L::load_int(&r.lo[j]), hi = L::load_int(&r.hi[j]);
  const typename L::I drop_a = L::load_int(&r.drop_a[j]), drop_c = L::load_int(&r.drop_c[j]);
  const F scale_lanes = splat<F>(scale), delta = L::load(&r.delta[j]);
  F masked_bad = L::zero();  // as in weights_rows
  const auto chain = [&](int64_t t) { return Capped ? mul(scale_lanes, L::load(cap_grad + t * rs)) : scale_lanes; };
  // g = P (f dP - delta) at key t (f P into p with dropout)
  const auto gradient = [&](int64_t t, F d) {
    const F weight = L::load(p + t * rs);
    if (!Dropped) return mul(weight, sub(d, delta));
    const F f = dropout_factor_rows(dropout, drop_a, drop_c, key0 + t);
    L::store(p + t * rs, mul(weight, f));
    return mul(weight, sub(mul(f, d), delta));
  };
  const auto masked = [&](int64_t t, typename L::Mask in) {
    const F d = L::load(dp + t * rs);
    masked_bad = L::check_outside(masked_bad, in, d);
    L::store(dp + t * rs, L::zero_outside(in, mul(gradient(t, d), chain(t))));
  };
  const auto plain = [&](int64_t from, int64_t to) {
    for (int64_t t = from; t < to; ++t) L::store(dp + t * rs, mul(gradient(t, L::load(dp + t * rs)), chain(t)));
  };
  split_keys<L>(W, key0, lo, hi, r.all_lo[j / L::kWidth], r.all_hi[j / L::kWidth], masked, plain);
  bad = L::either(bad, masked_bad);
}

// One call's weights_rows and score_grads_rows.
template <class L>
using WeightsRows = void (*)(float*, int64_t, int64_t, int64_t, const BlockRows&, int64_t, const ScoreMods&, int64_t,
                             float*, typename L::F&);
template <class L>
using ScoreGradsRows = void (*)(float*, float*, int64_t, int64_t, int64_t, const BlockRows&, int64_t, float,
                                const float*, typename L::F&, const Dropout&);
template <class L>
WeightsRows<L> pick_weights_rows(bool plain) {
  return plain ? weights_rows<L, true> : weights_rows<L, false>;
}
template <class L>
ScoreGradsRows<L> pick_score_grads_rows(bool dropped, bool capped) {
  return capped ? (dropped ? score_grads_rows<L, true, true> : score_grads_rows<L, false, true>)
                : (dropped ? score_grads_rows<L, true, false> : score_grads_rows<L, false, false>);
}

}  // namespace
}  // namespace attnkit_native
