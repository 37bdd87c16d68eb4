// The backward: gradients of the forward from its lse, FlashAttention's way, by query blocks.
//
// Per block and chunk of keys: P from the lse, dP = dO V^T, dS = scale * P * (f dP - delta) with
// f the dropout factors (1 without dropout), dV += (f P)^T dO, dQ += dS K, dK += dS^T Q; the
// scores from the forward's register tiles, the other four products on register tiles too
// (tiles.h; dQ accumulated transposed, like Qt, and transposed out at the block's end); nothing of
// size Lq x Lk is ever stored. Chunks where a zeroed score or dP held a non-finite value are
// redone by their attended pairs (exact_backward_chunk).

#pragma once

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "aligned.h"
#include "dropout.h"
#include "half.h"
#include "kept_memory.h"
#include "lanes.h"
#include "params.h"
#include "products.h"
#include "score_mods.h"
#include "softmax.h"
#include "tiles.h"

namespace attnkit_native {
namespace {

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

// FlashAttention's row term of the backward, dO . O - dlse (the lse's gradient, 0 when unused).
// A half-precision output comes with what its rounding took off (`low_row`, the forward's
// residual): O = out + low, as the float32 kernel's row term reads it. Without it the rounded
// output dominates dQ and dK on rows whose weights peak on one key (bf16, scale 1: dq off by 0.157
// where PyTorch's math path is off by 0.054).
inline float row_delta(const float* go_row, const float* o_row, const float* low_row, int64_t Dv,
                       const float* grad_lse) {
  const float low = low_row ? dot(go_row, low_row, Dv) : 0.0f;
  return dot(go_row, o_row, Dv) + low - (grad_lse ? *grad_lse : 0.0f);
}

// The gradients of a row that attends the keys [lo, hi) but whose scores there were all -inf (lse
// -inf; block_span gives it no keys, so the tiles skip it): its weights are all 0, so each pair's
// dS = scale * 0 * f dP and dV's term 0 * dO are zeros, or NaN where what they multiply is not
// finite, as the definition's products give (an inf in a key reaches dq as 0 x inf, one in the
// query reaches dk). No row term: the definition's weights of such a row are 0 whatever its scores
// (no normaliser to differentiate, and its lse is the constant -inf), where FlashAttention's
// delta = dO . O would carry a NaN of the output (0 x a NaN value) into every key's dS; the
// reference backend has NaN in dk only where 0 meets an inf of the query. Such rows need an inf
// among the inputs: plain loops.
void zero_weight_gradients(const float* q_row, const float* go_row, const float* k_head, int64_t k2s,
                           const float* v_head, int64_t v2s, int64_t lo, int64_t hi, int64_t D, int64_t Dv,
                           float scale, const Dropout& dropout, DropoutRow dropout_keys, float* dq_row,
                           float* dk_head, int64_t dk2s, float* dv_head, int64_t dv2s) {
  for (int64_t t = lo; t < hi; ++t) {
    const float f = dropout.active ? dropout_factor(dropout, dropout_keys, t) : 1.0f;
    const float ds = scale * (0.0f * (f * dot(go_row, v_head + t * v2s, Dv)));
    axpy(dq_row, ds, k_head + t * k2s, D);
    axpy(dk_head + t * dk2s, ds, q_row, D);
    axpy(dv_head + t * dv2s, 0.0f * f, go_row, Dv);
  }
}

// The backward's tasks, (sequence, kv head, part of `part_rows` rows) numbered as the loop reads
// them, ordered by the attended keys of their rows, most first (ties in task order).
std::vector<int64_t> costliest_first(const Params& c, int64_t B, int64_t Hkv, int64_t parts, int64_t part_rows) {
  std::vector<int64_t> cost(B * parts, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* lo = c.lo_of(b, 0);
    const int64_t* hi = c.hi_of(b, 0);
    for (int64_t i = 0; i < c.Lq; ++i) {
      cost[b * parts + i / part_rows] += std::max<int64_t>(0, std::min(hi[i], c.Lk) - std::max<int64_t>(lo[i], 0));
    }
  }
  std::vector<int64_t> order(B * Hkv * parts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return cost[x / (Hkv * parts) * parts + x % parts] > cost[y / (Hkv * parts) * parts + y % parts];
  });
  return order;
}

// Gradients of interval_forward: given grad_out [B, H, Lq, Dv], the forward's output [B, H, Lq, Dv]
// and lse [B, H, Lq] (float32), and grad_lse [B, H, Lq] (float32) when the lse was used too,
// returns (dq, dk, dv) in the inputs' dtype, each in the shape of its input, laid out as
// like_layout gives. Half-precision inputs are read as float32 (half.h), and dk, dv summed in
// float32 before their one rounding. Each block computes its rows' delta = rowsum(grad_out * out)
// - grad_lse from rows it reads anyway (computed apart, a half-precision call converted both
// tensors whole first: 4 ms of a 180 ms window backward, L = 8192, 2 threads).
// Blocks of different rows add into the same key rows, so a task owns whole (batch, kv head)
// pairs; with fewer pairs than threads, each pair's rows are cut into `parts` that add into
// their own copy of dK and dV, summed at the end (`parts` copies: still O(L) memory).
std::tuple<at::Tensor, at::Tensor, at::Tensor> interval_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse_rows, const std::optional<at::Tensor>& grad_lse_rows,
    const at::Tensor& lo_rows, const at::Tensor& hi_rows,
    double scale, int64_t block, int64_t chunk_asked, int64_t parts, double dropout_p, int64_t seed, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t dropout_head_start, int64_t dropout_row_start,
    int64_t dropout_key_start, const std::optional<at::Tensor>& out_low, bool split_weights_asked) {
  Params c("interval_backward", query, key, value, lo_rows, hi_rows, /*together=*/false);
  const int64_t B = c.B, H = c.H, Lq = c.Lq, D = c.D, Hkv = c.Hkv, Lk = c.Lk, Dv = c.Dv;  // the lambdas capture these
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == B && grad_out.size(1) == H && grad_out.size(2) == Lq &&
                  grad_out.size(3) == Dv, "interval_backward: grad_out must be [B, H, Lq, Dv]");
  TORCH_CHECK(grad_out.scalar_type() == c.dtype && grad_out.device().is_cpu() && grad_out.stride(3) == 1,
              "interval_backward: grad_out must be CPU, of the inputs' dtype, with a unit stride along the head "
              "dimension");
  TORCH_CHECK(out.sizes() == grad_out.sizes() && out.scalar_type() == c.dtype && out.device().is_cpu() &&
                  out.stride(3) == 1,
              "interval_backward: out must be the forward's output: [B, H, Lq, Dv] like grad_out");
  const bool has_low = out_low.has_value() && out_low->numel() > 0;
  TORCH_CHECK(!has_low || (out_low->sizes() == out.sizes() && out_low->scalar_type() == c.dtype &&
                           out_low->device().is_cpu() && out_low->stride(3) == 1),
              "interval_backward: out_low must be the forward's residual: [B, H, Lq, Dv] like out");
  TORCH_CHECK(block > 0 && chunk_asked > 0 && parts > 0, "interval_backward: block, chunk and parts must be positive");
  c.modifiers(scale, dropout_p, seed, softcap, alibi_slopes, dropout_head_start, dropout_row_start, dropout_key_start);
  const Dropout& dropout = c.dropout;
  const at::Tensor lse = lse_rows.contiguous();
  const at::Tensor grad_lse = grad_lse_rows ? grad_lse_rows->contiguous() : at::Tensor();
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({B, H, Lq}),
              "interval_backward: lse must be float32 [B, H, Lq]");
  TORCH_CHECK(!grad_lse.defined() || (grad_lse.scalar_type() == at::kFloat && grad_lse.sizes() == lse.sizes()),
              "interval_backward: grad_lse must be float32 [B, H, Lq] like lse");

  at::Tensor dq = like_layout(query, B, H, Lq, D, c.dtype);  // each block writes its rows
  // [B, Hkv, parts, Lk, C]: each part's float32 copy laid out like key (value), summed over parts
  // at the end; half precision in one part writes its gradients directly (KeyGradRows)
  const bool copies = c.dtype == at::kFloat || parts > 1;
  // Each task zeroes the key rows its blocks reach as it reaches them (KeyGradRows), and a sum over
  // several parts skips the rows a part never reached (part_spans): zeroing and summing whole
  // copies cost a fifth of a float32 window backward in 4 parts, L = 8192, and a third of a bf16
  // one, which also rounded in a pass of its own
  const auto key_grads = [&](const at::Tensor& like, int64_t C) {
    if (!copies) return like_layout(like, B, Hkv, Lk, C, c.dtype);
    return like_layout(like, B, Hkv, parts * Lk, C).view({B, Hkv, parts, Lk, C});
  };
  at::Tensor dk = key_grads(key, D), dv = key_grads(value, Dv);
  const int64_t blocks = (Lq + block - 1) / block;
  const int64_t blocks_per_part = (blocks + parts - 1) / parts;
  std::vector<std::pair<int64_t, int64_t>> part_spans(parts > 1 ? B * Hkv * parts : 0, {Lk, 0});  // empty spans
  if (dq.numel() > 0 && Lk > 0) {
    const Rows go(grad_out), o(out);
    const float* l = lse.data_ptr<float>();
    const float* gl = grad_lse.defined() ? grad_lse.data_ptr<float>() : nullptr;
    const Rows dq_rows(dq), dk_rows(dk), dv_rows(dv);
    // The five products on the units the forward's took (products.h; dO's rows moved by pairs too;
    // float16 on the tiles runs again converted where it meets a NaN or inf, every gradient row
    // written again)
    const HalfProducts asked_units = backward_half_products(c.dtype, D, Dv, Lk, c.q.s2, c.k.s2, c.v.s2, go.s2);
    run_on_units(asked_units, [&](HalfProducts units, SplitWatch& watch) {
      const bool packed = units != HalfProducts::kConvert;
      const bool split_inputs = packed && c.dtype == at::kHalf;
      // float16: the scores over three parts' features, dP over four (amx.h)
      const int64_t packed_D = split_inputs ? 3 * D : D, packed_Dv = split_inputs ? 4 * Dv : Dv;
      // dV takes P rounded to bfloat16 once by the forward's rule (Params::weights_round_once), and in
      // two parts where the caller asks (sinks: their P sums to less than one, which the kernel cannot
      // see; one part there put calls over twice the bar's error). dQ and dK take dS in two parts
      // always: by the forward's rule, one part put dq at 2.4x SDPA's error in 1 call of 3,000
      // (thirteenth session), and dK alone at 2.1x in 2 plain calls of 3,000 (twentieth; both in
      // docs/performance.md).
      const bool split_weights = packed && (split_inputs || split_weights_asked || !c.weights_round_once());
      const int64_t chunk = chunk_keys(units, chunk_asked);
      const bool capped = c.capped();  // the cap's derivative is stored then
      using L = RowLanes;
      const WeightsRows<L> weights = pick_weights_rows<L>(c.plain());  // one per call
      const ScoreGradsRows<L> score_grads = pick_score_grads_rows<L>(dropout.active, capped);

      // Threads claim tasks one at a time, the costliest first (by the keys their rows attend): the
      // four parts of a causal head's rows cost 1 : 3 : 5 : 7, and a split into halves gave one of two
      // threads 12 of the 16 (docs/performance.md, "the backward's tasks claimed").
      const int64_t tasks = B * Hkv * parts;
      const std::vector<int64_t> order = costliest_first(c, B, Hkv, parts, blocks_per_part * block);
      std::atomic<int64_t> next_task{0};
      at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
        watch.begin();
        // The scores come from the forward's register tiles, bit for bit the forward's: the weights
        // recomputed from its lse must round alike (a score one ulp lower under a huge scale would
        // weigh 0 here where the forward gave it 1). P (in place of the scores), dP, dS and the cap's
        // derivative stay key-major with the rows as lanes, as the tiles give them, and the other
        // four products read them so (a transpose of each chunk's scores into rows took 6-9% of a
        // causal backward).
        const int64_t padded = (block + kGroup - 1) / kGroup * kGroup;
        // scores and grads: a chunk's rows rounded up to whole tiles of keys (the tiles write past W)
        Floats qt(packed ? 0 : D * padded, 0.0f), scores((chunk + kTile) * padded), grads((chunk + kTile) * padded, 0.0f);
        TileScope tiles(units == HalfProducts::kTiles);
        LineVector<uint32_t> packed_q(packed ? padded * packed_D / 2 : 0), packed_go(packed ? padded * packed_Dv / 2 : 0);
        LineVector<uint32_t> rows_q(packed ? padded * D / 2 : 0), rows_go(packed ? padded * Dv / 2 : 0);
        LineVector<uint32_t> rows_q_low(split_inputs ? padded * D / 2 : 0), rows_go_low(split_inputs ? padded * Dv / 2 : 0);
        // the weights (one part or two) and score gradients (two) as bfloat16 (amx.h, high and low). Every
        // buffer a tile reads or writes starts on a cache line (aligned.h: from glibc's 16-byte start
        // every tile row of 64 bytes touched two lines; window backward 110-118 -> 96-102 ms with the
        // two parts, L = 16384, 2 threads)
        LineVector<uint32_t> packed_ds(packed ? padded * round_up(chunk, kTileK) / 2 : 0), packed_ds_low(packed_ds.size());
        LineVector<uint16_t> key_rows(packed ? (chunk + kTile) * padded : 0), key_rows_low(key_rows.size());
        LineVector<uint16_t> spare_keys(packed ? kTile * std::max(packed_D, packed_Dv) : 0);
        // K^T's last block for dQ (amx_values; float16: both parts)
        LineVector<uint16_t> spare_block(packed ? (split_inputs ? 2 : 1) * D * kTileK : 0);
        Floats spare_sums(packed ? 2 * kTile * kTile : 0);
        std::optional<TransposedRows> keys_transposed;
        if (packed) keys_transposed.emplace(c.k, Lk);
        Floats got(packed ? 0 : Dv * padded), dqt(D * padded);  // dO^T and dQ^T: rows as lanes, like Qt
        std::vector<Start> dq_start(padded / kGroup);
        const Floats no_rescale(padded);
        Floats cap_grads(capped ? chunk * padded : 0);
        Floats weights_rows, grads_rows;  // [rows][width] copies for the exact path
        std::vector<int64_t> row_lo(padded), row_hi(padded);
        std::vector<std::pair<int64_t, int64_t>> spans(padded / kHalf);  // the keys each half of the rows reaches
        std::vector<KeySegments> segments(padded / kGroup);  // ... as segments of a chunk
        std::vector<DropoutRow> row_keys(padded);
        BlockRows r(padded);
        FloatRows queries(c.q), keys(c.k), values(c.v), grads_given(go), outputs(o),
            lows(has_low ? Rows(*out_low) : Rows());  // as float32 (half.h)
        // float16 on the tiles: rows of two bfloat16 parts (amx.h), queries [high | high | low] and
        // keys [high | low | high], dO [high | high | low | low] and values [high | low | high | low]
        HeldRows<uint16_t> split_queries(c.q, 3 * D, split_query_row), split_grads(go, 4 * Dv, split_grad_row);
        HeldRows<uint16_t> split_keys(c.k, 3 * D, split_key_row), split_values(c.v, 4 * Dv, split_value_row);
        const uint16_t *split_k = nullptr, *split_v = nullptr;
        int64_t split_k2s = 0, split_v2s = 0;
        OutputRows dq_out(dq_rows);
        KeyGradRows dk_sums(dk_rows, Lk, parts), dv_sums(dv_rows, Lk, parts);
        const auto reach = [&](int64_t from, int64_t to) { dk_sums.reach(from, to), dv_sums.reach(from, to); };
        for (int64_t claimed; !watch.stopped() && (claimed = next_task.fetch_add(1)) < tasks;) {
          const int64_t task = order[claimed];
          const int64_t b = task / (Hkv * parts), kv = (task / parts) % Hkv, part = task % parts;
          const auto [dk_head, dk2s] = dk_sums.start(b, kv, part);
          const auto [dv_head, dv2s] = dv_sums.start(b, kv, part);
          const int64_t block_end = std::min(blocks, (part + 1) * blocks_per_part);
          for (int64_t h = kv * c.group; h < (kv + 1) * c.group; ++h) {
            const ScoreMods mods = c.mods(b, h);
            for (int64_t index = part * blocks_per_part; index < block_end; ++index) {
              const int64_t first = index * block, rows = std::min(block, Lq - first);
              const float* l_block = l + (b * H + h) * Lq + first;
              const auto [span_lo, span_hi] = block_span(c.lo_of(b, first), c.hi_of(b, first), rows, Lk, l_block,
                                                         row_lo.data(), row_hi.data());
              for (int64_t j = 0; j < rows && dropout.active; ++j) {
                row_keys[j] = dropout_row(dropout, b, h, first + j);
              }
              const auto [dq_block, dq2s] = dq_out.block(b, h, first, rows);
              // rows with keys and lse -inf, after the block's tiles (which read other key rows)
              const auto weightless_rows = [&, dq_block = dq_block, dq2s = dq2s, dk_head = dk_head, dk2s = dk2s,
                                            dv_head = dv_head, dv2s = dv2s] {
                const int64_t* lo = c.lo_of(b, first);
                const int64_t* hi = c.hi_of(b, first);
                for (int64_t j = 0; j < rows; ++j) {
                  const int64_t a = std::max<int64_t>(lo[j], 0), z = std::min<int64_t>(hi[j], Lk);
                  if (l_block[j] != kNegInf || a >= z) continue;
                  const auto [q_rows, q_stride] = queries.head(b, h, first, first + rows);
                  const auto [g_rows, g_stride] = grads_given.head(b, h, first, first + rows);
                  const float* go_row = g_rows + (first + j) * g_stride;
                  reach(a, z);
                  const auto [k_rows, k_stride] = keys.head(b, kv, a, z);
                  const auto [v_rows, v_stride] = values.head(b, kv, a, z);
                  zero_weight_gradients(q_rows + (first + j) * q_stride, go_row, k_rows, k_stride, v_rows,
                                        v_stride, a, z, D, Dv, static_cast<float>(scale), dropout,
                                        dropout.active ? dropout_row(dropout, b, h, first + j) : DropoutRow{},
                                        dq_block + j * dq2s, dk_head, dk2s, dv_head, dv2s);
                }
              };
              if (span_lo >= span_hi) {  // no row of the block attends any key
                zero_rows(dq_block, rows, dq2s, D);
                weightless_rows();
                dq_out.store();
                continue;
              }
              const auto [go_head, g2s] = grads_given.head(b, h, first, first + rows);
              const auto [o_head, o2s] = outputs.head(b, h, first, first + rows);
              const auto [low_head, low2s] = lows.head(b, h, first, first + rows);  // nullptr: no residual
              const float* go_block = go_head + first * g2s;
              // On the packed layouts the products read the bfloat16 rows; float32 query, key and value rows are
              // converted only for the chunks redone by attended pairs.
              const float *q_head = nullptr, *k_head = nullptr, *v_head = nullptr, *q_block = nullptr;
              int64_t q2s = 0, k2s = 0, v2s = 0;
              const auto float_rows = [&] {
                if (k_head != nullptr) return;
                std::tie(q_head, q2s) = queries.head(b, h, first, first + rows);
                std::tie(k_head, k2s) = keys.head(b, kv, span_lo, span_hi);
                std::tie(v_head, v2s) = values.head(b, kv, span_lo, span_hi);
                q_block = q_head + first * q2s;
              };
              const int64_t rs = (rows + kGroup - 1) / kGroup * kGroup;
              // One group of rows skips the pairs outside each half's keys in all five products (tiles.h);
              // the products over rows take one group at a time only
              const bool trimmed = !packed && rs == kGroup;
              if (trimmed) half_spans(row_lo.data(), row_hi.data(), rows, rs, Lk, spans.data());
              if (split_inputs) {
                const auto [q_parts, q_parts_s] = split_queries.head(b, h, first, first + rows);
                const auto [go_parts, go_parts_s] = split_grads.head(b, h, first, first + rows);
                const uint16_t* q_rows = q_parts + first * q_parts_s;
                const uint16_t* go_rows = go_parts + first * go_parts_s;
                pack_queries(q_rows, q_parts_s, rows, packed_D, rs, packed_q.data());
                pack_queries(go_rows, go_parts_s, rows, packed_Dv, rs, packed_go.data());
                pack_rows(q_rows, q_parts_s, rows, D, rs, rows_q.data());
                pack_rows(q_rows + 2 * D, q_parts_s, rows, D, rs, rows_q_low.data());
                pack_rows(go_rows, go_parts_s, rows, Dv, rs, rows_go.data());
                pack_rows(go_rows + 2 * Dv, go_parts_s, rows, Dv, rs, rows_go_low.data());
              } else if (packed) {
                pack_queries(bf16_row(c.q, b, h, first), c.q.s2, rows, D, rs, packed_q.data());
                pack_queries(bf16_row(go, b, h, first), go.s2, rows, Dv, rs, packed_go.data());
                pack_rows(bf16_row(c.q, b, h, first), c.q.s2, rows, D, rs, rows_q.data());
                pack_rows(bf16_row(go, b, h, first), go.s2, rows, Dv, rs, rows_go.data());
              } else {
                float_rows();
                transpose(q_block, q2s, rows, D, qt.data(), rs);  // Qt[d][r], padding rows 0
                for (int64_t d = 0; d < D; ++d) std::fill(qt.data() + d * rs + rows, qt.data() + (d + 1) * rs, 0.0f);
                transpose(go_block, g2s, rows, Dv, got.data(), rs);  // dOt[dv][r], padding rows 0
                for (int64_t d = 0; d < Dv; ++d) std::fill(got.data() + d * rs + rows, got.data() + (d + 1) * rs, 0.0f);
              }
              bool dq_started = false;  // dQt holds this block's sum so far
              const float* o_block = o_head + first * o2s;
              const float* gl_block = gl ? gl + (b * H + h) * Lq + first : nullptr;
              // The rows' lanes; padding rows (up to a whole group) attend nothing
              for (int64_t j = 0; j < rs; ++j) {
                const bool real = j < rows, dropped = real && dropout.active;
                r.lo[j] = real ? static_cast<int32_t>(row_lo[j]) : 0, r.hi[j] = real ? static_cast<int32_t>(row_hi[j]) : 0;
                r.drop_a[j] = dropped ? static_cast<int32_t>(row_keys[j].a) : 0;
                r.drop_c[j] = dropped ? static_cast<int32_t>(row_keys[j].c) : 0;
                r.lse[j] = real ? l_block[j] : 0.0f;
                // FlashAttention's D term: dS = P * (f dP - delta), and a row's sum of f * P * dP is
                // dO . O whatever the dropout factors f
                const float* grad_lse_j = gl_block ? gl_block + j : nullptr;
                const float* low_row = low_head ? low_head + (first + j) * low2s : nullptr;
                r.delta[j] = real ? row_delta(go_block + j * g2s, o_block + j * o2s, low_row, Dv, grad_lse_j) : 0.0f;
              }
              for (int64_t j = 0; j < rs; j += L::kWidth) {
                const int64_t whole = std::min(rows, j + L::kWidth);
                int64_t& all_lo = r.all_lo[j / L::kWidth];
                int64_t& all_hi = r.all_hi[j / L::kWidth];
                all_lo = 0, all_hi = whole - j < L::kWidth ? 0 : Lk;  // padding rows attend nothing
                for (int64_t i = j; i < whole; ++i) all_lo = std::max(all_lo, row_lo[i]), all_hi = std::min(all_hi, row_hi[i]);
              }
              // on the packed layouts chunks start at multiples of 32 keys, as the forward's (K^T's blocks)
              const int64_t chunk_lo = packed ? span_lo / kTileK * kTileK : span_lo;
              if (split_inputs) {
                std::tie(split_k, split_k2s) = split_keys.head(b, kv, chunk_lo, span_hi);
                std::tie(split_v, split_v2s) = split_values.head(b, kv, chunk_lo, span_hi);
              }
              for (int64_t c0 = chunk_lo; c0 < span_hi; c0 += chunk) {
                const int64_t width = std::min(chunk, span_hi - c0);
                float* p = scores.data();  // S, then P in its place: [t][r], row stride rs
                float* ds = grads.data();  // dP, then dS in its place, the same layout
                float* cap = cap_grads.empty() ? nullptr : cap_grads.data();
                L::F bad = L::zero();
                const KeySegments* trim = nullptr;
                if (trimmed) {
                  chunk_segments(spans.data(), rs, c0, width, segments.data());
                  trim = segments.data();
                }
                if (split_inputs) {
                  scores_product(units, split_k + c0 * split_k2s, split_k2s, width, span_hi - c0, packed_D, packed_q.data(),
                                 rs, p, spare_keys.data());
                } else if (packed) {
                  scores_product(units, bf16_row(c.k, b, kv, c0), c.k.s2, width, Lk - c0, D, packed_q.data(), rs, p, spare_keys.data());
                } else {
                  block_scores(k_head + c0 * k2s, k2s, width, D, qt.data(), rs, p, trim);
                }
                for (int64_t j = 0; j < rs; j += L::kWidth) {
                  weights(p + j, rs, width, c0, r, j, mods, first + j, cap ? cap + j : nullptr, bad);
                }
                // dP[t][r] = sum_dv V[t][dv] dOt[dv][r]: the scores' tiles (padding rows of dOt are 0)
                if (split_inputs) {
                  scores_product(units, split_v + c0 * split_v2s, split_v2s, width, span_hi - c0, packed_Dv,
                                 packed_go.data(), rs, ds, spare_keys.data());
                } else if (packed) {
                  scores_product(units, bf16_row(c.v, b, kv, c0), c.v.s2, width, Lk - c0, Dv, packed_go.data(), rs, ds,
                                 spare_keys.data());
                } else {
                  block_scores(v_head + c0 * v2s, v2s, width, Dv, got.data(), rs, ds, trim);
                }
                // lanes past the block's rows: 0 (0 times an infinite value there would read as a
                // masked non-finite value below)
                for (int64_t t = 0; t < width && rows < rs; ++t) std::fill(ds + t * rs + rows, ds + (t + 1) * rs, 0.0f);
                for (int64_t j = 0; j < rs; j += L::kWidth) {  // with dropout, also turns P into the weights the output used
                  score_grads(p + j, ds + j, rs, width, c0, r, j, static_cast<float>(scale), cap ? cap + j : nullptr, bad,
                              dropout);
                }
                reach(c0, c0 + width);
                if (L::any_bits(bad)) {
                  float_rows();
                  weights_rows.resize(rows * width), grads_rows.resize(rows * width);
                  transpose(p, rs, width, rows, weights_rows.data(), width);
                  transpose(ds, rs, width, rows, grads_rows.data(), width);
                  exact_backward_chunk(rows, width, c0, row_lo.data(), row_hi.data(), weights_rows.data(),
                                       grads_rows.data(), q_block, q2s, go_block, g2s, k_head, k2s, dqt.data(), rs,
                                       dk_head, dk2s, dv_head, dv2s, D, Dv, !dq_started);
                  dq_started = true;
                  continue;
                }
                // dV_chunk += (f P)^T dO, dQt (+)= K_chunk^T dS^T, dK_chunk += dS^T Q
                std::fill(dq_start.begin(), dq_start.end(), dq_started ? Start::kKeep : Start::kZero);
                dq_started = true;
                if (packed) {
                  // P rounded once or in two bfloat16 parts (amx.h, split_halves), dS in two parts, in B's
                  // layout too, for dQ
                  uint16_t* p_low = split_weights ? key_rows_low.data() : nullptr;
                  pack_key_rows(p, rs, width, key_rows.data(), p_low);
                  rows_product(units, key_rows.data(), p_low, rs, width, rows_go.data(), Dv, dv_head + c0 * dv2s, dv2s,
                               spare_sums.data(), split_inputs ? rows_go_low.data() : nullptr);
                  pack_key_rows(ds, rs, width, key_rows.data(), key_rows_low.data(), packed_ds.data(), packed_ds_low.data());
                  values_product(units, keys_transposed->from(b, kv, c0, c0 + width), width, D, packed_ds.data(), rs, dqt.data(),
                                 dq_start.data(), no_rescale.data(), spare_block.data(), packed_ds_low.data(),
                                 split_inputs ? keys_transposed->low_at(c0) : nullptr);
                  rows_product(units, key_rows.data(), key_rows_low.data(), rs, width, rows_q.data(), D, dk_head + c0 * dk2s,
                               dk2s, spare_sums.data(), split_inputs ? rows_q_low.data() : nullptr);
                } else {
                  block_rows_product(p, rs, width, rows, go_block, g2s, Dv, dv_head + c0 * dv2s, dv2s, trim);
                  block_values(k_head + c0 * k2s, k2s, width, D, ds, rs, dqt.data(), dq_start.data(), no_rescale.data(),
                               trim);
                  block_rows_product(ds, rs, width, rows, q_block, q2s, D, dk_head + c0 * dk2s, dk2s, trim);
                }
              }
              transpose(dqt.data(), rs, D, rows, dq_block, dq2s);  // dq[r][d] = dQt[d][r]
              weightless_rows();
              dq_out.store();
            }
          }
          if (parts > 1) part_spans[task] = dk_sums.reached();  // dv_sums reached the same rows
          dk_sums.finish(), dv_sums.finish();
          watch.note();
        }
      });
    });
  } else {  // no task ran: no key row was reached
    dk.zero_(), dv.zero_();
  }
  const auto summed = [&](const at::Tensor& sums, const at::Tensor& like) {
    if (!copies) return sums;
    if (parts == 1) return sums.squeeze(2);  // float32 (half precision in one part has no copies)
    const int64_t C = sums.size(4);
    // each key row: the parts whose span holds it, in part order from 0 (as a sum over the parts'
    // dim would add them, the others' zeros left out), rounded once into the call's dtype
    at::Tensor total = like_layout(like, B, Hkv, Lk, C, c.dtype);
    const Rows from(sums), to(total);
    at::parallel_for(0, B * Hkv * Lk, 256, [&](int64_t begin, int64_t end) {
      Floats row(C);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t b = index / (Hkv * Lk), kv = (index / Lk) % Hkv, i = index % Lk;
        std::fill(row.begin(), row.end(), 0.0f);
        for (int64_t part = 0; part < parts; ++part) {
          const auto [first, last] = part_spans[(b * Hkv + kv) * parts + part];
          if (i < first || i >= last) continue;
          const float* x = from.floats(b, kv, part) + i * from.s3;
          for (int64_t j = 0; j < C; ++j) row[j] += x[j];
        }
        if (to.is_float()) {
          std::copy(row.begin(), row.end(), to.mutable_floats(b, kv, i));
        } else {
          from_float(row.data(), C, to.type, const_cast<char*>(to.at(b, kv, i)));
        }
      }
    });
    return total;
  };
  return {dq, summed(dk, key), summed(dv, value)};
}

}  // namespace
}  // namespace attnkit_native
