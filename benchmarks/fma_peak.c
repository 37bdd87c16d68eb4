/* The cores' fused multiply-add peak in float32: independent FMA chains on the widest vectors the
 * build targets (-march=native), one loop per OpenMP thread, best of 5 timed runs. Prints GFLOP/s
 * (2 flops per lane and FMA). benchmarks/common.py builds and runs it: the rate no kernel's
 * products can beat, next to which PyTorch's own matmul rate can be read (a BLAS may not use a
 * CPU's widest vectors: MKL on AMD Zen 5 ran at 40% of this). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define CHAINS 16 /* of 32 registers; 2 pipes x 4 cycles of latency need 8 */
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SPLAT(x) _mm512_set1_ps(x)
static float lane0(vec v) { return _mm512_cvtss_f32(v); }
#elif defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define CHAINS 12 /* of 16 registers, with the two operands */
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SPLAT(x) _mm256_set1_ps(x)
static float lane0(vec v) { return _mm256_cvtss_f32(v); }
#else
#error "needs FMA (x86-64 with AVX2 or AVX-512)"
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long steps = 50000000; /* per thread: ~0.2 s on a 4 GHz core */
  double best = 0.0;
  float sink = 0.0f;
  for (int run = 0; run < 5; ++run) {
    const double start = now();
#pragma omp parallel reduction(+ : sink)
    {
      vec acc[CHAINS];
      for (int i = 0; i < CHAINS; ++i) acc[i] = SPLAT(0.001f * i);
      const vec x = SPLAT(0.999999f), y = SPLAT(1e-7f); /* converges to 0.1: no subnormals */
      for (long s = 0; s < steps; ++s) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; ++i) acc[i] = FMA(acc[i], x, y);
      }
      for (int i = 0; i < CHAINS; ++i) sink += lane0(acc[i]);
    }
    const double seconds = now() - start;
    const double gflops = (double)omp_get_max_threads() * steps * CHAINS * LANES * 2 / seconds / 1e9;
    if (gflops > best) best = gflops;
  }
  printf("%.1f %d %d %g\n", best, omp_get_max_threads(), LANES, sink);
  return 0;
}
