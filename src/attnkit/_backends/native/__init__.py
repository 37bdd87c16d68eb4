"""attnkit's own CPU kernel for interval masks (``csrc/``: one header per idea, compiled as one unit,
``csrc/ops.cpp``).

Attention where each query row attends one interval of keys ``[lo, hi)``, which is what every
structured mask is: each block of rows runs over its rows' key span with register-tiled products
(256-bit, or 512-bit where the CPU has AVX-512: the same bits) and a masked running softmax,
output and log-sum-exp, and the gradients from them (the backward's five products on the same
kind of tiles: no BLAS). The tiled
backend runs it, forward and backward, where it is built and applies (CPU tensors in float32, or
bfloat16 / float16 computed in float32 on CPUs without half-precision units, and on CPUs with AMX,
where the products run on the tiles, float16's as two bfloat16 parts per value; a structured mask, no
dense tensor mask; dropout included), and PyTorch's kernels block by block
otherwise; both give the same results up to float rounding, and the same dropout pattern.

- :mod:`.building`: compiling (an install step: ``attnkit build-kernel``), probing in a separate
  process, the build record;
- :mod:`.loading`: loading it into this process only when it matches its record; ``available``,
  ``applies``, ``turned_off``;
- :mod:`.ops`: the raw ops ``torch.ops.attnkit_native.*`` with their tile choices;
- :mod:`.tile_tables`: the tile tables and ``computed_fraction``.
"""

from .building import build, cache_dir, library_path
from .loading import (applies, available, enabled, hint_if_not_built, loaded_from, serves, serves_half_precision,
                      turned_off, why_unavailable, wide)
from .ops import (HALF_PRODUCTS, dot_products_available, half_products, half_products_available, interval_backward,
                  interval_forward, matrix_units_available, release_kept_memory, use_half_products)
from .tile_tables import backward_tiles, computed_fraction, tiles

__all__ = ["build", "cache_dir", "library_path", "applies", "available", "enabled", "hint_if_not_built", "loaded_from", "serves", "serves_half_precision", "turned_off",
           "why_unavailable", "interval_forward", "interval_backward", "HALF_PRODUCTS", "half_products",
           "half_products_available", "use_half_products", "matrix_units_available", "dot_products_available",
           "release_kept_memory", "tiles", "backward_tiles",
           "computed_fraction", "wide"]
