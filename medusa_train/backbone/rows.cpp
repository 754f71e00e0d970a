// medusa-train's CPU float32 (and bfloat16: AVX512-BF16, or AMX's tiles) linear for a few rows (a verify step's tree
// nodes; backbone/rows.py), and the RMS norm of such rows, each alone.
//
// y[m, n] = sum_k x[m, k] * w[n, k], with w packed once into panels of PANEL outputs (rows.py ``pack_weight``): a
// panel holds, for each step along k, the PANEL outputs' weights side by side (float32: one k; bfloat16: a pair of
// k, as AVX512-BF16's dot product takes them), so one vector load brings 16 (8 on AVX2) outputs' weights and each
// output's sum stays in its own vector lane: no horizontal sums, and the panels stream in order.
//
// Every (m, n) is summed the same way whatever the number of rows and threads: one lane adding its k steps in
// order from zero, so a row's output is bitwise the same in any verify it is part of.
//
// Why: a library GEMM at 2-16 rows packs the weights on every call and then computes, instead of streaming them
// once; a step that reads the same weights as a 1-token step costs 1.8x one (docs/results.md, "Step cost"). The
// kernel before this one read nn.Linear's own layout and summed each output's lanes at the end of every pass over
// a block: at K = 576 that took as long as the products (60% of the multiply-add peak with the weights in cache).
// Built with pybind11 and ATen's parallel_for only (torch/extension.h took 32 s to compile here, these 8): the
// Python side (rows.py) checks dtypes, devices and shapes and hands over contiguous buffers.
#include <pybind11/pybind11.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the row kernel needs AVX2 with FMA, or AVX-512"
#endif

#if defined(__AVX512F__)
#define VW 16
#define NR 2   // weight vectors of a panel: 2 x 16 outputs
// input rows a pass holds (2 x 4 accumulators of the 32 registers): more rows go in more groups, each taking the block
// from L1 in turn. Groups of up to 12 (24 accumulators) cost more: the BF16 CPU, the backbone's 211 linears, two
// threads, in turns, bf16 8 / 10 / 12 rows 10.49 / 11.75 / 12.74 -> 8.55 / 9.45 / 9.68 ms, float32 18.23 / 20.24 /
// 22.08 -> 12.88 / 18.52 / 17.91; 1-4 and 16-64 rows alike (docs/log/2026-12-08-groups-of-four-rows.md)
#define MB 4
typedef __m512 vec;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vbroadcast(float v) { return _mm512_set1_ps(v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline float vsum(vec v) {  // one fixed tree: halves added down to one lane
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
static inline void vstore(float* y, vec v, int n) {  // the first n lanes
  _mm512_mask_storeu_ps(y, n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), v);
}
static inline vec vload_first(const float* p, int n) {  // the first n lanes, zeros after
  return _mm512_maskz_loadu_ps(n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), p);
}
#else
#define VW 8
#define NR 3  // 3 x 8 outputs
#define MB 4  // 4 x 3 accumulators + 3 weight vectors + 1 input of the 16 registers (6 x 2, 5 x 2, 2 x 4: slower)
typedef __m256 vec;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vbroadcast(float v) { return _mm256_set1_ps(v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline float vsum(vec v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
static inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline void vstore(float* y, vec v, int n) {
  if (n >= 8) return _mm256_storeu_ps(y, v);
  _mm256_maskstore_ps(y, first_lanes(n), v);
}
static inline vec vload_first(const float* p, int n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes(n));
}
#endif
#define PANEL (NR * VW)  // outputs a panel holds

// The element kinds: float32 (FMA), and on CPUs with AVX512-BF16 bfloat16 (a pair of bf16 products summed into each
// float32 lane by one instruction, the output rounded to bfloat16 to nearest even, as torch rounds). KS: the k a
// step takes.
struct F32 {
  typedef float T;
  static constexpr int KS = 1;
  static inline vec input(const T* x) { return vbroadcast(*x); }
  static inline vec bias(const T* b, int n) { return vload_first(b, n); }
  static inline vec madd(vec w, vec x, vec acc) { return vfma(w, x, acc); }
  static inline void store(T* y, vec v, int n) { vstore(y, v, n); }
  static inline vec widen(const T* x, int n) { return vload_first(x, n); }  // n elements as float32, zeros after
  static inline vec rounded(vec v) { return v; }                             // v as an element holds it
};

#if defined(__AVX512BF16__)
#define HAS_BF16 1
struct BF16 {
  typedef uint16_t T;
  static constexpr int KS = 2;
  static inline vec input(const T* x) {  // the pair x[k], x[k + 1] in every lane
    int32_t pair;
    std::memcpy(&pair, x, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static inline vec madd(vec w, vec x, vec acc) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static inline vec bias(const T* b, int n) {  // n bf16 values widened (exactly) to float32 lanes, zeros after
    uint16_t first[16] = {0};
    if (n < 16) std::memcpy(first, b, 2 * n);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(n < 16 ? first : b));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline __m512i bits(vec v) {  // rounded to nearest even (NaN kept a quiet NaN), as torch rounds: bf16 bits
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i out = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    return _mm512_mask_mov_epi32(out, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  }
  static inline void store(T* y, vec v, int n) {
    _mm512_mask_cvtepi32_storeu_epi16(y, n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), bits(v));
  }
  static inline vec widen(const T* x, int n) { return bias(x, n); }
  static inline vec rounded(vec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits(v), 16)); }
};
#else
#define HAS_BF16 0
#endif

// How a panel is read: once, in blocks of BLOCK_STEPS steps (12 KB on AVX2, 16 KB on AVX-512: both blocks in flight
// fit the 32-48 KB L1), every group of at most MB rows taking a block from L1 before the next block, each row's sums
// parked in memory between blocks (a lane's sum still adds its k in order from zero: the same floats as one pass).
// Meanwhile each group prefetches into L1 its share of the next block's cache lines, spread evenly over its steps
// (and, with several rows, into L2 its share of the block after). Why: a core has a few (~16) line fill buffers for
// its misses, and an L2 hit takes one too. Before, a panel was read in full by
// each group in turn (its 55-196 KB from L2 after the first), and the prefetches came in bursts: memory sat idle while
// the rows' multiply-adds ran, so a 12-row pass cost about a 1-row pass plus its arithmetic. The AMX CPU, the
// backbone's 210 float32 linears, old and new in turns (docs/log/2026-12-01-one-read-per-panel.md): AVX2 code, one
// thread, 1 / 4 / 12 / 16 rows 29.6 / 35.7 / 42.6 / 47.4 -> 28.1 / 31.3 / 36.1 / 41.0 ms; AVX-512, two threads,
// 17.6 / 21.0 / 28.2 / 31.4 -> 14.8 / 16.1 / 19.2 / 20.1; bitwise the same outputs.
#define BLOCK_STEPS 128
#define SWEEP_ROWS 64  // rows a sweep holds sums for (more: the panel swept once per 64)

// steps [s0, s1) of rows m0 .. m0 + R - 1 against one panel, the sums taken from and left in ``park`` (zeros before
// the first block); this group (``group`` of ``groups``) prefetches its share of the lines from ``next`` on into L1,
// and where ``deep`` the same share of the block after into L2
template <class E, int R>
static inline void block_pass(const typename E::T* X, const float* panel, vec* park, int64_t m0, int64_t K, int64_t s0,
                              int64_t s1, const char* next, int group, int groups, bool deep) {
  vec acc[R][NR];
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = park[(m0 + i) * NR + r];
  const typename E::T* x = X + m0 * K;
  const int64_t span = s1 - s0, lines = (span * NR * VW * 4 + 63) / 64, share = (lines + groups - 1) / groups;
  const char* ahead = next + group * share * 64;
  // ``far``: its share two blocks ahead, into L2, where there are several rows: a step then takes so long that a line
  // a step into L1 streams slower than memory can (the BF16 CPU's 211 linears, in turns with the build without it:
  // 8 / 16 rows bf16 10.7 / 13.0 -> 10.0 / 11.4 ms, float32 21.4 / 26.9 -> 20.1 / 22.9; the AVX2 build 2 / 4 / 8 / 12
  // rows 19.1 / 21.4 / 22.0 / 26.2 -> 18.2 / 18.8 / 17.5 / 22.6; 24-32 rows alike; one row, a plain step, keeps the
  // stream it had; docs/log/2026-12-07-the-bf16-cpu-again.md)
  const char* far = deep ? ahead + BLOCK_STEPS * NR * VW * 4 : nullptr;
  // the first step prefetches, then one line every span / share steps, at most one a step (a block with more lines
  // than steps, one group's: the rest on demand; two a step where needed measured 1-10% slower at 1-8 rows)
  int64_t credit = span - share;
  for (int64_t s = s0; s < s1; ++s) {
    if ((credit += share) >= span) {
      credit -= span;
      _mm_prefetch(ahead, _MM_HINT_T0);
      ahead += 64;
      if (far) {
        _mm_prefetch(far, _MM_HINT_T1);
        far += 64;
      }
    }
    vec w[NR];
    for (int r = 0; r < NR; ++r) w[r] = vload(panel + (s * NR + r) * VW);
    for (int i = 0; i < R; ++i) {
      const vec xv = E::input(x + i * K + s * E::KS);
      for (int r = 0; r < NR; ++r) acc[i][r] = E::madd(w[r], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < NR; ++r) park[(m0 + i) * NR + r] = acc[i][r];
}

template <class E, int R>
static inline void block_pass_of(const typename E::T* X, const float* panel, vec* park, int64_t m0, int64_t K,
                                 int64_t s0, int64_t s1, const char* next, int group, int groups, int64_t rows,
                                 bool deep) {
  if constexpr (R > 0) {
    if (rows == R) return block_pass<E, R>(X, panel, park, m0, K, s0, s1, next, group, groups, deep);
    block_pass_of<E, R - 1>(X, panel, park, m0, K, s0, s1, next, group, groups, rows, deep);
  }
}

// rows 0 .. M - 1 (at most SWEEP_ROWS) of X against one panel (its first output n0), read once; Y's outputs written
template <class E>
static inline void sweep(const typename E::T* X, const float* panel, const typename E::T* B, typename E::T* Y,
                         int64_t n0, int64_t K, int64_t N, int64_t M) {
  alignas(64) vec park[SWEEP_ROWS * NR];
  const int64_t steps = K / E::KS;
  const int groups = int((M + MB - 1) / MB);
  for (int64_t i = 0; i < M * NR; ++i) park[i] = vzero();  // every sum starts from zero (K = 0: the bias alone)
  for (int64_t s0 = 0; s0 < steps; s0 += BLOCK_STEPS) {
    const int64_t s1 = std::min<int64_t>(steps, s0 + BLOCK_STEPS);
    // one block ahead: the rest of this panel, then the next panel's start (the panels lie end to end)
    const char* next = reinterpret_cast<const char*>(panel + (s0 + BLOCK_STEPS) * NR * VW);
    // the rows split evenly over the groups (10 rows: 4 + 3 + 3, not 4 + 4 + 2): a group of few rows pays a block's
    // loads for little arithmetic (the BF16 CPU, the backbone's 211 linears, two threads, groups of 12, 13 / 16 / 20
    // rows: bfloat16 16.8 / 16.9 / 16.7 -> 14.3 / 15.3 / 15.7 ms, float32 25.9 / 28.6 / 28.6 -> 23.8 / 26.7 / 28.1;
    // AVX2 code, 5 / 9 rows 21.4 / 24.0 -> 18.2 / 20.7; other counts alike; docs/log/2026-12-07-the-bf16-cpu-again.md)
    for (int g = 0; g < groups; ++g) {
      const int64_t m0 = M * g / groups, m1 = M * (g + 1) / groups;
      block_pass_of<E, MB>(X, panel, park, m0, K, s0, s1, next, g, groups, m1 - m0, M > 1);
    }
  }
  for (int r = 0; r < NR; ++r) {  // the sums, plus the bias if any (in float32), rounded once to the output type
    const int64_t left = N - n0 - r * VW;
    if (left <= 0) break;
    const int n = int(std::min<int64_t>(left, VW));
    const vec b = B ? E::bias(B + n0 + r * VW, n) : vzero();
    for (int64_t i = 0; i < M; ++i) E::store(Y + i * N + n0 + r * VW, B ? vadd(park[i * NR + r], b) : park[i * NR + r], n);
  }
}

// y (M, N) = x (M, K) @ w (N, K)^T (+ b (N,) where bias_ptr is not 0), x, b and y in E's element type, x and y
// row-major, w as pack_weight packs it, y written whole.
template <class E>
static void rows_linear_of(int64_t x_ptr, int64_t packed_ptr, int64_t bias_ptr, int64_t y_ptr, int64_t M, int64_t K,
                           int64_t N) {
  typedef typename E::T T;
  const T* X = reinterpret_cast<const T*>(x_ptr);
  const T* B = reinterpret_cast<const T*>(bias_ptr);
  const float* packed = reinterpret_cast<const float*>(packed_ptr);  // 32-bit lanes: a float or a bf16 pair
  T* Y = reinterpret_cast<T*>(y_ptr);
  const int64_t panels = (N + PANEL - 1) / PANEL, lanes = (K / E::KS) * PANEL;
  pybind11::gil_scoped_release unlocked;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += SWEEP_ROWS)
        sweep<E>(X + m0 * K, packed + p * lanes, B, Y + m0 * N, p * PANEL, K, N, std::min<int64_t>(SWEEP_ROWS, M - m0));
  });
}

// RMS norm of M rows of N, each row alone (a decoding step's norms: row_norms.py ``step_rms_norm``): y = w * (x * r),
// r = 1 / sqrt(sum(x^2) / N + eps), in float32; bfloat16 rows widened exactly, x * r rounded to bf16 and the product
// with w rounded again, as a Llama-style norm rounds in torch. A row's sum of squares is its lanes' sums along the row
// in order, then one fixed tree across the lanes: the same whatever rows share the call.
template <class E>
static void rms_norm_of(int64_t x_ptr, int64_t w_ptr, int64_t y_ptr, int64_t M, int64_t N, double eps) {
  typedef typename E::T T;
  const T* X = reinterpret_cast<const T*>(x_ptr);
  const T* W = reinterpret_cast<const T*>(w_ptr);
  T* Y = reinterpret_cast<T*>(y_ptr);
  pybind11::gil_scoped_release unlocked;
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* x = X + m * N;
      vec squares = vzero();
      for (int64_t k = 0; k < N; k += VW) {
        const vec v = E::widen(x + k, int(std::min<int64_t>(VW, N - k)));
        squares = vfma(v, v, squares);
      }
      const vec r = vbroadcast(1.0f / std::sqrt(vsum(squares) / float(N) + float(eps)));
      for (int64_t k = 0; k < N; k += VW) {
        const int n = int(std::min<int64_t>(VW, N - k));
        E::store(Y + m * N + k, vmul(E::widen(W + k, n), E::rounded(vmul(E::widen(x + k, n), r))), n);
      }
    }
  });
}

// The rotary embedding of a step's query and key rows (row_rotary.py ``step_rotary``), as transformers' Llama-style
// ``apply_rotary_pos_emb`` computes it: y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) for x's halves
// x1, x2, every product and the sum rounded to the element type as torch rounds each of its ops (a bf16 product of two
// bf16 values is exact in float32, then rounded to nearest even; (-a) * b is -(a * b), and p + (-q) is p - q, exactly),
// so the output is bitwise torch's. No multiply may fuse into the add (an FMA rounds once): contraction is off here.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static inline float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t bf16_bits(float f) {  // to nearest even; a NaN a quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded);
}
struct RotF32 {
  typedef float T;
  static inline float get(T v) { return v; }
  static inline T put(float v) { return v; }
  static inline float round(float v) { return v; }
};
struct RotBF16 {
  typedef uint16_t T;
  static inline float get(T v) { return bf16_value(v); }
  static inline T put(float v) { return bf16_bits(v); }
  static inline float round(float v) { return bf16_value(bf16_bits(v)); }
};

// y[b, h, s, :] for x (B, H, S, D) and cos, sin (B or 1, S, D), strides in elements (the last dimension contiguous;
// cb 0: one cos row for every batch row)
template <class E>
static void rotary_of(int64_t x_ptr, int64_t cos_ptr, int64_t sin_ptr, int64_t y_ptr, int64_t B, int64_t H, int64_t S,
                      int64_t D, int64_t xb, int64_t xh, int64_t xs, int64_t cb, int64_t cs, int64_t yb, int64_t yh,
                      int64_t ys) {
  typedef typename E::T T;
  const T* X = reinterpret_cast<const T*>(x_ptr);
  const T* C = reinterpret_cast<const T*>(cos_ptr);
  const T* Sn = reinterpret_cast<const T*>(sin_ptr);
  T* Y = reinterpret_cast<T*>(y_ptr);
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s) {
        const T* x = X + b * xb + h * xh + s * xs;
        const T* c = C + b * cb + s * cs;
        const T* n = Sn + b * cb + s * cs;
        T* y = Y + b * yb + h * yh + s * ys;
        for (int64_t d = 0; d < half; ++d) {
          const float p = E::round(E::get(x[d]) * E::get(c[d]));
          const float q = E::round(E::get(x[d + half]) * E::get(n[d]));
          y[d] = E::put(p - q);
        }
        for (int64_t d = half; d < D; ++d) {
          const float p = E::round(E::get(x[d]) * E::get(c[d]));
          const float q = E::round(E::get(x[d - half]) * E::get(n[d]));
          y[d] = E::put(p + q);
        }
      }
}
#pragma GCC pop_options

#if HAS_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bfloat16 on AMX's tiles (Intel's CPUs from Sapphire Rapids): one TDPBF16PS multiplies up to 16 rows by 32 k of 16
// outputs, so a pass over 1-16 rows costs what reading the panel costs. The same packed panels: a step s holds the
// panel's 32 outputs' pairs (k = 2s, 2s + 1) in 128 bytes, so 16 steps at a stride of 128 bytes are a B tile in AMX's
// pair layout (its first or second 64 bytes: outputs 0-15 or 16-31), and 32 of a row's k are an A tile row. An
// output's sum depends on its own row alone and always takes the same instructions in the same order, so a row's
// output is bitwise the same at any number of rows (not the same as the AVX512-BF16 path's: another summation).
#define HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

static bool amx_permitted() {  // Linux gives a process AMX's tile state only once asked (arch_prctl, since 5.16)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// tiles 0, 1: the sums (R rows x 16 outputs each), 2: R rows' 32 k, 3, 4: the panel's two halves, 16 steps
static void load_tiles(int R) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) c.colsb[t] = 64, c.rows[t] = uint8_t(t < 3 ? R : 16);
  _tile_loadconfig(&c);
}

static void amx_pass(const uint16_t* X, const float* panel, const uint16_t* B, uint16_t* Y, int64_t m0, int64_t n0,
                     int64_t K, int64_t N, int R) {
  alignas(64) float sums[16 * PANEL];
  _tile_zero(0);
  _tile_zero(1);
  const uint16_t* x = X + m0 * K;
  for (int64_t k = 0; k < K; k += 32) {
    const float* steps = panel + (k / 2) * PANEL;
    _tile_loadd(2, x + k, K * 2);
    _tile_loadd(3, steps, PANEL * 4);
    _tile_loadd(4, steps + VW, PANEL * 4);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, sums, PANEL * 4);
  _tile_stored(1, sums + VW, PANEL * 4);
  for (int r = 0; r < NR; ++r) {  // as pass() ends: the bias in float32, one rounding
    const int64_t left = N - n0 - r * VW;
    if (left <= 0) break;
    const int n = int(std::min<int64_t>(left, VW));
    const vec b = B ? BF16::bias(B + n0 + r * VW, n) : vzero();
    for (int i = 0; i < R; ++i)
      BF16::store(Y + (m0 + i) * N + n0 + r * VW, vadd(vload(sums + i * PANEL + r * VW), b), n);
  }
}

// rows_linear_of<BF16>'s contract; a K that is not a multiple of 32 takes the AVX512-BF16 path (whole layers: each
// layer's rows still sum alike at any number of rows)
static void rows_linear_amx(int64_t x_ptr, int64_t packed_ptr, int64_t bias_ptr, int64_t y_ptr, int64_t M, int64_t K,
                            int64_t N) {
  if (K % 32 != 0 || !amx_permitted()) return rows_linear_of<BF16>(x_ptr, packed_ptr, bias_ptr, y_ptr, M, K, N);
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x_ptr);
  const uint16_t* B = reinterpret_cast<const uint16_t*>(bias_ptr);
  const float* packed = reinterpret_cast<const float*>(packed_ptr);
  uint16_t* Y = reinterpret_cast<uint16_t*>(y_ptr);
  const int64_t panels = (N + PANEL - 1) / PANEL, lanes = (K / 2) * PANEL;
  pybind11::gil_scoped_release unlocked;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    int loaded = 0;  // the tile configuration is each thread's own
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += 16) {  // the later passes read the panel from the caches
        const int R = int(std::min<int64_t>(16, M - m0));
        if (R != loaded) load_tiles(R), loaded = R;
        amx_pass(X, packed + p * lanes, B, Y, m0, p * PANEL, K, N, R);
      }
    _tile_release();
  });
}
#else
#define HAS_AMX 0
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("panel") = PANEL;
  m.def("rows_linear", &rows_linear_of<F32>, "y = x @ w.T (+ b) for a few float32 rows, w packed (pack_weight)");
  m.def("rms_norm", &rms_norm_of<F32>, "y = w * x / rms(x) for float32 rows, each alone");
  m.def("rotary", &rotary_of<RotF32>, "x * cos + rotate_half(x) * sin for float32 rows, as torch computes it");
#if HAS_BF16
  m.def("rms_norm_bf16", &rms_norm_of<BF16>, "rms_norm for bfloat16 rows, rounded as torch rounds a Llama-style norm");
  m.def("rotary_bf16", &rotary_of<RotBF16>, "rotary for bfloat16 rows, each product and sum rounded as torch rounds");
  m.def("rows_linear_bf16", &rows_linear_of<BF16>,
        "y = x @ w.T (+ b) for a few bfloat16 rows (float32 sums and bias, rounded to nearest even), w packed");
#endif
#if HAS_AMX
  m.def("rows_linear_amx", &rows_linear_amx, "rows_linear_bf16 on AMX's tiles (its own summation: bitwise the same "
        "at any number of rows, not the same as rows_linear_bf16's)");
  m.def("amx_permitted", &amx_permitted, "whether Linux gave this process AMX's tile state");
#endif
}
