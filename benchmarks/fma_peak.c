/* The cores' fused multiply-add peak in float32: independent FMA chains on the widest vectors the
 * build targets (-march=native), one loop per OpenMP thread. Each timed run lasts about a second
 * (its length calibrated by a first short run: 0.2 s runs read 220 GFLOP/s on a Xeon whose matmul
 * then reached 250, the cores still ramping their clocks), best of 7 after a warm-up second.
 * Prints GFLOP/s (2 flops per lane and FMA). benchmarks/common.py builds and runs it: the rate no kernel's
 * products can beat, next to which PyTorch's own matmul rate can be read (a BLAS may not use a
 * CPU's widest vectors: MKL on AMD Zen 5 ran at 40% of this).
 *
 * `fma_peak SECONDS bf16` times AVX512-BF16's dot product instead (VDPBF16PS: per lane, two bfloat16
 * products added to a float32 sum, 4 flops), where the build has it: whether a kernel on those
 * instructions could beat the float32 FMA path on this CPU (on an Intel Xeon with AMX it reached
 * half the FMA's rate, so it cannot). */
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

#if defined(__AVX512BF16__)
#define DOT_BF16 1
/* acc + x.y over pairs of bfloat16 (x = 1, y = 2^-126 in both halves: the sums stay small) */
#define DOT(a) _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32(0x3F803F80), (__m512bh)_mm512_set1_epi32(0x00800080))
#else
#define DOT_BF16 0
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int dot_bf16 = 0; /* time VDPBF16PS instead of FMA */

static double run(long steps, float* sink_out) {
  float sink = 0.0f;
  const double start = now();
#pragma omp parallel reduction(+ : sink)
  {
    vec acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = SPLAT(0.001f * i);
    const vec x = SPLAT(0.999999f), y = SPLAT(1e-7f); /* converges to 0.1: no subnormals */
    if (dot_bf16) {
#if DOT_BF16
      for (long s = 0; s < steps; ++s) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; ++i) acc[i] = DOT(acc[i]);
      }
#endif
    } else {
      for (long s = 0; s < steps; ++s) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; ++i) acc[i] = FMA(acc[i], x, y);
      }
    }
    for (int i = 0; i < CHAINS; ++i) sink += lane0(acc[i]);
  }
  *sink_out += sink;
  return now() - start;
}

int main(int argc, char** argv) {
  const double seconds_per_run = argc > 1 ? atof(argv[1]) : 1.0;
  dot_bf16 = argc > 2 && argv[2][0] == 'b';
  if (dot_bf16 && !DOT_BF16) {
    fprintf(stderr, "fma_peak: this build has no AVX512-BF16\n");
    return 2;
  }
  float sink = 0.0f;
  long steps = 10000000;
  double warm = 0.0;
  while (warm < seconds_per_run) { /* warm-up and calibration: at least one run's length */
    const double took = run(steps, &sink);
    warm += took;
    if (took < 0.25 * seconds_per_run) steps *= 2;
  }
  const double per_step = run(steps, &sink) / steps;
  steps = (long)(seconds_per_run / per_step) + 1;
  double best = 0.0;
  for (int r = 0; r < 7; ++r) {
    const double seconds = run(steps, &sink);
    const double gflops = (double)omp_get_max_threads() * steps * CHAINS * LANES * (dot_bf16 ? 4 : 2) / seconds / 1e9;
    if (gflops > best) best = gflops;
  }
  printf("%.1f %d %d %g\n", best, omp_get_max_threads(), LANES, sink);
  return 0;
}
