// medusa-train's CPU attention for a decoding step's few queries (a plain step's one, a verify's tree nodes, a
// prompt lookup's guesses) over a cache, grouped heads, an optional mask: backbone/step_attention.py.
//
// out[i, h] = sum_j p_j v_j / sum_j p_j, p_j = exp(s_j - max s), s_j = (q[h, i] . k_j) * scale (+ mask[i, j]), in
// float32 whatever the element type (float32 or bfloat16; a bf16 output rounded once, to nearest even).
//
// Every query row is computed alone, by one thread, keys in order, each key's score by the same sequence of
// operations (AVX-512: its own lane's sum over the head's elements in order, 16 keys a vector; AVX2: its dot product's
// lanes summed by one fixed tree), and a key whose weight is exactly zero (masked out, or one whose exp underflows)
// changes no sum. So a row's output is bitwise the same whatever other rows share the call
// and whatever masked-out keys lie between its own: a verify step's node attends exactly as the same token would in a
// plain step over the same text. torch's SDPA at one or a few queries costs ~20x its reads here (0.04-0.09 ms a layer
// over 142 cached keys, docs/results.md "Step cost").
#include <pybind11/pybind11.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the step attention needs AVX2 with FMA, or AVX-512"
#endif

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vec;
typedef __mmask16 lanes_t;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset(float v) { return _mm512_set1_ps(v); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vload_bf16(const uint16_t* p) {  // VW bf16 values widened (exactly) to float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vec vzero_below(vec x, vec y, float limit) {  // 0 where x < limit, else y (a NaN stays a NaN)
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, vset(limit), _CMP_LT_OQ), vzero());
}
static inline void vstore_bf16(uint16_t* y, vec v) {  // rounded to nearest even, a NaN kept a quiet NaN (as torch)
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i out = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  out = _mm512_mask_mov_epi32(out, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(out));
}
#else
#define VW 8
typedef __m256 vec;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset(float v) { return _mm256_set1_ps(v); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vload_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vec vpow2i(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vec vzero_below(vec x, vec y, float limit) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, vset(limit), _CMP_LT_OQ), y);
}
static inline void vstore_bf16(uint16_t* y, vec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i out = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  out = _mm256_blendv_epi8(out, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
}
static inline float vsum(vec v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
#endif

// exp(x) for x <= 0, lane by lane (each lane's result depends on its own input only): x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its degree-7 Taylor polynomial (relative error < 2e-7 there), times 2^n; 0 below -87 (where 2^n would
// leave float32's normal range); a NaN stays a NaN.
static inline vec vexp(vec x) {
  const vec n = vround(vmul(x, vset(1.44269504088896341f)));
  vec r = vfma(n, vset(-0.693359375f), x);  // ln 2 in two parts: the first exact in float32
  r = vfma(n, vset(2.12194440e-4f), r);
  vec p = vset(1.0f / 5040);
  p = vfma(p, r, vset(1.0f / 720));
  p = vfma(p, r, vset(1.0f / 120));
  p = vfma(p, r, vset(1.0f / 24));
  p = vfma(p, r, vset(1.0f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  return vzero_below(x, vmul(p, vpow2i(vmax(n, vset(-126.0f)))), -87.0f);
}

struct F32 {
  typedef float T;
  static constexpr bool PAIRS = false;
  static inline vec load(const T* p) { return vload(p); }
  static inline void store(T* y, vec v) { vstore(y, v); }
};

struct BF16 {
  typedef uint16_t T;
  static constexpr bool PAIRS = true;  // two to a 32-bit lane, as AVX512-BF16's dot product takes them
  static inline vec load(const T* p) { return vload_bf16(p); }
  static inline void store(T* y, vec v) { vstore_bf16(y, v); }
};

enum MaskKind { NO_MASK = 0, ADDITIVE = 1, ALLOWED = 2 };  // none; float32, added to the scores; bool, true: attend

// One query row of a task: a task's rows all read one key head's L keys, the head dimension C vectors (both known when
// compiled, so the sums stay in registers), the keys and values read once for all of them. Rows are independent:
// each one's sums are what they would be alone.
struct Row {
  const void* q;     // its query (D elements)
  const void* mask;  // its mask row (or none)
  void* out;         // its output (D elements)
};

constexpr bool HOLD = VW == 16;  // whether a value's vectors are held in registers while the rows use them

// rows a value block holds: R x C sums in registers (AVX-512: 16 of its 32, beside the value's C vectors; with more
// rows GCC kept every sum in memory as well, stored at each key: 1.65x the time at 6 rows; AVX2: 14 of its 16)
template <int C>
constexpr int rows_for() {
  return std::max(1, VW == 16 ? 16 / C : 14 / C);
}

// rows a task takes: its scores' words laid out once for all of them (AVX-512: a 16-key block's transposition shared
// by up to 16 rows), their weighted values in blocks of rows_for
template <int C>
constexpr int task_rows() {
  return VW == 16 ? rows_for<C>() * std::max(1, 16 / rows_for<C>()) : rows_for<C>();
}

#if VW == 16
// A 16 x 16 block of 32-bit elements transposed: lane c of in[r] becomes lane r of out[c].
static inline void transpose16(const __m512 in[16], __m512 out[16]) {
  __m512 t[16], u[16], w[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 4; ++c) {
      w[8 * i + c] = _mm512_shuffle_f32x4(u[8 * i + c], u[8 * i + 4 + c], 0x88);
      w[8 * i + 4 + c] = _mm512_shuffle_f32x4(u[8 * i + c], u[8 * i + 4 + c], 0xdd);
    }
  for (int c = 0; c < 8; ++c) {
    out[c] = _mm512_shuffle_f32x4(w[c], w[8 + c], 0x88);
    out[8 + c] = _mm512_shuffle_f32x4(w[c], w[8 + c], 0xdd);
  }
}

// How a key head's elements are scored, 16 keys at a time with one key to a lane: a score is its lane's sum over the
// head's 32-bit words in order (a float32 element, a bf16 pair on AVX512-BF16's dot product, or a bf16 element widened
// where that instruction is missing), the same sequence of operations for every key and every query row.
template <class E>
struct Words {
#if defined(__AVX512BF16__)
  static constexpr bool PAIRED = E::PAIRS;
#else
  static constexpr bool PAIRED = false;
#endif
  static constexpr int per(int D) { return PAIRED ? D / 2 : D; }  // words in a key of D elements
  // words [w, w + count) of a key row (count <= 16), lanes past count zero
  static inline __m512 load(const typename E::T* key, int w, int count) {
    const __mmask16 m = __mmask16((1u << count) - 1);
    if constexpr (PAIRED) return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, key + 2 * w));
    if constexpr (E::PAIRS) return E::load(key + w);  // widened bf16: a head is whole vectors, count is 16
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(key) + w);
  }
  // one row's query as the words its scores multiply (a widened bf16 query: float32)
  static inline void query(const typename E::T* q, int D, float* out) {
    if constexpr (PAIRED || !E::PAIRS) {
      std::memcpy(out, q, size_t(D) * sizeof(typename E::T));
    } else {
      for (int c = 0; c < D; c += VW) vstore(out + c, E::load(q + c));
    }
  }
  static inline vec step(vec acc, const float* q, int w, __m512 key) {
#if defined(__AVX512BF16__)
    if constexpr (PAIRED) {
      int32_t pair;  // the query's pair w, its bits as they are
      std::memcpy(&pair, q + w, sizeof(pair));
      return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)_mm512_castps_si512(key));
    }
#endif
    return vfma(vset(q[w]), key, acc);
  }
};

// keys [j0, j0 + n) of a key head (n <= 16), key j0 + l in lane l of kt[w], word by word; lanes past n zero
template <class E, int W>
static inline void key_block(const typename E::T* k, int64_t D, int n, __m512* kt) {
  __m512 in[16], out[16];
  for (int w0 = 0; w0 < W; w0 += 16) {
    const int count = std::min(16, W - w0);
    for (int l = 0; l < 16; ++l) in[l] = l < n ? Words<E>::load(k + l * D, w0, count) : _mm512_setzero_ps();
    transpose16(in, out);
    for (int c = 0; c < count; ++c) kt[w0 + c] = out[c];
  }
}

// each key's score for a task's rows (count of them, at most 16), their largest in top: the keys 16 at a time, a key to
// a lane (above), each block transposed once for all the rows, Q rows' sums in registers at once; times scale, plus the
// mask. Masked-out keys (a boolean mask's) score -inf.
template <class E, int C, int Q>
static void scores(const Row* rows, int count, const typename E::T* k, int mask_kind, int64_t L, float scale, float* s,
                   float* top) {
  constexpr int D = C * VW, W = Words<E>::per(D);
  const float lowest = -std::numeric_limits<float>::infinity();
  static_assert(task_rows<C>() <= 16, "a task's rows share one transposition of each 16-key block");
  alignas(64) float q[16][D];  // the task's queries, as words
  alignas(64) __m512 kt[W];
  vec best[16];
  __mmask16 bad[16];
  for (int r = 0; r < count; ++r) {
    Words<E>::query(static_cast<const typename E::T*>(rows[r].q), D, q[r]);
    best[r] = vset(lowest);
    bad[r] = 0;
  }
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int n = int(std::min<int64_t>(16, L - j0));
    const __mmask16 m = __mmask16((1u << n) - 1);
    key_block<E, W>(k + j0 * D, D, n, kt);
    for (int r0 = 0; r0 < count; r0 += Q) {
      const int rows_now = std::min(Q, count - r0);
      vec acc[Q];
      for (int r = 0; r < Q; ++r) acc[r] = vzero();
      for (int w = 0; w < W; ++w) {
        const __m512 key = kt[w];
        for (int r = 0; r < Q; ++r) {
          if (r >= rows_now) break;
          acc[r] = Words<E>::step(acc[r], q[r0 + r], w, key);
        }
      }
      for (int r = 0; r < rows_now; ++r) {
        const Row& row = rows[r0 + r];
        vec score = vmul(acc[r], vset(scale));
        if (mask_kind == ADDITIVE) {
          score = _mm512_add_ps(score, _mm512_maskz_loadu_ps(m, static_cast<const float*>(row.mask) + j0));
        } else if (mask_kind == ALLOWED) {
          alignas(16) unsigned char allowed[16] = {0};
          std::memcpy(allowed, static_cast<const bool*>(row.mask) + j0, size_t(n));
          const __m512i flags = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(allowed)));
          score = _mm512_mask_mov_ps(vset(lowest), _mm512_test_epi32_mask(flags, flags), score);
        }
        _mm512_mask_storeu_ps(s + (r0 + r) * L + j0, m, score);
        bad[r0 + r] |= _mm512_mask_cmp_ps_mask(m, score, score, _CMP_UNORD_Q);
        best[r0 + r] = _mm512_mask_max_ps(best[r0 + r], m, best[r0 + r], score);
      }
    }
  }
  for (int r = 0; r < count; ++r)
    top[r] = bad[r] ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(best[r]);  // a NaN: output NaN
}

#else
// how many rows' queries the scores hold in registers at once: Q x C of them, beside Q sums and C keys
template <int C>
constexpr int score_rows() {
  return std::max(1, 14 / (C + 1));
}

// each key's score for up to Q rows (count of them), their largest in top: q . k_j summed lane by lane over the C
// vectors in order, then across the lanes by vsum's fixed tree, times scale, plus the mask
template <class E, int C, int Q>
static void scores(const Row* rows, int count, const typename E::T* k, int mask_kind, int64_t L, float scale, float* s,
                   float* top) {
  typedef typename E::T T;
  constexpr int64_t D = int64_t(C) * VW;
  const float lowest = -std::numeric_limits<float>::infinity();
  vec q[Q][C];
  for (int r = 0; r < Q; ++r)
    for (int c = 0; c < C; ++c) q[r][c] = r < count ? E::load(static_cast<const T*>(rows[r].q) + c * VW) : vzero();
  float best[Q];
  for (int r = 0; r < Q; ++r) best[r] = lowest;
  for (int64_t j = 0; j < L; ++j) {
    const T* kj = k + j * D;
    for (int r = 0; r < Q; ++r) {
      if (r >= count) break;
      if (mask_kind == ALLOWED && !static_cast<const bool*>(rows[r].mask)[j]) {
        s[r * L + j] = lowest;
        continue;
      }
      vec acc = vmul(q[r][0], E::load(kj));  // the key read from the cache line each row (L1: cheaper than registers)
      for (int c = 1; c < C; ++c) acc = vfma(q[r][c], E::load(kj + c * VW), acc);
      float score = vsum(acc) * scale;
      if (mask_kind == ADDITIVE) score += static_cast<const float*>(rows[r].mask)[j];
      s[r * L + j] = score;
      best[r] = score > best[r] || score != score ? score : best[r];  // a NaN score stays: the row's output NaN
    }
  }
  for (int r = 0; r < count; ++r) top[r] = best[r];
}
#endif

// each row's scores turned into weights, in place: exp(s - top), lane by lane (a row whose every key is masked out:
// all zero)
static void weights(float* s, const float* top, int count, int64_t L) {
  const float lowest = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < count; ++r) {
    float* sr = s + r * L;
    if (top[r] == lowest) {  // every key masked out: weights all zero, output zeros (SDPA: NaN; no decoder asks this)
      for (int64_t j = 0; j < L; ++j) sr[j] = 0.0f;
      continue;
    }
    const vec vtop = vset(top[r]);
    int64_t j = 0;
    for (; j + VW <= L; j += VW) vstore(sr + j, vexp(vsub(vload(sr + j), vtop)));
    if (j < L) {  // the tail through the same vector code (lanes past L padded with -inf: exp 0, not stored)
      alignas(64) float tail[VW];
      for (int l = 0; l < VW; ++l) tail[l] = j + l < L ? sr[j + l] : lowest;
      vstore(tail, vexp(vsub(vload(tail), vtop)));
      for (int64_t l = 0; j + l < L; ++l) sr[j + l] = tail[l];
    }
  }
}

// R rows' outputs: their weighted values over the keys in order, divided by the weights' sum
template <class E, int C, int R>
static void weighted_values(const Row* rows, const typename E::T* v, int64_t L, const float* s /* R x L */) {
  typedef typename E::T T;
  constexpr int64_t D = int64_t(C) * VW;
  vec acc[R][C];
  float total[R];
  for (int r = 0; r < R; ++r) {
    total[r] = 0.0f;
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  }
  for (int64_t j = 0; j < L; ++j) {
    const T* vj = v + j * D;
    vec vv[HOLD ? C : 1];  // AVX-512: the value widened once for all R rows; AVX2 (16 registers): read by each row
    if constexpr (HOLD)
      for (int c = 0; c < C; ++c) vv[c] = E::load(vj + c * VW);
    for (int r = 0; r < R; ++r) {  // a weight of +0 (masked out, or underflowed) leaves every sum as it was
      const float p = s[r * L + j];
      total[r] += p;
      const vec pv = vset(p);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(pv, HOLD ? vv[c] : E::load(vj + c * VW), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    T* out = static_cast<T*>(rows[r].out);
    const vec sum = vset(total[r]);
    for (int c = 0; c < C; ++c) E::store(out + c * VW, total[r] == 0.0f ? vzero() : vdiv(acc[r][c], sum));
  }
}

// the weighted values of a block's rows by how many there are (at most R)
template <class E, int C, int R>
static void values_block(const Row* rows, int count, const typename E::T* v, int64_t L, const float* s) {
  if constexpr (R > 0) {
    if (count == R) return weighted_values<E, C, R>(rows, v, L, s);
    values_block<E, C, R - 1>(rows, count, v, L, s);
  }
}

// a task's rows (at most task_rows): scores, weights, then the weighted values rows_for at a time
template <class E, int C>
static void attend_rows(const Row* rows, int count, const typename E::T* k, const typename E::T* v, int mask_kind,
                        int64_t L, float scale, float* s /* count x L */) {
  constexpr int RB = rows_for<C>();
  float top[task_rows<C>()];
#if VW == 16
  scores<E, C, 8>(rows, count, k, mask_kind, L, scale, s, top);  // 8 rows' sums in registers at once
#else
  constexpr int QR = score_rows<C>();
  for (int r0 = 0; r0 < count; r0 += QR)
    scores<E, C, QR>(rows + r0, std::min(QR, count - r0), k, mask_kind, L, scale, s + r0 * L, top + r0);
#endif
  weights(s, top, count, L);
  for (int r0 = 0; r0 < count; r0 += RB)
    values_block<E, C, RB>(rows + r0, std::min(RB, count - r0), v, L, s + r0 * L);
}

// q (Q queries, H heads, D) with strides (q_row, q_head); k, v (G heads, L keys, D) with head strides, rows of D;
// mask (Q, >= L) rows of mask_row elements (or none); out (Q, H, D) contiguous. Head h reads key head h / (H / G).
// Work: for each key head, its Q x H / G query rows in blocks of up to task_rows<C>, a block per task.
template <class E, int C>
static void attend_c(const typename E::T* q, const typename E::T* k, const typename E::T* v, const char* mask,
                     typename E::T* out, int64_t Q, int64_t H, int64_t G, int64_t L, int64_t q_row, int64_t q_head,
                     int64_t k_head, int64_t v_head, int mask_kind, int64_t mask_row, float scale) {
  constexpr int TB = task_rows<C>();
  constexpr int64_t D = int64_t(C) * VW;
  const int64_t group = H / G, per_head = Q * group, blocks = (per_head + TB - 1) / TB;
  const size_t mask_item = mask_kind == ALLOWED ? sizeof(bool) : sizeof(float);
  // a thread takes at least ~4K query-key pairs (~15 us): a plain step's few rows stay on one
  const int64_t grain = std::max<int64_t>(1, 4096 / (L * std::min<int64_t>(TB, per_head)));
  at::parallel_for(0, G * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(TB * L);
    Row rows[TB];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / blocks, first = (task % blocks) * TB;
      const int count = int(std::min<int64_t>(TB, per_head - first));
      for (int r = 0; r < count; ++r) {
        const int64_t i = (first + r) / group, h = g * group + (first + r) % group;
        rows[r] = Row{q + i * q_row + h * q_head, mask_kind == NO_MASK ? nullptr : mask + i * mask_row * mask_item,
                      out + (i * H + h) * D};
      }
      attend_rows<E, C>(rows, count, k + g * k_head, v + g * v_head, mask_kind, L, scale, scores.data());
    }
  });
}

// the head dimensions compiled for (multiples of the vector width)
#define HEAD_DIMS(X) X(64) X(128) X(32) X(80) X(96) X(256)

template <class E>
static bool attend(int64_t q_ptr, int64_t k_ptr, int64_t v_ptr, int64_t mask_ptr, int64_t out_ptr, int64_t Q,
                   int64_t H, int64_t G, int64_t L, int64_t D, int64_t q_row, int64_t q_head, int64_t k_head,
                   int64_t v_head, int mask_kind, int64_t mask_row, double scale) {
  typedef typename E::T T;
  const T* q = reinterpret_cast<const T*>(q_ptr);
  const T* k = reinterpret_cast<const T*>(k_ptr);
  const T* v = reinterpret_cast<const T*>(v_ptr);
  const char* mask = reinterpret_cast<const char*>(mask_ptr);
  T* out = reinterpret_cast<T*>(out_ptr);
  pybind11::gil_scoped_release unlocked;
#define CASE(d)                                                                                                     \
  if (D == d) {                                                                                                     \
    attend_c<E, d / VW>(q, k, v, mask, out, Q, H, G, L, q_row, q_head, k_head, v_head, mask_kind, mask_row,      \
                        float(scale));                                                                          \
    return true;                                                                                                   \
  }
  HEAD_DIMS(CASE)
#undef CASE
  return false;
}

static pybind11::list head_dims() {
  pybind11::list dims;
#define ADD(d) dims.append(d);
  HEAD_DIMS(ADD)
#undef ADD
  return dims;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("lanes") = VW;
  m.attr("head_dims") = head_dims();
  m.def("attend", &attend<F32>, "a step's float32 query rows over a cache (backbone/step_attention.py)");
  m.def("attend_bf16", &attend<BF16>, "a step's bfloat16 query rows over a cache, in float32, rounded once");
}
