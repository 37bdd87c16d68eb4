// attnkit's own CPU kernel: attention where each query row attends one interval of keys.
//
// Every structured mask in attnkit.masks gives each query row i one interval [lo[i], hi[i]) of
// keys (causal, sliding window, documents, prefix-LM, padding and their intersections). This is
// the kernel's one translation unit: it registers the ops, and includes the headers that hold
// one idea each:
//
//   lanes.h        lane arithmetic (one float, 8 lanes, 16 lanes), exp and tanh, the lane traits
//   score_mods.h   scale, soft-capping, ALiBi
//   dropout.h      the dropout hash
//   kept_memory.h  the allocator that keeps large outputs' mappings; the outputs' layout
//   aligned.h      scratch buffers aligned to a cache line
//   half.h         bfloat16 and float16 inputs read as float32 rows, outputs rounded once
//   amx.h          the bfloat16 products on AMX tiles, forward and backward (where the CPU has them)
//   dots.h         the same products on AVX512-BF16 dot products (where it has those and no tiles)
//   products.h     which of the two (or the float32-convert path) a call's products take
//   params.h       the call's checked inputs, pointers, strides and sizes (Params)
//   softmax.h      the row loops: running softmax, the backward's weights and score gradients
//   tiles.h        register tiles, one template over the lane traits for both ISAs
//   forward.h      interval_forward
//   backward.h     interval_backward
//
// One unit, not one per op: every header is templates and inline functions the two ops share, and
// torch's headers dominate the compile (each unit would parse them again), so one unit keeps the
// build's time and the compiler's view of the whole kernel (what it inlines) as when this was one
// file. The headers keep internal linkage (an anonymous namespace) for that reason.
//
// Built by attnkit/_backends/native/building.py with -O3 -mavx2 -mfma -mf16c (and -mavx512f on a CPU with
// AVX-512), -ffp-contract=off (no FMA the source does not ask for: the backward's weights must
// round as the forward's did) and no -ffast-math (which would let the compiler assume there are
// no infinities).

#include <torch/library.h>

#include "backward.h"
#include "forward.h"
#include "kept_memory.h"

TORCH_LIBRARY(attnkit_native, m) {
  m.def("interval_forward(Tensor query, Tensor key, Tensor value, Tensor lo, Tensor hi, float scale, int block, "
        "int chunk, float dropout, int seed, float softcap, Tensor? alibi_slopes, int dropout_head_start, "
        "int dropout_row_start, int dropout_key_start, bool residual) -> (Tensor, Tensor, Tensor)");
  m.def("interval_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
        "Tensor? grad_lse, Tensor lo, Tensor hi, float scale, int block, int chunk, int parts, float dropout, int seed, "
        "float softcap, Tensor? alibi_slopes, int dropout_head_start, int dropout_row_start, int dropout_key_start, "
        "Tensor? out_low, bool split_weights) -> (Tensor, Tensor, Tensor)");
  m.def("release_kept_memory() -> int", &attnkit_native::release_kept_memory);
  m.def("matrix_units_available() -> bool", &attnkit_native::matrix_units_available);
  m.def("dot_products_available() -> bool", &attnkit_native::dot_products_available);
  m.def("use_half_products(int units) -> int", &attnkit_native::use_half_products);
  m.def("backward_packs(Tensor query, Tensor key, Tensor value, Tensor grad_out) -> bool",
        &attnkit_native::backward_packs);
}

TORCH_LIBRARY_IMPL(attnkit_native, CPU, m) {
  m.impl("interval_forward", &attnkit_native::interval_forward);
  m.impl("interval_backward", &attnkit_native::interval_backward);
}
