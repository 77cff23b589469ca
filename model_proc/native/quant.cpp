// Linear layers on GGUF-quantized weights as the file stores them (issue 31):
// the blocks are read where they lie, dequantized in registers, never into a
// float copy of the weight. model_proc/quant/matmul.py chooses between these.
//
// Types (gguf numbering): Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8),
// Q4_K (12), Q5_K (13), Q6_K (14). A weight [N, K] is N rows of K /
// weights_per_block blocks back to back, a uint8 tensor [N, row_bytes]; its
// rows may be strided (a block-aligned column slice), its bytes in a row must
// be contiguous.
//
// `dequantize`: float32 [N, K] equal bit for bit to gguf-py's
// gguf.quants.dequantize, i.e. in its float32 operation order: Q4_1 and Q5_1
// are (d * q) + m and the K-quants (d * sc) * q - (dmin * m), two roundings
// each, never one fused multiply-add (so this file is built with
// -ffp-contract=off, model_proc/native/__init__.py; the explicit
// _mm256_fmadd_ps below still fuse).
//
// `gemv`: y = x @ dequantize(W).T for the few rows of decode, x float32 (not
// quantized, unlike llama.cpp's q8 activations: the result is the float32
// product up to summation order). Decode reads every weight once, so the cost
// to beat is the weight stream, and on 2 cores of AVX2 the decode's
// instructions come close to it. Per chunk of 32 weights: 8 codes at a time
// widened to int32 (pmovzx from memory, a mask or shift for nibbles and high
// bits, a variable shift of qh for Q5_0's and Q5_1's fifth bits) and to float,
// dotted with x unscaled, the chunk's scale applied once to that dot; the
// offsets (Q4_0's -8 d, Q5_0's -16 d, Q4_1's and Q5_1's m, the K-quants'
// -dmin m) once per chunk through x's sums over the chunk. That is ~16
// instructions per 32 weights and x row instead of ~20 scaling each weight.
// One weight row at a time, whole: reading 4 rows interleaved cut the
// prefetcher's stream from ~19 to ~12-14 GB/s (one thread). Each row (in L1
// by then) takes every x row, 6 at a time. Threads take contiguous ranges of
// weight rows.
// Weights are not repacked: a repacked (interleaved) layout would shave decode
// work but break the "row slices are weights" contract the caller relies on.
// Past ~16 x rows the gemv loses to dequantized tiles and torch's sgemm
// (matmul.py): each of its FMAs loads x, where sgemm's blocking reuses it.
//
// Measured, 8192 x 2048 (a 1B Llama's MLP up), one x row, weights from DRAM,
// AMD EPYC (Zen 3, 3.2 GHz), 2026-12-06:
// - one thread, its CPU time: Q4_0, Q4_1, Q4_K, Q8_0 ~13 weights/ns, Q5_K ~9,
//   Q6_K ~8 (Q4_0: 7.5 GB/s of blocks, Q8_0: 14; one thread reads ~20 GB/s);
// - both cores, fastest of 300 calls (the machine was loaded, 1-min load
//   average 4-5: the medians were time slices), floor = bytes / 18.2 GB/s
//   (`sum`): Q4_0 0.66 ms (1.27 x floor), Q4_1 0.69 (1.19), Q8_0 0.78 (0.80:
//   22.7 GB/s, above `sum`'s), Q4_K 0.64 (1.23), Q5_K 0.93 (1.47), Q6_K 1.08
//   (1.43); float32 F.linear 3.19 ms. The 4- and 5-bit types are bound by the
//   decode's instructions on 2 cores, Q8_0 by memory;
// - Q5_0 ~8.3 weights/ns (5.7 GB/s), Q5_1 ~8 (6.0 GB/s), one thread, beside
//   Q4_0 ~13 in the same run (2026-12-07, load average 3.6): their fifth bits
//   take 3 more vector instructions per 8 weights, and the decode, not the
//   stream, bounds them. At 2048 x 640 (Gemma 3 270M's Q5_0 up): Q5_0 ~7.6,
//   Q4_0 ~11.
// python -m bench.micro.quant_bench has every shape and row count.
//
// Paths: AVX2 + FMA + F16C where the compiler targets them (-march=native),
// a scalar one everywhere else (and under set_simd(False), for the tests).

#include <torch/extension.h>

#include "ggml_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BS_QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int kChunk = 32;  // weights per decoded chunk: 4 vectors of 8 floats

bool simd_enabled = true;  // set_simd(False) runs the scalar path (tests, benchmarks)

bool use_simd() {
#ifdef BS_QUANT_AVX2
  return simd_enabled;
#else
  return false;
#endif
}

inline float f16(const uint8_t* p) {  // exact, any alignment
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef BS_QUANT_AVX2
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// A block's factors as float32, computed as gguf-py computes them.
struct Prep {
  alignas(32) float scale[16];  // chunk c's (Q6_K: scale[2c], scale[2c + 1] for its two halves of 16)
  alignas(32) float offset[8];  // added after the scaling: Q4_1's m, the K-quants' -(dmin * m)
  alignas(32) float fused[8];   // gemv: what chunk c adds per unit of x (offset - bias * scale)
};

// The K-quants' eight 6-bit scales and mins from their 12 packed bytes (4 bytes at a time)
inline void k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t out[4] = {a & 0x3f3f3f3f, (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030),  // scales 0-3, 4-7
                           b & 0x3f3f3f3f, ((c >> 4) & 0x0f0f0f0f) | ((b >> 2) & 0x30303030)};  // mins
  std::memcpy(sc, out, 8);
  std::memcpy(mn, out + 2, 8);
}

#ifdef BS_QUANT_AVX2
inline __m256i load8_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load8_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
// the bits of each int32 from bit `lo` moved to bit `to`, masked
inline __m256i bits_to(__m256i v, int lo, int to, int mask_at_to) {
  v = lo > to ? _mm256_srl_epi32(v, _mm_cvtsi32_si128(lo - to)) : _mm256_sll_epi32(v, _mm_cvtsi32_si128(to - lo));
  return _mm256_and_si256(v, _mm256_set1_epi32(mask_at_to));
}
#endif

// Each type: its block shape; its codes' bias (Q4_0: q - 8, Q6_K: q - 32);
// kOffset: an offset follows the scaling; kFused: gemv folds the bias and
// offset into a term per unit of x (else it subtracts the bias from the codes);
// kHalfScales: a scale per 16 weights; prep(): the factors; scalar(): a whole
// block, exact (the path without AVX2); codes8(): codes v * 8 .. v * 8 + 7 of
// chunk c (weights 32 c + 8 v ...) as 8 int32, unbiased.
struct Q4_0 {
  static constexpr int64_t kType = 2, kQK = 32, kBytes = 18;
  static constexpr int kBias = 8;
  static constexpr bool kOffset = false, kFused = true, kHalfScales = false;
  static void prep(const uint8_t* b, Prep& p) {
    const float d = f16(b);
    p.scale[0] = d;
    p.fused[0] = -8.0f * d;
  }
  static void scalar(const uint8_t* b, float* y) {
    const float d = f16(b);
    const uint8_t* q = b + 2;
    for (int i = 0; i < 16; ++i) {
      y[i] = d * static_cast<float>((q[i] & 15) - 8);
      y[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
    }
  }
#ifdef BS_QUANT_AVX2
  static __m256i codes8(const uint8_t* b, int, int v) {  // weights 0-15: low nibbles, 16-31: high
    const __m256i a = load8_u8(b + 2 + 8 * (v & 1));
    return v < 2 ? low4(a) : _mm256_srli_epi32(a, 4);
  }
#endif
};

struct Q4_1 {
  static constexpr int64_t kType = 3, kQK = 32, kBytes = 20;
  static constexpr int kBias = 0;
  static constexpr bool kOffset = true, kFused = true, kHalfScales = false;
  static void prep(const uint8_t* b, Prep& p) {
    p.scale[0] = f16(b);
    p.offset[0] = p.fused[0] = f16(b + 2);
  }
  static void scalar(const uint8_t* b, float* y) {
    const float d = f16(b), m = f16(b + 2);
    const uint8_t* q = b + 4;
    for (int i = 0; i < 16; ++i) {
      y[i] = d * static_cast<float>(q[i] & 15) + m;
      y[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
    }
  }
#ifdef BS_QUANT_AVX2
  static __m256i codes8(const uint8_t* b, int, int v) {
    const __m256i a = load8_u8(b + 4 + 8 * (v & 1));
    return v < 2 ? low4(a) : _mm256_srli_epi32(a, 4);
  }
#endif
};

// Q5_0 and Q5_1: Q4_0's and Q4_1's blocks with a fifth bit per weight: fp16
// d, (Q5_1: fp16 m,) qh, a little-endian uint32 whose bit i is weight i's
// fifth, then the 16 bytes of nibbles (weights 0-15 low, 16-31 high).
// Q5_0: d (q - 16); Q5_1: d q + m.
template <bool kMin>
struct Q5 {
  static constexpr int64_t kType = kMin ? 7 : 6, kQK = 32, kBytes = kMin ? 24 : 22;
  static constexpr int kBias = kMin ? 0 : 16;
  static constexpr bool kOffset = kMin, kFused = true, kHalfScales = false;
  static constexpr int kQh = kMin ? 4 : 2, kQs = kQh + 4;  // where qh and the nibbles start
  static void prep(const uint8_t* b, Prep& p) {
    p.scale[0] = f16(b);
    if constexpr (kMin)
      p.offset[0] = p.fused[0] = f16(b + 2);
    else
      p.fused[0] = -16.0f * p.scale[0];
  }
  static void scalar(const uint8_t* b, float* y) {
    const float d = f16(b);
    uint32_t qh;
    std::memcpy(&qh, b + kQh, 4);
    const uint8_t* q = b + kQs;
    for (int i = 0; i < 16; ++i) {
      const int lo = (q[i] & 15) | ((qh >> i) & 1) << 4, hi = (q[i] >> 4) | ((qh >> (i + 16)) & 1) << 4;
      if constexpr (kMin) {
        const float m = f16(b + 2);
        y[i] = d * static_cast<float>(lo) + m;
        y[i + 16] = d * static_cast<float>(hi) + m;
      } else {
        y[i] = d * static_cast<float>(lo - 16);
        y[i + 16] = d * static_cast<float>(hi - 16);
      }
    }
  }
#ifdef BS_QUANT_AVX2
  // weights 8 v + j: bit 8 v + j of qh shifted to bit 4 by a variable shift
  // per lane (of qh << 4 where the shift would be left, of qh for the top
  // byte, whose bits qh << 4 has lost), or'd into the nibbles. qh broadcast
  // from memory and shifted as a vector: ~8% faster than two broadcasts from
  // a general register (g++'s choice for qh and qh << 4 computed as ints).
  // Tried, slower (Q5_0 8192 x 2048, one x row, one thread: this 2.0 ms): the
  // 32 codes built as bytes, qh spread to a byte mask (pshufb, cmpeq), then
  // widened in registers (2.5 ms) or stored and reloaded by pmovzx (2.7 ms).
  static __m256i codes8(const uint8_t* b, int, int v) {
    const __m256i a = load8_u8(b + kQs + 8 * (v & 1));
    const __m256i u = v < 2 ? low4(a) : _mm256_srli_epi32(a, 4);
    int qh;
    std::memcpy(&qh, b + kQh, 4);
    const __m256i h = v < 3 ? _mm256_slli_epi32(_mm256_set1_epi32(qh), 4) : _mm256_set1_epi32(qh);
    const int s = v < 3 ? 8 * v : 20;
    const __m256i shift = _mm256_setr_epi32(s, s + 1, s + 2, s + 3, s + 4, s + 5, s + 6, s + 7);
    return _mm256_or_si256(u, _mm256_and_si256(_mm256_srlv_epi32(h, shift), _mm256_set1_epi32(16)));
  }
#endif
};
using Q5_0 = Q5<false>;
using Q5_1 = Q5<true>;

struct Q8_0 {
  static constexpr int64_t kType = 8, kQK = 32, kBytes = 34;
  static constexpr int kBias = 0;
  static constexpr bool kOffset = false, kFused = false, kHalfScales = false;
  static void prep(const uint8_t* b, Prep& p) { p.scale[0] = f16(b); }
  static void scalar(const uint8_t* b, float* y) {
    const float d = f16(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(q[i]) * d;
  }
#ifdef BS_QUANT_AVX2
  static __m256i codes8(const uint8_t* b, int, int v) { return load8_i8(b + 2 + 8 * v); }
#endif
};

// Q4_K and Q5_K: 256 weights, 8 sub-blocks of 32 with 6-bit scales and mins;
// fp16 d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of fifth bits: bit j of
// each for sub-block j,) 128 bytes of nibbles: sub-block j is the low (j even)
// or high nibbles of bytes [32 (j / 2), 32 (j / 2) + 32).
template <bool kFifthBit>
struct QK45 {
  static constexpr int64_t kType = kFifthBit ? 13 : 12, kQK = 256, kBytes = kFifthBit ? 176 : 144;
  static constexpr int kBias = 0;
  static constexpr bool kOffset = true, kFused = true, kHalfScales = false;
  static constexpr int kQs = kFifthBit ? 48 : 16;  // where the nibbles start
  static void prep(const uint8_t* b, Prep& p) {
    const float d = f16(b), dmin = f16(b + 2);
    uint8_t sc[8], mn[8];
    k4_scales(b + 4, sc, mn);
#ifdef BS_QUANT_AVX2  // the loop below, vectorised (g++ would convert byte by byte)
    _mm256_store_ps(p.scale, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(load8_u8(sc))));
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(load8_u8(mn)));
    const __m256 offset = _mm256_xor_ps(dm, _mm256_set1_ps(-0.0f));
    _mm256_store_ps(p.offset, offset);
    _mm256_store_ps(p.fused, offset);
#else
    for (int j = 0; j < 8; ++j) {
      p.scale[j] = d * static_cast<float>(sc[j]);
      p.offset[j] = p.fused[j] = -(dmin * static_cast<float>(mn[j]));  // s q - dm == s q + -(dm)
    }
#endif
  }
  static int code(const uint8_t* b, int j, int i) {
    const int u = (b[kQs + 32 * (j / 2) + i] >> (4 * (j & 1))) & 15;
    return kFifthBit ? u | (((b[16 + i] >> j) & 1) << 4) : u;
  }
  static void scalar(const uint8_t* b, float* y) {
    Prep p;
    prep(b, p);
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) y[32 * j + i] = p.scale[j] * static_cast<float>(code(b, j, i)) + p.offset[j];
  }
#ifdef BS_QUANT_AVX2
  static __m256i codes8(const uint8_t* b, int c, int v) {
    const __m256i a = load8_u8(b + kQs + 32 * (c / 2) + 8 * v);
    const __m256i u = c & 1 ? _mm256_srli_epi32(a, 4) : low4(a);
    return kFifthBit ? _mm256_or_si256(u, bits_to(load8_u8(b + 16 + 8 * v), c, 4, 16)) : u;
  }
#endif
};
using Q4_K = QK45<false>;
using Q5_K = QK45<true>;

// Q6_K: 256 weights; 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8
// scales (one per 16 weights), fp16 d last. Chunk c = 4 h + s (h: which half
// of 128 weights, s: 0..3) takes the low (s < 2) or high nibbles of
// ql[64 h + 32 (s & 1) ...] and bits 2 s.. of qh[32 h ...]; q - 32.
struct Q6_K {
  static constexpr int64_t kType = 14, kQK = 256, kBytes = 210;
  static constexpr int kBias = 32;
  static constexpr bool kOffset = false, kFused = false, kHalfScales = true;
  static void prep(const uint8_t* b, Prep& p) {
    const float d = f16(b + 208);
#ifdef BS_QUANT_AVX2  // the loop below, vectorised
    for (int i = 0; i < 16; i += 8)
      _mm256_store_ps(p.scale + i, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(load8_i8(b + 192 + i))));
#else
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) p.scale[i] = d * static_cast<float>(sc[i]);
#endif
  }
  static int code(const uint8_t* b, int c, int i) {
    const int h = c / 4, s = c % 4;
    return ((b[64 * h + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15) | (((b[128 + 32 * h + i] >> (2 * s)) & 3) << 4);
  }
  static void scalar(const uint8_t* b, float* y) {
    Prep p;
    prep(b, p);
    for (int c = 0; c < 8; ++c)
      for (int i = 0; i < 32; ++i) y[32 * c + i] = p.scale[2 * c + i / 16] * static_cast<float>(code(b, c, i) - kBias);
  }
#ifdef BS_QUANT_AVX2
  static __m256i codes8(const uint8_t* b, int c, int v) {
    const int h = c / 4, s = c % 4;
    const __m256i a = load8_u8(b + 64 * h + 32 * (s & 1) + 8 * v);
    const __m256i lo = s >> 1 ? _mm256_srli_epi32(a, 4) : low4(a);
    return _mm256_or_si256(lo, bits_to(load8_u8(b + 128 + 32 * h + 8 * v), 2 * s, 4, 0x30));
  }
#endif
};

#ifdef BS_QUANT_AVX2
template <class T>
inline void codes(const uint8_t* b, int c, __m256i u[4]) {
  for (int v = 0; v < 4; ++v) u[v] = T::codes8(b, c, v);
}
#endif

template <class T>
inline float scale_of(const Prep& p, int c, int half) {
  return p.scale[T::kHalfScales ? 2 * c + half : c];
}

#ifdef BS_QUANT_AVX2
constexpr int kTileRows = 6;  // x rows per pass over a weight row: an accumulator each

// Chunk c of a block as 4 x 8 floats, bit for bit gguf-py: scale * (q - bias), then + offset.
template <class T>
inline void decode_exact(const uint8_t* b, const Prep& p, int c, __m256 w[4]) {
  __m256i u[4];
  codes<T>(b, c, u);
  for (int v = 0; v < 4; ++v) {
    const __m256i q = T::kBias ? _mm256_sub_epi32(u[v], _mm256_set1_epi32(T::kBias)) : u[v];
    w[v] = _mm256_mul_ps(_mm256_set1_ps(scale_of<T>(p, c, v / 2)), _mm256_cvtepi32_ps(q));
    if constexpr (T::kOffset) w[v] = _mm256_add_ps(w[v], _mm256_set1_ps(p.offset[c]));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[m * ldy] = x[m] . W's row w for MR x rows (ldx floats apart). Per chunk
// of 32 weights and x row, the codes (as floats, unscaled) are dotted with x
// into t, then acc += scale * t: 5 FMAs per 32 weights and x row; the offsets
// (Q4_0's bias, mins) come in once per chunk from xs, x's sums over each chunk
// (ldxs apart): sum (s q + o) x = s (q . x) + o sum x.
template <class T, int MR>
void gemv_tile(const uint8_t* w, int64_t blocks, const float* x, int64_t ldx, const float* xs, int64_t ldxs, float* y,
               int64_t ldy) {
  constexpr int kChunks = T::kQK / kChunk;
  constexpr bool kIntBias = T::kBias != 0 && !T::kFused;
  __m256 acc[MR], off[MR];  // off: the fused offsets, a lane per chunk (K-quants)
  float off1[MR];           // or one (a chunk a block)
  for (int m = 0; m < MR; ++m) acc[m] = off[m] = _mm256_setzero_ps(), off1[m] = 0.0f;
  for (int64_t blk = 0; blk < blocks; ++blk, w += T::kBytes) {
    Prep p;
    T::prep(w, p);
#pragma GCC unroll 8  // c a constant: the nibble and bit selections become immediates
    for (int c = 0; c < kChunks; ++c) {
      const float* xc = x + blk * T::kQK + c * kChunk;
      __m256i u[4];
      codes<T>(w, c, u);
      __m256 q[4];
      for (int v = 0; v < 4; ++v)
        q[v] = _mm256_cvtepi32_ps(kIntBias ? _mm256_sub_epi32(u[v], _mm256_set1_epi32(T::kBias)) : u[v]);
      for (int m = 0; m < MR; ++m) {
        const float* xm = xc + m * ldx;
        if constexpr (T::kHalfScales) {
          const __m256 t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xm + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xm)));
          const __m256 t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xm + 16)));
          acc[m] = _mm256_fmadd_ps(t0, _mm256_set1_ps(p.scale[2 * c]), acc[m]);
          acc[m] = _mm256_fmadd_ps(t1, _mm256_set1_ps(p.scale[2 * c + 1]), acc[m]);
        } else {
          // two short chains rather than one of four: more FMAs in flight
          const __m256 t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xm + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xm)));
          const __m256 t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xm + 16)));
          acc[m] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), _mm256_set1_ps(p.scale[c]), acc[m]);
        }
      }
    }
    if constexpr (T::kFused) {
      for (int m = 0; m < MR; ++m) {
        const float* s = xs + m * ldxs + blk * kChunks;
        if constexpr (kChunks == 8)
          off[m] = _mm256_fmadd_ps(_mm256_load_ps(p.fused), _mm256_loadu_ps(s), off[m]);
        else
          off1[m] += p.fused[0] * s[0];
      }
    }
  }
  for (int m = 0; m < MR; ++m) y[m * ldy] = hsum(_mm256_add_ps(acc[m], off[m])) + off1[m];
}

// Weight rows [n0, n1) against all M x rows; xs: x's sums per chunk of 32, [M, K / 32].
// One weight row after the other, whole: the hardware prefetcher streams rows
// read in order at ~19 GB/s, but only ~12-14 GB/s when 4 rows are read
// interleaved (one thread, rows of 1-2 KiB). Each row (a few KiB, in L1)
// takes all x rows, kTileRows at a time.
template <class T>
void gemv_simd(const uint8_t* w, int64_t ldw, int64_t blocks, const float* x, const float* xs, int64_t M, int64_t K,
               float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t ldxs = K / kChunk;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * ldw;
    for (int64_t m = 0; m < M; m += kTileRows) {
      const float* xm = x + m * K;
      const float* sm = xs + m * ldxs;
      float* ym = y + m * N + n;
      switch (std::min<int64_t>(M - m, kTileRows)) {
        case 1: gemv_tile<T, 1>(wn, blocks, xm, K, sm, ldxs, ym, N); break;
        case 2: gemv_tile<T, 2>(wn, blocks, xm, K, sm, ldxs, ym, N); break;
        case 3: gemv_tile<T, 3>(wn, blocks, xm, K, sm, ldxs, ym, N); break;
        case 4: gemv_tile<T, 4>(wn, blocks, xm, K, sm, ldxs, ym, N); break;
        case 5: gemv_tile<T, 5>(wn, blocks, xm, K, sm, ldxs, ym, N); break;
        default: gemv_tile<T, kTileRows>(wn, blocks, xm, K, sm, ldxs, ym, N); break;
      }
    }
  }
}

// x's sums over each chunk of 32 columns: [M, K / 32]
inline void chunk_sums(const float* x, int64_t M, int64_t K, float* xs) {
  for (int64_t i = 0; i < M * K / kChunk; ++i) {
    const float* p = x + i * kChunk;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
    xs[i] = hsum(s);
  }
}
#endif

// One weight row dequantized, bit for bit as gguf-py.
template <class T>
void dequant_row(const uint8_t* w, int64_t blocks, float* y) {
#ifdef BS_QUANT_AVX2
  if (use_simd()) {
    for (int64_t blk = 0; blk < blocks; ++blk, w += T::kBytes, y += T::kQK) {
      Prep p;
      T::prep(w, p);
      for (int c = 0; c < T::kQK / kChunk; ++c) {
        __m256 v[4];
        decode_exact<T>(w, p, c, v);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + c * kChunk + 8 * i, v[i]);
      }
    }
    return;
  }
#endif
  for (int64_t blk = 0; blk < blocks; ++blk) T::scalar(w + blk * T::kBytes, y + blk * T::kQK);
}

// Rows [n0, n1) without AVX2: each weight row dequantized into `row`, dotted with every x row.
template <class T>
void gemv_scalar(const uint8_t* w, int64_t ldw, int64_t blocks, const float* x, int64_t M, int64_t K, float* y,
                 int64_t N, int64_t n0, int64_t n1) {
  std::vector<float> row(K);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t blk = 0; blk < blocks; ++blk) T::scalar(w + n * ldw + blk * T::kBytes, row.data() + blk * T::kQK);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float part[8] = {};  // 8 partial sums: a vectorisable loop, shorter chains
      for (int64_t k = 0; k < K; k += 8)
        for (int i = 0; i < 8; ++i) part[i] += row[k + i] * xm[k + i];
      float s = 0.0f;
      for (float v : part) s += v;
      y[m * N + n] = s;
    }
  }
}

// Calls f(T{}) with T the block type of `qtype`; a clear error for any other.
template <class F>
auto dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0::kType: return f(Q4_0{});
    case Q4_1::kType: return f(Q4_1{});
    case Q5_0::kType: return f(Q5_0{});
    case Q5_1::kType: return f(Q5_1{});
    case Q8_0::kType: return f(Q8_0{});
    case Q4_K::kType: return f(Q4_K{});
    case Q5_K::kType: return f(Q5_K{});
    case Q6_K::kType: return f(Q6_K{});
  }
  TORCH_CHECK_VALUE(false, "unsupported GGML type ", qtype, " (supported: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, ",
                    "Q4_K=12, Q5_K=13, Q6_K=14)");
}

using batchserve::check_blocks;

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t k, const c10::optional<at::Tensor>& out) {
  return dispatch(qtype, [&](auto t) {
    using T = decltype(t);
    check_blocks<T>(blocks, k);
    const int64_t N = blocks.size(0), blocks_per_row = k / T::kQK, ldw = blocks.stride(0);
    at::Tensor y = out ? *out : at::empty({N, k}, at::kFloat);
    TORCH_CHECK_VALUE(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == N && y.size(1) == k &&
                          y.stride(1) == 1,
                      "out must be float32 [", N, ", ", k, "] with contiguous rows");
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t ldy = y.stride(0);
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / k), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) dequant_row<T>(w + n * ldw, blocks_per_row, yp + n * ldy);
    });
    return y;
  });
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  return dispatch(qtype, [&](auto t) {
    using T = decltype(t);
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                      "x must be a contiguous float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
    const int64_t M = x.size(0), K = x.size(1), N = blocks.dim() == 2 ? blocks.size(0) : 0;
    check_blocks<T>(blocks, K);
    at::Tensor y = at::empty({M, N}, at::kFloat);
    if (M == 0 || N == 0) return y;
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t ldw = blocks.stride(0), blocks_per_row = K / T::kQK;
    std::vector<float> xs(use_simd() ? M * K / kChunk : 0);
#ifdef BS_QUANT_AVX2
    if (use_simd()) chunk_sums(xp, M, K, xs.data());
#endif
    // groups of 4 weight rows, contiguous ranges of them per thread
    at::parallel_for(0, (N + 3) / 4, 1, [&](int64_t g0, int64_t g1) {
      const int64_t n0 = 4 * g0, n1 = std::min(N, 4 * g1);
#ifdef BS_QUANT_AVX2
      if (use_simd()) return gemv_simd<T>(w, ldw, blocks_per_row, xp, xs.data(), M, K, yp, N, n0, n1);
#endif
      gemv_scalar<T>(w, ldw, blocks_per_row, xp, M, K, yp, N, n0, n1);
    });
    return y;
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("dequantize", &dequantize,
        "float32 [N, k] from GGUF blocks uint8 [N, row_bytes] of gguf type `qtype`, bit for bit gguf-py's "
        "dequantize; into `out` (float32 [N, k], contiguous rows) if given",
        py::arg("blocks"), py::arg("qtype"), py::arg("k"), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("gemv", &gemv,
        "y = x @ dequantize(W).T, float32 [M, N], from x float32 [M, K] (contiguous) and W's GGUF blocks "
        "uint8 [N, row_bytes]; for few rows (decode)",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  // for layers.cpp's DecoderStack, which calls it without Python between
  m.attr("gemv_fn") = py::capsule(reinterpret_cast<void*>(&gemv), "batchserve.quant.gemv");
  m.def("block_shape",
        [](int64_t qtype) {
          return dispatch(qtype, [](auto t) { return std::make_pair(decltype(t)::kQK, decltype(t)::kBytes); });
        },
        "(weights, bytes) per block of `qtype` as this file lays it out (tests check it against ggml_types)",
        py::arg("qtype"));
  m.def("set_simd", [](bool on) { simd_enabled = on; },
        "whether the AVX2 path runs where built (the default) or the scalar one (tests, benchmarks)");
  m.def("simd", &use_simd, "whether the AVX2 path runs: built for it and not switched off");
}
