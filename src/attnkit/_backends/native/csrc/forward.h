// The forward: output and log-sum-exp of attention where each query row attends one interval of
// keys, block by block with a flash-style running softmax over chunks of keys.
//
// A block of rows computes scores only over the span of its rows' intervals (tiles.h: register
// tiles, no BLAS), masks each row to its own interval while taking the softmax (softmax.h: no mask
// tensor), and multiplies by the values. Compared with PyTorch's fused CPU kernel on the same
// blocks it avoids the kernel's fixed 512-key chunks (a 512 window's 543-key span would run as
// 512 + 31), the additive mask pass, and partial outputs merged in Python. Rows where the block's
// products met a non-finite value are redone by their attended pairs (exact_forward_row).

#pragma once

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "aligned.h"
#include "dropout.h"
#include "half.h"
#include "kept_memory.h"
#include "lanes.h"
#include "packed_softmax.h"
#include "params.h"
#include "products.h"
#include "score_mods.h"
#include "softmax.h"
#include "tiles.h"

namespace attnkit_native {
namespace {

// The output of a row whose attended scores are all -inf: each attended value weighed by 0, which
// is 0 but NaN wherever a value holds NaN or inf (0 x inf, as the definition's products give);
// zeros for a row with no key.
void zero_weighted_values(const float* v_head, int64_t v2s, int64_t Dv, int64_t lo, int64_t hi, float* out) {
  std::fill(out, out + Dv, 0.0f);
  for (int64_t t = lo; t < hi; ++t) axpy(out, 0.0f, v_head + t * v2s, Dv);
}

// One query row by its attended pairs only, for rows where the block's products met a non-finite
// value: scores s_t = scale q . k_t for t in [lo, hi), weights exp(s_t - max) / sum, output
// sum_t w_t f_t v_t in IEEE arithmetic (a weight of 0 times an infinite value is NaN), lse. A NaN
// or +inf score makes the row NaN; all scores -inf (or none) make it zeros with lse -inf. `s` is
// scratch for the row's scores.
void exact_forward_row(const float* q_row, const float* k_head, int64_t k2s, const float* v_head, int64_t v2s,
                       int64_t D, int64_t Dv, int64_t lo, int64_t hi, const ScoreMods& mods, int64_t row,
                       const Dropout& dropout, DropoutRow dropout_keys, Floats& s, float* out,
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
  if (row_max == kNegInf) {
    zero_weighted_values(v_head, v2s, Dv, lo, hi, out);
    *lse = kNegInf;
    return;
  }
  std::fill(out, out + Dv, 0.0f);
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

// `first`: the first row's bytes; `stride`, `width`: in bytes.
inline void prefetch_rows(const char* first, int64_t rows, int64_t stride, int64_t width, bool for_writing) {
  static const bool prefetchw = has_prefetchw();  // asked of the CPU: the build flags do not imply it
  for_writing = for_writing && prefetchw;
  for (int64_t j = 0; j < rows; ++j) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(first + j * stride);
    const uintptr_t end = begin + static_cast<uintptr_t>(width);
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

// Output [B, H, Lq, Dv] (the inputs' dtype, laid out as the query: see like_layout) and the
// natural-log sum-exp [B, H, Lq] (float32, before dropout) of attention over the intervals [lo, hi) (params.h has the layout);
// a row with no key gives zeros and -inf. Optional dropout on the weights, from a seed (dropout.h).
// Third, with `residual` and half-precision inputs, what rounding the output took off, like the
// output (half.h's OutputRows); else an empty tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor> interval_forward(const at::Tensor& query, const at::Tensor& key,
                                                    const at::Tensor& value, const at::Tensor& lo_rows,
                                                    const at::Tensor& hi_rows, double scale, int64_t block,
                                                    int64_t chunk_asked, double dropout_p, int64_t seed, double softcap,
                                                    const std::optional<at::Tensor>& alibi_slopes,
                                                    int64_t dropout_head_start, int64_t dropout_row_start,
                                                    int64_t dropout_key_start, bool residual) {
  Params c("interval_forward", query, key, value, lo_rows, hi_rows, /*together=*/true);
  TORCH_CHECK(block > 0 && chunk_asked > 0, "interval_forward: block and chunk must be positive");
  TORCH_CHECK(c.Lk < (int64_t{1} << 31), "interval_forward: at most 2^31 - 1 keys");
  c.modifiers(scale, dropout_p, seed, softcap, alibi_slopes, dropout_head_start, dropout_row_start, dropout_key_start);
  const int64_t B = c.B, H = c.H, Lq = c.Lq, D = c.D, Lk = c.Lk, Dv = c.Dv;  // the lambdas capture these
  const Dropout& dropout = c.dropout;

  at::Tensor out = like_layout(query, B, H, Lq, Dv, c.dtype);
  at::Tensor lse = at::empty({B, H, Lq}, query.options().dtype(at::kFloat));
  at::Tensor low = residual && c.dtype != at::kFloat ? like_layout(query, B, H, Lq, Dv, c.dtype)
                                                     : at::empty({0}, query.options());
  if (lse.numel() == 0) return {out, lse, low};
  // bfloat16 products on the AMX tiles or the dot products, read from packed layouts (products.h;
  // float16 on the tiles runs again converted where it meets a NaN or inf)
  run_on_units(half_products(c.dtype, D, Dv, Lk, c.q.s2, c.k.s2, c.v.s2), [&](HalfProducts units, SplitWatch& watch) {
    const bool packed = units != HalfProducts::kConvert;
    // float16 on the tiles: rows of two bfloat16 parts side by side, three times the features (amx.h)
    const bool split_inputs = packed && c.dtype == at::kHalf;
    const int64_t packed_D = split_inputs ? 3 * D : D;
    const int64_t blocks = (Lq + block - 1) / block;
    const Rows o(out), o_low = low.numel() > 0 ? Rows(low) : Rows();
    float* l = lse.data_ptr<float>();
    using L = RowLanes;
    const bool rescore = rescored(c.plain(), static_cast<float>(scale));
    const SoftmaxRows<L> softmax = pick_softmax_rows<L>(rescore, dropout.active);  // one per call
    // On the packed layouts P is rounded to bfloat16 for P V, so the weights carry the dropout's keep mask
    // (factors 0 or 1) and 1 / (1 - p) multiplies each row once at the end, in float32: a row of one
    // kept key then reads that key's value times the exact factor, where bf16(1 / (1 - p)) was off
    // by up to 2^-9 (the backward takes the exact factor). Converted, the weights are float32.
    Dropout kept = dropout;
    if (packed) kept.keep_scale = 1.0f;
    const float after_sum = packed && dropout.active ? dropout.keep_scale : 1.0f;
    // P V takes P rounded once or in two parts by Params::weights_round_once (two cost those calls
    // about 1.1x the forward's time, docs/performance.md, thirteenth session)
    const bool split_weights = packed && (split_inputs || !c.weights_round_once());
    // on 16 lanes the packed layouts' weights come straight from the softmax (packed_softmax.h)
    const PackedSoftmaxRows packed_softmax =
        packed ? pick_packed_softmax_rows(rescore, dropout.active, split_weights) : nullptr;

    const int64_t padded = (block + kGroup - 1) / kGroup * kGroup;
    const int64_t chunk = chunk_keys(units, chunk_asked);
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
      watch.begin();
      // scores: a chunk's rows rounded up to whole tiles of keys (the tiles write past W)
      Floats qt(packed ? 0 : D * padded), scores((chunk + kTile) * padded), ot(Dv * padded);
      TileScope tiles(units == HalfProducts::kTiles);
      // from a cache line, as every buffer a tile reads (backward.h)
      LineVector<uint32_t> packed_queries(packed ? padded * packed_D / 2 : 0);
      LineVector<uint32_t> packed_weights(packed ? padded * round_up(chunk, kTileK) / 2 : 0);
      LineVector<uint32_t> weights_low(split_weights ? padded * round_up(chunk, kTileK) / 2 : 0);
      LineVector<uint16_t> spare_keys(packed ? kTile * packed_D : 0);
      LineVector<uint16_t> spare_values(packed ? (split_inputs ? 2 : 1) * Dv * kTileK : 0);
      std::optional<TransposedRows> transposed;
      if (packed) transposed.emplace(c.v, Lk);
      BlockRows r(padded);
      std::vector<Start> start(padded / kGroup);
      std::vector<int64_t> row_lo(padded), row_hi(padded);
      std::vector<std::pair<int64_t, int64_t>> spans(padded / kHalf);  // the keys each half of the rows reaches
      std::vector<KeySegments> segments(padded / kGroup);  // ... as segments of a chunk
      std::vector<DropoutRow> row_keys(padded);
      Floats exact_scores;
      FloatRows queries(c.q), keys(c.k), values(c.v);  // as float32 (half.h)
      HeldRows<uint16_t> split_queries(c.q, 3 * D, split_query_row), split_keys(c.k, 3 * D, split_key_row);
      OutputRows outputs(o, o_low);
      for (int64_t begin; !watch.stopped() && (begin = next_task.fetch_add(claim)) < tasks;) {
        const int64_t end = std::min(tasks, begin + claim);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / (H * blocks), h = (task / blocks) % H, first = (task % blocks) * block;
          const ScoreMods mods = c.mods(b, h);
          const int64_t rows = std::min(block, Lq - first), rs = (rows + kGroup - 1) / kGroup * kGroup;
          const auto [span_lo, span_hi] =
              block_span(c.lo_of(b, first), c.hi_of(b, first), rows, Lk, nullptr, row_lo.data(), row_hi.data());
          const auto [o_block, o2s] = outputs.block(b, h, first, rows);
          float* l_block = l + (b * H + h) * Lq + first;
          if (task + 1 < tasks) {
            const int64_t next_b = (task + 1) / (H * blocks), next_h = ((task + 1) / blocks) % H;
            const int64_t next_first = ((task + 1) % blocks) * block;
            prefetch_rows(c.q.at(next_b, next_h, next_first), std::min(block, Lq - next_first), c.q.s2 * c.q.bytes,
                          D * c.q.bytes, false);
          }
          if (span_lo >= span_hi) {  // no row of the block attends any key
            zero_rows(o_block, rows, o2s, Dv);
            outputs.store();
            std::fill(l_block, l_block + rows, kNegInf);
            continue;
          }
          // after the check: an empty block's span would make the threads' converted rows start over.
          // On the packed layouts the products read the bfloat16 rows, and float32 rows are converted only for
          // the rows redone below.
          const float *q_head = nullptr, *k_head = nullptr, *v_head = nullptr;
          int64_t q2s = 0, k2s = 0, v2s = 0;
          const auto float_rows = [&] {
            if (k_head != nullptr) return;
            std::tie(q_head, q2s) = queries.head(b, h, first, first + rows);
            std::tie(k_head, k2s) = keys.head(b, h / c.group, span_lo, span_hi);
            std::tie(v_head, v2s) = values.head(b, h / c.group, span_lo, span_hi);
          };
          if (!packed) float_rows();
          // Rows past the block's last (padding up to a whole group, queries 0) attend the whole span, so
          // that they do not narrow the keys all rows of their vector attend; their results are dropped.
          half_spans(row_lo.data(), row_hi.data(), rows, rs, Lk, spans.data());
          for (int64_t j = rows; j < rs; ++j) row_lo[j] = span_lo, row_hi[j] = span_hi;
          for (int64_t j = 0; j < rs; ++j) {
            if (dropout.active) row_keys[j] = j < rows ? dropout_row(dropout, b, h, first + j) : DropoutRow{};
            r.lo[j] = static_cast<int32_t>(row_lo[j]), r.hi[j] = static_cast<int32_t>(row_hi[j]);
            r.drop_a[j] = static_cast<int32_t>(row_keys[j].a), r.drop_c[j] = static_cast<int32_t>(row_keys[j].c);
            r.max[j] = kNegInf, r.sum[j] = 0.0f;
          }
          for (int64_t j = 0; j < rs; j += L::kWidth) {
            const auto lo_j = row_lo.begin() + j, hi_j = row_hi.begin() + j;
            r.all_lo[j / L::kWidth] = std::max<int64_t>(0, *std::max_element(lo_j, lo_j + L::kWidth));
            r.all_hi[j / L::kWidth] = std::min<int64_t>(Lk, *std::min_element(hi_j, hi_j + L::kWidth));
          }
          // float16 on the tiles: the keys' parts for the block's chunks, from the first chunk's start
          const uint16_t* split_key_rows = nullptr;
          int64_t split_k2s = 0;
          if (split_inputs) {
            const auto [q_parts, q_parts_s] = split_queries.head(b, h, first, first + rows);
            pack_queries(q_parts + first * q_parts_s, q_parts_s, rows, packed_D, rs, packed_queries.data());
            std::tie(split_key_rows, split_k2s) = split_keys.head(b, h / c.group, span_lo / kTileK * kTileK, span_hi);
          } else if (packed) {
            pack_queries(bf16_row(c.q, b, h, first), c.q.s2, rows, D, rs, packed_queries.data());
          } else {  // Qt[d][r] = q_r[d], padding rows 0
            transpose(q_head + first * q2s, q2s, rows, D, qt.data(), rs);
            for (int64_t d = 0; d < D; ++d) std::fill(qt.data() + d * rs + rows, qt.data() + (d + 1) * rs, 0.0f);
          }
          // On the packed layouts chunks start at multiples of 32 keys (V^T's blocks): the keys before span_lo in
          // the first are masked for every row, as any key outside a row's interval is.
          const int64_t chunk_lo = packed ? span_lo / kTileK * kTileK : span_lo;
          for (int64_t c0 = chunk_lo; c0 < span_hi; c0 += chunk) {
            const int64_t width = std::min(chunk, span_hi - c0);
            if (c0 + chunk >= span_hi) {  // written next
              prefetch_rows(o.at(b, h, first), rows, o.s2 * o.bytes, Dv * o.bytes, true);
            }
            float* s = scores.data();
            if (split_inputs) {
              scores_product(units, split_key_rows + c0 * split_k2s, split_k2s, width, span_hi - c0, packed_D,
                             packed_queries.data(), rs, s, spare_keys.data());
            } else if (packed) {
              scores_product(units, bf16_row(c.k, b, h / c.group, c0), c.k.s2, width, Lk - c0, D,
                             packed_queries.data(), rs, s, spare_keys.data());
            } else {
              chunk_segments(spans.data(), rs, c0, width, segments.data());
              block_scores(k_head + c0 * k2s, k2s, width, D, qt.data(), rs, s, segments.data());
            }
            uint32_t* low = split_weights ? weights_low.data() : nullptr;
            for (int64_t j = 0; j < rs; j += L::kWidth) {
              if (packed_softmax) {
                packed_softmax(s + j, rs, width, c0, r, j, mods, first + j, kept, packed_weights.data(), low);
              } else {
                softmax(s + j, rs, width, c0, r, j, mods, first + j, kept);
              }
            }
            for (int64_t g = 0; g < rs / kGroup; ++g) {
              const float* rescale = r.rescale.data() + g * kGroup;
              const bool ones = std::all_of(rescale, rescale + kGroup, [](float x) { return x == 1.0f; });
              start[g] = c0 == chunk_lo ? Start::kZero : ones ? Start::kKeep : Start::kRescale;
            }
            if (packed) {
              if (!packed_softmax) pack_weights(s, rs, width, packed_weights.data(), low);
              const uint16_t* vt = transposed->from(b, h / c.group, c0, c0 + width);
              values_product(units, vt, width, Dv, packed_weights.data(), rs, ot.data(), start.data(),
                             r.rescale.data(), spare_values.data(), low,
                             split_inputs ? transposed->low_at(c0) : nullptr);
            } else {
              block_values(v_head + c0 * v2s, v2s, width, Dv, s, rs, ot.data(), start.data(), r.rescale.data(),
                           segments.data());
            }
          }
          transpose(ot.data(), rs, Dv, rows, o_block, o2s);  // out[r][dv] = Ot[dv][r], normalised below
          // A non-finite value in an accumulator came from a value the block multiplied by a weight:
          // a masked key's (weight 0, which must not count) or an attended one's, where the running
          // rescaling may have turned a weight into 0 early; such rows are redone by attended pairs.
          for (int64_t j = 0; j < rows; ++j) {
            float* acc = o_block + j * o2s;
            const float sum = r.sum[j];
            if (std::isnan(sum)) {  // a NaN or +inf score among the attended ones
              std::fill(acc, acc + Dv, std::numeric_limits<float>::quiet_NaN());
              l_block[j] = std::numeric_limits<float>::quiet_NaN();
            } else if (sum > 0.0f) {
              if (scale_and_check(acc, Dv, after_sum / sum)) {
                l_block[j] = r.max[j] + std::log(sum);
              } else {
                float_rows();
                exact_forward_row(q_head + (first + j) * q2s, k_head, k2s, v_head, v2s, D, Dv, row_lo[j], row_hi[j],
                                  mods, first + j, dropout, row_keys[j], exact_scores, acc, l_block + j);
              }
            } else {  // no key, or only scores of -inf
              float_rows();
              zero_weighted_values(v_head, v2s, Dv, row_lo[j], row_hi[j], acc);
              l_block[j] = kNegInf;
            }
          }
          outputs.store();
        }
        watch.note();
      }
    });
  });
  return {out, lse, low};
}

}  // namespace
}  // namespace attnkit_native
