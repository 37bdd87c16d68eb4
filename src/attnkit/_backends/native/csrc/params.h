// The call's parameters: its inputs checked once, their pointers, strides and sizes, its
// intervals, score modifiers and dropout, as forward and backward both read them.
//
// Both ops check their inputs alike and then index the same tensors the same way; building this
// once replaces the two ops' pointer-and-stride preambles (24 lines each, a place for one of them
// to drift from the other).
//
// Layout: query [B, H, Lq, D], key [B, Hkv, Lk, D], value [B, Hkv, Lk, Dv], one dtype of float32,
// bfloat16 and float16 (half.h), any strides with a unit last-dim stride; lo, hi int64 [S, Lq] with S = 1 (shared) or B. H % Hkv == 0 (GQA:
// query head h reads key/value head h / (H / Hkv)).

#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include "dropout.h"
#include "half.h"
#include "lanes.h"
#include "score_mods.h"
#include "tiles.h"

namespace attnkit_native {
namespace {

// Keys and values for the register tiles: as given, or copied into [B, Hkv, Lk, C] when a head's
// rows are not adjacent in memory (a model's projections give [B, L, Hkv, C], Hkv * C floats apart)
// and enough query rows read them that the copy pays: the tiles read 6 rows at once, and rows
// spread over many pages ran the forward 8-20% slower (causal, 8 query heads, D = 64, L = 2048
// and 8192, 1 and 2 threads, 2 or 8 kv heads); from 1024 rows down it was level or a loss.
at::Tensor rows_together(const at::Tensor& t, int64_t query_rows) {
  return query_rows >= 2048 && t.size(2) > 1 && t.stride(2) != t.size(3) ? t.contiguous() : t;
}

struct Params {
  const char* op;
  int64_t B, H, Lq, D, Hkv, Lk, Dv, group;  // group: query heads per kv head
  at::Tensor key, value, lo_rows, hi_rows, slopes;  // what the pointers below point into, kept alive
  at::ScalarType dtype = at::kFloat;  // the inputs' and outputs' (half.h)
  Rows q, k, v;
  const int64_t* lo = nullptr;
  const int64_t* hi = nullptr;
  bool shared_rows = false;  // one row of intervals for every sequence
  double scale = 1.0, softcap = 0.0;
  Dropout dropout;

  // Checks query, key, value, lo, hi (one kernel dtype, CPU, a unit last-dim stride; lo, hi int64
  // [1 or B, Lq]) and takes their pointers; `together`: keys and values by rows_together.
  Params(const char* op_name, const at::Tensor& query, const at::Tensor& key_given, const at::Tensor& value_given,
         const at::Tensor& lo_given, const at::Tensor& hi_given, bool together)
      : op(op_name) {
    TORCH_CHECK(query.dim() == 4 && key_given.dim() == 4 && value_given.dim() == 4, op, ": 4-D inputs");
    dtype = query.scalar_type();
    for (const at::Tensor* t : {&query, &key_given, &value_given}) {
      TORCH_CHECK(kernel_dtype(dtype) && t->scalar_type() == dtype && t->device().is_cpu() && t->stride(3) == 1, op,
                  ": CPU inputs of one dtype (float32, bfloat16 or float16) with a unit stride along the head "
                  "dimension");
    }
    B = query.size(0), H = query.size(1), Lq = query.size(2), D = query.size(3);
    Hkv = key_given.size(1), Lk = key_given.size(2), Dv = value_given.size(3);
    TORCH_CHECK(key_given.size(0) == B && value_given.size(0) == B && value_given.size(1) == Hkv &&
                    value_given.size(2) == Lk && key_given.size(3) == D && Hkv > 0 && H % Hkv == 0,
                op, ": mismatched shapes");
    lo_rows = lo_given.contiguous();
    hi_rows = hi_given.contiguous();
    TORCH_CHECK(lo_rows.scalar_type() == at::kLong && hi_rows.scalar_type() == at::kLong && lo_rows.dim() == 2 &&
                    lo_rows.sizes() == hi_rows.sizes() && lo_rows.size(1) == Lq &&
                    (lo_rows.size(0) == 1 || lo_rows.size(0) == B),
                op, ": lo, hi must be int64 [1 or B, Lq]");
    group = H / Hkv;
    key = together ? rows_together(key_given, Lq) : key_given;
    value = together ? rows_together(value_given, Lq) : value_given;
    q = Rows(query), k = Rows(key), v = Rows(value);
    lo = lo_rows.data_ptr<int64_t>(), hi = hi_rows.data_ptr<int64_t>();
    shared_rows = lo_rows.size(0) == 1;
  }

  // Checks and takes the score modifiers and dropout (after the op's own checks, in its order):
  // ALiBi slopes float32 [1 or B, H], softcap >= 0 (0: none), dropout in [0, 1).
  void modifiers(double scale_given, double dropout_p, int64_t seed, double softcap_given,
                 const std::optional<at::Tensor>& alibi_slopes, int64_t head_start, int64_t row_start,
                 int64_t key_start) {
    TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout must be in [0, 1)");
    dropout = make_dropout(dropout_p, seed, head_start, row_start, key_start);
    TORCH_CHECK(softcap_given >= 0.0, op, ": softcap must be >= 0 (0: none)");
    if (alibi_slopes.has_value() && alibi_slopes->defined()) {
      const at::Tensor& s = *alibi_slopes;
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.device().is_cpu() && s.dim() == 2 &&
                      (s.size(0) == 1 || s.size(0) == B) && s.size(1) == H,
                  op, ": alibi_slopes must be float32 CPU [1 or B, H]");
      slopes = s.contiguous();
    }
    scale = scale_given, softcap = softcap_given;
  }

  // The modifiers of sequence b, head h.
  ScoreMods mods(int64_t b, int64_t h) const { return score_mods(scale, softcap, slopes, b, h, Lq, Lk); }
  // Soft-capping as ScoreMods sees it (a float cap > 0).
  bool capped() const { return static_cast<float>(softcap) > 0.0f; }
  // Neither soft-capping nor ALiBi in the call (ScoreMods::plain for every head).
  bool plain() const { return !capped() && !slopes.defined(); }
  // Whether the bfloat16 products may take the weights P rounded to bfloat16 once (else in two
  // parts, amx.h split_halves): where PyTorch's own fused CPU kernel (the accuracy rule's bar)
  // rounds them so too, D == Dv, no score modifier, no dropout. Elsewhere PyTorch computes the call
  // in float32 (SDPA's math path for D != Dv; eager float32 ops for what SDPA lacks), and one part
  // there put 10 random calls in 3,000 over twice that bar's error (docs/performance.md, thirteenth
  // session). The forward's P V and the backward's dV follow it; set by modifiers().
  bool weights_round_once() const { return D == Dv && plain() && !dropout.active; }
  // The intervals of sequence b's rows from `first`.
  const int64_t* lo_of(int64_t b, int64_t first) const { return lo + (shared_rows ? 0 : b * Lq) + first; }
  const int64_t* hi_of(int64_t b, int64_t first) const { return hi + (shared_rows ? 0 : b * Lq) + first; }
};

// The span [first, last) of the keys that `rows` rows attending [lo[j], hi[j]) reach, clipped to
// [0, Lk): empty ({Lk, 0}) when no row attends a key.
std::pair<int64_t, int64_t> key_span(const int64_t* lo, const int64_t* hi, int64_t rows, int64_t Lk) {
  int64_t first = Lk, last = 0;
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t from = std::max<int64_t>(lo[j], 0), to = std::min<int64_t>(hi[j], Lk);
    if (from < to) first = std::min(first, from), last = std::max(last, to);
  }
  return {first, last};
}

// The intervals of a block's `rows` rows clipped to the keys [0, Lk) into row_lo, row_hi (a row
// whose lse is -inf, when `lse` is given, gets none: its weights are all 0, so the tiles have nothing
// to add, and the backward multiplies those zeros itself where an input is infinite,
// zero_weight_gradients); returns their key_span.
std::pair<int64_t, int64_t> block_span(const int64_t* lo, const int64_t* hi, int64_t rows, int64_t Lk,
                                              const float* lse, int64_t* row_lo, int64_t* row_hi) {
  for (int64_t j = 0; j < rows; ++j) {
    row_lo[j] = std::max<int64_t>(lo[j], 0);
    row_hi[j] = std::min<int64_t>(hi[j], Lk);
    if (lse != nullptr && lse[j] == kNegInf) row_hi[j] = row_lo[j];
  }
  return key_span(row_lo, row_hi, rows, Lk);
}

// The key_span of each half of a block's rows (kHalf rows, tiles.h), `row_lo` and `row_hi` as
// block_span gave them, into spans[0 .. rs / kHalf): rows past the block's `rows` reach none.
inline void half_spans(const int64_t* row_lo, const int64_t* row_hi, int64_t rows, int64_t rs, int64_t Lk,
                       std::pair<int64_t, int64_t>* spans) {
  for (int64_t first = 0; first < rs; first += kHalf) {
    spans[first / kHalf] =
        key_span(row_lo + first, row_hi + first, std::clamp<int64_t>(rows - first, 0, kHalf), Lk);
  }
}

}  // namespace
}  // namespace attnkit_native
