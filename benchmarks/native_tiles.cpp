// The native kernel's register tiles alone: the forward's two products (block_scores: S = K Qt,
// block_values: Ot += V P) and the backward's product over rows (block_rows_product: dK += dS^T Q,
// dV += P^T dO) for W keys against one group of 32 rows, D = 64, one thread. Built and run by benchmarks/native_tiles.py with the kernel's own flags
// (the 256-bit build, or the 512-bit one where the flags say so). Prints GFLOP/s (2 per
// multiply-add), best of 15 runs of about 0.1 s each: noise from other jobs only slows a run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "aligned.h"
#include "tiles.h"

using namespace attnkit_native;

template <class Product>
double best_rate(double flops_per_call, Product product) {
  const long calls = std::max(1L, static_cast<long>(2e8 / flops_per_call));
  double best = 1e30;
  for (int run = 0; run < 15; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (long c = 0; c < calls; ++c) {
      product();
      asm volatile("" ::: "memory");  // every call's stores happen
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return flops_per_call * calls / best / 1e9;
}

int main(int argc, char** argv) {
  const int64_t D = 64, rs = kGroup;
  for (int a = 1; a < argc; ++a) {
    const int64_t W = std::atol(argv[a]);
    // the kernel's own scratch memory, aligned to a cache line
    Floats qt(D * rs, 0.01f), k(W * D, 0.02f), s(W * rs), ot(D * rs, 0.0f), rescale(rs, 1.0f), dk(W * D, 0.0f);
    const Start keep = Start::kKeep;
    const double flops = 2.0 * W * D * rs;
    const double scores = best_rate(flops, [&] { block_scores(k.data(), D, W, D, qt.data(), rs, s.data()); });
    const double values = best_rate(flops, [&] {
      block_values(k.data(), D, W, D, s.data(), rs, ot.data(), &keep, rescale.data());
    });
    // the rows of a block (Q or dO, row-major) against its key-major weights, into W key rows of D
    const double rows = best_rate(flops, [&] { block_rows_product(s.data(), rs, W, rs, qt.data(), D, D, dk.data(), D); });
    std::printf("%ld %.1f %.1f %.1f\n", static_cast<long>(W), scores, values, rows);
  }
  return 0;
}
