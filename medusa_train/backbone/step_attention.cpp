// medusa-train's CPU attention for a decoding step's few queries (a plain step's one, a verify's tree nodes, a
// prompt lookup's guesses) over a cache, grouped heads, an optional mask: backbone/step_attention.py.
//
// out[i, h] = sum_j p_j v_j / sum_j p_j, p_j = exp(s_j - max s), s_j = (q[h, i] . k_j) * scale (+ mask[i, j]), in
// float32 whatever the element type (float32 or bfloat16; a bf16 output rounded once, to nearest even).
//
// Every query row is computed alone, by one thread, keys in order, each key's score by the same sequence of
// operations (its dot product's lanes summed by one fixed tree), and a key whose weight is exactly zero (masked out,
// or one whose exp underflows) is skipped. So a row's output is bitwise the same whatever other rows share the call
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
static inline float vsum(vec v) {  // one fixed tree: halves added down to one lane
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
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

// R query rows of one key head against its L keys, the head dimension C vectors (both known when compiled, so the R x C
// sums stay in registers): the keys and values read once for all R rows. Rows are independent: each one's sums are
// what they would be alone.
struct Row {
  const void* q;     // its query (D elements)
  const void* mask;  // its mask row (or none)
  void* out;         // its output (D elements)
};

// how many rows' queries the scores hold in registers at once: Q x C of them, beside Q sums and C keys
template <int C>
constexpr int score_rows() {
  return std::max(1, (VW == 16 ? 24 : 14) / (C + 1));
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

#if defined(__AVX512BF16__)
// bfloat16 scores on AVX512-BF16: one instruction sums a pair of products into each float32 lane (q . k_j over the
// C / 2 vectors of pairs in order, then vsum's tree): half the instructions of widening both to float32, the same
// sequence for every key
template <int C, int Q>
static void scores_paired(const Row* rows, int count, const uint16_t* k, int mask_kind, int64_t L, float scale, float* s,
                          float* top) {
  constexpr int P = C / 2;  // vectors of bf16 pairs in a head
  constexpr int64_t D = int64_t(C) * VW;
  const float lowest = -std::numeric_limits<float>::infinity();
  __m512bh q[Q][P];
  for (int r = 0; r < Q; ++r)
    for (int c = 0; c < P; ++c)
      q[r][c] = (__m512bh)(r < count ? _mm512_loadu_si512(static_cast<const uint16_t*>(rows[r].q) + c * 2 * VW)
                                     : _mm512_setzero_si512());
  float best[Q];
  for (int r = 0; r < Q; ++r) best[r] = lowest;
  for (int64_t j = 0; j < L; ++j) {
    const uint16_t* kj = k + j * D;
    __m512bh kv[P];
    for (int c = 0; c < P; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kj + c * 2 * VW);
    for (int r = 0; r < Q; ++r) {
      if (r >= count) break;
      if (mask_kind == ALLOWED && !static_cast<const bool*>(rows[r].mask)[j]) {
        s[r * L + j] = lowest;
        continue;
      }
      vec acc = _mm512_dpbf16_ps(vzero(), q[r][0], kv[0]);
      for (int c = 1; c < P; ++c) acc = _mm512_dpbf16_ps(acc, q[r][c], kv[c]);
      float score = vsum(acc) * scale;
      if (mask_kind == ADDITIVE) score += static_cast<const float*>(rows[r].mask)[j];
      s[r * L + j] = score;
      best[r] = score > best[r] || score != score ? score : best[r];  // a NaN score stays: the row's output NaN
    }
  }
  for (int r = 0; r < count; ++r) top[r] = best[r];
}
#endif

constexpr bool HOLD = VW == 16;  // whether a value's vectors are held in registers while the rows use them

template <class E, int C, int R>
static void attend_rows(const Row* rows, const typename E::T* k, const typename E::T* v, int mask_kind, int64_t L,
                        float scale, float* s /* R x L */) {
  typedef typename E::T T;
  constexpr int64_t D = int64_t(C) * VW;
  const float lowest = -std::numeric_limits<float>::infinity();
  constexpr int QR = score_rows<C>();
  float top[R];
  for (int r0 = 0; r0 < R; r0 += QR) {  // scores, QR rows at a time with their queries held in registers
#if defined(__AVX512BF16__)
    if constexpr (E::PAIRS && C % 2 == 0) {
      scores_paired<C, (R < QR ? R : QR)>(rows + r0, std::min(QR, R - r0), k, mask_kind, L, scale, s + r0 * L,
                                          top + r0);
      continue;
    }
#endif
    scores<E, C, (R < QR ? R : QR)>(rows + r0, std::min(QR, R - r0), k, mask_kind, L, scale, s + r0 * L, top + r0);
  }
  for (int r = 0; r < R; ++r) {
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

// the rows of a block by how many there are (at most R)
template <class E, int C, int R>
static void attend_block(const Row* rows, int count, const typename E::T* k, const typename E::T* v, int mask_kind,
                         int64_t L, float scale, float* s) {
  if constexpr (R > 0) {
    if (count == R) return attend_rows<E, C, R>(rows, k, v, mask_kind, L, scale, s);
    attend_block<E, C, R - 1>(rows, count, k, v, mask_kind, L, scale, s);
  }
}

// rows a block holds: R x C sums in registers (AVX-512: 16 of its 32, beside the value's C vectors; with more rows GCC
// kept every sum in memory as well, stored at each key: 1.65x the time at 6 rows; AVX2: 14 of its 16)
template <int C>
constexpr int rows_for() {
  return std::max(1, VW == 16 ? 16 / C : 14 / C);
}

// q (Q queries, H heads, D) with strides (q_row, q_head); k, v (G heads, L keys, D) with head strides, rows of D;
// mask (Q, >= L) rows of mask_row elements (or none); out (Q, H, D) contiguous. Head h reads key head h / (H / G).
// Work: for each key head, its Q x H / G query rows in blocks of up to rows_for<C>, a block per task.
template <class E, int C>
static void attend_c(const typename E::T* q, const typename E::T* k, const typename E::T* v, const char* mask,
                     typename E::T* out, int64_t Q, int64_t H, int64_t G, int64_t L, int64_t q_row, int64_t q_head,
                     int64_t k_head, int64_t v_head, int mask_kind, int64_t mask_row, float scale) {
  constexpr int RB = rows_for<C>();
  constexpr int64_t D = int64_t(C) * VW;
  const int64_t group = H / G, per_head = Q * group, blocks = (per_head + RB - 1) / RB;
  const size_t mask_item = mask_kind == ALLOWED ? sizeof(bool) : sizeof(float);
  // a thread takes at least ~4K query-key pairs (~15 us): a plain step's few rows stay on one
  const int64_t grain = std::max<int64_t>(1, 4096 / (L * RB));
  at::parallel_for(0, G * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(RB * L);
    Row rows[RB];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / blocks, first = (task % blocks) * RB;
      const int count = int(std::min<int64_t>(RB, per_head - first));
      for (int r = 0; r < count; ++r) {
        const int64_t i = (first + r) / group, h = g * group + (first + r) % group;
        rows[r] = Row{q + i * q_row + h * q_head, mask_kind == NO_MASK ? nullptr : mask + i * mask_row * mask_item,
                      out + (i * H + h) * D};
      }
      attend_block<E, C, RB>(rows, count, k + g * k_head, v + g * v_head, mask_kind, L, scale, scores.data());
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
