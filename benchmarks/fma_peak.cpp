// The vector units' multiply-add peak on this CPU: independent FMA chains on registers, no memory traffic, one chain
// set per thread (benchmarks/roof.py). Built with the row kernel's instruction-set flags, so AVX2 code paths time
// 8-wide FMAs and AVX-512 ones 16-wide.
#include <pybind11/pybind11.h>
#include <immintrin.h>
#include <omp.h>
#include <cstdint>

#if defined(__AVX512F__)
#define CHAINS 24  // of the 32 registers: enough to cover the FMA latency on both pipes
#define WIDTH 16
typedef __m512 vec;
static inline vec vset(float v) { return _mm512_set1_ps(v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vfirst(vec a) { return _mm512_cvtss_f32(a); }
#else
#define CHAINS 12  // of the 16 registers
#define WIDTH 8
typedef __m256 vec;
static inline vec vset(float v) { return _mm256_set1_ps(v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vfirst(vec a) { return _mm256_cvtss_f32(a); }
#endif

// multiply-adds per second over `threads` threads, each running `iterations` rounds of CHAINS vector FMAs
static double fma_peak(int64_t iterations, int threads) {
  double sink = 0, start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    vec acc[CHAINS];
    const vec b = vset(1.0000001f), c = vset(1e-9f);
    for (int i = 0; i < CHAINS; ++i) acc[i] = vset(float(i));
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < CHAINS; ++i) acc[i] = vfma(acc[i], b, c);
    }
    for (int i = 0; i < CHAINS; ++i) sink += vfirst(acc[i]);  // keeps the chains alive
  }
  const double seconds = omp_get_wtime() - start;
  return sink == 0.123456 ? 0 : double(iterations) * CHAINS * WIDTH * threads / seconds;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fma_peak", &fma_peak, "multiply-adds per second of register-only FMA chains on `threads` threads");
}
