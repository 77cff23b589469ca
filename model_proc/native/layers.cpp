// The decoder's per-token building blocks in bfloat16 on a CPU
// (model_proc/layers.py): the matmuls, RMSNorm and rotary; and a whole step's
// decoder layers in one call (`DecoderStack`, model.py's NativeDecoder).
//
// Matmuls (`Linear`): y = x @ W.T with its epilogue (bias, the residual add, the MLP's
// SiLU(gate) * up) fused, every product on the matrix units through torch's
// brgemm (AMX, or AVX512_BF16), or, for 17-64 rows on AMX, this file's own
// tile loop (bit-identical, faster there; see "the AMX loop").
//
// Why not oneDNN's packed matmul, which the float32 path keeps: every matmul
// of the default model (30 layers and the head, interleaved as in a step,
// with their epilogues), 2 cores, bfloat16, median ms (python -m
// bench.linear_bench, bench/RESULTS.md, 2026-12-01, the second run):
//   rows        1     8    32    64   256   1024
//   oneDNN    17.7  18.5  23.2  26.9  61.8  243.8
//   this      13.6  13.9  19.1  22.9  46.4  188.0
// (before the AMX loop took 17-64 rows with its K chunks and prefetch).
// A decode step's matmuls read every weight once; at 1 to 8 rows this loop
// reads them at ~19-20 GB/s (the machine's `sum` read 22-24 GB/s), oneDNN at
// 13-15.

// Layout (packed once, by layers.pack_blocks): W [N, K] becomes blocks of
// BN = 64 output columns, each the VNNI layout brgemm reads for B:
// [N / BN, K / 2, BN, 2] (N padded with zero rows to a multiple of BN). A
// gated matmul (gate and up stacked) interleaves the blocks: gate block j,
// then up block j, so one task holds both halves of its output columns.
//
// Work: tasks = column blocks x row tiles, handed out to the threads one at
// a time (consecutive tasks share a block, which stays in L2). A row tile is up to
// 64 rows (128 from 256 rows on): brgemm's M; its float32 result goes
// through the epilogue into bfloat16 in one pass.
//
// RMSNorm and rotary: one pass each in float32, rounded once (torch's
// bfloat16 rotary is five ops, each rounding; its RMSNorm nine small ops).
// At one row a layer's two norms and its rotary cost ~90 us of op dispatch
// in torch.

#include <torch/extension.h>
#include <pybind11/stl.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BS_LINEAR 1
#include <immintrin.h>
#endif
#if defined(BS_LINEAR) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define BS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t BN = 64;

bool supported() {
#ifdef BS_LINEAR
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

// The AMX loop below (17 to 64 rows) where the CPU has AMX and Linux grants
// its state to this process; brgemm alone otherwise. Switchable off for
// benchmarks and tests.
bool amx_enabled = true;
constexpr int64_t kAmxMinRows = 17, kAmxMaxRows = 64;

bool amx_usable() {
#ifdef BS_AMX
  // Linux hands out the AMX tile state only to a process that asks for it
  static const bool granted = supported() && __builtin_cpu_supports("amx-bf16") &&
                              syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return amx_enabled && granted;
#else
  return false;
#endif
}

#ifdef BS_LINEAR

inline __m512 load_bf16(const at::BFloat16* p, __mmask16 mask) {
  const __m256i v = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline void store_bf16(at::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// e^x: 2^n * 2^f, n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor
// polynomial of degree 6 (relative error ~2e-7, far below bfloat16's 4e-3).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  for (float c : {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u = g * u / (1 + e^-g)
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  return _mm512_div_ps(_mm512_mul_ps(g, u), den);
}

struct Epilogue {
  const float* bias;          // [blocks * BN], in the packed block order; may be null
  const at::BFloat16* add;    // [M, n_out] row stride lda; may be null
  int64_t lda;
  bool gated;
  bool float_out;             // y in float32 (the LM head's logits), not rounded to bfloat16
};

// Float32 output (the LM head's logits, 12.6 MB at 64 rows) goes out with
// streaming stores: written once here and read once by the sampler, its
// lines are not worth reading in before they are written (what a plain
// store does). Measured (the forward at 64 x 256, one process, alternated,
// 2026-12-02): 40.09 -> 39.13 and 40.23 -> 38.64 ms; the head and the
// argmax after a step's matmuls 3.67 -> 2.81 and 3.78 -> 3.04 ms; 1 and 8
// rows unchanged (10.28 / 10.25, 13.73 / 13.47 ms). The writing threads
// fence their streaming stores before the region's end.
inline void store_float(float* p, __m512 v, __mmask16 mask) {
  if (mask == __mmask16(0xFFFF) && (reinterpret_cast<uintptr_t>(p) & 63) == 0) {
    _mm512_stream_ps(p, v);
  } else {
    _mm512_mask_storeu_ps(p, mask, v);
  }
}

// One task's float32 tile(s) c [rows, BN] (two for a gated task: gate, up)
// into y's columns col0.. (at most BN of them, fewer in the last block).
void finish_tile(const float* c, int64_t rows, int64_t tile_rows, const float* bias, const Epilogue& e,
                 void* y, int64_t ldy, int64_t row0, int64_t col0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 mask = cols - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - j)) - 1);
      __m512 v = _mm512_loadu_ps(c + r * BN + j);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
      if (e.gated) {
        __m512 u = _mm512_loadu_ps(c + (tile_rows + r) * BN + j);
        if (bias) u = _mm512_add_ps(u, _mm512_loadu_ps(bias + BN + j));
        v = silu_mul(v, u);
      }
      if (e.add) v = _mm512_add_ps(v, load_bf16(e.add + (row0 + r) * e.lda + col0 + j, mask));
      const int64_t at = (row0 + r) * ldy + col0 + j;
      if (e.float_out) {
        store_float(static_cast<float*>(y) + at, v, mask);
      } else {
        store_bf16(static_cast<at::BFloat16*>(y) + at, v, mask);
      }
    }
  }
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// y = x / sqrt(mean(x^2) + eps) for one row of H values: float32 inside,
// rounded once (RMSNorm without its weight, which is folded into the next matmul).
inline void normalize_row(const at::BFloat16* in, at::BFloat16* out, int64_t H, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t j = 0; j < H; j += 16) {
    const __m512 v = load_bf16(in + j, tail_mask(H - j));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / H + eps));
  for (int64_t j = 0; j < H; j += 16) {
    const __mmask16 m = tail_mask(H - j);
    store_bf16(out + j, _mm512_mul_ps(load_bf16(in + j, m), scale), m);
  }
}


#ifdef BS_AMX
// ---- the AMX loop for 17 to 64 rows ---------------------------------------------------------
// brgemm is slower there than at 16 rows by more than the extra products
// (the model's matmuls at 17 rows 16.5 ms against 12.7 at 16), and at 64
// rows a decode step's matmuls took ~19.5 ms against the weights' ~11 ms at
// the read rate: the weight stream and the products added up instead of
// overlapping. This loop takes one task's rows (up to 4 tiles of 16) against
// its block's 64 columns, in chunks of 256 of K: each chunk's weights
// (32 KiB) are read from memory once and used by every row tile from L1,
// the 16 x 64 float32 result of each row tile kept in c between chunks.
// While it runs, it prefetches the weights of the thread's next task into
// L2, two lines of every KiB (the L2's own streamer fetches the rest; every
// line by software takes the core's fill buffers from the tile loads).
// Measured (the model's matmuls, python -m bench.linear_bench's step, one
// process, the variants alternated, 2026-12-02), ms at 17 / 24 / 40 / 48 /
// 56 / 64 rows:
//   brgemm                     14.20 14.45 17.18 17.12 18.53 19.61
//   row tiles over the whole K 13.19 13.40 15.84 16.45 18.34 19.38
//   chunks of 256 + prefetch   12.78 12.81 14.12 14.65 16.21 16.99
// and at 64 rows: chunks alone (128) 19.39, the prefetch alone 18.06-18.27;
// chunks of 64 / 128 / 192 / 288 with it 20.04 / 17.42 / 16.83-16.92 / 17.46;
// prefetching one line per KiB 17.50, two per 2 KiB 17.46, four per KiB
// 17.44, every line 17.90. The products are the same, in the same order
// (a chunk's float32 sums go through memory exactly): bit-identical to
// brgemm's. brgemm keeps 1-16 rows (this loop was 4-8% slower there).
// Measured and not kept, before the chunks: T0/T1 prefetch of the weights
// 2-16 KiB ahead (no gain); sub-blocks of 16 columns packed contiguously with
// every weight tile used by all row tiles at once (no gain at 64 rows, 16%
// slower at 256). With the chunks: 2 x 2 quadrants of 32 x 32 over the whole
// K, the next call's first blocks prefetched during a call's last tasks, row
// tiles of 32 for calls of few blocks (bench/RESULTS.md, 2026-12-02).
//
// Tiles: tmm0-3 C (16 rows x 16 columns each: the block's 64), tmm4/7 A (16
// rows x 32 deep, alternating between K steps), tmm5/6 B (16 K pairs x 16
// columns of the block's VNNI layout, alternating). A K step reads the
// block's 4 KiB of weights for it in order; a row tile of fewer than 16 rows
// reads a zero-padded copy (its extra rows' results are never stored).
constexpr int64_t kAmxKChunk = 256;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig cfg;  // every tile 16 rows of 64 bytes
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Prefetch of the next task's weights, spread over this task's K steps:
// two lines of each KiB from `next` on.
struct WeightPrefetch {
  const char* next = nullptr;
  int64_t kib = 0;       // KiB of it left
  int64_t per_step = 0;  // KiB per K step
  void step() {
    for (int64_t i = 0; i < per_step && kib > 0; ++i, --kib, next += 1024) {
      _mm_prefetch(next, _MM_HINT_T1);
      _mm_prefetch(next + 64, _MM_HINT_T1);
    }
  }
};

// One K step: A (tile TA) times the block's four B tiles into C0-3.
#define BS_AMX_STEP(TA, k)                                 \
  do {                                                     \
    const at::BFloat16* wk = w + (k) * BN;                 \
    _tile_loadd(TA, a + (k), lda);                         \
    pf.step();                                             \
    _tile_loadd(5, wk, BN * 4);                            \
    _tile_dpbf16ps(0, TA, 5);                              \
    _tile_loadd(6, wk + 32, BN * 4);                       \
    _tile_dpbf16ps(1, TA, 6);                              \
    _tile_loadd(5, wk + 64, BN * 4);                       \
    _tile_dpbf16ps(2, TA, 5);                              \
    _tile_loadd(6, wk + 96, BN * 4);                       \
    _tile_dpbf16ps(3, TA, 6);                              \
  } while (0)

// c [tiles * 16, BN] float32 (row stride BN) = the row tiles a[m] (row
// stride lda[m] bytes, 16 rows each) @ one packed block w [K/2, BN, 2].
inline void amx_block(const at::BFloat16* const* a_tiles, const int64_t* lda_tiles, int tiles,
                      const at::BFloat16* w, int64_t K, float* c, WeightPrefetch& pf) {
  for (int64_t k0 = 0; k0 < K; k0 += kAmxKChunk) {
    const int64_t k1 = std::min(K, k0 + kAmxKChunk);
    for (int m = 0; m < tiles; ++m) {
      float* cm = c + m * 16 * BN;
      if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, cm, BN * 4);
        _tile_loadd(1, cm + 16, BN * 4);
        _tile_loadd(2, cm + 32, BN * 4);
        _tile_loadd(3, cm + 48, BN * 4);
      }
      const at::BFloat16* a = a_tiles[m];
      const int64_t lda = lda_tiles[m];
      int64_t k = k0;
      for (; k + 64 <= k1; k += 64) {
        BS_AMX_STEP(4, k);
        BS_AMX_STEP(7, k + 32);
      }
      if (k < k1) BS_AMX_STEP(4, k);
      _tile_stored(0, cm, BN * 4);
      _tile_stored(1, cm + 16, BN * 4);
      _tile_stored(2, cm + 32, BN * 4);
      _tile_stored(3, cm + 48, BN * 4);
    }
  }
}
#undef BS_AMX_STEP
#endif  // BS_AMX

#endif  // BS_LINEAR

inline int threads_for(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
}

// y [M, n_out] = epilogue(x [M, K] @ W.T), W packed as above. norm_eps >= 0:
// x's rows are RMS-normalized first (as rms_norm below, bit for bit), in the
// same parallel region: the norm before a matmul costs no call of its own.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t n_out, bool gated,
                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& add, bool float_out,
                  double norm_eps) {
  TORCH_CHECK(supported(), "the native linear needs AMX or AVX512_BF16 (and a build with them)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(2) == BN && w.size(3) == 2, "w must be packed blocks");
  const int64_t M = x.size(0), K = w.size(1) * 2, blocks = w.size(0), per_task = gated ? 2 : 1;
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(blocks % per_task == 0 && n_out <= blocks / per_task * BN, "n_out does not fit the blocks");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks * BN,
                        "bias must be float32 in the packed block order");
  if (add) TORCH_CHECK(add->scalar_type() == at::kBFloat16 && add->dim() == 2 && add->size(0) == M &&
                       add->size(1) == n_out && add->stride(1) == 1, "add must be [rows, n_out] bfloat16");
  at::Tensor y = at::empty({M, n_out}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0 || n_out == 0) return y;
#ifdef BS_LINEAR
  const int64_t tile = M < 256 ? 64 : 128;
  const int64_t tiles = (M + tile - 1) / tile, units = blocks / per_task, tasks = units * tiles;
  const bool norm = norm_eps >= 0;
  // the normalized rows, when asked for: what the products read
  at::Tensor xn = norm ? at::empty({M, K}, x.options()) : at::Tensor();
  const auto* x_in = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
  auto* xn_p = norm ? reinterpret_cast<at::BFloat16*>(xn.data_ptr()) : nullptr;
  const at::BFloat16* xp = norm ? xn_p : x_in;
  const auto* wp = reinterpret_cast<const at::BFloat16*>(w.data_ptr());
  void* yp = y.data_ptr();
  const Epilogue e{bias ? bias->data_ptr<float>() : nullptr,
                   add ? reinterpret_cast<const at::BFloat16*>(add->data_ptr()) : nullptr, add ? add->stride(0) : 0,
                   gated, float_out};
  const int64_t ld_in = x.stride(0), ldx = norm ? K : ld_in, ldy = y.stride(0);
  // the AMX loop for a few rows (see above); brgemm from there on
  const bool amx = M >= kAmxMinRows && M <= kAmxMaxRows && K % 32 == 0 && amx_usable();
  const int64_t full_rows = M / 16 * 16;  // rows in whole 16-row tiles; the rest (AMX) read a padded copy
  const int threads = threads_for(tasks);
#pragma omp parallel num_threads(threads)
  {
    if (norm) {
#pragma omp for  // its implicit barrier: every row is ready before any product
      for (int64_t r = 0; r < M; ++r)
        normalize_row(x_in + r * ld_in, xn_p + r * K, K, static_cast<float>(norm_eps));
    }
    std::vector<float> c(per_task * tile * BN);
#ifdef BS_AMX
    std::vector<at::BFloat16> pad;
    if (amx) {
      configure_tiles();
      if (full_rows < M) {
        pad.assign(16 * K, at::BFloat16(0.0f));
        for (int64_t r = full_rows; r < M; ++r)
          std::copy(xp + r * ldx, xp + r * ldx + K, pad.data() + (r - full_rows) * K);
      }
    }
#endif
#pragma omp for schedule(dynamic, 1)  // a thread that loses its core for a moment leaves its blocks to the other (quiet: as fast as static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t unit = t / tiles, row0 = (t % tiles) * tile, rows = std::min(tile, M - row0);
#ifdef BS_AMX
      if (amx) {
        const at::BFloat16* a_tiles[4];
        int64_t lda_tiles[4];
        int row_tiles = 0;
        for (int64_t m0 = 0; m0 < rows; m0 += 16, ++row_tiles) {
          const bool whole = row0 + m0 + 16 <= full_rows;
          a_tiles[row_tiles] = whole ? xp + (row0 + m0) * ldx : pad.data();
          lda_tiles[row_tiles] = (whole ? ldx : K) * 2;
        }
        // this thread's next task, as dynamic scheduling mostly hands them out: t + threads
        WeightPrefetch pf;
        if (t + threads < tasks) {
          pf.next = reinterpret_cast<const char*>(wp + (t + threads) / tiles * per_task * K * BN);
          pf.kib = per_task * K * BN * 2 / 1024;
          const int64_t steps = per_task * row_tiles * ((K + 31) / 32);
          pf.per_step = (pf.kib + steps - 1) / steps;
        }
        for (int64_t h = 0; h < per_task; ++h)
          amx_block(a_tiles, lda_tiles, row_tiles, wp + (unit * per_task + h) * K * BN, K, c.data() + h * tile * BN,
                    pf);
      } else
#endif
      for (int64_t h = 0; h < per_task; ++h) {
        const int64_t b = unit * per_task + h;
        at::native::cpublas::brgemm(rows, BN, K, ldx, BN, BN, false, xp + row0 * ldx, wp + b * K * BN,
                                    c.data() + h * tile * BN);
      }
      const int64_t col0 = unit * BN;
      finish_tile(c.data(), rows, tile, e.bias ? e.bias + unit * per_task * BN : nullptr, e, yp, ldy, row0, col0,
                  std::min(BN, n_out - col0));
    }
    if (float_out) _mm_sfence();  // the streaming stores, visible before the barrier
    // each releases the tile state it configured; brgemm's release also
    // forgets which kernel configured the tiles last, so brgemm configures
    // them again on its next call, wherever our loop ran in between
#ifdef BS_AMX
    if (amx) _tile_release();
    else
#endif
      at::native::cpublas::brgemm_release();
  }
#endif
  return y;
}


// Rows in parallel only when there is enough work to pay for waking threads.
inline int row_threads(int64_t rows, int64_t per_row) { return threads_for(rows * per_row / 65536 + 1); }

// ---- portable rows (any CPU): what the quantized layers' steps use where the
// AVX512 ones above are not built, in bfloat16 or float32 (E). Plain loops in
// a fixed order (8 partial sums), float32 inside, rounded once; the compiler
// vectorizes them for the machine. One build gives one set of bits: the
// modules' path and the stack below call the same functions.

template <typename E>
inline void normalize_row_portable(const E* in, E* out, int64_t H, float eps) {
  float part[8] = {};
  int64_t j = 0;
  for (; j + 8 <= H; j += 8)
    for (int l = 0; l < 8; ++l) {
      const float v = static_cast<float>(in[j + l]);
      part[l] += v * v;
    }
  for (int l = 0; j < H; ++j, ++l) {
    const float v = static_cast<float>(in[j]);
    part[l] += v * v;
  }
  const float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (j = 0; j < H; ++j) out[j] = static_cast<E>(static_cast<float>(in[j]) * scale);
}

// One token's heads [heads, 2 * half] in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
template <typename E>
inline void rope_row_portable(E* x, const E* c, const E* s, int64_t heads, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    E* p = x + h * 2 * half;
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = static_cast<float>(p[j]), x2 = static_cast<float>(p[half + j]);
      const float cj = static_cast<float>(c[j]), sj = static_cast<float>(s[j]);
      p[j] = static_cast<E>(x1 * cj - x2 * sj);
      p[half + j] = static_cast<E>(x2 * cj + x1 * sj);
    }
  }
}

template <typename F>
void with_activation_type(at::ScalarType t, const F& f) {
  if (t == at::kBFloat16) return f(at::BFloat16());
  TORCH_CHECK(t == at::kFloat, "activations must be bfloat16 or float32, got ", t);
  f(0.0f);
}

// A quantized product's epilogue (model_proc/quant/: its float32 output y
// [M, R]) into `dtype` (bfloat16 or float32) [M, n_out]: + bias, then
// SiLU(gate) * up when gated (gate the first n_out columns of y, up the next
// n_out), then + add (the residual, in `dtype`), in float32, rounded once.
constexpr int64_t kFinishColumns = 256;

at::Tensor finish(const at::Tensor& y, int64_t n_out, bool gated, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& add, at::ScalarType dtype) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1, "y must be [rows, R] float32");
  const int64_t M = y.size(0), R = y.size(1), ldy = y.stride(0);
  TORCH_CHECK(R == (gated ? 2 : 1) * n_out, "y has ", R, " columns for n_out ", n_out, gated ? " gated" : "");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == R,
                        "bias must be float32 [", R, "]");
  if (add) TORCH_CHECK(add->scalar_type() == dtype && add->dim() == 2 && add->size(0) == M &&
                       add->size(1) == n_out && add->stride(1) == 1, "add must be [rows, n_out] of the output dtype");
  at::Tensor out = at::empty({M, n_out}, y.options().dtype(dtype));
  with_activation_type(dtype, [&](auto e) {
    using E = decltype(e);
    const float* yp = y.data_ptr<float>();
    const float* b = bias ? bias->data_ptr<float>() : nullptr;
    const E* ap = add ? reinterpret_cast<const E*>(add->data_ptr()) : nullptr;
    const int64_t lda = add ? add->stride(0) : 0;
    E* op = reinterpret_cast<E*>(out.data_ptr());
    // Pieces of kFinishColumns columns: the gate's exp costs ~20 plain ops an element, so a
    // decode step's one row (1536 gated columns: ~4% of its time on one thread) is split too
    const int64_t pieces = (n_out + kFinishColumns - 1) / kFinishColumns;
    const int threads = gated ? threads_for(M * pieces) : row_threads(M, R);
#pragma omp parallel for num_threads(threads)
    for (int64_t i = 0; i < M * pieces; ++i) {
      const int64_t r = i / pieces, j0 = i % pieces * kFinishColumns;
      const float* row = yp + r * ldy;
      for (int64_t j = j0; j < std::min(n_out, j0 + kFinishColumns); ++j) {
        float v = b ? row[j] + b[j] : row[j];
        if (gated) {
          const float u = b ? row[n_out + j] + b[n_out + j] : row[n_out + j];
          v = v * u / (1.0f + std::exp(-v));
        }
        if (ap) v += static_cast<float>(ap[r * lda + j]);
        op[r * n_out + j] = static_cast<E>(v);
      }
    }
  });
  return out;
}

// y = x / sqrt(mean(x^2) + eps), per row of x [rows, H] (the weight is folded
// into the next matmul). Any CPU: bfloat16 on the AVX512 row above where
// built; else, and for float32, the portable one.
at::Tensor rms_norm(const at::Tensor& x, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, H] with contiguous rows");
  const int64_t rows = x.size(0), H = x.size(1), ldx = x.stride(0);
  at::Tensor y = at::empty({rows, H}, x.options());
  with_activation_type(x.scalar_type(), [&](auto e) {
    using E = decltype(e);
    const E* xp = reinterpret_cast<const E*>(x.data_ptr());
    E* yp = reinterpret_cast<E*>(y.data_ptr());
#pragma omp parallel for num_threads(row_threads(rows, H))
    for (int64_t r = 0; r < rows; ++r) {
#ifdef BS_LINEAR
      if constexpr (std::is_same_v<E, at::BFloat16>) {
        if (supported()) {
          normalize_row(xp + r * ldx, yp + r * H, H, static_cast<float>(eps));
          continue;
        }
      }
#endif
      normalize_row_portable(xp + r * ldx, yp + r * H, H, static_cast<float>(eps));
    }
  });
  return y;
}

// Rotary in place, rotate-half layout: x [T, heads, D] (heads contiguous, any
// row stride: q and k heads inside the fused qkv output), cos/sin [T, 1, D/2]
// (or [T, D/2]), all bfloat16 or all float32. With x = (x1, x2):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [T, heads, D] with contiguous heads");
  const int64_t T = x.size(0), heads = x.size(1), half = x.size(2) / 2, ldx = x.stride(0);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->numel() == T * half,
                "cos/sin must be [T, D/2] of x's dtype, contiguous");
  const int threads = row_threads(T, heads * half * 2);
#ifdef BS_LINEAR
  if (x.scalar_type() == at::kBFloat16 && supported()) {
    auto* xp = reinterpret_cast<at::BFloat16*>(x.data_ptr());
    const auto* cp = reinterpret_cast<const at::BFloat16*>(cos.data_ptr());
    const auto* sp = reinterpret_cast<const at::BFloat16*>(sin.data_ptr());
#pragma omp parallel for num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < half; j += 16) {
        const __mmask16 m = tail_mask(half - j);
        const __m512 c = load_bf16(cp + t * half + j, m), s = load_bf16(sp + t * half + j, m);
        for (int64_t h = 0; h < heads; ++h) {
          at::BFloat16* p = xp + t * ldx + h * 2 * half;
          const __m512 x1 = load_bf16(p + j, m), x2 = load_bf16(p + half + j, m);
          store_bf16(p + j, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), m);
          store_bf16(p + half + j, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), m);
        }
      }
    }
    return;
  }
#endif
  with_activation_type(x.scalar_type(), [&](auto e) {
    using E = decltype(e);
    E* xp = reinterpret_cast<E*>(x.data_ptr());
    const E* cp = reinterpret_cast<const E*>(cos.data_ptr());
    const E* sp = reinterpret_cast<const E*>(sin.data_ptr());
#pragma omp parallel for num_threads(threads)
    for (int64_t t = 0; t < T; ++t) rope_row_portable(xp + t * ldx, cp + t * half, sp + t * half, heads, half);
  });
}

// Per row of x [rows, V] float32 (logits): the index of its largest value,
// the first of equal ones, a NaN counting as the largest (torch's argmax
// semantics). Two passes: the row's max (and whether it holds a NaN), then
// the first index holding it; the row is in L2 for the second.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(supported(), "the native argmax needs AVX512_BF16");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be [rows, V] float32 with contiguous rows");
  const int64_t rows = x.size(0), V = x.size(1), ldx = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
#ifdef BS_LINEAR
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma omp parallel for num_threads(row_threads(rows, V))
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = xp + r * ldx;
    __m512 mx = neg_inf;
    __mmask16 nan = 0;
    for (int64_t j = 0; j < V && !nan; j += 16) {
      const __m512 v = _mm512_mask_loadu_ps(neg_inf, tail_mask(V - j), p + j);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    int64_t best = 0;
    if (nan) {
      while (!std::isnan(p[best])) ++best;
    } else {
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      for (int64_t j = 0; j < V; j += 16) {
        const __mmask16 mask = tail_mask(V - j);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(mask, _mm512_maskz_loadu_ps(mask, p + j), m, _CMP_EQ_OQ);
        if (hit) {
          best = j + __builtin_ctz(hit);
          break;
        }
      }
    }
    op[r] = best;
  }
#endif
  return out;
}

// ---- a step's decoder layers in one call ---------------------------------------------------
// What model.py's layers do for a step (the native path: bfloat16, one rank),
// without returning to Python between ops: per layer the fused q/k/v matmul
// with the input norm, rotary on q and k, the KV store and attention
// (attention.cpp's `decode` / `extend`, called through their addresses, over
// the step's parts: one, or a mixed step's extend rows then its decoding
// rows), o_proj + the residual, gate/up with the post-attention norm,
// down_proj + the residual. Same ops, same arguments, same order as the
// Python path: the same bits. Python's part of a step was ~40 us a layer
// (module calls, views, argument checks) and a GIL release and re-acquire
// around every native call.

using AttentionFn = at::Tensor (*)(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&);
using DecodeFn = at::Tensor (*)(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&);

// Tokens [start, start + count) of a step and the attention metadata of their
// rows: decode (one token a row; kv_indptr, kv_indices, max_len) or extend
// (qo_indptr too). loc: their KV slots.
struct AttnPart {
  bool decode;
  int64_t start, count, max_len;
  at::Tensor qo_indptr, kv_indptr, kv_indices, loc;
};

template <typename Fn>
Fn capsule_fn(const pybind11::capsule& c, const char* name) {
  TORCH_CHECK(std::string(c.name()) == name, "expected the attention module's ", name);
  return reinterpret_cast<Fn>(c.get_pointer());
}

// A quantized matmul (model_proc/quant/): y float32 [M, N] = x float32 [M, K]
// @ dequantize(W).T for W's GGUF blocks uint8 [N, row_bytes] of a type:
// quant.cpp's `gemv` or quant_dot.cpp's `matmul_q8`, by their addresses.
using QuantMatmulFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t);

// One quantized weight as QuantWeight holds it (model_proc/quant/weight.py):
// row segments, each of one block type, an optional input scale (the norm
// weight before it, which cannot be folded into blocks) and the float32
// bias; its product is QuantWeight.matmul's, the same calls in the same order.
struct QuantMat {
  std::vector<std::pair<int64_t, at::Tensor>> segments;  // (GGUF type, blocks [rows, row_bytes])
  int64_t rows = 0;
  c10::optional<at::Tensor> input_scale, bias;  // float32 [K], [rows]

  at::Tensor product(const at::Tensor& x, QuantMatmulFn fn) const {
    at::Tensor xf = x.to(at::kFloat).contiguous();
    if (input_scale) {  // xf * input_scale, without a tensor op's dispatch (~60 a decode step)
      at::Tensor scaled = at::empty_like(xf);
      const float* in = xf.data_ptr<float>();
      const float* s = input_scale->data_ptr<float>();
      float* out = scaled.data_ptr<float>();
      const int64_t K = xf.size(1);
      TORCH_CHECK(input_scale->numel() == K, "input_scale has ", input_scale->numel(), " values for ", K, " columns");
      for (int64_t r = 0; r < xf.size(0); ++r)
        for (int64_t k = 0; k < K; ++k) out[r * K + k] = in[r * K + k] * s[k];
      xf = std::move(scaled);
    }
    if (segments.size() == 1) return fn(xf, segments[0].second, segments[0].first);
    at::Tensor y = at::empty({x.size(0), rows}, xf.options());
    int64_t at = 0;
    for (const auto& [qtype, blocks] : segments) {
      y.narrow(1, at, blocks.size(0)).copy_(fn(xf, blocks, qtype));
      at += blocks.size(0);
    }
    return y;
  }
};

class DecoderStack {
 public:
  DecoderStack(const pybind11::capsule& decode, const pybind11::capsule& extend, int64_t q_heads, int64_t kv_heads,
               int64_t head_dim, int64_t hidden, int64_t inter, double eps, double scale)
      : decode_(capsule_fn<DecodeFn>(decode, "batchserve.attention.decode")),
        extend_(capsule_fn<AttentionFn>(extend, "batchserve.attention.extend")), q_heads_(q_heads),
        kv_heads_(kv_heads), head_dim_(head_dim), hidden_(hidden), inter_(inter), eps_(eps), scale_(scale) {}

  // one decoder layer's packed weights (Linear.packed / packed_bias) and its KV buffers
  void add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o, c10::optional<at::Tensor> o_bias,
                 at::Tensor gate_up, c10::optional<at::Tensor> gate_up_bias, at::Tensor down,
                 c10::optional<at::Tensor> down_bias, at::Tensor k_buf, at::Tensor v_buf) {
    TORCH_CHECK(quant_layers_.empty(), "a stack holds packed or quantized layers, not both");
    layers_.push_back({std::move(qkv), std::move(qkv_bias), std::move(o), std::move(o_bias), std::move(gate_up),
                       std::move(gate_up_bias), std::move(down), std::move(down_bias), std::move(k_buf),
                       std::move(v_buf)});
  }

  // one decoder layer on quantized weights; gemv: quant.cpp's, q8: quant_dot.cpp's (or None)
  void add_quant_layer(QuantMat qkv, QuantMat o, QuantMat gate_up, QuantMat down, at::Tensor k_buf, at::Tensor v_buf,
                       const pybind11::capsule& gemv, const c10::optional<pybind11::capsule>& q8) {
    TORCH_CHECK(layers_.empty(), "a stack holds packed or quantized layers, not both");
    gemv_ = capsule_fn<QuantMatmulFn>(gemv, "batchserve.quant.gemv");
    q8_ = q8 ? capsule_fn<QuantMatmulFn>(*q8, "batchserve.quant_dot.matmul_q8") : nullptr;
    quant_layers_.push_back({std::move(qkv), std::move(o), std::move(gate_up), std::move(down), std::move(k_buf),
                             std::move(v_buf)});
  }

  // x [tokens, hidden] -> the last layer's output; parts cover the tokens in order.
  // q8: quantized layers' products on 8-bit activations (quant_dot.cpp), else the float gemv
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<AttnPart>& parts, bool q8) const {
    const int64_t n = x.size(0), q_size = q_heads_ * head_dim_;
    int64_t covered = 0;
    for (const AttnPart& p : parts) {
      TORCH_CHECK(p.start == covered && p.count >= 0, "attention parts must cover the tokens in order");
      covered += p.count;
    }
    TORCH_CHECK(covered == n, "attention parts cover ", covered, " tokens of ", n);
    if (!quant_layers_.empty()) return forward_quant(std::move(x), cos, sin, parts, q8);
    const c10::optional<at::Tensor> none;
    for (const Layer& L : layers_) {
      const at::Tensor heads = linear(x, L.qkv, q_size + 2 * kv_heads_ * head_dim_, false, L.qkv_bias, none, false,
                                      eps_).view({n, q_heads_ + 2 * kv_heads_, head_dim_});
      rope_(heads.narrow(1, 0, q_heads_ + kv_heads_), cos, sin);
      const at::Tensor o = attend(heads, L.k_buf, L.v_buf, parts);
      x = linear(o.view({n, q_size}), L.o, hidden_, false, L.o_bias, x, false, -1.0);
      x = linear(linear(x, L.gate_up, inter_, true, L.gate_up_bias, none, false, eps_), L.down, hidden_, false,
                 L.down_bias, x, false, -1.0);
    }
    return x;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size() + quant_layers_.size()); }

 private:
  struct Layer {
    at::Tensor qkv;
    c10::optional<at::Tensor> qkv_bias;
    at::Tensor o;
    c10::optional<at::Tensor> o_bias;
    at::Tensor gate_up;
    c10::optional<at::Tensor> gate_up_bias;
    at::Tensor down;
    c10::optional<at::Tensor> down_bias;
    at::Tensor k_buf, v_buf;
  };
  struct QuantLayer {
    QuantMat qkv, o, gate_up, down;
    at::Tensor k_buf, v_buf;
  };

  // heads [n, q + 2 kv heads, D] (q and k rotated) -> attention's output [n, q heads, D], K/V stored
  at::Tensor attend(const at::Tensor& heads, const at::Tensor& k_buf, const at::Tensor& v_buf,
                    const std::vector<AttnPart>& parts) const {
    at::Tensor o = at::empty({heads.size(0), q_heads_, head_dim_}, heads.options());
    for (const AttnPart& p : parts) {
      const at::Tensor rows = heads.narrow(0, p.start, p.count);
      const at::Tensor q = rows.narrow(1, 0, q_heads_), k = rows.narrow(1, q_heads_, kv_heads_),
                       v = rows.narrow(1, q_heads_ + kv_heads_, kv_heads_);
      at::Tensor out = o.narrow(0, p.start, p.count);
      if (p.decode) {
        decode_(out, q, k_buf, v_buf, p.kv_indptr, p.kv_indices, scale_, p.max_len, k, v, p.loc);
      } else {
        extend_(out, q, k_buf, v_buf, p.qo_indptr, p.kv_indptr, p.kv_indices, scale_, k, v, p.loc);
      }
    }
    return o;
  }

  // The modules' path on quantized weights (layers.py Linear._quantized_forward): the
  // norm (rms_norm), the product (QuantMat), its epilogue (finish), rotary (rope_)
  at::Tensor forward_quant(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                           const std::vector<AttnPart>& parts, bool q8) const {
    const int64_t n = x.size(0), q_size = q_heads_ * head_dim_;
    const QuantMatmulFn fn = q8 && q8_ ? q8_ : gemv_;
    const at::ScalarType dt = x.scalar_type();
    const c10::optional<at::Tensor> none;
    for (const QuantLayer& L : quant_layers_) {
      const at::Tensor heads = finish(L.qkv.product(rms_norm(x, eps_), fn), L.qkv.rows, false, L.qkv.bias, none, dt)
                                   .view({n, q_heads_ + 2 * kv_heads_, head_dim_});
      rope_(heads.narrow(1, 0, q_heads_ + kv_heads_), cos, sin);
      const at::Tensor o = attend(heads, L.k_buf, L.v_buf, parts);
      x = finish(L.o.product(o.view({n, q_size}), fn), hidden_, false, L.o.bias, x, dt);
      const at::Tensor h = finish(L.gate_up.product(rms_norm(x, eps_), fn), inter_, true, L.gate_up.bias, none, dt);
      x = finish(L.down.product(h, fn), hidden_, false, L.down.bias, x, dt);
    }
    return x;
  }

  DecodeFn decode_;
  AttentionFn extend_;
  QuantMatmulFn gemv_ = nullptr, q8_ = nullptr;
  int64_t q_heads_, kv_heads_, head_dim_, hidden_, inter_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  std::vector<QuantLayer> quant_layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("linear", &linear, "y = epilogue(x @ W.T), W in packed blocks (see layers.cpp)", py::arg("x"), py::arg("w"),
        py::arg("n_out"), py::arg("gated"), py::arg("bias"), py::arg("add"), py::arg("float_out") = false,
        py::arg("norm_eps") = -1.0, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm without weight, per row, float32 inside", py::arg("x"), py::arg("eps"));
  m.def("rope_", &rope_, "rotary in place (rotate-half layout), float32 inside", py::arg("x"), py::arg("cos"),
        py::arg("sin"));
  m.def("argmax_rows", &argmax_rows, "per row, the index of the largest value (the first; NaN largest)",
        py::arg("x"));
  m.def("supported", &supported,
        "whether this build and CPU can run `linear` (AMX or AVX512_BF16); rms_norm, rope_ and finish run anywhere");
  m.attr("block_columns") = BN;
  py::class_<AttnPart>(m, "AttnPart", "a step's tokens [start, start + count) and their rows' attention metadata")
      .def(py::init([](bool decode, int64_t start, int64_t count, int64_t max_len,
                       const c10::optional<at::Tensor>& qo_indptr, at::Tensor kv_indptr, at::Tensor kv_indices,
                       at::Tensor loc) {
             TORCH_CHECK(decode || qo_indptr.has_value(), "an extend part needs qo_indptr");
             return AttnPart{decode, start, count, max_len, qo_indptr.value_or(at::Tensor()), std::move(kv_indptr),
                             std::move(kv_indices), std::move(loc)};
           }),
           py::arg("decode"), py::arg("start"), py::arg("count"), py::arg("max_len"), py::arg("qo_indptr"),
           py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("loc"));
  py::class_<QuantMat>(m, "QuantMat", "a quantized weight's segments, input scale and bias (see QuantMat)")
      .def(py::init([](std::vector<std::pair<int64_t, at::Tensor>> segments, c10::optional<at::Tensor> input_scale,
                       c10::optional<at::Tensor> bias) {
             int64_t rows = 0;
             for (const auto& [qtype, blocks] : segments) {
               TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "blocks must be uint8 [rows, bytes]");
               rows += blocks.size(0);
             }
             TORCH_CHECK(!segments.empty(), "a quantized weight has at least one segment");
             if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == rows, "bias: float32 [rows]");
             if (input_scale) TORCH_CHECK(input_scale->scalar_type() == at::kFloat && input_scale->is_contiguous(),
                                          "input_scale: float32 [K], contiguous");
             return QuantMat{std::move(segments), rows, std::move(input_scale), std::move(bias)};
           }),
           py::arg("segments"), py::arg("input_scale"), py::arg("bias"));
  m.def("finish", &finish,
        "a quantized product's epilogue: float32 y -> dtype (bfloat16 or float32): + bias, SiLU(gate) * up, + add",
        py::arg("y"), py::arg("n_out"), py::arg("gated"), py::arg("bias"), py::arg("add"), py::arg("dtype"),
        py::call_guard<py::gil_scoped_release>());
  py::class_<DecoderStack>(m, "DecoderStack", "a step's decoder layers in one call (see layers.cpp)")
      .def(py::init<const py::capsule&, const py::capsule&, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                    double>(),
           py::arg("decode_fn"), py::arg("extend_fn"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("hidden"), py::arg("inter"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DecoderStack::add_layer, py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"),
           py::arg("o_bias"), py::arg("gate_up"), py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"),
           py::arg("k_buf"), py::arg("v_buf"))
      .def("add_quant_layer", &DecoderStack::add_quant_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("k_buf"), py::arg("v_buf"), py::arg("gemv_fn"), py::arg("q8_fn"))
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("parts"),
           py::arg("q8") = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
  m.def("set_amx", [](bool on) { amx_enabled = on; },
        "whether the AMX loop takes 17-64 rows where it can run (the default), or brgemm every call");
  m.def("amx_enabled", [] { return amx_enabled; }, "the switch set_amx sets");
}
