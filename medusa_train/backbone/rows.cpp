// medusa-train's CPU float32 (and bfloat16) linear for a few rows (a verify step's tree nodes; backbone/rows.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] with w in nn.Linear's own (out, in) layout: nothing is repacked or copied.
// Every (m, n) is summed the same way whatever the number of rows and threads (one vector accumulator over k in
// order, a fixed horizontal sum, then the tail in order), so a row's output is bitwise the same in any
// verify it is part of.
//
// Why: a library GEMM at 2-16 rows packs the weights on every call and then computes, instead of streaming them
// once; a step that reads the same weights as a 1-token step costs 1.8x one (docs/results.md, "Step cost").
// Here each weight vector is loaded once and used by every row (NR weight rows x MB input rows in registers).
// Built with pybind11 and ATen's parallel_for only (torch/extension.h took 32 s to compile here, these 8): the
// Python side (rows.py) checks dtypes, devices and shapes and hands over contiguous float32 buffers.
#include <pybind11/pybind11.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

// into L2, not L1: a 16-row step's inputs and this block's weights fill L1 already (L1 measured slower from 4 rows on)
#define PREFETCH_HINT _MM_HINT_T1

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the row kernel needs AVX2 with FMA, or AVX-512"
#endif

// the sum of 8 floats in one fixed order (both builds end their horizontal sums here)
static inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
#define VW 16
#define NR 4  // weight rows and input rows a block holds in registers: 4 x 6 accumulators + 4 weight vectors
#define MBMAX 6  // + 1 input vector of the 32 registers
typedef __m512 vec;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return sum8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))); }
#else
#define VW 8
#define NR 3  // 3 x 4 accumulators + 3 weight vectors + 1 input vector of the 16 registers (4 x 2 measured slower
#define MBMAX 4  // from 4 rows on)
typedef __m256 vec;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return sum8(a); }
#endif

// The element kinds the kernel multiplies: float32 (FMA), and on CPUs with AVX512-BF16 bfloat16 (pairs of bf16
// products summed into float32 lanes by one instruction, the output rounded to bfloat16 to nearest even, as torch
// rounds). STEP elements of a row are one vector load.
struct F32 {
  typedef float T;
  typedef vec W;
  static constexpr int STEP = VW;
  static inline W load(const T* p) { return vload(p); }
  static inline vec madd(W a, W b, vec acc) { return vfma(a, b, acc); }
  static inline float value(T v) { return v; }
  static inline T out(float s) { return s; }
};

#if defined(__AVX512BF16__)
#define HAS_BF16 1
static inline float bf16_value(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
struct BF16 {
  typedef uint16_t T;
  typedef __m512bh W;
  static constexpr int STEP = 32;
  static inline W load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static inline vec madd(W a, W b, vec acc) { return _mm512_dpbf16_ps(acc, a, b); }
  static inline float value(T v) { return bf16_value(v); }
  static inline T out(float s) {  // round to nearest even (NaN kept a quiet NaN), as torch's bfloat16 conversion
    uint32_t u;
    std::memcpy(&u, &s, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};
#else
#define HAS_BF16 0
#endif

// ahead: this pass's share (ahead_bytes) of the next block's weights (NR rows, contiguous after this block's), asked
// for step_bytes a step while this pass computes, or null. Without it the kernel paid its arithmetic and its memory
// stream one after the other (a 16-token pass's linears took the sum of the two limits, a 1-token pass's 1.3x the
// memory limit: docs/results.md, "Step cost"); a prefetch changes no result.
template <class E, int MB>
static inline void block(const typename E::T* X, const typename E::T* W, typename E::T* Y, int64_t m0, int64_t n0,
                         int64_t nr, int64_t K, int64_t KV, int64_t N, const char* ahead, int64_t step_bytes,
                         int64_t ahead_bytes) {
  vec acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = vzero();
  const typename E::T* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = W + (n0 + (r < nr ? r : 0)) * K;
  for (int64_t k = 0; k < KV; k += E::STEP) {
    if (ahead)
      for (int64_t b = (k / E::STEP) * step_bytes, end = std::min(b + step_bytes, ahead_bytes); b < end; b += 64)
        _mm_prefetch(ahead + b, PREFETCH_HINT);
    typename E::W wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = E::load(w[r] + k);
    for (int i = 0; i < MB; ++i) {
      typename E::W xv = E::load(X + (m0 + i) * K + k);
      for (int r = 0; r < NR; ++r) acc[r][i] = E::madd(wv[r], xv, acc[r][i]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int i = 0; i < MB; ++i) {
      float s = vsum(acc[r][i]);
      for (int64_t k = KV; k < K; ++k) s += E::value(w[r][k]) * E::value(X[(m0 + i) * K + k]);
      Y[(m0 + i) * N + n0 + r] = E::out(s);
    }
}

template <class E, int MB>
static inline void rows_from(const typename E::T* X, const typename E::T* W, typename E::T* Y, int64_t m0, int64_t n0,
                             int64_t nr, int64_t K, int64_t KV, int64_t N, int64_t left, const char* ahead,
                             int64_t step_bytes, int64_t ahead_bytes) {
  if constexpr (MB > 0) {
    if (left == MB) return block<E, MB>(X, W, Y, m0, n0, nr, K, KV, N, ahead, step_bytes, ahead_bytes);
    rows_from<E, MB - 1>(X, W, Y, m0, n0, nr, K, KV, N, left, ahead, step_bytes, ahead_bytes);
  }
}

// y (M, N) = x (M, K) @ w (N, K)^T, all row-major in E's element type, y written whole.
template <class E>
static void rows_linear_of(int64_t x_ptr, int64_t w_ptr, int64_t y_ptr, int64_t M, int64_t K, int64_t N) {
  typedef typename E::T T;
  const T* X = reinterpret_cast<const T*>(x_ptr);
  const T* W = reinterpret_cast<const T*>(w_ptr);
  T* Y = reinterpret_cast<T*>(y_ptr);
  const int64_t KV = K - K % E::STEP;
  const int64_t blocks = (N + NR - 1) / NR;
  pybind11::gil_scoped_release unlocked;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * NR, nr = std::min<int64_t>(NR, N - n0);
      // each pass over this block's weights (MBMAX rows at a time; the later ones read them from the cache) asks
      // for its share of the next block's: the memory stream runs through the whole block's arithmetic, not only
      // through its first pass (a 16-row call on weights streamed from memory: 235 -> 204 us for a 1536 x 576 layer)
      const int64_t next_bytes = n0 + NR < N ? std::min<int64_t>(NR, N - n0 - NR) * K * int64_t(sizeof(T)) : 0;
      const char* next = next_bytes ? reinterpret_cast<const char*>(W + (n0 + NR) * K) : nullptr;
      const int64_t passes = std::max<int64_t>(1, (M + MBMAX - 1) / MBMAX), steps = std::max<int64_t>(1, KV / E::STEP);
      const int64_t share = (next_bytes + passes - 1) / passes;
      const int64_t step_bytes = ((share + steps - 1) / steps + 63) / 64 * 64;  // whole lines, a step's prefetches
      for (int64_t m0 = 0, p = 0; m0 < M; m0 += MBMAX, ++p) {
        const int64_t from = p * share, bytes = std::min(share, next_bytes - from);
        const char* ahead = bytes > 0 ? next + from : nullptr;
        if (M - m0 >= MBMAX) block<E, MBMAX>(X, W, Y, m0, n0, nr, K, KV, N, ahead, step_bytes, bytes);
        else rows_from<E, MBMAX - 1>(X, W, Y, m0, n0, nr, K, KV, N, M - m0, ahead, step_bytes, bytes);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear_of<F32>, "y = x @ w.T for a few float32 rows, from and into contiguous buffers");
#if HAS_BF16
  m.def("rows_linear_bf16", &rows_linear_of<BF16>,
        "y = x @ w.T for a few bfloat16 rows (float32 sums, rounded to nearest even), contiguous buffers");
#endif
}
