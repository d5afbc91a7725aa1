// Sluice's native CPU kernel: activations times int8 weights in 32-value blocks
// (llama.cpp's Q8_0 granularity: one f32 scale per block of a weight row). Each block is
// dequantized in registers to bf16 and multiplied with the activations rounded to bf16
// by AVX-512 BF16 dot products (two products a lane, summed in f32).
//
// Registered with XLA as the FFI target "sluice_q8_linear" (cpu_kernels/native.py
// builds and loads it; model/quant.py calls it). Why it exists: a step of a few token
// rows is bound by reading the weights; int8 weights are a quarter of f32's bytes, and
// XLA:CPU materialises any dequantization done inside the jit (it ran slower than f32,
// docs/history/benchmarks-log.md). bf16 dots do twice the f32 FMA's work per instruction once
// the weights are dequantized (once per block, for every row); Q8_0 x Q8_0 with VNNI
// int8 dots cost as much here, each block being rescaled in f32 per row, and was less
// accurate (docs/benchmarks.md, "int8 weights").
//
// Where the CPU has AMX (Intel since Sapphire Rapids; built with -march=native, so the
// compiler says), every row count goes through the tile unit instead: each block of a
// 16-column group is dequantized into a 16 x 32 bf16 tile and multiplied with the
// activations, 16 rows at a time, by TDPBF16PS (16 x 16 x 32 products an instruction)
// while the vector unit dequantizes the next block. The dequantization, once per weight
// whatever the row count, is then most of the work: 16 rows cost about what one does
// (2-core Sapphire Rapids, 30 layers of the embedded model: 11 ms at 1 row, 15 at 16,
// 89 at 272, against 15 / 28 / 369 for the AVX-512 path; docs/history/benchmarks-log.md). The OS
// must grant the tile state (arch_prctl); where it does not, the AVX-512 path runs. A
// row's result does not depend on the other rows of its call in either path (each sums
// its blocks in one order).
//
// Layouts:
//   w     uint8 [L, Np, K]: weight (out n, in k) of layer l, stored as q + 128, q in
//         [-127, 127], packed: columns in groups of 16, a group's blocks in order
//         [K/32][16][32] (block b of its 16 columns side by side), so that a group reads
//         its weights as one sequential stream; Np is N rounded up to 16 (zero columns).
//         With the attribute layout = 1 (the AVX2 path's, packed where it runs) a block
//         is [32][16] instead: the 16 columns of one k side by side;
//   ws    f32   [L, Np, K/32]: the scale of each 32-value block, packed the same way
//         ([Np/16][K/32][16]);
//   x     f32   [K, T] (feature_major) or [T, K];
//   layer int32 []: which of the L layers;
//   out   f32   [N, T] (feature_major) or [T, N].
// The AMX and AVX-512 paths read layout 0 only; AVX2 and portable read both.
// K must be a multiple of 32. Work is split over XLA's intra-op thread pool by column
// ranges; the calling thread works too and waits for the rest.
//
// Where the CPU has AVX2 and FMA but no AVX-512 (AMD before Zen 4, older Intel, many
// cloud machines), the same weights multiply in f32 FMAs on 8 lanes, without bf16's
// rounding (see the AVX2 section). Without AVX2, a portable loop computes it
// one product at a time: correct, but slower than XLA's f32, so "auto" settings do not
// choose int8 there (native.py, `fast`).
//
// (About 770 lines: the AMX, AVX-512, AVX2 and portable paths compute their definitions
// from one packing (the AVX2 path's own block order beside it) behind one entry point;
// they stay in one file so that they change together.)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "dense_rows.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The AVX-512 path multiplies in bf16 dots: AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire
// Rapids on). Skylake-SP, Cascade Lake and Ice Lake have AVX-512 without it: they take
// the AVX2 path.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SLUICE_Q8_AVX512 1
#endif

constexpr int64_t kBlock = 32;  // values per scale
constexpr int64_t kGroup = 16;  // columns packed together
constexpr int64_t kSub = 4;     // columns of a register tile (AVX-512 paths)
constexpr int64_t kAhead = 8;   // blocks of weights prefetched ahead (AMX path)



// float -> bf16 bits, rounding to nearest even (as the AVX-512 conversion does), and back.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

using sluice::Out;

#ifdef SLUICE_Q8_AVX512
// Rows [m0, m0 + MT) by columns j0..j0 + NT of the group of 4 whose packed weights start
// at wg (scales at sg); x is bf16 [T, K]; the group's first column is n0.
template <int MT, int NT>
inline void tile(const uint8_t* wg, const float* sg, int j0, const uint16_t* x, int64_t k,
                 int64_t m0, int64_t n0, const Out& out) {
  const int64_t kb = k / kBlock;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  for (int64_t b = 0; b < kb; ++b) {
    __m512bh wv[NT];
    for (int j = 0; j < NT; ++j) {  // dequantize: (u - 128) * s = u * s + (-128 * s)
      const uint8_t* wr = wg + (b * kGroup + j0 + j) * kBlock;
      const __m512 s = _mm512_set1_ps(sg[b * kGroup + j0 + j]);
      const __m512 bias = _mm512_mul_ps(s, minus128);
      const __m128i u0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr));
      const __m128i u1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16));
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u0)), s, bias);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u1)), s, bias);
      wv[j] = _mm512_cvtne2ps_pbh(hi, lo);  // values 0..31 in order
    }
    for (int i = 0; i < MT; ++i) {
      const __m512bh xv =
          (__m512bh)_mm512_loadu_si512(x + (m0 + i) * k + b * kBlock);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j)
      out.set(m0 + i, n0 + j0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

// Every row of the columns j0..j0 + NT of one group: up to 8 rows at a time (one
// dequantization serves all of them).
template <int NT>
void rows(const uint8_t* wg, const float* sg, int j0, const uint16_t* x, int64_t k,
          int64_t t, int64_t n0, const Out& out) {
  int64_t m = 0;
  for (; m + 8 <= t; m += 8) tile<8, NT>(wg, sg, j0, x, k, m, n0, out);
  switch (t - m) {
    case 7: tile<7, NT>(wg, sg, j0, x, k, m, n0, out); break;
    case 6: tile<6, NT>(wg, sg, j0, x, k, m, n0, out); break;
    case 5: tile<5, NT>(wg, sg, j0, x, k, m, n0, out); break;
    case 4: tile<4, NT>(wg, sg, j0, x, k, m, n0, out); break;
    case 3: tile<3, NT>(wg, sg, j0, x, k, m, n0, out); break;
    case 2: tile<2, NT>(wg, sg, j0, x, k, m, n0, out); break;
    case 1: tile<1, NT>(wg, sg, j0, x, k, m, n0, out); break;
    default: break;
  }
}

// Many rows: the group's 4 columns dequantized once into a bf16 buffer ([K/32][4][32],
// 4.5 KB for K = 576: it stays in L1), then every row tile reads them from there: the
// dequantization (7 vector operations a block and column) is not repeated per tile.
template <int MT>
inline void tile_dequantized(const uint16_t* wb, int j0, const uint16_t* x, int64_t k,
                             int64_t m0, int64_t n0, const Out& out) {
  const int64_t kb = k / kBlock;
  __m512 acc[MT][kSub];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kSub; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    __m512bh wv[kSub];
    for (int j = 0; j < kSub; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(wb + (b * kGroup + j0 + j) * kBlock);
    for (int i = 0; i < MT; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * k + b * kBlock);
      for (int j = 0; j < kSub; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kSub; ++j)
      out.set(m0 + i, n0 + j0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

constexpr int64_t kDequantizeOnceRows = 8;  // from this many rows on (measured, 2-core Zen 4)

// The group's blocks dequantized to bf16 into wb ([K/32][16][32]: block b of column j at
// (b * 16 + j) * 32), the layout both the register tiles and AMX's weight tiles read.
void dequantize_blocks(const uint8_t* wg, const float* sg, int64_t b0, int64_t b1,
                       uint16_t* wb) {
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  for (int64_t i = b0 * kGroup; i < b1 * kGroup; ++i) {  // block b, column j: i = b * 16 + j
    const __m512 s = _mm512_set1_ps(sg[i]);
    const __m512 bias = _mm512_mul_ps(s, minus128);
    const uint8_t* wr = wg + i * kBlock;
    const __m128i u0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr));
    const __m128i u1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u0)), s, bias);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u1)), s, bias);
    _mm512_storeu_si512(wb + i * kBlock, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

void group(const uint8_t* wg, const float* sg, const uint16_t* x, int64_t k, int64_t t,
           int64_t n0, const Out& out, int = 0) {
  if (t <= 4) {  // registers: t x 4 accumulators + 4 weight vectors
    for (int j0 = 0; j0 < kGroup; j0 += 4) rows<4>(wg, sg, j0, x, k, t, n0, out);
    return;
  }
  if (t < kDequantizeOnceRows) {  // 8 x 2 accumulators + 2 weight vectors
    for (int j0 = 0; j0 < kGroup; j0 += 2) rows<2>(wg, sg, j0, x, k, t, n0, out);
    return;
  }
  thread_local std::vector<uint16_t> wb;
  const int64_t kb = k / kBlock;
  wb.resize(kb * kGroup * kBlock);
  dequantize_blocks(wg, sg, 0, kb, wb.data());
  for (int j0 = 0; j0 < kGroup; j0 += kSub) {
    int64_t m = 0;  // 6 x 4 accumulators + 4 weight vectors + 1 row
    for (; m + 6 <= t; m += 6) tile_dequantized<6>(wb.data(), j0, x, k, m, n0, out);
    switch (t - m) {
      case 5: tile_dequantized<5>(wb.data(), j0, x, k, m, n0, out); break;
      case 4: tile_dequantized<4>(wb.data(), j0, x, k, m, n0, out); break;
      case 3: tile_dequantized<3>(wb.data(), j0, x, k, m, n0, out); break;
      case 2: tile_dequantized<2>(wb.data(), j0, x, k, m, n0, out); break;
      case 1: tile_dequantized<1>(wb.data(), j0, x, k, m, n0, out); break;
      default: break;
    }
  }
}

#ifdef SLUICE_AMX
// AMX. Tiles 0-3 accumulate C [16 columns][16 rows] f32 for up to 4 row tiles, tile 4
// holds a block of the weights (A: 16 columns x 32 k, bf16) and tiles 5-7 the
// activations' block (B: 16 pairs of k x 16 rows x 2, bf16, "VNNI" order).

// The activations as B tiles: xv[((mt * K/32 + b) * 16 + r) * 32 + m * 2 + i] is
// x[row 16 mt + m][k = 32 b + 2 r + i] as bf16, rows past t zero.
void to_vnni(const float* x, int64_t t, int64_t k, int64_t mtiles, uint16_t* xv) {
  const int64_t kb = k / kBlock;
  std::memset(xv, 0, mtiles * kb * 512 * sizeof(uint16_t));
  for (int64_t m = 0; m < t; ++m) {
    uint16_t* tile = xv + (m / 16) * kb * 512 + (m % 16) * 2;
    for (int64_t i = 0; i < k; ++i) {
      const float v = x[m * k + i];
      tile[(i / kBlock) * 512 + ((i % kBlock) / 2) * 32 + (i % 2)] = bf16_bits(v);
    }
  }
}

// A C tile (columns n0.., rows 16 mt..) goes straight into out where it is whole and out
// is feature-major, else through a buffer (`copy_tile`). The tile's number must be a
// literal for the intrinsic, hence the macro.
inline bool whole(int64_t mt, int64_t t, int64_t n0, const Out& out) {
  return out.rows == nullptr && out.sm == 1 && mt * 16 + 16 <= t && n0 + 16 <= out.n;
}

inline void copy_tile(const float* c, int64_t mt, int64_t t, int64_t n0, const Out& out) {
  const int64_t m0 = mt * 16, mm = std::min<int64_t>(16, t - m0);
  const int64_t nn = std::min<int64_t>(16, out.n - n0);
  for (int64_t n = 0; n < nn; ++n)
    for (int64_t m = 0; m < mm; ++m) out.p[out.at(m0 + m) * out.sm + (n0 + n) * out.sn] = c[n * 16 + m];
}

#define SLUICE_EMIT(TILE, mt)                                                        \
  do {                                                                               \
    if (whole(mt, t, n0, out)) {                                                     \
      _tile_stored(TILE, out.p + n0 * out.sn + (mt) * 16, out.sn * sizeof(float));   \
    } else {                                                                         \
      alignas(64) float c[16 * 16];                                                  \
      _tile_stored(TILE, c, 64);                                                     \
      copy_tile(c, mt, t, n0, out);                                                  \
    }                                                                                \
  } while (0)

// Row tiles mt0.. (up to 4) of one group. The first pass over a group dequantizes each
// block just before its products (wg, sg given), so the tile unit multiplies one block
// while the vector unit dequantizes the next; later passes read wb as it is.
template <int NT>
void amx_tiles(const uint8_t* wg, const float* sg, uint16_t* wb, const uint16_t* xv,
               int64_t kb, int64_t mt0, int64_t t, int64_t n0, const Out& out) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  const uint16_t* x0 = xv + mt0 * kb * 512;
  for (int64_t b = 0; b < kb; ++b) {
    if (wg != nullptr) {
      // The weights stream from memory at a few GB/s a thread unless asked for ahead:
      // a block's 512 bytes and its scales, kAhead blocks on (past the group's end, the
      // next group's: a work item's groups lie one after another).
      const char* ahead = reinterpret_cast<const char*>(wg + (b + kAhead) * kGroup * kBlock);
      for (int i = 0; i < kGroup * kBlock; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sg + (b + kAhead) * kGroup), _MM_HINT_T0);
      dequantize_blocks(wg, sg, b, b + 1, wb);
    }
    _tile_loadd(4, wb + b * 512, 64);
    _tile_loadd(5, x0 + b * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NT > 1) {
      _tile_loadd(6, x0 + (kb + b) * 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(7, x0 + (2 * kb + b) * 512, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NT > 3) {
      _tile_loadd(5, x0 + (3 * kb + b) * 512, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  SLUICE_EMIT(0, mt0);
  if constexpr (NT > 1) SLUICE_EMIT(1, mt0 + 1);
  if constexpr (NT > 2) SLUICE_EMIT(2, mt0 + 2);
  if constexpr (NT > 3) SLUICE_EMIT(3, mt0 + 3);
}

void group_amx(const uint8_t* wg, const float* sg, const uint16_t* xv, int64_t k, int64_t t,
               int64_t n0, const Out& out) {
  thread_local std::vector<uint16_t> wb;
  const int64_t kb = k / kBlock, mtiles = (t + 15) / 16;
  wb.resize(kb * kGroup * kBlock);
  for (int64_t mt = 0; mt < mtiles; mt += 4) {
    const uint8_t* w = mt == 0 ? wg : nullptr;
    switch (std::min<int64_t>(4, mtiles - mt)) {
      case 4: amx_tiles<4>(w, sg, wb.data(), xv, kb, mt, t, n0, out); break;
      case 3: amx_tiles<3>(w, sg, wb.data(), xv, kb, mt, t, n0, out); break;
      case 2: amx_tiles<2>(w, sg, wb.data(), xv, kb, mt, t, n0, out); break;
      default: amx_tiles<1>(w, sg, wb.data(), xv, kb, mt, t, n0, out); break;
    }
  }
}
#endif  // SLUICE_AMX

void to_bf16(const float* src, int64_t count, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  for (; i < count; ++i) dst[i] = bf16_bits(src[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SLUICE_Q8_AVX2 1
// AVX2 + FMA (no AVX-512: AMD before Zen 4, Intel before Skylake-SP, many cloud CPUs).
// There is no bf16 dot here, so nothing is rounded to bf16: a block's weights are
// dequantized exactly as the other paths dequantize them (u * s - 128 s in one FMA, before
// their rounding) and multiplied with the f32 activations in f32 FMAs on 8 lanes: the
// int8 weights' definition, without bf16's rounding of either side (closer to f32; the
// rounding cost as much as the products on one row). A column's 8 lane sums run over
// blocks and their four quarters in one order whatever the rows, then `sum8` (simd.h)
// adds the lanes in one order: a row's result does not depend on its batch.

// Quarter q (values 8q..8q+7) of the block at wr with scale s (bias = -128 s), dequantized.
inline __m256 dequantize8(const uint8_t* wr, int q, __m256 s, __m256 bias) {
  const __m128i u = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + 8 * q));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u)), s, bias);
}

using sluice::sum8;

// Rows [m0, m0 + MT) by the 16 columns of one group, the group's weights read once, in the
// order they are stored ([K/32][16][32]: one sequential stream, which the hardware
// prefetcher follows; walking a few columns at a time instead jumped 512 bytes a block
// and ran 1.5x slower at one row). Each block of a column is dequantized once for the MT
// rows. The 16 x MT lane sums live in L1 (16 columns' accumulators do not fit the 16
// registers), each loaded and stored once a block.
template <int MT>
inline void rows16(const uint8_t* wg, const float* sg, const float* x, int64_t k,
                   int64_t m0, int64_t n0, const Out& out) {
  const int64_t kb = k / kBlock;
  x += m0 * k;
  alignas(32) float acc[MT][kGroup][8] = {};
  const __m256 minus128 = _mm256_set1_ps(-128.f);
  for (int64_t b = 0; b < kb; ++b) {
    for (int j = 0; j < kGroup; ++j) {
      const uint8_t* wr = wg + (b * kGroup + j) * kBlock;
      const __m256 s = _mm256_broadcast_ss(sg + b * kGroup + j);
      const __m256 bias = _mm256_mul_ps(s, minus128);
      __m256 a[MT];
      for (int i = 0; i < MT; ++i) a[i] = _mm256_load_ps(acc[i][j]);
      for (int q = 0; q < 4; ++q) {
        const __m256 w = dequantize8(wr, q, s, bias);
        for (int i = 0; i < MT; ++i)
          a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + b * kBlock + 8 * q), w, a[i]);
      }
      for (int i = 0; i < MT; ++i) _mm256_store_ps(acc[i][j], a[i]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kGroup; ++j) out.set(m0 + i, n0 + j, sum8(_mm256_load_ps(acc[i][j])));
}

// Rows in passes of 8, each reading the group's weights again (from L1/L2 after the
// first: a group is 9-24 KB). Dequantizing the group once into an f32 buffer for many
// rows measured no faster (4% at 272 rows, slower at 16).
void group(const uint8_t* wg, const float* sg, const float* x, int64_t k, int64_t t,
           int64_t n0, const Out& out, int = 0) {
  int64_t m = 0;
  for (; m + 8 <= t; m += 8) rows16<8>(wg, sg, x, k, m, n0, out);
  switch (t - m) {
    case 7: rows16<7>(wg, sg, x, k, m, n0, out); break;
    case 6: rows16<6>(wg, sg, x, k, m, n0, out); break;
    case 5: rows16<5>(wg, sg, x, k, m, n0, out); break;
    case 4: rows16<4>(wg, sg, x, k, m, n0, out); break;
    case 3: rows16<3>(wg, sg, x, k, m, n0, out); break;
    case 2: rows16<2>(wg, sg, x, k, m, n0, out); break;
    case 1: rows16<1>(wg, sg, x, k, m, n0, out); break;
    default: break;
  }
}


// Layout 1 ("k16", what model/quant.py packs where this path runs): a group's block is
// [32 k][16 columns], so 16 columns of one k are one 16-byte load. Its definition here:
// each product row x column is one chain of FMAs over k = 0 .. K-1 in order, from 0
// (the weights dequantized as above), whatever the rows of the call. Two forms compute it:
//   - under kLanesRows rows (`few_rows`), the columns are the lanes: a k's 16 weights
//     dequantized in two vectors, an activation broadcast, 1-2 groups' accumulators in
//     registers a block, in passes of up to 6 rows (two groups at one row: chains enough
//     for the FMA's latency; four spilled);
//   - from kLanesRows rows (`group_lanes`), the rows are the lanes: the activations
//     transposed to [K][rows], each block dequantized into L1 and each weight broadcast
//     for 16 rows, 12 accumulators (6 columns x 16 rows) a block: one load a two FMAs,
//     1.2-1.35x the rate of `rows16` from 16 rows; under 16 rows about its rate
//     (docs/history/benchmarks-log.md, "The AVX2 int8 kernel's own block order").
constexpr int64_t kLanesRows = 16;

// Columns [0, 8) and [8, 16) of k row i of block b (layout 1), dequantized.
inline void dequantize_k16(const uint8_t* wg, int64_t b, int64_t i, __m256 s0, __m256 s1,
                           __m256 b0, __m256 b1, __m256& w0, __m256& w1) {
  const uint8_t* p = wg + (b * kBlock + i) * kGroup;
  const __m128i u0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i u1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u0)), s0, b0);
  w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u1)), s1, b1);
}

// One block of few_rows: acc[(m * G + g) * 2 + h] (8 lanes each, L1) += the block's
// products; in registers for the block's 32 k (GCC kept an accumulator array live across
// blocks in memory, a store a FMA).
template <int MT, int G>
inline void few_block(const uint8_t* wg, const float* sg, int64_t gw, int64_t gs,
                      const float* xr, int64_t k, int64_t b, float* acc) {
  constexpr int kAcc = MT * G * 2;
  const __m256 minus128 = _mm256_set1_ps(-128.f);
  __m256 s[2 * G], bias[2 * G], a[kAcc];
  for (int j = 0; j < 2 * G; ++j) {
    s[j] = _mm256_loadu_ps(sg + (j / 2) * gs + b * kGroup + 8 * (j % 2));
    bias[j] = _mm256_mul_ps(s[j], minus128);
  }
  for (int j = 0; j < kAcc; ++j) a[j] = _mm256_load_ps(acc + 8 * j);
  for (int64_t i = 0; i < kBlock; ++i) {
    __m256 w[2 * G];
    for (int g = 0; g < G; ++g)
      dequantize_k16(wg + g * gw, b, i, s[2 * g], s[2 * g + 1], bias[2 * g], bias[2 * g + 1],
                     w[2 * g], w[2 * g + 1]);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_broadcast_ss(xr + m * k + b * kBlock + i);
      for (int j = 0; j < 2 * G; ++j) a[m * 2 * G + j] = _mm256_fmadd_ps(xv, w[j], a[m * 2 * G + j]);
    }
  }
  for (int j = 0; j < kAcc; ++j) _mm256_store_ps(acc + 8 * j, a[j]);
}

// Rows [m0, m0 + MT) of x ([T, K]) times G groups (wg.., sg.., columns n0..).
template <int MT, int G>
void few_rows(const uint8_t* wg, const float* sg, const float* x, int64_t k, int64_t m0,
              int64_t n0, const Out& out) {
  const int64_t gw = kGroup * k, gs = kGroup * (k / kBlock);  // a group's weights, scales
  alignas(32) float acc[MT * G * 2 * 8] = {};
  for (int64_t b = 0; b < k / kBlock; ++b) few_block<MT, G>(wg, sg, gw, gs, x + m0 * k, k, b, acc);
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kGroup; ++c)
        out.set(m0 + m, n0 + g * kGroup + c, acc[((m * G + g) * 2 + c / 8) * 8 + c % 8]);
}

// Groups [g0, g1) of the layer for rows [m0, m0 + MT): G groups at a time, then one.
template <int MT, int G>
void few_groups(const uint8_t* wl, const float* sl, const float* x, int64_t k, int64_t m0,
                int64_t g0, int64_t g1, const Out& out) {
  const int64_t gw = kGroup * k, gs = kGroup * (k / kBlock);
  int64_t g = g0;
  for (; g + G <= g1; g += G)
    few_rows<MT, G>(wl + g * gw, sl + g * gs, x, k, m0, g * kGroup, out);
  for (; g < g1; ++g) few_rows<MT, 1>(wl + g * gw, sl + g * gs, x, k, m0, g * kGroup, out);
}

// t < kLanesRows rows: passes of up to 6 rows, each over the groups [g0, g1).
void few(const uint8_t* wl, const float* sl, const float* x, int64_t k, int64_t t,
         int64_t g0, int64_t g1, const Out& out) {
  for (int64_t m = 0, r; m < t; m += r) {
    r = std::min<int64_t>(6, t - m);
    switch (r) {
      case 1: few_groups<1, 2>(wl, sl, x, k, m, g0, g1, out); break;
      case 2: few_groups<2, 2>(wl, sl, x, k, m, g0, g1, out); break;
      case 3: few_groups<3, 2>(wl, sl, x, k, m, g0, g1, out); break;
      case 4: few_groups<4, 1>(wl, sl, x, k, m, g0, g1, out); break;
      case 5: few_groups<5, 1>(wl, sl, x, k, m, g0, g1, out); break;
      default: few_groups<6, 1>(wl, sl, x, k, m, g0, g1, out); break;
    }
  }
}

// Block b of the group (layout 1) dequantized: wb[i * 16 + c] = weight (column c, k 32b + i).
inline void dequantize_block_k16(const uint8_t* wg, const float* sg, int64_t b, float* wb) {
  const __m256 minus128 = _mm256_set1_ps(-128.f);
  const __m256 s0 = _mm256_loadu_ps(sg + b * kGroup), s1 = _mm256_loadu_ps(sg + b * kGroup + 8);
  const __m256 b0 = _mm256_mul_ps(s0, minus128), b1 = _mm256_mul_ps(s1, minus128);
  for (int64_t i = 0; i < kBlock; ++i) {
    __m256 w0, w1;
    dequantize_k16(wg, b, i, s0, s1, b0, b1, w0, w1);
    _mm256_store_ps(wb + i * kGroup, w0);
    _mm256_store_ps(wb + i * kGroup + 8, w1);
  }
}

// Columns [c0, c0 + NC) x NV vectors of 8 rows from row vector v0, over one block: acc
// [16][tp] (rows in lanes), xb the block's activations [32][tp], wb the block.
template <int NC, int NV>
inline void lanes_tile(const float* wb, const float* xb, int64_t tp, int64_t v0, int c0,
                       float* acc) {
  __m256 a[NC][NV];
  for (int c = 0; c < NC; ++c)
    for (int v = 0; v < NV; ++v) a[c][v] = _mm256_loadu_ps(acc + (c0 + c) * tp + 8 * (v0 + v));
  for (int i = 0; i < kBlock; ++i) {
    __m256 xv[NV];
    for (int v = 0; v < NV; ++v) {
      xv[v] = _mm256_loadu_ps(xb + i * tp + 8 * (v0 + v));
      asm("" : "+x"(xv[v]));  // held in a register for the NC columns (GCC re-read it)
    }
    for (int c = 0; c < NC; ++c) {
      const __m256 w = _mm256_broadcast_ss(wb + i * kGroup + c0 + c);
      for (int v = 0; v < NV; ++v) a[c][v] = _mm256_fmadd_ps(xv[v], w, a[c][v]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + (c0 + c) * tp + 8 * (v0 + v), a[c][v]);
}

// One group (layout 1), t rows, from xk ([K][tp], tp = t rounded up to 8, rows past t 0).
void group_lanes(const uint8_t* wg, const float* sg, const float* xk, int64_t k, int64_t t,
                 int64_t tp, int64_t n0, const Out& out) {
  thread_local std::vector<float> accv;
  accv.assign(kGroup * tp, 0.f);
  float* acc = accv.data();
  alignas(32) float wb[kBlock * kGroup];
  const int64_t nv = tp / 8;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    dequantize_block_k16(wg, sg, b, wb);
    const float* xb = xk + b * kBlock * tp;
    int64_t v = 0;
    for (; v + 2 <= nv; v += 2) {
      lanes_tile<6, 2>(wb, xb, tp, v, 0, acc);
      lanes_tile<6, 2>(wb, xb, tp, v, 6, acc);
      lanes_tile<4, 2>(wb, xb, tp, v, 12, acc);
    }
    if (v < nv) {
      lanes_tile<12, 1>(wb, xb, tp, v, 0, acc);
      lanes_tile<4, 1>(wb, xb, tp, v, 12, acc);
    }
  }
  for (int c = 0; c < kGroup; ++c)
    for (int64_t m = 0; m < t; ++m) out.set(m, n0 + c, acc[c * tp + m]);
}

#else
// Portable fallback (no AVX2): the same arithmetic, one product at a time.
void group(const uint8_t* wg, const float* sg, const uint16_t* x, int64_t k, int64_t t,
           int64_t n0, const Out& out, int layout) {
  for (int j = 0; j < kGroup; ++j)
    for (int64_t m = 0; m < t; ++m) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t at = (i / kBlock) * kGroup + j;
        const int64_t wi = layout == 0 ? at * kBlock + i % kBlock : i * kGroup + j;
        const float w = (static_cast<float>(wg[wi]) - 128.f) * sg[at];
        acc += bf16_value(bf16_bits(w)) * bf16_value(x[m * k + i]);
      }
      out.set(m, n0 + j, acc);
    }
}

void to_bf16(const float* src, int64_t count, uint16_t* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = bf16_bits(src[i]);
}
#endif

// x (f32 [T, K]) times layer weights wl/sl into `o` (and the rows `o` leaves at zero
// zeroed, by the same work items).
void multiply(ffi::ThreadPool& pool, const float* x, int64_t t, int64_t k,
              const uint8_t* wl, const float* sl, int64_t np, const Out& o, int layout) {
  constexpr int64_t kGroups = 4;  // groups a work item: 64 columns
  const int64_t groups = np / kGroup, items = (groups + kGroups - 1) / kGroups;
#ifdef SLUICE_AMX
  if (sluice::amx_permitted()) {
    thread_local std::vector<uint16_t> xv;
    const int64_t mtiles = (t + 15) / 16;
    xv.resize(mtiles * (k / kBlock) * 512);
    to_vnni(x, t, k, mtiles, xv.data());
    const uint16_t* xvp = xv.data();  // (in the lambda, `xv` would be the worker's own)
    sluice::parallel_for(pool, items, [&](int64_t p) {
      sluice::tiles_on();
      for (int64_t g = p * kGroups; g < std::min(groups, (p + 1) * kGroups); ++g)
        group_amx(wl + g * kGroup * k, sl + g * kGroup * (k / kBlock), xvp, k, t,
                  g * kGroup, o);
      _tile_release();
      o.clear(p * kGroups * kGroup, (p + 1) * kGroups * kGroup);
    });
    return;
  }
#endif
#ifdef SLUICE_Q8_AVX2
  if (layout == 1 && t < kLanesRows) {
    sluice::parallel_for(pool, items, [&](int64_t p) {
      few(wl, sl, x, k, t, p * kGroups, std::min(groups, (p + 1) * kGroups), o);
      o.clear(p * kGroups * kGroup, (p + 1) * kGroups * kGroup);
    });
    return;
  }
  if (layout == 1) {  // the rows as lanes: x^T [K][tp], rows past t zero
    const int64_t tp = (t + 7) / 8 * 8;
    thread_local std::vector<float> xkv;
    xkv.assign(k * tp, 0.f);
    float* xk = xkv.data();
    for (int64_t m = 0; m < t; ++m)
      for (int64_t i = 0; i < k; ++i) xk[i * tp + m] = x[m * k + i];
    sluice::parallel_for(pool, items, [&](int64_t p) {
      for (int64_t g = p * kGroups; g < std::min(groups, (p + 1) * kGroups); ++g)
        group_lanes(wl + g * kGroup * k, sl + g * kGroup * (k / kBlock), xk, k, t, tp,
                    g * kGroup, o);
      o.clear(p * kGroups * kGroup, (p + 1) * kGroups * kGroup);
    });
    return;
  }
  const float* xt = x;  // f32 as it is
#else
  thread_local std::vector<uint16_t> xb;  // bf16, reused across calls
  xb.resize(t * k);
  to_bf16(x, t * k, xb.data());
  const uint16_t* xt = xb.data();
#endif
  // Pieces of 64 columns: enough to balance the threads, few enough that each streams a
  // long run of weights.
  sluice::parallel_for(pool, items, [&](int64_t p) {
    for (int64_t g = p * kGroups; g < std::min(groups, (p + 1) * kGroups); ++g)
      group(wl + g * kGroup * k, sl + g * kGroup * (k / kBlock), xt, k, t, g * kGroup, o,
            layout);
    o.clear(p * kGroups * kGroup, (p + 1) * kGroups * kGroup);
  });
}

ffi::Error Q8LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> ws,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                        int32_t feature_major, int32_t layout) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = ws.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("sluice_q8_linear: x must be 2-D, w and ws 3-D");
  const bool fm = feature_major != 0;
  const auto od = out->dimensions();
  const int64_t nl = wd[0], np = wd[1], k = wd[2];
  const int64_t t = fm ? xd[1] : xd[0], n = fm ? od[0] : od[1];
  if ((fm ? xd[0] : xd[1]) != k || k % kBlock || np % kGroup || n > np || np - n >= kGroup ||
      sd[0] != nl || sd[1] != np || sd[2] != k / kBlock)
    return ffi::Error::InvalidArgument("sluice_q8_linear: shapes do not agree");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= nl) return ffi::Error::InvalidArgument("sluice_q8_linear: bad layer");
#if defined(SLUICE_Q8_AVX512) || defined(SLUICE_AMX)
  if (layout != 0)  // (model/quant.py packs layout 1 only where the AVX2 path runs)
    return ffi::Error::InvalidArgument("sluice_q8_linear: this build reads layout 0 only");
#endif
  if (layout != 0 && layout != 1)
    return ffi::Error::InvalidArgument("sluice_q8_linear: layout must be 0 or 1");
  if (t == 0) return ffi::Error::Success();
  const uint8_t* wl = w.typed_data() + l * np * k;
  const float* sl = ws.typed_data() + l * np * (k / kBlock);
  const float* xr = x.typed_data();
  Out o{nullptr, 0, 0, 0};
  const int64_t tl = sluice::live_rows(xr, t, k, fm, out->typed_data(), n, o);
  if (tl == 0) return ffi::Error::Success();
  multiply(pool, xr, tl, k, wl, sl, np, o, layout);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceQ8Linear, Q8LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("feature_major")
                                  .Attr<int32_t>("layout"));

// 1 when built with the AVX-512 path, 0 for the portable one.
extern "C" int sluice_q8_avx512() {
#ifdef SLUICE_Q8_AVX512
  return 1;
#else
  return 0;
#endif
}

// 1 when built with the AVX2 path (no AVX-512 BF16), else 0.
extern "C" int sluice_q8_avx2() {
#ifdef SLUICE_Q8_AVX2
  return 1;
#else
  return 0;
#endif
}

// The block order this build's weights are packed in (model/quant.py asks): 1, [32 k][16
// columns], for the AVX2 path, which reads it fastest; else 0, [16 columns][32 k].
extern "C" int sluice_q8_layout() {
#ifdef SLUICE_Q8_AVX2
  return 1;
#else
  return 0;
#endif
}

// 1 when this build reads weights packed in block order `layout`: the AVX-512 and AMX
// paths read layout 0 only, the AVX2 and portable ones both.
extern "C" int sluice_q8_reads_layout(int layout) {
#if defined(SLUICE_Q8_AVX512) || defined(SLUICE_AMX)
  return layout == 0;
#else
  return layout == 0 || layout == 1;
#endif
}

// 1 when built with the AMX path and the OS grants the tile state, else 0.
extern "C" int sluice_q8_amx() {
#ifdef SLUICE_AMX
  return sluice::amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}
