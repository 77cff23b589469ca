// Attention over the paged KV pool, read in place through the slot indices.
//
// Layout (model_proc/attention.py): k_buf, v_buf [slots, kv_heads, D]; a
// row's keys are k_buf[kv_indices[kv_indptr[i] .. kv_indptr[i+1]]]. Queries
// [tokens, q_heads, D]; the `group` query heads h*group .. h*group+group-1
// share KV head h (GQA). Scores, softmax and accumulators are float32 for
// both float32 and bfloat16 inputs. Threads: OpenMP (torch's own runtime,
// libgomp, by its soname), as many as torch.get_num_threads().
//
// decode: one work item per (row, KV split): the row's query heads walk
//   its keys in blocks of 32, KV head by KV head within a block (scores, one
//   online-softmax update per block, then P x V), each K and V row read once
//   for its whole query group, the next block's slot rows prefetched. Few
//   rows get their keys split so every thread has work; the splits' partial
//   (max, sum, acc) are merged in a second pass.
// extend: one work item per (row, KV head, tile of new tokens): the tile
//   walks the row's keys (cached prefix, then its new tokens, which the
//   backend stored into the pool first) up to its last token's position, in
//   blocks packed from their slots into small scratch; a query sees key t
//   only if t <= prefix + its index (causal tail). bfloat16 (head_dim a
//   multiple of 32, where torch's brgemm can run: AMX or AVX512_BF16) packs
//   every key block once per call and does the two products of a block as
//   brgemm calls (extend_brgemm); otherwise float32 SIMD, packing per tile.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <omp.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && !defined(BATCHSERVE_NO_AVX512)
#include <immintrin.h>
#define BS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(BATCHSERVE_NO_AVX2)
#include <immintrin.h>
#define BS_AVX2 1
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// 2^f for f in [-0.5, 0.5], highest power first (Horner): degree 6, relative
// error ~1e-7; degree 4, ~5e-5 (for weights rounded to bfloat16 anyway)
constexpr float kExp2Poly[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
constexpr float kExp2Coarse[] = {9.618129107628477e-3f, 5.550410866482158e-2f, 2.402265069591007e-1f,
                                 6.931471805599453e-1f, 1.0f};

// ---------------------------------------------------------------- 16 floats
#ifdef BS_AVX512
template <int N> inline __m512 horner(__m512 f, const float (&c)[N]) {
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return p;
}
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 bcast(float x) { return {_mm512_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 load(const c10::BFloat16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static V16 load(const int8_t* p) {  // an int8 KV cache's values, widened
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  V16 operator*(V16 o) const { return {_mm512_mul_ps(v, o.v)}; }
  V16 operator-(V16 o) const { return {_mm512_sub_ps(v, o.v)}; }
  V16 operator+(V16 o) const { return {_mm512_add_ps(v, o.v)}; }
  static V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  // lanes >= n set to x (all of them for n <= 0)
  V16 fill_from(int n, float x) const {
    __mmask16 keep = n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
    return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(x), v)};
  }
  // e^x, relative error ~1e-7; inputs below -87 give ~0 (the caller masks
  // lanes that must be exactly 0)
  V16 exp() const { return V16{_mm512_mul_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f))}.exp2(); }
  // 2^x, the same error; inputs below -126 give ~0
  V16 exp2() const {
    __m512 t = _mm512_max_ps(v, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]; 2^f by its Taylor series in f ln 2
    return {_mm512_scalef_ps(horner(f, kExp2Poly), n)};
  }
  // 2^x to ~5e-5 relative (degree 4): for weights that are rounded to
  // bfloat16 (4e-3) before they are used
  V16 exp2_coarse() const {
    __m512 t = _mm512_max_ps(v, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    return {_mm512_scalef_ps(horner(f, kExp2Coarse), n)};
  }
};
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
// every cache line of one head's row (D elements)
template <typename T, int D> inline void prefetch_row(const T* p) {
  for (int i = 0; i < static_cast<int>(D * sizeof(T)); i += 64) prefetch(reinterpret_cast<const char*>(p) + i);
}
#elif defined(BS_AVX2)
// Two 8-float halves (AVX2 + FMA: an EPYC or a Xeon without AVX512). exp by
// the AVX512 path's polynomials, 2^n put into the exponent bits (the inputs
// are clamped to [-126, 126], so the result is a normal float).
template <int N> inline __m256 horner(__m256 f, const float (&c)[N]) {
  __m256 p = _mm256_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
  return p;
}
inline __m256 exp2_poly(__m256 t, bool coarse) {
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);  // in [-0.5, 0.5]
  const __m256 p = coarse ? horner(f, kExp2Coarse) : horner(f, kExp2Poly);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline __m256 widen_bf16(__m128i w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
}
struct V16 {
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 bcast(float x) { const __m256 b = _mm256_set1_ps(x); return {b, b}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V16 load(const c10::BFloat16* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {widen_bf16(_mm256_castsi256_si128(w)), widen_bf16(_mm256_extracti128_si256(w, 1))};
  }
  static V16 load(const int8_t* p) {  // an int8 KV cache's values, widened
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  static V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  V16 operator*(V16 o) const { return {_mm256_mul_ps(lo, o.lo), _mm256_mul_ps(hi, o.hi)}; }
  V16 operator-(V16 o) const { return {_mm256_sub_ps(lo, o.lo), _mm256_sub_ps(hi, o.hi)}; }
  V16 operator+(V16 o) const { return {_mm256_add_ps(lo, o.lo), _mm256_add_ps(hi, o.hi)}; }
  static V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  float sum() const { return hsum8(_mm256_add_ps(lo, hi)); }
  float max() const { return hmax8(_mm256_max_ps(lo, hi)); }
  // lanes >= n set to x (all of them for n <= 0)
  V16 fill_from(int n, float x) const {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    const __m256 keep_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane));
    const __m256 b = _mm256_set1_ps(x);
    return {_mm256_blendv_ps(b, lo, keep_lo), _mm256_blendv_ps(b, hi, keep_hi)};
  }
  // e^x, relative error ~1e-7; inputs below -87 give ~0
  V16 exp() const {
    const __m256 l2e = _mm256_set1_ps(1.44269504088896341f), lim = _mm256_set1_ps(-87.0f);
    return {exp2_poly(_mm256_mul_ps(_mm256_max_ps(lo, lim), l2e), false),
            exp2_poly(_mm256_mul_ps(_mm256_max_ps(hi, lim), l2e), false)};
  }
  V16 exp2() const { return {exp2_poly(lo, false), exp2_poly(hi, false)}; }
  V16 exp2_coarse() const { return {exp2_poly(lo, true), exp2_poly(hi, true)}; }
};
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
template <typename T, int D> inline void prefetch_row(const T* p) {
  for (int i = 0; i < static_cast<int>(D * sizeof(T)); i += 64) prefetch(reinterpret_cast<const char*>(p) + i);
}
// the totals of 8 vectors, one per lane (a hadd tree)
inline __m256 sum8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
#else
struct V16 {
  float v[16];
  static V16 zero() { return bcast(0.0f); }
  static V16 bcast(float x) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
  template <typename T> static V16 load(const T* p) {
    V16 r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]); return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  static V16 fma(V16 a, V16 b, V16 c) { for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
  V16 operator*(V16 o) const { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = v[i] * o.v[i]; return r; }
  V16 operator-(V16 o) const { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = v[i] - o.v[i]; return r; }
  V16 operator+(V16 o) const { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = v[i] + o.v[i]; return r; }
  static V16 max(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::max(a.v[i], b.v[i]); return r; }
  float sum() const { float s = 0; for (int i = 0; i < 16; ++i) s += v[i]; return s; }
  float max() const { float s = v[0]; for (int i = 1; i < 16; ++i) s = std::max(s, v[i]); return s; }
  V16 fill_from(int n, float x) const { V16 r = *this; for (int i = std::max(n, 0); i < 16; ++i) r.v[i] = x; return r; }
  V16 exp() const { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::exp(std::max(v[i], -87.0f)); return r; }
  V16 exp2() const { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::exp2(std::max(v[i], -126.0f)); return r; }
  V16 exp2_coarse() const { return exp2(); }
};
inline void prefetch(const void* p) { __builtin_prefetch(p); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
template <typename T, int D> inline void prefetch_row(const T* p) {
  for (int i = 0; i < static_cast<int>(D * sizeof(T)); i += 64) prefetch(reinterpret_cast<const char*>(p) + i);
}
#endif

// s[t] = q . K row t for the 16 rows krow[0..16): float32 dot products.
// AVX512: one 16-lane partial-sum vector per row, then the 16 vectors
// reduced together (a transpose-and-add tree, ~3 instructions per row
// instead of a full horizontal sum each); bfloat16 with AVX512_BF16 takes
// q and K in bfloat16 pairs straight into float32 (vdpbf16ps, products
// exact, sums in float32).
#ifdef BS_AVX512
inline __m512 pair_sum(__m512 a, __m512 b) {  // [a0+a2, b0+b2, a1+a3, b1+b3] per 128 bits
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline __m512 sum16(const __m512* a) {
  __m512 r[8], u[4];
  for (int i = 0; i < 8; ++i) r[i] = pair_sum(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 v[2];
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

template <typename T, int D, typename TK = T>
inline void scores16(const float* qf, const T* qraw, float scale, const TK* const* krow, float* s) {
  constexpr int C = D / 16;
#ifdef BS_AVX512
  __m512 a[16];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<TK, c10::BFloat16> && D % 32 == 0) {
    for (int t = 0; t < 16; ++t) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < D / 32; ++c)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qraw + 32 * c),
                               (__m512bh)_mm512_loadu_si512(krow[t] + 32 * c));
      a[t] = acc;
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
    return;
  }
#endif
  for (int t = 0; t < 16; ++t) {
    V16 acc = V16::load(qf) * V16::load(krow[t]);
    for (int c = 1; c < C; ++c) acc = V16::fma(V16::load(qf + 16 * c), V16::load(krow[t] + 16 * c), acc);
    a[t] = acc.v;
  }
  _mm512_storeu_ps(s, sum16(a));
#elif defined(BS_AVX2)
  (void)qraw; (void)scale;
  __m256 a[16];
  for (int t = 0; t < 16; ++t) {
    V16 acc = V16::load(qf) * V16::load(krow[t]);
    for (int c = 1; c < C; ++c) acc = V16::fma(V16::load(qf + 16 * c), V16::load(krow[t] + 16 * c), acc);
    a[t] = _mm256_add_ps(acc.lo, acc.hi);
  }
  _mm256_storeu_ps(s, sum8(a));
  _mm256_storeu_ps(s + 8, sum8(a + 8));
#else
  (void)qraw; (void)scale;
  for (int t = 0; t < 16; ++t) {
    V16 acc = V16::load(qf) * V16::load(krow[t]);
    for (int c = 1; c < C; ++c) acc = V16::fma(V16::load(qf + 16 * c), V16::load(krow[t] + 16 * c), acc);
    s[t] = acc.sum();
  }
#endif
}

// torch's thread count (torch.set_num_threads), never more than the items
inline int threads_for(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
}

template <typename T> inline void store_row(T* dst, const float* src, float mul, int d) {
  for (int i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

// What every kernel reads from its tensors: shapes, strides (in elements)
// and data pointers. q/out [tokens, q_heads, D]; k_buf/v_buf [slots,
// kv_heads, D]; the `group` query heads of a KV head are adjacent (GQA).
template <typename T> struct Operands {
  int64_t q_heads, kv_heads;
  int group;
  int64_t slot_stride, q_stride, o_stride;
  const T* q;
  T* out;
  const T* k;
  const T* v;
  static Operands of(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf) {
    return {q.size(1), k_buf.size(1), static_cast<int>(q.size(1) / k_buf.size(1)), k_buf.stride(0), q.stride(0),
            out.stride(0), q.data_ptr<T>(), out.data_ptr<T>(), k_buf.data_ptr<T>(), v_buf.data_ptr<T>()};
  }
};

// ------------------------------------------------------------------ decode
constexpr int kDecodeBlock = 32;  // keys per online-softmax update

// Attention of a row's query heads (q: float32, pre-scaled, [heads * group][D];
// qraw: as given, unscaled, for the bfloat16 dot products) over keys
// [k0, k1) of the row's slot list, all `heads` KV heads of each key at once:
// its whole slot row, contiguous memory (measured 1.2-1.3x faster than one
// work item per KV head, scattered or not: bfloat16, 64 x 2048, one layer's
// pool called repeatedly). Leaves the un-normalized accumulators, running
// maxima and sums, per query head. The next block's K and V slot rows are
// prefetched, every cache line of them, while this block runs: the slots
// are scattered, so no hardware prefetcher can guess them (1.7x faster than
// prefetching only the first line of each row, same measurement; one line
// in 2 / 4 / 8, leaving the rest to the L2 streamer: 1.4-1.7x slower at 64 x
// 256, on pages of 16 or 256). During the last block, the first block of
// the thread's next work item (next_slots [next_k0, next_k1)), which would
// otherwise start on a cold miss: 64 x 256, 30 layers' pools on huge pages,
// 20.29 -> 18.97 ms on random pages of 16, 16.59 -> 15.58 on pages of 256;
// 64 x 2048 165.5 -> 164.6 (fewer row starts).
// acc[g] = acc[g] * alpha[g] + sum_t p[g][t] V[t] for G query heads of one KV
// head (accumulators in registers, each V row widened once for all G).
template <typename T, int D, int G, typename Prefetch>
inline void pv_group(const T* const* vrow, int n, const float (*p)[kDecodeBlock], const float* alpha, float* acc,
                     Prefetch& prefetch_some, int per_piece) {
  constexpr int C = D / 16;
  V16 av[G][C];
  for (int g = 0; g < G; ++g) {
    const V16 al = V16::bcast(alpha[g]);
    for (int c = 0; c < C; ++c) av[g][c] = V16::load(acc + g * D + 16 * c) * al;
  }
  for (int t = 0; t < n; ++t) {
    prefetch_some(per_piece);
    V16 v[C];
    for (int c = 0; c < C; ++c) v[c] = V16::load(vrow[t] + 16 * c);
    for (int g = 0; g < G; ++g) {
      const V16 pt = V16::bcast(p[g][t]);
      for (int c = 0; c < C; ++c) av[g][c] = V16::fma(pt, v[c], av[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) av[g][c].store(acc + g * D + 16 * c);
}

// TK: the cache's element type, T's or int8_t (an int8 cache: k_scale and
// v_scale [slots, heads] hold each token's and head's scale; a key's scores
// are scaled after the dot product, a value's scale folded into its
// probability, so the rows are widened but never multiplied out).
template <typename T, int D, typename TK = T>
void decode_part(const float* q, const T* qraw, float scale, int heads, int group, const TK* k_buf, const TK* v_buf,
                 int64_t slot_stride, const int64_t* slots, int64_t k0, int64_t k1, float* acc, float* m, float* l,
                 float* scratch, const int64_t* next_slots, int64_t next_k0, int64_t next_k1,
                 const float* k_scale = nullptr, const float* v_scale = nullptr) {
  constexpr bool kInt8 = std::is_same_v<TK, int8_t>;
  // a cache whose rows the float32 dot products widen (int8; bfloat16 without
  // AVX512_BF16's own dot product): each K row widened once per query group
#if defined(BS_AVX512) && defined(__AVX512BF16__)
  constexpr bool kNativeBf16Dot = std::is_same_v<T, c10::BFloat16> && std::is_same_v<TK, c10::BFloat16> && D % 32 == 0;
#else
  constexpr bool kNativeBf16Dot = false;
#endif
  constexpr bool kWidenK = !std::is_same_v<TK, float> && !kNativeBf16Dot;
  const int nq = heads * group;
  const int row_bytes = static_cast<int>(heads * D * sizeof(TK));
  auto prefetch_slot = [&](int64_t slot) {
    const char* kr = reinterpret_cast<const char*>(k_buf + slot * slot_stride);
    const char* vr = reinterpret_cast<const char*>(v_buf + slot * slot_stride);
    for (int i = 0; i < row_bytes; i += 64) { prefetch(kr + i); prefetch(vr + i); }
  };
  // The next block's lines, into L2 (T1), a few at a time between this
  // block's pieces of work. Scattered rows leave the time to how many misses
  // are in flight: into L1 (T0) each waits for one of the core's few fill
  // buffers, and all at once they queue ahead of this block's arithmetic.
  // Measured (bench/RESULTS.md, 64 x 2048): T0 all at once 1.9-2.1x the
  // bandwidth floor, T0 spread 1.9-2.0x, T1 spread 1.6x, T1 all at once 1.8x,
  // T1 two blocks ahead no better, NTA 3.7x.
  int64_t pf_t = 0, pf_end = 0;
  int pf_line = 0;
  const int64_t* pf_slots = slots;
  auto prefetch_some = [&](int lines) {
    for (; lines > 0 && pf_t < pf_end; --lines) {
      const int64_t off = pf_slots[pf_t] * slot_stride * static_cast<int64_t>(sizeof(TK)) + pf_line;
      prefetch_l2(reinterpret_cast<const char*>(k_buf) + off);
      prefetch_l2(reinterpret_cast<const char*>(v_buf) + off);
      if ((pf_line += 64) >= row_bytes) { pf_line = 0; ++pf_t; }
    }
  };
  for (int i = 0; i < nq; ++i) { m[i] = kNegInf; l[i] = 0.0f; }
  std::fill(acc, acc + nq * D, 0.0f);
  // per query head: the block's scores, then its probabilities, and alpha
  float (*s)[kDecodeBlock] = reinterpret_cast<float (*)[kDecodeBlock]>(scratch);
  float (*p)[kDecodeBlock] = s + nq;
  float* alpha = scratch + 2 * nq * kDecodeBlock;
  for (int64_t t = k0; t < std::min(k1, k0 + kDecodeBlock); ++t) prefetch_slot(slots[t]);  // the first block, now
  for (int64_t t0 = k0; t0 < k1; t0 += kDecodeBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kDecodeBlock, k1 - t0));
    // the block's slot rows (a short last block repeats its first row; those
    // scores are never used)
    const TK* krow[kDecodeBlock];
    const TK* vrow0[kDecodeBlock];
    for (int t = 0; t < kDecodeBlock; ++t) {
      krow[t] = k_buf + slots[t0 + (t < n ? t : 0)] * slot_stride;
      vrow0[t] = v_buf + slots[t0 + (t < n ? t : 0)] * slot_stride;
    }
    pf_t = std::min(k1, t0 + kDecodeBlock);
    pf_end = std::min(k1, t0 + 2 * kDecodeBlock);
    pf_line = 0;
    if (pf_t == pf_end && next_slots != nullptr) {
      // the last block: the first block of the thread's next work item instead
      pf_slots = next_slots;
      pf_t = next_k0;
      pf_end = std::min(next_k1, next_k0 + kDecodeBlock);
    }
    // lines of the next block per piece of this one: its slot rows' lines
    // spread over the pieces (scores, softmax, P x V per key)
    const int per_piece = (static_cast<int>(pf_end - pf_t) * row_bytes / 64 + heads * (3 * group + n) - 1) /
                          (heads * (3 * group + n));
    for (int h = 0; h < heads; ++h) {
      const TK* kh[kDecodeBlock];
      for (int t = 0; t < kDecodeBlock; ++t) kh[t] = krow[t] + h * D;
      for (int t = 0; t < n; t += 16) {
        if constexpr (kWidenK) {
          // 16 K rows widened to float32 once for the whole query group, not
          // once per query head: the same values, so the same scores (64 x 2048:
          // 6-8% less attention time, docs/architecture.md's int8 KV entry)
          alignas(64) float kw[16 * D];
          const float* kwr[16];
          for (int j = 0; j < 16; ++j) {
            for (int c = 0; c < D / 16; ++c) V16::load(kh[t + j] + 16 * c).store(kw + j * D + 16 * c);
            kwr[j] = kw + j * D;
          }
          for (int g = 0; g < group; ++g) {
            const int i = h * group + g;
            prefetch_some(per_piece);
            scores16<float, D, float>(q + i * D, q + i * D, scale, kwr, &s[i][t]);
          }
        } else {
          for (int g = 0; g < group; ++g) {
            const int i = h * group + g;
            prefetch_some(per_piece);
            scores16<T, D, TK>(q + i * D, qraw + i * D, scale, kh + t, &s[i][t]);
          }
        }
      }
      float vs[kDecodeBlock];  // an int8 cache: the block's value scales for head h
      if constexpr (kInt8) {
        float ks[kDecodeBlock];
        for (int t = 0; t < n; ++t) {
          ks[t] = k_scale[slots[t0 + t] * heads + h];
          vs[t] = v_scale[slots[t0 + t] * heads + h];
        }
        for (int g = 0; g < group; ++g)
          for (int t = 0; t < n; ++t) s[h * group + g][t] *= ks[t];
      }
      for (int g = 0; g < group; ++g) {
        const int i = h * group + g;
        prefetch_some(per_piece);
        float bm = V16::load(&s[i][0]).fill_from(n, kNegInf).max();
        for (int t = 16; t < n; t += 16) bm = std::max(bm, V16::load(&s[i][t]).fill_from(n - t, kNegInf).max());
        const float mn = std::max(m[i], bm);
        alpha[i] = std::exp(m[i] - mn);  // 0 for the first block
        float sum = 0.0f;
        for (int t = 0; t < n; t += 16) {
          V16 e = (V16::load(&s[i][t]) - V16::bcast(mn)).exp().fill_from(n - t, 0.0f);
          e.store(&p[i][t]);
          sum += e.sum();
        }
        l[i] = l[i] * alpha[i] + sum;
        m[i] = mn;
        if constexpr (kInt8)  // after the sum: the scale belongs to V, not to the probability
          for (int t = 0; t < n; ++t) p[i][t] *= vs[t];
      }
      // P x V: each V row of head h read (and widened to float32) once for
      // the whole query group, up to 4 heads' accumulators in registers at a
      // time (12-16 independent FMA chains; one head at a time left the FMAs
      // waiting on each other and reloaded the row per head)
      const TK* vh[kDecodeBlock];
      for (int t = 0; t < n; ++t) vh[t] = vrow0[t] + h * D;
      for (int g0 = 0; g0 < group; g0 += 4) {
        const int i0 = h * group + g0;
        switch (std::min(4, group - g0)) {
          case 1: pv_group<TK, D, 1>(vh, n, &p[i0], alpha + i0, acc + i0 * D, prefetch_some, per_piece); break;
          case 2: pv_group<TK, D, 2>(vh, n, &p[i0], alpha + i0, acc + i0 * D, prefetch_some, per_piece); break;
          case 3: pv_group<TK, D, 3>(vh, n, &p[i0], alpha + i0, acc + i0 * D, prefetch_some, per_piece); break;
          default: pv_group<TK, D, 4>(vh, n, &p[i0], alpha + i0, acc + i0 * D, prefetch_some, per_piece); break;
        }
      }
    }
    prefetch_some(std::numeric_limits<int>::max());
  }
}

template <typename T, int D, typename TK = T>
void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                 const at::Tensor& kv_indptr, const at::Tensor& kv_indices, double scale, int64_t splits,
                 const float* k_scale = nullptr, const float* v_scale = nullptr) {
  const int64_t rows = q.size(0);
  const int64_t q_heads = q.size(1), kv_heads = k_buf.size(1), slot_stride = k_buf.stride(0);
  const int group = static_cast<int>(q_heads / kv_heads);
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const TK* kp = k_buf.data_ptr<TK>();
  const TK* vp = v_buf.data_ptr<TK>();
  const int64_t* indptr = kv_indptr.data_ptr<int64_t>();
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  // splits > 1: each split's acc [q_heads][D], max [q_heads], sum [q_heads]
  at::Tensor part;
  float* pp = nullptr;
  const int64_t part_size = q_heads * (D + 2);
  if (splits > 1) {
    part = at::empty({rows * splits * part_size}, q.options().dtype(at::kFloat));
    pp = part.data_ptr<float>();
  }
  const int64_t items = rows * splits;
  const float sc = static_cast<float>(scale);
  const int nthreads = threads_for(items);
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> qf(q_heads * D), acc(q_heads * D), m(q_heads), l(q_heads);
    std::vector<float> scratch(q_heads * (2 * kDecodeBlock + 1));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = it / splits, sp = it % splits;
      const int64_t len = indptr[b + 1] - indptr[b];
      const int64_t chunk = (len + splits - 1) / splits;
      const int64_t k0 = std::min(len, sp * chunk), k1 = std::min(len, k0 + chunk);
      const T* qr = qp + b * q_stride;
      for (int i = 0; i < q_heads * D; ++i) qf[i] = static_cast<float>(qr[i]) * sc;
      // this thread's next item, as dynamic scheduling mostly hands them out:
      // its first block is prefetched during this item's last
      const int64_t nx = it + nthreads;
      const int64_t* next_slots = nullptr;
      int64_t nk0 = 0, nk1 = 0;
      if (nx < items) {
        const int64_t nb = nx / splits, nsp = nx % splits, nlen = indptr[nb + 1] - indptr[nb];
        const int64_t nchunk = (nlen + splits - 1) / splits;
        nk0 = std::min(nlen, nsp * nchunk);
        nk1 = std::min(nlen, nk0 + nchunk);
        next_slots = indices + indptr[nb];
      }
      decode_part<T, D, TK>(qf.data(), qr, sc, static_cast<int>(kv_heads), group, kp, vp, slot_stride,
                            indices + indptr[b], k0, k1, acc.data(), m.data(), l.data(), scratch.data(), next_slots,
                            nk0, nk1, k_scale, v_scale);
      if (splits == 1) {
        for (int i = 0; i < q_heads; ++i) store_row(op + b * o_stride + i * D, acc.data() + i * D, 1.0f / l[i], D);
      } else {
        float* dst = pp + it * part_size;
        std::memcpy(dst, acc.data(), sizeof(float) * q_heads * D);
        std::memcpy(dst + q_heads * D, m.data(), sizeof(float) * q_heads);
        std::memcpy(dst + q_heads * (D + 1), l.data(), sizeof(float) * q_heads);
      }
    }
  }
  if (splits == 1) return;
#pragma omp parallel num_threads(threads_for(rows * q_heads))
  {
    float acc[D];
#pragma omp for schedule(static)
    for (int64_t bi = 0; bi < rows * q_heads; ++bi) {
      const int64_t b = bi / q_heads, i = bi % q_heads;
      const float* base = pp + b * splits * part_size;
      float mx = kNegInf;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, base[sp * part_size + q_heads * D + i]);
      float sum = 0.0f;
      std::fill(acc, acc + D, 0.0f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float* src = base + sp * part_size;
        const float ls = src[q_heads * (D + 1) + i];
        if (ls == 0.0f) continue;  // an empty split
        const float w = std::exp(src[q_heads * D + i] - mx);
        sum += ls * w;
        for (int d = 0; d < D; ++d) acc[d] += w * src[i * D + d];
      }
      store_row(op + b * o_stride + i * D, acc, 1.0f / sum, D);
    }
  }
}

// ------------------------------------------------------------------ extend
constexpr int kTileQ = 32;  // new tokens per work item
constexpr int kKeyBlock = 16;

template <typename T, int D>
void extend_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                 const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                 double scale) {
  constexpr int C = D / 16;
  const int64_t rows = qo_indptr.size(0) - 1;
  const auto [q_heads, kv_heads, group, slot_stride, q_stride, o_stride, qp, op, kp, vp] =
      Operands<T>::of(out, q, k_buf, v_buf);
  const int64_t* qo = qo_indptr.data_ptr<int64_t>();
  const int64_t* kvp = kv_indptr.data_ptr<int64_t>();
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  // work items: (row, tile) pairs in order, times KV heads
  std::vector<int64_t> tile_row, tile_first;
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t j = 0; j < qo[b + 1] - qo[b]; j += kTileQ) { tile_row.push_back(b); tile_first.push_back(j); }
  const int64_t tiles = static_cast<int64_t>(tile_row.size());
#pragma omp parallel num_threads(threads_for(tiles * kv_heads))
  {
    std::vector<float> qf(kTileQ * group * D), acc(kTileQ * group * D);
    std::vector<float> m(kTileQ * group), l(kTileQ * group);
    alignas(64) float kt[D * kKeyBlock];  // K block transposed: kt[d][t]
    alignas(64) float vb[kKeyBlock * D];
    alignas(64) float s[kKeyBlock];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < tiles * kv_heads; ++it) {
      const int64_t tile = it / kv_heads, h = it % kv_heads, b = tile_row[tile];
      const int64_t n_new = qo[b + 1] - qo[b], n_kv = kvp[b + 1] - kvp[b], prefix = n_kv - n_new;
      const int64_t j0 = tile_first[tile], j1 = std::min(n_new, j0 + kTileQ);
      const int nq = static_cast<int>(j1 - j0), mq = nq * group;
      const int64_t* slots = indices + kvp[b];
      for (int j = 0; j < nq; ++j) {
        const T* qr = qp + (qo[b] + j0 + j) * q_stride + h * group * D;
        for (int i = 0; i < group * D; ++i) qf[j * group * D + i] = static_cast<float>(qr[i]) * static_cast<float>(scale);
      }
      std::fill(acc.begin(), acc.begin() + mq * D, 0.0f);
      std::fill(m.begin(), m.begin() + mq, kNegInf);
      std::fill(l.begin(), l.begin() + mq, 0.0f);
      const int64_t n_keys = prefix + j1;  // the tile's last token sees keys 0 .. prefix + j1 - 1
      for (int64_t t0 = 0; t0 < n_keys; t0 += kKeyBlock) {
        const int nb = static_cast<int>(std::min<int64_t>(kKeyBlock, n_keys - t0));
        for (int t = 0; t < nb; ++t) {
          if (t0 + kKeyBlock + t < n_keys) {
            prefetch_row<T, D>(kp + slots[t0 + kKeyBlock + t] * slot_stride + h * D);
            prefetch_row<T, D>(vp + slots[t0 + kKeyBlock + t] * slot_stride + h * D);
          }
          const T* kr = kp + slots[t0 + t] * slot_stride + h * D;
          const T* vr = vp + slots[t0 + t] * slot_stride + h * D;
          for (int d = 0; d < D; ++d) kt[d * kKeyBlock + t] = static_cast<float>(kr[d]);
          for (int c = 0; c < C; ++c) V16::load(vr + 16 * c).store(vb + t * D + 16 * c);
        }
        for (int t = nb; t < kKeyBlock; ++t)
          for (int d = 0; d < D; ++d) kt[d * kKeyBlock + t] = 0.0f;
        for (int j = 0; j < nq; ++j) {
          // keys of this block that query j sees
          const int nv = static_cast<int>(std::min<int64_t>(nb, prefix + j0 + j + 1 - t0));
          if (nv <= 0) continue;
          for (int g = 0; g < group; ++g) {
            const int mi = j * group + g;
            const float* qv = qf.data() + mi * D;
            V16 a0 = V16::zero(), a1 = V16::zero();
            for (int d = 0; d < D; d += 2) {
              a0 = V16::fma(V16::bcast(qv[d]), V16::load(kt + d * kKeyBlock), a0);
              a1 = V16::fma(V16::bcast(qv[d + 1]), V16::load(kt + (d + 1) * kKeyBlock), a1);
            }
            V16 sc = V16::fma(a0, V16::bcast(1.0f), a1).fill_from(nv, kNegInf);
            const float mn = std::max(m[mi], sc.max());
            const float alpha = std::exp(m[mi] - mn);
            V16 p = (sc - V16::bcast(mn)).exp().fill_from(nv, 0.0f);
            l[mi] = l[mi] * alpha + p.sum();
            m[mi] = mn;
            p.store(s);
            float* a = acc.data() + mi * D;
            V16 av[C];
            for (int c = 0; c < C; ++c) av[c] = V16::load(a + 16 * c) * V16::bcast(alpha);
            for (int t = 0; t < nv; ++t) {
              const V16 pt = V16::bcast(s[t]);
              for (int c = 0; c < C; ++c) av[c] = V16::fma(pt, V16::load(vb + t * D + 16 * c), av[c]);
            }
            for (int c = 0; c < C; ++c) av[c].store(a + 16 * c);
          }
        }
      }
      for (int j = 0; j < nq; ++j)
        for (int g = 0; g < group; ++g) {
          const int mi = j * group + g;
          store_row(op + (qo[b] + j0 + j) * o_stride + (h * group + g) * D, acc.data() + mi * D, 1.0f / l[mi], D);
        }
    }
  }
}

// bfloat16 extend on the CPU's matrix units. Two phases in one OpenMP
// region:
// (1) pack: each key block (kKeyBlockB keys) of each (row, KV head) is read
//     once from its slots into the VNNI layout torch's brgemm (oneDNN
//     ukernels: AMX tiles or AVX512_BF16) takes, pairs along the reduced
//     dimension: K as [D/2][keys][2], V as [keys/2][D][2], into a scratch
//     kept across calls. Each K/V byte of the pool is read once per layer,
//     however many query tiles read it (packing per tile read the prefix
//     once per 64 new tokens);
// (2) attend: one work item per (row, KV head, tile of kTileQB new tokens);
//     A's rows are the tile's query heads of that KV head (GQA: the group
//     shares each packed block), walking the key blocks up to the tile's
//     last token (causal tail). Per block: scores = Q K^T (brgemm, float32
//     out), the online softmax in float32 in base 2 (scores scaled by
//     scale * log2(e)), P rounded to bfloat16 (as in SGLang's CPU extend;
//     the row sums keep float32), acc += P V (brgemm).
// Blocks of 256 keys: a quarter of the online-softmax rescales and brgemm
// calls of 64-key blocks; S (192 x 256 float32) and P stay in L2.
constexpr int kTileQB = 64;  // new tokens per work item
constexpr int kKeyBlockB = 256;
constexpr float kLog2e = 1.44269504088896341f;
// A block's weights are taken against the running max when its own max is at
// most this much above it (base 2): weights up to 2^8, far inside float32 and
// bfloat16's range, and no rescale of acc for that block.
constexpr float kLazyRescale = 8.0f;

// K rows t of a block (slots[t], KV head h) -> [D/2][BK] uint32 pairs; a
// short block repeats its first key (masked by the caller) so every lane
// the product reads is finite.
#ifdef BS_AVX512
// r[i] = column i of the 16 x 16 matrix of 32-bit lanes whose rows are r[0..16)
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] now holds, per 128-bit lane L, rows 4L..4L+3 of column 4 * (lane
  // group) + b: gather the lanes across registers
  for (int i = 0; i < 4; ++i) {
    const __m512i a = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88), b = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88), d = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    t[i] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[i + 8] = _mm512_shuffle_i32x4(a, c, 0xdd);
    t[i + 4] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(b, d, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

template <int D, int BK>
inline void pack_k_block(const uint32_t* k32, const int64_t* slots, int nb, int64_t slot_stride, int64_t h,
                         uint32_t* dst) {
#ifdef BS_AVX512
  if constexpr ((D / 2) % 16 == 0 && BK % 16 == 0) {
    // 16 keys x 16 bfloat16 pairs at a time, transposed in registers
    for (int t0 = 0; t0 < BK; t0 += 16) {
      const uint32_t* src[16];
      for (int i = 0; i < 16; ++i) src[i] = k32 + (slots[t0 + i < nb ? t0 + i : 0] * slot_stride + h * D) / 2;
      for (int c = 0; c < D / 2; c += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src[i] + c);
        transpose16x16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (c + i) * BK + t0, r[i]);
      }
    }
    return;
  }
#endif
  for (int t = 0; t < BK; ++t) {
    const uint32_t* src = k32 + (slots[t < nb ? t : 0] * slot_stride + h * D) / 2;
    for (int d2 = 0; d2 < D / 2; ++d2) dst[d2 * BK + t] = src[d2];
  }
}

// V rows -> [BK/2][D][2]: rows t and t+1 interleaved
template <int D, int BK>
inline void pack_v_block(const c10::BFloat16* v, const int64_t* slots, int nb, int64_t slot_stride, int64_t h,
                         c10::BFloat16* dst) {
  for (int t = 0; t < BK; t += 2) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(v + slots[t < nb ? t : 0] * slot_stride + h * D);
    const uint16_t* b = reinterpret_cast<const uint16_t*>(v + slots[t + 1 < nb ? t + 1 : 0] * slot_stride + h * D);
    uint16_t* o = reinterpret_cast<uint16_t*>(dst) + t * D;
#ifdef BS_AVX512
    // (a0 b0 a1 b1 ...): two-source permutes of 32 x 16 bits
    static const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                               39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    static const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                               55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    if constexpr (D % 32 == 0) {
      for (int d = 0; d < D; d += 32) {
        const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
        _mm512_storeu_si512(o + 2 * d, _mm512_permutex2var_epi16(va, lo, vb));
        _mm512_storeu_si512(o + 2 * d + 32, _mm512_permutex2var_epi16(va, hi, vb));
      }
      continue;
    }
#endif
    for (int d = 0; d < D; ++d) { o[2 * d] = a[d]; o[2 * d + 1] = b[d]; }
  }
}

// 16 floats -> 16 bfloat16, round to nearest even
inline void store_bf16x16(c10::BFloat16* dst, const V16& x) {
#if defined(BS_AVX512) && defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x.v));
#else
  alignas(64) float f[16];
  x.store(f);
  for (int i = 0; i < 16; ++i) dst[i] = c10::BFloat16(f[i]);
#endif
}

template <int D>
void extend_brgemm(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                   const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                   double scale) {
  using T = c10::BFloat16;
  constexpr int BK = kKeyBlockB;
  const int64_t rows = qo_indptr.size(0) - 1;
  const auto [q_heads, kv_heads, group, slot_stride, q_stride, o_stride, qp, op, kp, vp] =
      Operands<T>::of(out, q, k_buf, v_buf);
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kp);  // K rows as bfloat16 pairs
  const int64_t* qo = qo_indptr.data_ptr<int64_t>();
  const int64_t* kvp = kv_indptr.data_ptr<int64_t>();
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  const float c = static_cast<float>(scale) * kLog2e;
  // key blocks: row b's block i of KV head h is packed entry (first_block[b] + i) * kv_heads + h
  std::vector<int64_t> first_block(rows + 1, 0), block_row;
  std::vector<int64_t> tile_row, tile_first;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t blocks = (kvp[b + 1] - kvp[b] + BK - 1) / BK;
    first_block[b + 1] = first_block[b] + blocks;
    block_row.insert(block_row.end(), blocks, b);
    for (int64_t j = 0; j < qo[b + 1] - qo[b]; j += kTileQB) { tile_row.push_back(b); tile_first.push_back(j); }
  }
  const int64_t packed = first_block[rows] * kv_heads, tiles = static_cast<int64_t>(tile_row.size());
  constexpr int64_t kEntry = 2 * BK * D;  // K then V of one block, bf16
  static std::vector<T> scratch;  // kept across calls: no page faults per layer
  if (scratch.size() < static_cast<size_t>(packed * kEntry)) scratch.resize(packed * kEntry);
  T* pk = scratch.data();
#pragma omp parallel num_threads(threads_for(std::max(packed, tiles * kv_heads)))
  {
#pragma omp for schedule(static)
    for (int64_t e = 0; e < packed; ++e) {
      const int64_t gb = e / kv_heads, h = e % kv_heads, b = block_row[gb];
      const int64_t t0 = (gb - first_block[b]) * BK;
      const int nb = static_cast<int>(std::min<int64_t>(BK, kvp[b + 1] - kvp[b] - t0));
      const int64_t* slots = indices + kvp[b] + t0;
      pack_k_block<D, BK>(k32, slots, nb, slot_stride, h, reinterpret_cast<uint32_t*>(pk + e * kEntry));
      pack_v_block<D, BK>(vp, slots, nb, slot_stride, h, pk + e * kEntry + BK * D);
    }  // implicit barrier: every block packed before any tile reads it
    const int max_m = kTileQB * group;
    std::vector<T> qa(max_m * D), pb(max_m * BK);
    std::vector<float> acc(max_m * D), s(max_m * BK), m(max_m), l(max_m);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < tiles * kv_heads; ++it) {
      const int64_t tile = it / kv_heads, h = it % kv_heads, b = tile_row[tile];
      const int64_t n_new = qo[b + 1] - qo[b], n_kv = kvp[b + 1] - kvp[b], prefix = n_kv - n_new;
      const int64_t j0 = tile_first[tile], j1 = std::min(n_new, j0 + kTileQB);
      const int nq = static_cast<int>(j1 - j0), mq = nq * group;
      // rows mi = j * group + g of A: the tile's queries of this KV head's group
      for (int j = 0; j < nq; ++j)
        std::memcpy(qa.data() + j * group * D, qp + (qo[b] + j0 + j) * q_stride + h * group * D,
                    sizeof(T) * group * D);
      std::fill(acc.begin(), acc.begin() + mq * D, 0.0f);
      std::fill(m.begin(), m.begin() + mq, kNegInf);
      std::fill(l.begin(), l.begin() + mq, 0.0f);
      const int64_t n_keys = prefix + j1;
      for (int64_t t0 = 0; t0 < n_keys; t0 += BK) {
        const T* kblock = pk + ((first_block[b] + t0 / BK) * kv_heads + h) * kEntry;
        at::native::cpublas::brgemm(mq, BK, D, D, BK, BK, false, qa.data(), kblock, s.data());
        for (int j = 0; j < nq; ++j) {
          // keys of this block query j sees: up to its own position (causal)
          const int nv = static_cast<int>(std::min<int64_t>(std::min<int64_t>(BK, n_kv - t0),
                                                            prefix + j0 + j + 1 - t0));
          for (int g = 0; g < group; ++g) {
            const int mi = j * group + g;
            float* srow = s.data() + mi * BK;
            T* prow = pb.data() + mi * BK;
            if (nv <= 0) {  // none of this block: P row 0, acc unchanged
              std::memset(static_cast<void*>(prow), 0, sizeof(T) * BK);
              continue;
            }
            V16 vmax = V16::bcast(kNegInf);
            const V16 vc = V16::bcast(c);
            V16 vsum = V16::zero();
            if (m[mi] != kNegInf) {
              // one pass against the running max (lazy rescale): kept unless
              // this block's max exceeds it by more than kLazyRescale (then
              // P's largest weights could pass 2^kLazyRescale: redone below)
              const V16 neg_m = V16::bcast(-m[mi]);
              for (int t = 0; t < BK; t += 16) {
                V16 e = V16::zero();
                if (t < nv) {
                  const V16 sv = V16::load(srow + t);
                  vmax = V16::max(vmax, nv - t >= 16 ? sv : sv.fill_from(nv - t, kNegInf));
                  e = V16::fma(sv, vc, neg_m).exp2_coarse().fill_from(nv - t, 0.0f);
                }
                vsum = vsum + e;
                store_bf16x16(prow + t, e);
              }
              if (vmax.max() * c - m[mi] <= kLazyRescale) {
                l[mi] += vsum.sum();
                continue;
              }
              vmax = V16::bcast(kNegInf);
              vsum = V16::zero();
            }
            float mn;
            if (nv == BK) {  // the whole block visible: no lane masks
              for (int t = 0; t < BK; t += 16) vmax = V16::max(vmax, V16::load(srow + t));
              mn = std::max(m[mi], vmax.max() * c);
              const V16 neg_mn = V16::bcast(-mn);
              for (int t = 0; t < BK; t += 16) {
                const V16 e = V16::fma(V16::load(srow + t), vc, neg_mn).exp2_coarse();
                vsum = vsum + e;
                store_bf16x16(prow + t, e);
              }
            } else {
              for (int t = 0; t < nv; t += 16)
                vmax = V16::max(vmax, V16::load(srow + t).fill_from(nv - t, kNegInf));
              mn = std::max(m[mi], vmax.max() * c);
              const V16 neg_mn = V16::bcast(-mn);
              for (int t = 0; t < BK; t += 16) {
                const V16 e = t < nv ? V16::fma(V16::load(srow + t), vc, neg_mn).exp2_coarse().fill_from(nv - t, 0.0f)
                                     : V16::zero();
                vsum = vsum + e;
                store_bf16x16(prow + t, e);
              }
            }
            const float alpha = std::exp2(m[mi] - mn);  // 0 on the first block (m = -inf)
            l[mi] = l[mi] * alpha + vsum.sum();
            m[mi] = mn;
            if (alpha != 1.0f) {
              float* a = acc.data() + mi * D;
              for (int d = 0; d < D; d += 16) (V16::load(a + d) * V16::bcast(alpha)).store(a + d);
            }
          }
        }
        at::native::cpublas::brgemm(mq, D, BK, BK, D, D, true, pb.data(), kblock + BK * D, acc.data());
      }
      for (int j = 0; j < nq; ++j)
        for (int g = 0; g < group; ++g) {
          const int mi = j * group + g;
          store_row(op + (qo[b] + j0 + j) * o_stride + (h * group + g) * D, acc.data() + mi * D, 1.0f / l[mi], D);
        }
    }
    at::native::cpublas::brgemm_release();
  }
}

template <typename T, int D>
void extend_dispatch(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                     double scale) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0) {
    if (at::native::cpublas::could_pack(at::kBFloat16))
      return extend_brgemm<D>(out, q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale);
  }
  extend_impl<T, D>(out, q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale);
}

// --------------------------------------------------------------- dispatch
void check(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf) {
  TORCH_CHECK(q.device().is_cpu(), "native attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [tokens, q_heads, head_dim]");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes(), "k_buf, v_buf must be [slots, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && out.scalar_type() == q.scalar_type() &&
              v_buf.scalar_type() == q.scalar_type(), "q, out and the pool must share a dtype");
  TORCH_CHECK(q.size(2) == k_buf.size(2), "head_dim differs between q and the pool");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "q_heads must be a multiple of kv_heads");
  for (const at::Tensor* t : {&out, &q})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q and out need contiguous heads");
  for (const at::Tensor* t : {&k_buf, &v_buf}) TORCH_CHECK(t->is_contiguous(), "the pool must be contiguous");
  TORCH_CHECK(k_buf.stride(0) == v_buf.stride(0), "k_buf and v_buf strides differ");
}

#define BS_DISPATCH(DTYPE, HEAD_DIM, FN, ...)                                              \
  [&] {                                                                                    \
    if (DTYPE == at::kFloat) {                                                             \
      switch (HEAD_DIM) {                                                                  \
        case 16: return FN<float, 16>(__VA_ARGS__);                                        \
        case 32: return FN<float, 32>(__VA_ARGS__);                                        \
        case 64: return FN<float, 64>(__VA_ARGS__);                                        \
        case 80: return FN<float, 80>(__VA_ARGS__);                                        \
        case 96: return FN<float, 96>(__VA_ARGS__);                                        \
        case 128: return FN<float, 128>(__VA_ARGS__);                                      \
        case 256: return FN<float, 256>(__VA_ARGS__);                                      \
      }                                                                                    \
    } else if (DTYPE == at::kBFloat16) {                                                   \
      switch (HEAD_DIM) {                                                                  \
        case 16: return FN<c10::BFloat16, 16>(__VA_ARGS__);                                \
        case 32: return FN<c10::BFloat16, 32>(__VA_ARGS__);                                \
        case 64: return FN<c10::BFloat16, 64>(__VA_ARGS__);                                \
        case 80: return FN<c10::BFloat16, 80>(__VA_ARGS__);                                \
        case 96: return FN<c10::BFloat16, 96>(__VA_ARGS__);                                \
        case 128: return FN<c10::BFloat16, 128>(__VA_ARGS__);                              \
        case 256: return FN<c10::BFloat16, 256>(__VA_ARGS__);                              \
      }                                                                                    \
    }                                                                                      \
    TORCH_CHECK(false, "native attention: no kernel for ", DTYPE, " head_dim ", HEAD_DIM); \
  }()

bool supports(const std::string& dtype, int64_t head_dim) {
  const bool dim_ok = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 80 ||
                      head_dim == 96 || head_dim == 128 || head_dim == 256;
  return dim_ok && (dtype == "float32" || dtype == "bfloat16");
}

// Whether extend runs its products on the matrix units (extend_brgemm) for
// this dtype and head_dim (bench/prefill_bench.py times it beside the torch
// path's extend where it does).
bool extend_on_matrix_units(const std::string& dtype, int64_t head_dim) {
  return dtype == "bfloat16" && supports(dtype, head_dim) && head_dim % 32 == 0 &&
         at::native::cpublas::could_pack(at::kBFloat16);
}

// Splits of each row's keys: enough work items for every thread (4 per
// thread), none shorter than 64 keys. A lone short row (one user, a few
// hundred tokens) is otherwise one item: one thread does the layer's
// attention while the other waits. Measured (whole decode step, the native
// decoder, one process, alternated, 2026-12-02), at least 256 / 128 / 64
// keys a split: 1 row x 128: 13.21 / 13.17 / 12.77 ms; x 256: 13.82 / 12.99 /
// 12.81; x 384: 14.40 / 13.53 / 13.41; x 512: 13.89 / 13.65 / 13.94; 4 x 256
// and 32 x 256 within 0.2%.
constexpr int64_t kMinSplitKeys = 64;
int64_t choose_splits(int64_t rows, int64_t max_len) {
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  while (rows * splits < 4 * threads && max_len / (splits * 2) >= kMinSplitKeys) splits *= 2;
  return splits;
}

// The KV store, fused ahead of the attention that reads it: the new tokens'
// K/V rows (all KV heads of a token: one contiguous copy each) into their
// slots loc. What KVPool.store does with two index_copy_ calls, minus two
// op dispatches per layer.
// What either store checks: loc contiguous int64 slots inside the pool; the
// new K/V [tokens, kv_heads, D] of one dtype (the pool's, unless the pool
// rounds them: int8), each token's heads contiguous. Returns loc's data.
const int64_t* checked_store_args(const at::Tensor& k_buf, const at::Tensor& k_new, const at::Tensor& v_new,
                                  const at::Tensor& loc, bool pool_dtype) {
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.is_contiguous(), "loc must be contiguous int64");
  const auto dtype = pool_dtype ? k_buf.scalar_type() : k_new.scalar_type();
  for (const at::Tensor* t : {&k_new, &v_new}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 3 && t->size(0) == loc.size(0) &&
                t->size(1) == k_buf.size(1) && t->size(2) == k_buf.size(2), "new K/V must be [tokens, kv_heads, D]");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "new K/V need contiguous heads");
  }
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < loc.size(0); ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] < k_buf.size(0), "slot ", lp[i], " out of the pool");
  return lp;
}

void store_kv(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& k_new, const at::Tensor& v_new,
              const at::Tensor& loc) {
  const int64_t* lp = checked_store_args(k_buf, k_new, v_new, loc, true);
  const int64_t n = loc.size(0);
  const int64_t row = k_buf.stride(0) * k_buf.element_size();
  const int64_t ks = k_new.stride(0) * k_new.element_size(), vs = v_new.stride(0) * v_new.element_size();
  char* kb = static_cast<char*>(k_buf.data_ptr());
  char* vb = static_cast<char*>(v_buf.data_ptr());
  const char* kn = static_cast<const char*>(k_new.data_ptr());
  const char* vn = static_cast<const char*>(v_new.data_ptr());
  const int64_t bytes = k_buf.size(1) * k_buf.size(2) * k_buf.element_size();
#pragma omp parallel for num_threads(threads_for(n / 256 + 1))
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(kb + lp[i] * row, kn + i * ks, bytes);
    std::memcpy(vb + lp[i] * row, vn + i * vs, bytes);
  }
}

// The int8 cache's store: each new token's K (and V) head rounded to int8
// with a scale of its own, max |x| / 127 (x / scale rounded half to even;
// 0 for an all-zero row), as KVPool.store rounds it in torch: the same bits.
template <typename T>
void store_kv_int8_rows(const at::Tensor& buf, const at::Tensor& scales, const at::Tensor& x_new,
                        const int64_t* lp, int64_t n) {
  const int64_t heads = buf.size(1), d = buf.size(2), row = buf.stride(0), xs = x_new.stride(0);
  int8_t* b = buf.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  const T* x = x_new.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(n / 64 + 1))
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = x + i * xs + h * d;
      float amax = 0.0f;
      for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(static_cast<float>(src[j])));
      const float s = amax / 127.0f;
      int8_t* dst = b + lp[i] * row + h * d;
      for (int64_t j = 0; j < d; ++j)
        dst[j] = s > 0.0f ? static_cast<int8_t>(std::max(-127.0f, std::min(127.0f,
                                                std::nearbyint(static_cast<float>(src[j]) / s)))) : 0;
      sc[lp[i] * heads + h] = s;
    }
}

void store_kv_int8(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& k_scale,
                   const at::Tensor& v_scale, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& loc) {
  const int64_t* lp = checked_store_args(k_buf, k_new, v_new, loc, false);
  const int64_t n = loc.size(0);
  if (k_new.scalar_type() == at::kFloat) {
    store_kv_int8_rows<float>(k_buf, k_scale, k_new, lp, n);
    store_kv_int8_rows<float>(v_buf, v_scale, v_new, lp, n);
  } else {
    TORCH_CHECK(k_new.scalar_type() == at::kBFloat16, "new K/V must be float32 or bfloat16");
    store_kv_int8_rows<c10::BFloat16>(k_buf, k_scale, k_new, lp, n);
    store_kv_int8_rows<c10::BFloat16>(v_buf, v_scale, v_new, lp, n);
  }
}

template <typename T, int D>
void decode_impl_int8(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& kv_indptr, const at::Tensor& kv_indices, double scale, int64_t splits,
                      const float* k_scale, const float* v_scale) {
  decode_impl<T, D, int8_t>(out, q, k_buf, v_buf, kv_indptr, kv_indices, scale, splits, k_scale, v_scale);
}

// decode over an int8 cache (KVPool with --kv-cache-dtype int8): q and out
// float32 or bfloat16; k_buf, v_buf int8 [slots, kv_heads, D]; k_scale,
// v_scale float32 [slots, kv_heads].
at::Tensor decode_int8(at::Tensor out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& kv_indptr,
                       const at::Tensor& kv_indices, double scale, int64_t max_len, const at::Tensor& k_new,
                       const at::Tensor& v_new, const at::Tensor& loc) {
  TORCH_CHECK(q.device().is_cpu(), "native attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "q and out must be [tokens, q_heads, head_dim] of one dtype");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes() && k_buf.scalar_type() == at::kChar &&
              v_buf.scalar_type() == at::kChar, "k_buf, v_buf must be int8 [slots, kv_heads, head_dim]");
  for (const at::Tensor* t : {&k_scale, &v_scale})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == k_buf.size(0) &&
                t->size(1) == k_buf.size(1) && t->is_contiguous(), "scales must be float32 [slots, kv_heads]");
  TORCH_CHECK(q.size(2) == k_buf.size(2), "head_dim differs between q and the pool");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "q_heads must be a multiple of kv_heads");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2) && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q and out need contiguous heads");
  for (const at::Tensor* t : {&k_buf, &v_buf}) TORCH_CHECK(t->is_contiguous(), "the pool must be contiguous");
  store_kv_int8(k_buf, v_buf, k_scale, v_scale, k_new, v_new, loc);
  TORCH_CHECK(kv_indptr.scalar_type() == at::kLong && kv_indices.scalar_type() == at::kLong &&
              kv_indptr.is_contiguous() && kv_indices.is_contiguous(), "indices must be contiguous int64");
  TORCH_CHECK(kv_indptr.size(0) == q.size(0) + 1, "kv_indptr must have rows + 1 entries");
  const int64_t splits = choose_splits(q.size(0), max_len);
  BS_DISPATCH(q.scalar_type(), q.size(2), decode_impl_int8, out, q, k_buf, v_buf, kv_indptr, kv_indices, scale,
              splits, k_scale.data_ptr<float>(), v_scale.data_ptr<float>());
  return out;
}

at::Tensor decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& kv_indptr, const at::Tensor& kv_indices, double scale, int64_t max_len,
                  const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& loc) {
  check(out, q, k_buf, v_buf);
  store_kv(k_buf, v_buf, k_new, v_new, loc);
  TORCH_CHECK(kv_indptr.scalar_type() == at::kLong && kv_indices.scalar_type() == at::kLong &&
              kv_indptr.is_contiguous() && kv_indices.is_contiguous(), "indices must be contiguous int64");
  TORCH_CHECK(kv_indptr.size(0) == q.size(0) + 1, "kv_indptr must have rows + 1 entries");
  const int64_t splits = choose_splits(q.size(0), max_len);
  BS_DISPATCH(q.scalar_type(), q.size(2), decode_impl, out, q, k_buf, v_buf, kv_indptr, kv_indices, scale, splits);
  return out;
}

at::Tensor extend(at::Tensor out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                  double scale, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& loc) {
  check(out, q, k_buf, v_buf);
  store_kv(k_buf, v_buf, k_new, v_new, loc);
  for (const at::Tensor* t : {&qo_indptr, &kv_indptr, &kv_indices})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
  TORCH_CHECK(qo_indptr.size(0) == kv_indptr.size(0), "qo_indptr and kv_indptr must have rows + 1 entries");
  BS_DISPATCH(q.scalar_type(), q.size(2), extend_dispatch, out, q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("decode", &decode, "store the new K/V into their slots (loc), then decode attention over the paged pool",
        py::arg("out"), py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("kv_indptr"),
        py::arg("kv_indices"), py::arg("scale"), py::arg("max_len"), py::arg("k_new"), py::arg("v_new"),
        py::arg("loc"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_int8", &decode_int8, "decode over an int8 pool: store the new K/V rounded to int8 with a scale "
        "per token and head, then decode attention",
        py::arg("out"), py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("scale"), py::arg("max_len"), py::arg("k_new"),
        py::arg("v_new"), py::arg("loc"), py::call_guard<py::gil_scoped_release>());
  m.def("extend", &extend, "store the new K/V, then extend attention: new tokens over their cached prefix "
        "and, causally, themselves",
        py::arg("out"), py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("qo_indptr"),
        py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("scale"), py::arg("k_new"), py::arg("v_new"),
        py::arg("loc"), py::call_guard<py::gil_scoped_release>());
  // decode's and extend's addresses, for the layers module's decoder loop (layers.cpp
  // DecoderStack) to call without a round trip through Python: both modules
  // link the same libtorch, so the tensors pass as they are
  m.attr("decode_fn") = py::capsule(reinterpret_cast<void*>(&decode), "batchserve.attention.decode");
  m.attr("extend_fn") = py::capsule(reinterpret_cast<void*>(&extend), "batchserve.attention.extend");
  m.def("supports", &supports, "whether a kernel exists for this dtype name and head_dim");
  m.def("choose_splits", &choose_splits, "KV splits a decode step uses");
  m.def("extend_on_matrix_units", &extend_on_matrix_units,
        "whether extend runs its products on the matrix units (brgemm) for this dtype name and head_dim");
#ifdef BS_AVX512
  m.attr("simd") = "avx512";
#elif defined(BS_AVX2)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "scalar";
#endif
}
