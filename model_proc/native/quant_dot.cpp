// Linear layers on GGUF-quantized weights with 8-bit activations: x's rows are
// quantized once to int8 blocks of 32 (a float scale each), and each weight
// block is dotted with them in integers, as llama.cpp's CPU matmuls do (its
// Q8_0 / Q8_1 activations). quant.cpp's `gemv` keeps x in float32 and spends
// ~16 instructions per 32 weights and x row dequantizing; here an x row costs
// per 32 weights one unsigned-by-signed byte multiply-add (vpmaddubsw), one
// widening pair add (vpmaddwd) and a share of a reduction, and a weight row
// is unpacked to bytes once for all x rows. The result is not the float32
// product: x is rounded to 8 bits (relative error ~1/254 of each block's
// largest |x| per value, model_proc/quant/int8_act.py states the bound).
//
// Activations (`quantize_rows`, x float32 [M, K], K a multiple of 32), each
// row padded with zeros to Kp = K rounded up to 256 (one group of 8 blocks,
// a K-quant's super-block), so the kernels never take a tail:
//   q    int8    [M, Kp]       q = nearbyint(x / d) (ties to even), |q| <= 127
//   d    float32 [M, Kp / 32]  d = max |x| / 127 over the block (0: all zero)
//   s    float32 [M, Kp / 32]  d * sum(q) over the block (Q8_1's s)
//   bsum int16   [M, Kp / 16]  sum(q) over each half block of 16
//
// Weights: GGUF blocks as stored, uint8 [N, row_bytes] (rows may be strided,
// a row's bytes contiguous), of Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12),
// Q6_K (14). Each weight row is unpacked into a per-thread buffer (L1): its
// codes as bytes in x's order (unsigned: Q4's nibbles, Q6_K's 6 bits; Q8_0
// signed, with their magnitudes beside, for the sign trick), int16 scales per
// 16 codes (K-quants: multiplied in during the pair add), the integer bias
// per 16 (Q4_0's 8, Q6_K's 32 times its scale: subtracted through bsum), and
// per block of 32 the float factor f of d_x and g of s.
//
// What `gemv_q8` computes, the same in both paths (canonical order):
//   per x row and group of 8 blocks (lane j = block 8 g + j):
//     i_j  = sum_h sc_h (codes_h . q_h) - sum_h bias_h bsum_h   (int32, exact)
//     acc_j = fma(f_j * d_j, float(i_j), acc_j)   (f_j * d_j rounded first)
//     acc_j = fma(g_j, s_j, acc_j)                 (types with an offset)
//   y = ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) + (acc_3 + acc_7))
// with, per type (d, m, dmin, sc, mn as gguf-py reads them; codes unsigned):
//   Q4_0: codes . q - 8 sum q, f = d;         Q4_1: codes . q, f = d, g = m
//   Q8_0: codes . q (signed), f = d;          Q4_K: sc_j (codes . q), f = d, g = -(dmin * mn_j)
//   Q6_K: sum of the two halves' sc_h (codes_h . q_h - 32 sum q_h), f = d
// The integer sums cannot overflow or saturate for |q| <= 127 (vpmaddubsw's
// pairs: Q8_0 2 * 128 * 127 = 32512 < 32767). So the AVX2 path and the scalar
// one (compiled everywhere, selectable by set_simd(False)) agree bit for bit;
// this file is built with -ffp-contract=off so that the scalar path's
// multiplies and adds are not fused where the AVX2 one does not fuse them.
//
// Threads take contiguous ranges of weight rows (at::parallel_for); each
// weight row is read from memory once, unpacked, and used for every x row
// while it is in L1.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BS_QDOT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;   // activation values per scale
constexpr int64_t kGroup = 256;  // 8 blocks: a lane each in the accumulators; the padding unit
constexpr int kMaxQ = 127;

bool simd_enabled = true;

bool use_simd() {
#ifdef BS_QDOT_AVX2
  return simd_enabled;
#else
  return false;
#endif
}

inline int64_t padded(int64_t k) { return (k + kGroup - 1) / kGroup * kGroup; }

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef BS_QDOT_AVX2
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// ---------------------------------------------------------------- activations

// One row: x[0, K) -> q, d, s, bsum over Kp (zeros past K).
void quantize_row_scalar(const float* x, int64_t K, int64_t Kp, int8_t* q, float* d, float* s, int16_t* bs) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / static_cast<float>(kMaxQ);
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int sum[2] = {0, 0};
    for (int i = 0; i < kBlock; ++i) {
      float v = std::nearbyint(xb[i] * id);
      v = std::min(std::max(v, -static_cast<float>(kMaxQ)), static_cast<float>(kMaxQ));
      const int qi = static_cast<int>(v);
      q[b * kBlock + i] = static_cast<int8_t>(qi);
      sum[i / 16] += qi;
    }
    d[b] = db;
    s[b] = db * static_cast<float>(sum[0] + sum[1]);
    bs[2 * b] = static_cast<int16_t>(sum[0]);
    bs[2 * b + 1] = static_cast<int16_t>(sum[1]);
  }
  std::memset(q + K, 0, Kp - K);
  for (int64_t b = K / kBlock; b < Kp / kBlock; ++b) d[b] = s[b] = 0.0f, bs[2 * b] = bs[2 * b + 1] = 0;
}

#ifdef BS_QDOT_AVX2
inline int hsum_i32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

void quantize_row_simd(const float* x, int64_t K, int64_t Kp, int8_t* q, float* d, float* s, int16_t* bs) {
  const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(static_cast<float>(kMaxQ));
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);  // max is exact in any order
    const float db = amax / static_cast<float>(kMaxQ);
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(_mm256_max_ps(r, _mm256_xor_ps(lim, sign)), lim);
      qi[i] = _mm256_cvtps_epi32(r);
    }
    const int s0 = hsum_i32(_mm256_add_epi32(qi[0], qi[1])), s1 = hsum_i32(_mm256_add_epi32(qi[2], qi[3]));
    // int32 -> int8 in order: packs interleave 128-bit lanes, a permute restores them
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    d[b] = db;
    s[b] = db * static_cast<float>(s0 + s1);
    bs[2 * b] = static_cast<int16_t>(s0);
    bs[2 * b + 1] = static_cast<int16_t>(s1);
  }
  std::memset(q + K, 0, Kp - K);
  for (int64_t b = K / kBlock; b < Kp / kBlock; ++b) d[b] = s[b] = 0.0f, bs[2 * b] = bs[2 * b + 1] = 0;
}
#endif

// ---------------------------------------------------------------- weights

// A weight row unpacked for the dot products (one per thread, reused row after row).
struct RowBuf {
  std::vector<uint8_t> codes;    // [Kp]: codes in x's order (Q8_0: int8)
  std::vector<uint8_t> mag;      // [Kp]: Q8_0's |codes|
  std::vector<int16_t> sc;       // [Kp / 2]: K-quants' scales, 16 per block of 32 (8 each half's)
  std::vector<int16_t> bias;     // [Kp / 16]: integer bias per 16 codes (times the scale)
  std::vector<float> f, g;       // [Kp / 32]: factor of d_x, of s_x
  explicit RowBuf(int64_t Kp)
      : codes(Kp), mag(Kp), sc(Kp / 2), bias(Kp / 16), f(Kp / kBlock), g(Kp / kBlock) {}
};

// Each type: block shape; kSigned (Q8_0: signed codes, sign trick); kScaled
// (int16 scales per 16 in sc); kBias (bias per 16 in bias); kOffset (g);
// unpack(): block -> its codes (kQK bytes), sc, bias, f, g; unpack_simd():
// the same codes with AVX2 (the floats and scales are the scalar ones).
struct Q4_0 {
  static constexpr int64_t kType = 2, kQK = 32, kBytes = 18;
  static constexpr bool kSigned = false, kScaled = false, kBias = true, kOffset = false;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t*, int16_t* bias, float* f, float*) {
    for (int i = 0; i < 16; ++i) c[i] = b[2 + i] & 15, c[i + 16] = b[2 + i] >> 4;
    bias[0] = bias[1] = 8;
    f[0] = f16(b);
  }
#ifdef BS_QDOT_AVX2
  static void unpack_simd(const uint8_t* b, uint8_t* c) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), lo4 = _mm_set1_epi8(15);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm_and_si128(v, lo4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16), _mm_and_si128(_mm_srli_epi16(v, 4), lo4));
  }
#endif
};

struct Q4_1 {
  static constexpr int64_t kType = 3, kQK = 32, kBytes = 20;
  static constexpr bool kSigned = false, kScaled = false, kBias = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t*, int16_t*, float* f, float* g) {
    for (int i = 0; i < 16; ++i) c[i] = b[4 + i] & 15, c[i + 16] = b[4 + i] >> 4;
    f[0] = f16(b);
    g[0] = f16(b + 2);
  }
#ifdef BS_QDOT_AVX2
  static void unpack_simd(const uint8_t* b, uint8_t* c) { Q4_0::unpack_simd(b + 2, c); }
#endif
};

struct Q8_0 {
  static constexpr int64_t kType = 8, kQK = 32, kBytes = 34;
  static constexpr bool kSigned = true, kScaled = false, kBias = false, kOffset = false;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t*, int16_t*, float* f, float*) {
    std::memcpy(c, b + 2, 32);
    f[0] = f16(b);
  }
#ifdef BS_QDOT_AVX2
  static void unpack_simd(const uint8_t* b, uint8_t* c) { std::memcpy(c, b + 2, 32); }
#endif
};

// The K-quants' eight 6-bit scales and mins from their 12 packed bytes (as quant.cpp)
inline void k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q4_K: 256 weights; fp16 d, dmin; 12 bytes of scales/mins; 128 of nibbles:
// sub-block j is the low (j even) or high nibbles of bytes [32 (j / 2), +32).
struct Q4_K {
  static constexpr int64_t kType = 12, kQK = 256, kBytes = 144;
  static constexpr bool kSigned = false, kScaled = true, kBias = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t* sc16, int16_t*, float* f, float* g) {
    const float d = f16(b), dmin = f16(b + 2);
    uint8_t sc[8], mn[8];
    k4_scales(b + 4, sc, mn);
    for (int j = 0; j < 8; ++j) {
      for (int i = 0; i < 32; ++i) c[32 * j + i] = (b[16 + 32 * (j / 2) + i] >> (4 * (j & 1))) & 15;
      for (int i = 0; i < 16; ++i) sc16[16 * j + i] = sc[j];
      f[j] = d;
      g[j] = -(dmin * static_cast<float>(mn[j]));
    }
  }
#ifdef BS_QDOT_AVX2
  static void unpack_simd(const uint8_t* b, uint8_t* c) {
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * p));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * p), _mm256_and_si256(v, lo4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * p + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4));
    }
  }
#endif
};

// Q6_K: 256 weights; 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8
// scales (one per 16), fp16 d last. Block of 32 number c = 4 h + s takes the
// low (s < 2) or high nibbles of ql[64 h + 32 (s & 1) ...] and bits 2 s.. of
// qh[32 h ...]; the weight is d sc (code - 32).
struct Q6_K {
  static constexpr int64_t kType = 14, kQK = 256, kBytes = 210;
  static constexpr bool kSigned = false, kScaled = true, kBias = true, kOffset = false;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t* sc16, int16_t* bias, float* f, float*) {
    const float d = f16(b + 208);
    for (int cc = 0; cc < 8; ++cc) {
      const int h = cc / 4, s = cc % 4;
      for (int i = 0; i < 32; ++i)
        c[32 * cc + i] = ((b[64 * h + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15) |
                         (((b[128 + 32 * h + i] >> (2 * s)) & 3) << 4);
      f[cc] = d;
    }
    for (int i = 0; i < 16; ++i) {
      const int sc = static_cast<int8_t>(b[192 + i]);
      for (int r = 0; r < 8; ++r) sc16[8 * i + r] = static_cast<int16_t>(sc);
      bias[i] = static_cast<int16_t>(32 * sc);
    }
  }
#ifdef BS_QDOT_AVX2
  static void unpack_simd(const uint8_t* b, uint8_t* c) {
    const __m256i lo4 = _mm256_set1_epi8(15), hi2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i out[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), hi2)),
          _mm256_or_si256(_mm256_and_si256(l1, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), hi2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4), _mm256_and_si256(qh, hi2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4),
                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), hi2))};
      for (int s = 0; s < 4; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 128 * h + 32 * s), out[s]);
    }
  }
#endif
};

// Weight row w (blocks_per_row blocks) into buf; the padding past K stays as
// the buffer was made (zeros: no row writes there).
template <class T>
void unpack_row(const uint8_t* w, int64_t blocks_per_row, RowBuf& buf, bool simd) {
  constexpr int64_t kBlocks32 = T::kQK / kBlock;
  for (int64_t blk = 0; blk < blocks_per_row; ++blk) {
    const uint8_t* b = w + blk * T::kBytes;
    uint8_t* c = buf.codes.data() + blk * T::kQK;
    T::unpack(b, c, buf.sc.data() + blk * T::kQK / 2, buf.bias.data() + blk * T::kQK / 16,
              buf.f.data() + blk * kBlocks32, buf.g.data() + blk * kBlocks32);
    (void)simd;
  }
}

#ifdef BS_QDOT_AVX2
// The floats and scales as unpack() makes them, the codes by unpack_simd()
// (g++ turns the scalar nibble loops into byte-at-a-time code).
template <class T>
void unpack_row_simd(const uint8_t* w, int64_t blocks_per_row, RowBuf& buf) {
  constexpr int64_t kBlocks32 = T::kQK / kBlock;
  for (int64_t blk = 0; blk < blocks_per_row; ++blk) {
    const uint8_t* b = w + blk * T::kBytes;
    uint8_t* c = buf.codes.data() + blk * T::kQK;
    T::unpack_simd(b, c);
    float* f = buf.f.data() + blk * kBlocks32;
    float* g = buf.g.data() + blk * kBlocks32;
    if constexpr (T::kType == Q4_0::kType || T::kType == Q8_0::kType) {
      f[0] = f16(b);
    } else if constexpr (T::kType == Q4_1::kType) {
      f[0] = f16(b);
      g[0] = f16(b + 2);
    } else if constexpr (T::kType == Q4_K::kType) {
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      k4_scales(b + 4, sc, mn);
      int16_t* sc16 = buf.sc.data() + blk * 128;
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc16 + 16 * j), _mm256_set1_epi16(sc[j]));
        f[j] = d;
        g[j] = -(dmin * static_cast<float>(mn[j]));
      }
    } else {  // Q6_K
      const float d = f16(b + 208);
      for (int j = 0; j < 8; ++j) f[j] = d;
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.bias.data() + blk * 16), _mm256_slli_epi16(sc, 5));
      // each scale 8 times: int16 i of block c's 16 is scale 2 c + i / 8
      int16_t* sc16 = buf.sc.data() + blk * 128;
      alignas(32) int16_t all[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(all), sc);
      for (int i = 0; i < 16; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(sc16 + 8 * i), _mm_set1_epi16(all[i]));
    }
  }
  if constexpr (T::kSigned) {
    const int64_t K = blocks_per_row * T::kQK;
    for (int64_t i = 0; i < K; i += 32) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.codes.data() + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.mag.data() + i), _mm256_abs_epi8(v));
    }
  }
  if constexpr (T::kType == Q4_0::kType) {  // the constant bias, per 16
    for (int64_t i = 0; i < blocks_per_row * 2; ++i) buf.bias[i] = 8;
  }
}
#endif

// ---------------------------------------------------------------- dot products

// The canonical final sum of 8 lanes (as the AVX2 hsum does it)
inline float hsum8(const float a[8]) {
  const float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

template <class T>
float dot_scalar(const RowBuf& buf, int64_t groups, const int8_t* q, const float* d, const float* s,
                 const int16_t* bs) {
  float acc[8] = {};
  for (int64_t gi = 0; gi < groups; ++gi) {
    for (int j = 0; j < 8; ++j) {
      const int64_t c = 8 * gi + j;  // block of 32
      int32_t isum = 0;
      for (int h = 0; h < 2; ++h) {
        const int64_t o = 32 * c + 16 * h;
        int32_t part = 0;
        for (int i = 0; i < 16; ++i) {
          const int32_t wc = T::kSigned ? static_cast<int8_t>(buf.codes[o + i]) : buf.codes[o + i];
          part += wc * q[o + i];
        }
        isum += (T::kScaled ? buf.sc[16 * c + 8 * h] : 1) * part;
        if constexpr (T::kBias) isum -= buf.bias[2 * c + h] * bs[2 * c + h];
      }
      const float prod = buf.f[c] * d[c];
      acc[j] = std::fma(prod, static_cast<float>(isum), acc[j]);
      if constexpr (T::kOffset) acc[j] = std::fma(buf.g[c], s[c], acc[j]);
    }
  }
  return hsum8(acc);
}

#ifdef BS_QDOT_AVX2
inline float hsum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a_i + a_{i+4}
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));                                          // (t0 + t2), (t1 + t3)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 8 vectors of 8 int32 -> one: lane j = the sum of v[j]'s lanes
inline __m256i reduce8(const __m256i v[8]) {
  const __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i b = _mm256_hadd_epi32(a01, a23);  // [v0..v3 lanes 0-3 | v0..v3 lanes 4-7]
  const __m256i c = _mm256_hadd_epi32(a45, a67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(b, c, 0x21), _mm256_blend_epi32(b, c, 0xF0));
}

template <class T>
inline __m256i block_dot(const RowBuf& buf, int64_t c, const int8_t* q) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
  __m256i p;
  if constexpr (T::kSigned) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.codes.data() + 32 * c));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.mag.data() + 32 * c));
    p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(x, w));
  } else {
    p = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.codes.data() + 32 * c)), x);
  }
  // int16 lanes 0-7: the first 16 codes, 8-15: the second; pairs summed to int32 (times the scales)
  if constexpr (T::kScaled)
    return _mm256_madd_epi16(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.sc.data() + 16 * c)));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

template <class T>
float dot_simd(const RowBuf& buf, int64_t groups, const int8_t* q, const float* d, const float* s,
               const int16_t* bs) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = block_dot<T>(buf, 8 * gi + j, q);
    __m256i isum = reduce8(v);
    if constexpr (T::kBias) {
      const __m256i b16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.bias.data() + 16 * gi));
      const __m256i x16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 16 * gi));
      isum = _mm256_sub_epi32(isum, _mm256_madd_epi16(b16, x16));
    }
    const __m256 prod = _mm256_mul_ps(_mm256_loadu_ps(buf.f.data() + 8 * gi), _mm256_loadu_ps(d + 8 * gi));
    acc = _mm256_fmadd_ps(prod, _mm256_cvtepi32_ps(isum), acc);
    if constexpr (T::kOffset)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(buf.g.data() + 8 * gi), _mm256_loadu_ps(s + 8 * gi), acc);
  }
  return hsum(acc);
}
#endif

template <class F>
auto dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0::kType: return f(Q4_0{});
    case Q4_1::kType: return f(Q4_1{});
    case Q8_0::kType: return f(Q8_0{});
    case Q4_K::kType: return f(Q4_K{});
    case Q6_K::kType: return f(Q6_K{});
  }
  TORCH_CHECK_VALUE(false, "unsupported GGML type ", qtype,
                    " for 8-bit activations (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)");
}

// ---------------------------------------------------------------- ops

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                    "x must be a contiguous float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes(),
                    x.is_contiguous() ? "" : " (not contiguous)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(K > 0 && K % kBlock == 0, "x's K = ", K, " is not a positive multiple of ", kBlock);
  const int64_t Kp = padded(K);
  at::Tensor q = at::empty({M, Kp}, at::kChar), d = at::empty({M, Kp / kBlock}, at::kFloat);
  at::Tensor s = at::empty({M, Kp / kBlock}, at::kFloat), bs = at::empty({M, Kp / 16}, at::kShort);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *sp = s.data_ptr<float>();
  int16_t* bp = bs.data_ptr<int16_t>();
  const bool simd = use_simd();
  for (int64_t m = 0; m < M; ++m) {
    auto row = quantize_row_scalar;
#ifdef BS_QDOT_AVX2
    if (simd) row = quantize_row_simd;
#endif
    row(xp + m * K, K, Kp, qp + m * Kp, dp + m * Kp / kBlock, sp + m * Kp / kBlock, bp + m * Kp / 16);
  }
  (void)simd;
  return {q, d, s, bs};
}

at::Tensor gemv_q8(const at::Tensor& q, const at::Tensor& d, const at::Tensor& s, const at::Tensor& bs,
                   const at::Tensor& blocks, int64_t qtype, int64_t k) {
  return dispatch(qtype, [&](auto t) {
    using T = decltype(t);
    TORCH_CHECK_VALUE(k > 0 && k % T::kQK == 0, "k = ", k, " is not a positive multiple of the type's ", T::kQK,
                      "-weight block");
    TORCH_CHECK_VALUE(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
                      "blocks must be a uint8 CPU tensor [N, row_bytes], got ", blocks.scalar_type(), " ",
                      blocks.sizes());
    TORCH_CHECK_VALUE(blocks.size(1) == k / T::kQK * T::kBytes, "blocks have ", blocks.size(1),
                      " bytes a row; k = ", k, " needs ", k / T::kQK * T::kBytes);
    TORCH_CHECK_VALUE(blocks.stride(1) == 1 || blocks.size(1) <= 1, "each row's bytes must be contiguous");
    const int64_t Kp = padded(k);
    TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() &&
                          q.size(1) == Kp,
                      "q must be quantize_rows' contiguous int8 [M, ", Kp, "] for k = ", k, ", got ",
                      q.scalar_type(), " ", q.sizes());
    const int64_t M = q.size(0);
    for (const auto& [name, a, type, width] :
         {std::make_tuple("d", &d, at::kFloat, Kp / kBlock), std::make_tuple("s", &s, at::kFloat, Kp / kBlock),
          std::make_tuple("bsum", &bs, at::kShort, Kp / 16)})
      TORCH_CHECK_VALUE(a->device().is_cpu() && a->scalar_type() == type && a->dim() == 2 && a->is_contiguous() &&
                            a->size(0) == M && a->size(1) == width,
                        name, " must be quantize_rows' contiguous ", c10::toString(type), " [", M, ", ", width,
                        "], got ", a->scalar_type(), " ", a->sizes());
    const int64_t N = blocks.size(0);
    at::Tensor y = at::empty({M, N}, at::kFloat);
    if (M == 0 || N == 0) return y;
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    const int64_t ldw = blocks.stride(0), blocks_per_row = k / T::kQK, groups = Kp / kGroup;
    const int8_t* qp = q.data_ptr<int8_t>();
    const float *dp = d.data_ptr<float>(), *sp = s.data_ptr<float>();
    const int16_t* bp = bs.data_ptr<int16_t>();
    float* yp = y.data_ptr<float>();
    const bool simd = use_simd();
    at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
      RowBuf buf(Kp);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wn = w + n * ldw;
#ifdef BS_QDOT_AVX2
        if (simd) {
          unpack_row_simd<T>(wn, blocks_per_row, buf);
          for (int64_t m = 0; m < M; ++m)
            yp[m * N + n] = dot_simd<T>(buf, groups, qp + m * Kp, dp + m * Kp / kBlock, sp + m * Kp / kBlock,
                                        bp + m * Kp / 16);
          continue;
        }
#endif
        unpack_row<T>(wn, blocks_per_row, buf, simd);
        for (int64_t m = 0; m < M; ++m)
          yp[m * N + n] = dot_scalar<T>(buf, groups, qp + m * Kp, dp + m * Kp / kBlock, sp + m * Kp / kBlock,
                                        bp + m * Kp / 16);
      }
    });
    return y;
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("quantize_rows", &quantize_rows,
        "x float32 [M, K] (K a multiple of 32) -> (q int8 [M, Kp], d float32 [M, Kp/32], s float32 [M, Kp/32], "
        "bsum int16 [M, Kp/16]): 8-bit blocks of 32 values, Kp = K rounded up to 256 (zero padding)",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("gemv_q8", &gemv_q8,
        "y float32 [M, N] = x @ dequantize(W).T with x as quantize_rows gives it (q, d, s, bsum) and W's GGUF "
        "blocks uint8 [N, row_bytes] of `qtype` (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), k columns",
        py::arg("q"), py::arg("d"), py::arg("s"), py::arg("bsum"), py::arg("blocks"), py::arg("qtype"),
        py::arg("k"), py::call_guard<py::gil_scoped_release>());
  m.def("supports", [](int64_t qtype) {
          switch (qtype) {
            case Q4_0::kType: case Q4_1::kType: case Q8_0::kType: case Q4_K::kType: case Q6_K::kType: return true;
          }
          return false;
        },
        "whether gemv_q8 takes GGUF type `qtype`", py::arg("qtype"));
  m.def("set_simd", [](bool on) { simd_enabled = on; },
        "whether the AVX2 path runs where built (the default) or the scalar one (tests, benchmarks)");
  m.def("simd", &use_simd, "whether the AVX2 path runs: built for it and not switched off");
}
