/* The core's peak rate of 512-bit bf16 dot products (vdpbf16ps) and fp32 fused multiply-adds, from
 * registers: 12 independent accumulators, so neither latency nor memory limits it. Kev's bf16
 * products are compared against this (bench_products.py); run one copy per core to see both.
 *
 * Build and run: gcc -O3 -mavx512f -mavx512bf16 benchmarks/dp_peak.c -o /tmp/dp_peak && /tmp/dp_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long n = 200000000;
  __m512 acc[12];
  for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  double t = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    __asm__ volatile("" ::"v"(acc[0]), "v"(acc[5]), "v"(acc[11]));  /* keep the loop */
  }
  double dt = now() - t;
  float sum = 0;
  for (int j = 0; j < 12; j++) sum += _mm512_reduce_add_ps(acc[j]);
  printf("vdpbf16ps zmm: %.2f a ns, %.1f GFLOP/s on one core (%g)\n", n * 12 / dt / 1e9, n * 12 * 64 / dt / 1e9, sum);
  const __m512 fa = _mm512_set1_ps(1.0f), fb = _mm512_set1_ps(1e-9f);
  t = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) acc[j] = _mm512_fmadd_ps(fa, fb, acc[j]);
    __asm__ volatile("" ::"v"(acc[0]), "v"(acc[5]), "v"(acc[11]));
  }
  dt = now() - t;
  sum = 0;
  for (int j = 0; j < 12; j++) sum += _mm512_reduce_add_ps(acc[j]);
  printf("vfmadd231ps zmm: %.2f a ns, %.1f GFLOP/s on one core (%g)\n", n * 12 / dt / 1e9, n * 12 * 32 / dt / 1e9, sum);
  return 0;
}
