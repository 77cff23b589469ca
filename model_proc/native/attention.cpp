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
//   multiple of 32, where torch's brgemm can run: AMX or AVX512_BF16) does
//   the two products of a block as brgemm calls; otherwise float32 SIMD.
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
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------- 16 floats
#ifdef BS_AVX512
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 bcast(float x) { return {_mm512_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 load(const c10::BFloat16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  V16 operator*(V16 o) const { return {_mm512_mul_ps(v, o.v)}; }
  V16 operator-(V16 o) const { return {_mm512_sub_ps(v, o.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  // lanes >= n set to x (all of them for n <= 0)
  V16 fill_from(int n, float x) const {
    __mmask16 keep = n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
    return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(x), v)};
  }
  // e^x, relative error ~1e-7; inputs below -87 give ~0 (the caller masks
  // lanes that must be exactly 0)
  V16 exp() const {
    __m512 x = _mm512_max_ps(v, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]; 2^f by its Taylor series in f ln 2
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return {_mm512_scalef_ps(p, n)};
  }
};
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
// every cache line of one head's row (D elements)
template <typename T, int D> inline void prefetch_row(const T* p) {
  for (int i = 0; i < static_cast<int>(D * sizeof(T)); i += 64) prefetch(reinterpret_cast<const char*>(p) + i);
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
  float sum() const { float s = 0; for (int i = 0; i < 16; ++i) s += v[i]; return s; }
  float max() const { float s = v[0]; for (int i = 1; i < 16; ++i) s = std::max(s, v[i]); return s; }
  V16 fill_from(int n, float x) const { V16 r = *this; for (int i = std::max(n, 0); i < 16; ++i) r.v[i] = x; return r; }
  V16 exp() const { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::exp(std::max(v[i], -87.0f)); return r; }
};
inline void prefetch(const void* p) { __builtin_prefetch(p); }
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

template <typename T, int D>
inline void scores16(const float* qf, const T* qraw, float scale, const T* const* krow, float* s) {
  constexpr int C = D / 16;
#ifdef BS_AVX512
  __m512 a[16];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0) {
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
// prefetching only the first line of each row, same measurement).
template <typename T, int D>
void decode_part(const float* q, const T* qraw, float scale, int heads, int group, const T* k_buf, const T* v_buf,
                 int64_t slot_stride, const int64_t* slots, int64_t k0, int64_t k1, float* acc, float* m, float* l,
                 float* scratch) {
  constexpr int C = D / 16;
  const int nq = heads * group;
  const int row_bytes = static_cast<int>(heads * D * sizeof(T));
  auto prefetch_slot = [&](int64_t slot) {
    const char* kr = reinterpret_cast<const char*>(k_buf + slot * slot_stride);
    const char* vr = reinterpret_cast<const char*>(v_buf + slot * slot_stride);
    for (int i = 0; i < row_bytes; i += 64) { prefetch(kr + i); prefetch(vr + i); }
  };
  for (int i = 0; i < nq; ++i) { m[i] = kNegInf; l[i] = 0.0f; }
  std::fill(acc, acc + nq * D, 0.0f);
  // per query head: the block's scores, then its probabilities, and alpha
  float (*s)[kDecodeBlock] = reinterpret_cast<float (*)[kDecodeBlock]>(scratch);
  float (*p)[kDecodeBlock] = s + nq;
  float* alpha = scratch + 2 * nq * kDecodeBlock;
  alignas(64) float vb[kDecodeBlock * D];
  for (int64_t t = k0; t < std::min(k1, k0 + kDecodeBlock); ++t) prefetch_slot(slots[t]);
  for (int64_t t0 = k0; t0 < k1; t0 += kDecodeBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kDecodeBlock, k1 - t0));
    // the block's slot rows (a short last block repeats its first row; those
    // scores are never used)
    const T* krow[kDecodeBlock];
    const T* vrow0[kDecodeBlock];
    for (int t = 0; t < kDecodeBlock; ++t) {
      krow[t] = k_buf + slots[t0 + (t < n ? t : 0)] * slot_stride;
      vrow0[t] = v_buf + slots[t0 + (t < n ? t : 0)] * slot_stride;
      if (t0 + kDecodeBlock + t < k1) prefetch_slot(slots[t0 + kDecodeBlock + t]);
    }
    for (int h = 0; h < heads; ++h) {
      const T* kh[kDecodeBlock];
      for (int t = 0; t < kDecodeBlock; ++t) kh[t] = krow[t] + h * D;
      for (int t = 0; t < n; t += 16)
        for (int g = 0; g < group; ++g) {
          const int i = h * group + g;
          scores16<T, D>(q + i * D, qraw + i * D, scale, kh + t, &s[i][t]);
        }
      for (int g = 0; g < group; ++g) {
        const int i = h * group + g;
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
      }
      // the block's V rows of head h as float32: the pool's own (float32) or
      // converted once into vb for the group (bfloat16)
      const float* vrow[kDecodeBlock];
      for (int t = 0; t < n; ++t) {
        const T* vr = vrow0[t] + h * D;
        if constexpr (std::is_same_v<T, float>) {
          vrow[t] = vr;
        } else {
          for (int c = 0; c < C; ++c) V16::load(vr + 16 * c).store(vb + t * D + 16 * c);
          vrow[t] = vb + t * D;
        }
      }
      for (int g = 0; g < group; ++g) {
        const int i = h * group + g;
        float* a = acc + i * D;
        V16 av[C];
        const V16 al = V16::bcast(alpha[i]);
        for (int c = 0; c < C; ++c) av[c] = V16::load(a + 16 * c) * al;
        for (int t = 0; t < n; ++t) {
          const V16 pt = V16::bcast(p[i][t]);
          for (int c = 0; c < C; ++c) av[c] = V16::fma(pt, V16::load(vrow[t] + 16 * c), av[c]);
        }
        for (int c = 0; c < C; ++c) av[c].store(a + 16 * c);
      }
    }
  }
}

template <typename T, int D>
void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                 const at::Tensor& kv_indptr, const at::Tensor& kv_indices, double scale, int64_t splits) {
  const int64_t rows = q.size(0), q_heads = q.size(1), kv_heads = k_buf.size(1);
  const int group = static_cast<int>(q_heads / kv_heads);
  const int64_t slot_stride = k_buf.stride(0);
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_buf.data_ptr<T>();
  const T* vp = v_buf.data_ptr<T>();
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
#pragma omp parallel num_threads(threads_for(items))
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
      decode_part<T, D>(qf.data(), qr, sc, static_cast<int>(kv_heads), group, kp, vp, slot_stride,
                        indices + indptr[b], k0, k1, acc.data(), m.data(), l.data(), scratch.data());
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
  const int64_t rows = qo_indptr.size(0) - 1, q_heads = q.size(1), kv_heads = k_buf.size(1);
  const int group = static_cast<int>(q_heads / kv_heads);
  const int64_t slot_stride = k_buf.stride(0);
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_buf.data_ptr<T>();
  const T* vp = v_buf.data_ptr<T>();
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

// bfloat16 extend on the CPU's matrix units: the same tiles and online
// softmax, but the two products of each key block, scores = Q K^T and
// acc += P V, are small GEMMs through torch's brgemm (oneDNN ukernels: AMX
// tiles or AVX512_BF16), bfloat16 in, float32 out. K and V of the block are
// packed in place from their slots into the VNNI layout it takes (pairs
// along the reduced dimension: K as [D/2][keys][2], V as [keys/2][D][2]);
// P goes in as bfloat16, as in SGLang's CPU extend.
constexpr int kTileQB = 64;   // new tokens per work item
constexpr int kKeyBlockB = 64;

template <int D>
void extend_brgemm(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                   const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                   double scale) {
  using T = c10::BFloat16;
  constexpr int BK = kKeyBlockB;
  const int64_t rows = qo_indptr.size(0) - 1, q_heads = q.size(1), kv_heads = k_buf.size(1);
  const int group = static_cast<int>(q_heads / kv_heads);
  const int64_t slot_stride = k_buf.stride(0);
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_buf.data_ptr<T>();
  const T* vp = v_buf.data_ptr<T>();
  const int64_t* qo = qo_indptr.data_ptr<int64_t>();
  const int64_t* kvp = kv_indptr.data_ptr<int64_t>();
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  std::vector<int64_t> tile_row, tile_first;
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t j = 0; j < qo[b + 1] - qo[b]; j += kTileQB) { tile_row.push_back(b); tile_first.push_back(j); }
  const int64_t tiles = static_cast<int64_t>(tile_row.size());
#pragma omp parallel num_threads(threads_for(tiles * kv_heads))
  {
    const int max_m = kTileQB * group;
    std::vector<T> qa(max_m * D), pb(max_m * BK);
    std::vector<float> acc(max_m * D), s(max_m * BK), m(max_m), l(max_m), alpha(max_m);
    alignas(64) uint32_t kpack[D / 2 * BK];  // bf16 pairs (d, d+1) of key t at [d / 2][t]
    alignas(64) T vpack[BK * D];             // bf16 pairs (t, t+1) of dim d at [t / 2][d][2]
    const uint32_t* kp32 = reinterpret_cast<const uint32_t*>(kp);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < tiles * kv_heads; ++it) {
      const int64_t tile = it / kv_heads, h = it % kv_heads, b = tile_row[tile];
      const int64_t n_new = qo[b + 1] - qo[b], n_kv = kvp[b + 1] - kvp[b], prefix = n_kv - n_new;
      const int64_t j0 = tile_first[tile], j1 = std::min(n_new, j0 + kTileQB);
      const int nq = static_cast<int>(j1 - j0), mq = nq * group;
      const int64_t* slots = indices + kvp[b];
      // rows m = j * group + g of A: the tile's queries of this KV head's group
      for (int j = 0; j < nq; ++j)
        std::memcpy(qa.data() + j * group * D, qp + (qo[b] + j0 + j) * q_stride + h * group * D,
                    sizeof(T) * group * D);
      std::fill(acc.begin(), acc.begin() + mq * D, 0.0f);
      std::fill(m.begin(), m.begin() + mq, kNegInf);
      std::fill(l.begin(), l.begin() + mq, 0.0f);
      const int64_t n_keys = prefix + j1;
      for (int64_t t0 = 0; t0 < n_keys; t0 += BK) {
        const int nb = static_cast<int>(std::min<int64_t>(BK, n_keys - t0));
        for (int t = 0; t < BK; ++t) {
          if (t < nb && t0 + BK + t < n_keys) {
            prefetch_row<T, D>(kp + slots[t0 + BK + t] * slot_stride + h * D);
            prefetch_row<T, D>(vp + slots[t0 + BK + t] * slot_stride + h * D);
          }
          // a short last block repeats its first key (masked below)
          const int64_t off = slots[t0 + (t < nb ? t : 0)] * slot_stride + h * D;
          const uint32_t* kr = kp32 + off / 2;
          for (int d2 = 0; d2 < D / 2; ++d2) kpack[d2 * BK + t] = kr[d2];
          const T* vr = vp + off;
          T* vdst = vpack + (t / 2) * D * 2 + (t % 2);
          for (int d = 0; d < D; ++d) vdst[2 * d] = vr[d];
        }
        at::native::cpublas::brgemm(mq, BK, D, D, BK, BK, false, qa.data(),
                                    reinterpret_cast<const T*>(kpack), s.data());
        for (int j = 0; j < nq; ++j) {
          const int nv = static_cast<int>(std::min<int64_t>(nb, prefix + j0 + j + 1 - t0));  // keys seen
          for (int g = 0; g < group; ++g) {
            const int mi = j * group + g;
            float* srow = s.data() + mi * BK;
            T* prow = pb.data() + mi * BK;
            if (nv <= 0) {  // none of this block: P row 0, acc unchanged
              alpha[mi] = 1.0f;
              std::fill(prow, prow + BK, T(0.0f));
              continue;
            }
            float bm = kNegInf;
            for (int t = 0; t < BK; t += 16) bm = std::max(bm, (V16::load(srow + t) * V16::bcast(sc)).fill_from(nv - t, kNegInf).max());
            const float mn = std::max(m[mi], bm);
            alpha[mi] = std::exp(m[mi] - mn);
            float sum = 0.0f;
            for (int t = 0; t < BK; t += 16) {
              V16 e = (V16::load(srow + t) * V16::bcast(sc) - V16::bcast(mn)).exp().fill_from(nv - t, 0.0f);
              e.store(srow + t);
              sum += e.sum();
            }
            // P rounded to bfloat16 for the product (l sums it in float32)
            for (int t = 0; t < BK; ++t) prow[t] = T(srow[t]);
            l[mi] = l[mi] * alpha[mi] + sum;
            m[mi] = mn;
            if (alpha[mi] != 1.0f) {
              float* a = acc.data() + mi * D;
              for (int c = 0; c < D / 16; ++c) (V16::load(a + 16 * c) * V16::bcast(alpha[mi])).store(a + 16 * c);
            }
          }
        }
        at::native::cpublas::brgemm(mq, D, BK, BK, D, D, true, pb.data(), vpack, acc.data());
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

// Splits of each row's keys: enough work items for every thread (4 per
// thread), none shorter than 256 keys.
int64_t choose_splits(int64_t rows, int64_t max_len) {
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  while (rows * splits < 4 * threads && max_len / (splits * 2) >= 256) splits *= 2;
  return splits;
}

// The KV store, fused ahead of the attention that reads it: the new tokens'
// K/V rows (all KV heads of a token: one contiguous copy each) into their
// slots loc. What KVPool.store does with two index_copy_ calls, minus two
// op dispatches per layer.
void store_kv(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& k_new, const at::Tensor& v_new,
              const at::Tensor& loc) {
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.is_contiguous(), "loc must be contiguous int64");
  for (const at::Tensor* t : {&k_new, &v_new}) {
    TORCH_CHECK(t->scalar_type() == k_buf.scalar_type() && t->dim() == 3 && t->size(0) == loc.size(0) &&
                t->size(1) == k_buf.size(1) && t->size(2) == k_buf.size(2), "new K/V must be [tokens, kv_heads, D]");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "new K/V need contiguous heads");
  }
  const int64_t n = loc.size(0), slots = k_buf.size(0);
  const int64_t row = k_buf.stride(0) * k_buf.element_size();
  const int64_t ks = k_new.stride(0) * k_new.element_size(), vs = v_new.stride(0) * v_new.element_size();
  const int64_t* lp = loc.data_ptr<int64_t>();
  char* kb = static_cast<char*>(k_buf.data_ptr());
  char* vb = static_cast<char*>(v_buf.data_ptr());
  const char* kn = static_cast<const char*>(k_new.data_ptr());
  const char* vn = static_cast<const char*>(v_new.data_ptr());
  const int64_t bytes = k_buf.size(1) * k_buf.size(2) * k_buf.element_size();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(lp[i] >= 0 && lp[i] < slots, "slot ", lp[i], " out of the pool");
#pragma omp parallel for num_threads(threads_for(n / 256 + 1))
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(kb + lp[i] * row, kn + i * ks, bytes);
    std::memcpy(vb + lp[i] * row, vn + i * vs, bytes);
  }
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
  m.def("extend", &extend, "store the new K/V, then extend attention: new tokens over their cached prefix "
        "and, causally, themselves",
        py::arg("out"), py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("qo_indptr"),
        py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("scale"), py::arg("k_new"), py::arg("v_new"),
        py::arg("loc"), py::call_guard<py::gil_scoped_release>());
  m.def("supports", &supports, "whether a kernel exists for this dtype name and head_dim");
  m.def("choose_splits", &choose_splits, "KV splits a decode step uses");
#ifdef BS_AVX512
  m.attr("simd") = "avx512";
#else
  m.attr("simd") = "scalar";
#endif
}
