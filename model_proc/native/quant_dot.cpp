// Linear layers on GGUF-quantized weights with 8-bit activations: x's rows are
// quantized once to int8 blocks of 32 (a float scale each), and each weight
// block is dotted with them in integers, as llama.cpp's CPU matmuls do (its
// Q8_0 / Q8_1 activations). quant.cpp's `gemv` keeps x in float32: 4 float
// FMAs per 32 weights and x row after a decode to floats; here 32 weights and
// an x row take one unsigned-by-signed byte multiply-add (vpmaddubsw), one
// widening pair add (vpmaddwd), one conversion and one FMA, after a cheaper
// decode (to bytes, shared by 4 x rows). The result is not the float32
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
// `gemv_q8(q, d, s, bsum, blocks, qtype, k)` -> y float32 [M, N]; `matmul_q8(x,
// blocks, qtype)` quantizes and multiplies in one call.
//
// Weights: GGUF blocks as stored, uint8 [N, row_bytes] (rows may be strided,
// a row's bytes contiguous), of Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12),
// Q6_K (14), never repacked. The AVX2 path decodes each block of 32 weights
// into a register of 32 codes in x's order (unsigned: Q4's nibbles, Q6_K's 6
// bits; Q8_0 signed, by the sign trick) and uses it for up to 4 x rows:
// vpmaddubsw (codes x q, pairs to int16), vpmaddwd (pairs to int32, times
// Q6_K's scale per 16), one conversion and one FMA by P = f * d_x per block
// and row, f the block's float scale (Q4_K: d * sc); the offsets (Q4_0's
// -8 d, Q4_1's m, Q4_K's -(dmin * mn)) once per 8 blocks through s, Q6_K's
// -32 sc through bsum. The scalar path unpacks a row into a buffer and
// follows the same order.
//
// The two paths make the same float operations in the same order (the
// canonical order, written out before dot_scalar below); the integer sums cannot overflow or saturate for |q| <= 127 (vpmaddubsw's
// pairs: Q8_0 2 * 128 * 127 = 32512 < 32767). So the AVX2 path and the scalar
// one (compiled everywhere, selectable by set_simd(False)) agree bit for bit;
// this file is built with -ffp-contract=off so that the scalar path's
// multiplies and adds are not fused where the AVX2 one does not fuse them.
//
// Threads take contiguous ranges of weight rows (at::parallel_for); each
// weight row is read from memory once and stays in L1 for every x row.

#include <torch/extension.h>

#include "ggml_blocks.h"

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

// Per block of 32 weights, what the dot product needs besides the codes:
// f (times d_x: the block's weight scale), g (times s_x: the offset per unit
// of x, Q4_0's -8 d, Q4_1's m, Q4_K's -(dmin mn)); int16 scales and biases
// per 16 codes (Q6_K: sc and 32 sc). Each type: block shape; kSigned (Q8_0:
// signed codes, the sign trick); kScaled (sc); kBias (bias, through bsum);
// kOffset (g); unpack(): one block's codes in x's order (kQK bytes) and its
// factors (the scalar path); the AVX2 path decodes a block of 32 in
// registers (codes32) and takes the same factors (factors8: 8 blocks of 32).
struct Q4_0 {
  static constexpr int64_t kType = 2, kQK = 32, kBytes = 18;
  static constexpr bool kSigned = false, kScaled = false, kBias = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t*, int16_t*, float* f, float* g) {
    for (int i = 0; i < 16; ++i) c[i] = b[2 + i] & 15, c[i + 16] = b[2 + i] >> 4;
    f[0] = f16(b);
    g[0] = -8.0f * f[0];
  }
};

struct Q4_1 {
  static constexpr int64_t kType = 3, kQK = 32, kBytes = 20;
  static constexpr bool kSigned = false, kScaled = false, kBias = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t*, int16_t*, float* f, float* g) {
    for (int i = 0; i < 16; ++i) c[i] = b[4 + i] & 15, c[i + 16] = b[4 + i] >> 4;
    f[0] = f16(b);
    g[0] = f16(b + 2);
  }
};

struct Q8_0 {
  static constexpr int64_t kType = 8, kQK = 32, kBytes = 34;
  static constexpr bool kSigned = true, kScaled = false, kBias = false, kOffset = false;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t*, int16_t*, float* f, float*) {
    std::memcpy(c, b + 2, 32);
    f[0] = f16(b);
  }
};

// The K-quants' eight 6-bit scales and mins from their 12 packed bytes:
// scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; scales
// and mins 4-7 the low and high nibbles of bytes 8-11 with the top 2 bits of
// bytes 0-3 and 4-7 above them. Four at a time in 32-bit words.
inline void k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t out[4] = {a & 0x3f3f3f3f, (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030),
                           b & 0x3f3f3f3f, ((c >> 4) & 0x0f0f0f0f) | ((b >> 2) & 0x30303030)};
  std::memcpy(sc, out, 8);
  std::memcpy(mn, out + 2, 8);
}

// Q4_K: 256 weights; fp16 d, dmin; 12 bytes of scales/mins; 128 of nibbles:
// sub-block j is the low (j even) or high nibbles of bytes [32 (j / 2), +32).
// f = d * sc (gguf-py's scale), g = -(dmin * mn).
struct Q4_K {
  static constexpr int64_t kType = 12, kQK = 256, kBytes = 144;
  static constexpr bool kSigned = false, kScaled = false, kBias = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* c, int16_t*, int16_t*, float* f, float* g) {
    const float d = f16(b), dmin = f16(b + 2);
    uint8_t sc[8], mn[8];
    k4_scales(b + 4, sc, mn);
    for (int j = 0; j < 8; ++j) {
      for (int i = 0; i < 32; ++i) c[32 * j + i] = (b[16 + 32 * (j / 2) + i] >> (4 * (j & 1))) & 15;
      f[j] = d * static_cast<float>(sc[j]);
      g[j] = -(dmin * static_cast<float>(mn[j]));
    }
  }
};

// Q6_K: 256 weights; 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8
// scales (one per 16), fp16 d last. Block of 32 number c = 4 h + s takes the
// low (s < 2) or high nibbles of ql[64 h + 32 (s & 1) ...] and bits 2 s.. of
// qh[32 h ...]; the weight is d sc (code - 32). f = d.
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
      sc16[i] = static_cast<int8_t>(b[192 + i]);
      bias[i] = static_cast<int16_t>(32 * sc16[i]);
    }
  }
};

// ---------------------------------------------------------------- dot products
//
// The canonical order, per x row, over groups of 8 blocks of 32 (256 values;
// a row's last group may hold fewer weight blocks, nv): two sets of 8 float
// lanes, A_l and B_l (two chains of FMAs: one would wait on its latency);
//   for each block j < nv of the group, P_j = f_j * d_j (rounded), and for
//   each lane l, I_jl = the integer dot of the block's codes 4l..4l+3 with q's
//   (times their half's sc): X_l = fma(P_j, float(I_jl), X_l), X = A for
//   even j, B for odd j;
//   then for each lane l (block l of the group; f = g = 0 past nv):
//     offset types: A_l = fma(g_l, s_l, A_l);
//     bias types:   A_l = fma(-P_l, float(sum over l's halves h of bias_h bsum_h), A_l);
// acc_l = A_l + B_l; y = ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) + (acc_3 + acc_7)).
// That is where vpmaddubsw/vpmaddwd leave each product (int32 lane l of a
// block holds its bytes 4l..4l+3), so the AVX2 path needs no horizontal
// integer sum per block.

// A weight row unpacked for the scalar path (one per thread, reused row after row).
struct RowBuf {
  std::vector<uint8_t> codes;    // [Kp]: codes in x's order (Q8_0: int8)
  std::vector<int16_t> sc;       // [Kp / 16]: Q6_K's scale per 16 codes
  std::vector<int16_t> bias;     // [Kp / 16]: Q6_K's 32 sc per 16 codes
  std::vector<float> f, g;       // [Kp / 32]: factor of d_x, of s_x (0 past K)
  explicit RowBuf(int64_t Kp) : codes(Kp), sc(Kp / 16), bias(Kp / 16), f(Kp / kBlock), g(Kp / kBlock) {}
};

inline float hsum8(const float a[8]) {
  const float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

template <class T>
void unpack_row(const uint8_t* w, int64_t blocks_per_row, RowBuf& buf) {
  constexpr int64_t kBlocks32 = T::kQK / kBlock;
  for (int64_t blk = 0; blk < blocks_per_row; ++blk)
    T::unpack(w + blk * T::kBytes, buf.codes.data() + blk * T::kQK, buf.sc.data() + blk * T::kQK / 16,
              buf.bias.data() + blk * T::kQK / 16, buf.f.data() + blk * kBlocks32, buf.g.data() + blk * kBlocks32);
}

template <class T>
float dot_scalar(const RowBuf& buf, int64_t nblk, int64_t groups, const int8_t* q, const float* d, const float* s,
                 const int16_t* bs) {
  float acc[8] = {}, odd[8] = {};
  for (int64_t gi = 0; gi < groups; ++gi) {
    float P[8];
    for (int l = 0; l < 8; ++l) P[l] = buf.f[8 * gi + l] * d[8 * gi + l];
    for (int j = 0; j < 8 && 8 * gi + j < nblk; ++j) {
      const int64_t c = 8 * gi + j;
      for (int l = 0; l < 8; ++l) {
        int32_t part = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) {
          const int32_t wc = T::kSigned ? static_cast<int8_t>(buf.codes[32 * c + i]) : buf.codes[32 * c + i];
          part += wc * q[32 * c + i];
        }
        if constexpr (T::kScaled) part *= buf.sc[2 * c + l / 4];
        float& a = j & 1 ? odd[l] : acc[l];
        a = std::fma(P[j], static_cast<float>(part), a);
      }
    }
    for (int l = 0; l < 8; ++l) {
      const int64_t c = 8 * gi + l;
      if constexpr (T::kOffset) acc[l] = std::fma(buf.g[c], s[c], acc[l]);
      if constexpr (T::kBias) {
        const int32_t b = buf.bias[2 * c] * bs[2 * c] + buf.bias[2 * c + 1] * bs[2 * c + 1];
        acc[l] = std::fma(-P[l], static_cast<float>(b), acc[l]);
      }
    }
  }
  for (int l = 0; l < 8; ++l) acc[l] += odd[l];
  return hsum8(acc);
}

#ifdef BS_QDOT_AVX2
inline float hsum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a_i + a_{i+4}
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));                                          // (t0 + t2), (t1 + t3)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 fp16 at p, p + stride, ... (the first nv; zeros after) as float32: a
// row's last group, short. Whole groups take f16x8_pairs: inserting 16-bit
// lanes one by one cost ~40% of a Q4_0 row at one x row, and vpgatherdd
// ~25% (Zen 3).
inline __m256 f16x8(const uint8_t* p, int64_t stride, int nv) {
  // lanes in registers: 16-bit stores read back as one vector would stall store forwarding, every row
  __m128i h = _mm_setzero_si128();
  switch (nv) {  // falls through: lane nv - 1 down to 0
    case 7: h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(p + 6 * stride), 6); [[fallthrough]];
    case 6: h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(p + 5 * stride), 5); [[fallthrough]];
    case 5: h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(p + 4 * stride), 4); [[fallthrough]];
    case 4: h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(p + 3 * stride), 3); [[fallthrough]];
    case 3: h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(p + 2 * stride), 2); [[fallthrough]];
    case 2: h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(p + stride), 1); [[fallthrough]];
    case 1: h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(p), 0); [[fallthrough]];
    default: break;
  }
  return _mm256_cvtph_ps(h);
}

// The same for a whole group of 8 blocks of kStride bytes, Q4_0, Q4_1: a
// 32-byte load at block 2 k holds its fp16 (bytes 0-1, low half) and block
// 2 k + 1's (bytes kStride.., high half); vpshufb moves each to its 16-bit
// lane of the result (2 k in the low half, 2 k + 1 in the high), zeros
// elsewhere; the 4 loads ORed, the two halves ORed. No load passes the
// group's end (6 kStride + 32 <= 8 kStride). Wider blocks (Q8_0) load each
// pair's two halves apart.
template <int kStride>
struct PairControls {  // vpshufb's controls for the 4 loads, as compile-time tables
  alignas(32) int8_t c[4][32];
  constexpr PairControls() : c{} {
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 32; ++i) c[k][i] = -128;  // a zero byte
      c[k][4 * k] = 0, c[k][4 * k + 1] = 1;
      c[k][16 + 4 * k + 2] = kStride - 16, c[k][16 + 4 * k + 3] = kStride - 15;
    }
  }
};
template <int kStride>
constexpr PairControls<kStride> kPairControls{};

template <int kStride>
inline __m256 f16x8_pairs(const uint8_t* p) {
  static_assert(kStride >= 16, "blocks of at least 16 bytes");
  constexpr int kIn = kStride <= 30 ? kStride : 16;  // wider blocks: each pair from two 16-byte loads
  __m256i v = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const uint8_t* b = p + 2 * k * kStride;
    const __m256i pair = kStride <= 30 ? load256(b)
                                       : _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + kStride),
                                                             reinterpret_cast<const __m128i*>(b));
    v = _mm256_or_si256(v, _mm256_shuffle_epi8(pair, load256(kPairControls<kIn>.c[k])));
  }
  return _mm256_cvtph_ps(_mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// A group of 8 blocks of 32 as the AVX2 path takes it: f, g (floats a lane
// per block) and, per block, its 32 codes (code()) and int16 scales (Q6_K).
struct Group {
  __m256 f, g;
  __m256i bias;  // Q6_K: 32 sc, per 16
  __m128i sc8;   // Q6_K: the 16 int8 scales
};

template <class T>
inline void group_factors(const uint8_t* w, int64_t gi, int nv, Group& gr) {
  if constexpr (T::kQK == 32) {
    const uint8_t* b = w + 8 * gi * T::kBytes;
    gr.f = nv == 8 ? f16x8_pairs<T::kBytes>(b) : f16x8(b, T::kBytes, nv);
    if constexpr (T::kType == Q4_0::kType) gr.g = _mm256_mul_ps(_mm256_set1_ps(-8.0f), gr.f);
    if constexpr (T::kType == Q4_1::kType) gr.g = nv == 8 ? f16x8_pairs<T::kBytes>(b + 2) : f16x8(b + 2, T::kBytes, nv);
  } else {
    const uint8_t* b = w + gi * T::kBytes;
    if constexpr (T::kType == Q4_K::kType) {
      uint8_t sc[8], mn[8];
      k4_scales(b + 4, sc, mn);
      const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
      const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
      gr.f = _mm256_mul_ps(_mm256_set1_ps(f16(b)), scf);
      gr.g = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), mnf), _mm256_set1_ps(-0.0f));
    } else {  // Q6_K
      gr.f = _mm256_set1_ps(f16(b + 208));
      gr.sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      gr.bias = _mm256_slli_epi16(_mm256_cvtepi8_epi16(gr.sc8), 5);
    }
  }
}

// Block j of group gi: its 32 codes in x's order
template <class T>
inline __m256i codes32(const uint8_t* w, int64_t gi, int j) {
  const __m256i lo4 = _mm256_set1_epi8(15);
  if constexpr (T::kType == Q4_0::kType || T::kType == Q4_1::kType) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (8 * gi + j) * T::kBytes + T::kBytes - 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), lo4);
  } else if constexpr (T::kType == Q8_0::kType) {
    return load256(w + (8 * gi + j) * T::kBytes + 2);
  } else if constexpr (T::kType == Q4_K::kType) {
    const __m256i v = load256(w + gi * T::kBytes + 16 + 32 * (j / 2));
    return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, lo4);
  } else {  // Q6_K
    const uint8_t* b = w + gi * T::kBytes;
    const int h = j / 4, s = j % 4;
    const __m256i l = load256(b + 64 * h + 32 * (s & 1)), qh = load256(b + 128 + 32 * h);
    const __m256i low = _mm256_and_si256(s >> 1 ? _mm256_srli_epi16(l, 4) : l, lo4);
    const __m256i high = s == 0 ? _mm256_slli_epi16(qh, 4)
                       : s == 1 ? _mm256_slli_epi16(qh, 2)
                       : s == 2 ? qh
                                : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
  }
}

struct ScalePairs {  // vpshufb's controls: byte 2 j eight times, then byte 2 j + 1 eight times
  alignas(16) int8_t c[8][16];
  constexpr ScalePairs() : c{} {
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 16; ++i) c[j][i] = static_cast<int8_t>(2 * j + i / 8);
  }
};
constexpr ScalePairs kScalePairs{};

// Block j of group gi against MR x rows, into acc (A or B by j's parity: the caller's choice)
template <class T, int MR>
__attribute__((always_inline)) inline void block_step(const uint8_t* w, int64_t gi, int j, const Group& gr,
                                                      const int8_t* q, int64_t ldq, const float (*P)[8],
                                                      __m256 (&acc)[MR]) {
  const __m256i wv = codes32<T>(w, gi, j);
  __m256i mag, sc;
  if constexpr (T::kSigned) mag = _mm256_abs_epi8(wv);
  if constexpr (T::kScaled)  // int16 lanes 0-7: scale 2 j, 8-15: scale 2 j + 1
    sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(gr.sc8, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kScalePairs.c[j]))));
  else
    sc = _mm256_set1_epi16(1);
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const __m256i x = load256(q + m * ldq + 32 * (8 * gi + j));
    const __m256i p = T::kSigned ? _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, wv)) : _mm256_maddubs_epi16(wv, x);
    acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(&P[m][j]), _mm256_cvtepi32_ps(_mm256_madd_epi16(p, sc)), acc[m]);
  }
}

// y[m * ldy] = weight row w . x row m for MR x rows (q ldq bytes apart; d, s
// lds floats apart; bsum ldb int16 apart); nblk blocks of 32 in the row.
template <class T, int MR>
void tile_simd(const uint8_t* w, int64_t nblk, const int8_t* q, int64_t ldq, const float* d, const float* s,
               int64_t lds, const int16_t* bs, int64_t ldb, float* y, int64_t ldy) {
  __m256 acc[MR], odd[MR];  // A and B: even blocks, odd ones
  for (int m = 0; m < MR; ++m) acc[m] = odd[m] = _mm256_setzero_ps();
  const int64_t groups = (nblk + 7) / 8;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int nv = static_cast<int>(std::min<int64_t>(8, nblk - 8 * gi));
    Group gr;
    group_factors<T>(w, gi, nv, gr);
    alignas(32) float P[MR][8];
    for (int m = 0; m < MR; ++m) _mm256_store_ps(P[m], _mm256_mul_ps(gr.f, _mm256_loadu_ps(d + m * lds + 8 * gi)));
    if (nv == 8) {
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        block_step<T, MR>(w, gi, j, gr, q, ldq, P, acc);
        block_step<T, MR>(w, gi, j + 1, gr, q, ldq, P, odd);
      }
    } else {
      for (int j = 0; j < nv; j += 2) {
        block_step<T, MR>(w, gi, j, gr, q, ldq, P, acc);
        if (j + 1 < nv) block_step<T, MR>(w, gi, j + 1, gr, q, ldq, P, odd);
      }
    }
    for (int m = 0; m < MR; ++m) {
      if constexpr (T::kOffset) acc[m] = _mm256_fmadd_ps(gr.g, _mm256_loadu_ps(s + m * lds + 8 * gi), acc[m]);
      if constexpr (T::kBias) {
        const __m256i b = _mm256_madd_epi16(gr.bias, load256(bs + m * ldb + 16 * gi));
        acc[m] = _mm256_fnmadd_ps(_mm256_load_ps(P[m]), _mm256_cvtepi32_ps(b), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) y[m * ldy] = hsum(_mm256_add_ps(acc[m], odd[m]));
}

constexpr int kTileRows = 4;  // x rows per pass over a weight row: 8 accumulators

template <class T>
void rows_simd(const uint8_t* w, int64_t nblk, int64_t M, const int8_t* q, const float* d, const float* s,
               const int16_t* bs, int64_t Kp, float* y, int64_t N) {
  const int64_t lds = Kp / kBlock, ldb = Kp / 16;
  for (int64_t m = 0; m < M; m += kTileRows) {
    const int8_t* qm = q + m * Kp;
    const float *dm = d + m * lds, *sm = s + m * lds;
    const int16_t* bm = bs + m * ldb;
    float* ym = y + m * N;
    switch (std::min<int64_t>(M - m, kTileRows)) {
      case 1: tile_simd<T, 1>(w, nblk, qm, Kp, dm, sm, lds, bm, ldb, ym, N); break;
      case 2: tile_simd<T, 2>(w, nblk, qm, Kp, dm, sm, lds, bm, ldb, ym, N); break;
      case 3: tile_simd<T, 3>(w, nblk, qm, Kp, dm, sm, lds, bm, ldb, ym, N); break;
      default: tile_simd<T, kTileRows>(w, nblk, qm, Kp, dm, sm, lds, bm, ldb, ym, N); break;
    }
  }
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
    batchserve::check_blocks<T>(blocks, k);
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
    [[maybe_unused]] const bool simd = use_simd();  // (a build without AVX2 has one path)
    const int64_t nblk = k / kBlock;
    at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
#ifdef BS_QDOT_AVX2
      if (simd) {
        for (int64_t n = n0; n < n1; ++n) rows_simd<T>(w + n * ldw, nblk, M, qp, dp, sp, bp, Kp, yp + n, N);
        return;
      }
#endif
      RowBuf buf(Kp);
      for (int64_t n = n0; n < n1; ++n) {
        unpack_row<T>(w + n * ldw, blocks_per_row, buf);
        for (int64_t m = 0; m < M; ++m)
          yp[m * N + n] = dot_scalar<T>(buf, nblk, groups, qp + m * Kp, dp + m * Kp / kBlock, sp + m * Kp / kBlock,
                                        bp + m * Kp / 16);
      }
    });
    return y;
  });
}

// Both in one call (decode makes hundreds: one crossing from python instead of two)
at::Tensor matmul_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be a contiguous float32 CPU tensor [M, K], got ", x.sizes());
  const auto [q, d, s, bs] = quantize_rows(x);
  return gemv_q8(q, d, s, bs, blocks, qtype, x.size(1));
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
  m.def("matmul_q8", &matmul_q8,
        "gemv_q8(*quantize_rows(x), blocks, qtype, K): y float32 [M, N] from x float32 [M, K] (contiguous)",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  // for layers.cpp's DecoderStack, which calls it without Python between
  m.attr("matmul_q8_fn") = py::capsule(reinterpret_cast<void*>(&matmul_q8), "batchserve.quant_dot.matmul_q8");
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
