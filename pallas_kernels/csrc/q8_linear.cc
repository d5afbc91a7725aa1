// Sluice's native CPU kernel: activations times int8 weights in 32-value blocks
// (llama.cpp's Q8_0 granularity: one f32 scale per block of a weight row). Each block is
// dequantized in registers to bf16 and multiplied with the activations rounded to bf16
// by AVX-512 BF16 dot products (two products a lane, summed in f32).
//
// Registered with XLA as the FFI target "sluice_q8_linear" (pallas_kernels/native.py
// builds and loads it; model/quant.py calls it). Why it exists: a step of a few token
// rows is bound by reading the weights; int8 weights are a quarter of f32's bytes, and
// XLA:CPU materialises any dequantization done inside the jit (it ran slower than f32,
// docs/benchmarks.md). bf16 dots do twice the f32 FMA's work per instruction once
// the weights are dequantized (once per block, for every row); Q8_0 x Q8_0 with VNNI
// int8 dots cost as much here, each block being rescaled in f32 per row, and was less
// accurate (docs/benchmarks.md, "int8 weights").
//
// Layouts:
//   w     uint8 [L, N, K]: weight (out n, in k) of layer l, stored as q + 128, q in
//         [-127, 127], packed: columns in groups of 4, a group's blocks in order
//         [K/32][4][32] (block b of its 4 columns side by side), so that a tile of 4
//         columns reads its weights as one sequential stream;
//   ws    f32   [L, N, K/32]: the scale of each 32-value block, packed the same way
//         ([N/4][K/32][4]);
//   x     f32   [K, T] (feature_major) or [T, K];
//   layer int32 []: which of the L layers;
//   out   f32   [N, T] (feature_major) or [T, N].
// K must be a multiple of 32 and N of 4. Work is split over XLA's intra-op thread pool by column
// ranges; the calling thread works too and waits for the rest.

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;  // values per scale
constexpr int64_t kGroup = 4;   // columns packed together


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

struct Out {
  float* p;
  int64_t sm, sn;  // strides of a row m and a column n
  void set(int64_t m, int64_t n, float v) const { p[m * sm + n * sn] = v; }
};

#ifdef __AVX512F__
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
inline void tile_dequantized(const uint16_t* wb, const uint16_t* x, int64_t k, int64_t m0,
                             int64_t n0, const Out& out) {
  const int64_t kb = k / kBlock;
  __m512 acc[MT][kGroup];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kGroup; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    __m512bh wv[kGroup];
    for (int j = 0; j < kGroup; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(wb + (b * kGroup + j) * kBlock);
    for (int i = 0; i < MT; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * k + b * kBlock);
      for (int j = 0; j < kGroup; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kGroup; ++j) out.set(m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

constexpr int64_t kDequantizeOnceRows = 8;  // from this many rows on (measured, 2-core Zen 4)

void group(const uint8_t* wg, const float* sg, const uint16_t* x, int64_t k, int64_t t,
           int64_t n0, const Out& out) {
  if (t <= 4) {  // registers: t x 4 accumulators + 4 weight vectors
    rows<4>(wg, sg, 0, x, k, t, n0, out);
    return;
  }
  if (t < kDequantizeOnceRows) {  // 8 x 2 accumulators + 2 weight vectors, two halves
    rows<2>(wg, sg, 0, x, k, t, n0, out);
    rows<2>(wg, sg, 2, x, k, t, n0, out);
    return;
  }
  thread_local std::vector<uint16_t> wb;
  const int64_t kb = k / kBlock;
  wb.resize(kb * kGroup * kBlock);
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  for (int64_t i = 0; i < kb * kGroup; ++i) {  // block b, column j: i = b * 4 + j
    const __m512 s = _mm512_set1_ps(sg[i]);
    const __m512 bias = _mm512_mul_ps(s, minus128);
    const uint8_t* wr = wg + i * kBlock;
    const __m128i u0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr));
    const __m128i u1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u0)), s, bias);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u1)), s, bias);
    _mm512_storeu_si512(wb.data() + i * kBlock, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  int64_t m = 0;  // 6 x 4 accumulators + 4 weight vectors + 1 row
  for (; m + 6 <= t; m += 6) tile_dequantized<6>(wb.data(), x, k, m, n0, out);
  switch (t - m) {
    case 5: tile_dequantized<5>(wb.data(), x, k, m, n0, out); break;
    case 4: tile_dequantized<4>(wb.data(), x, k, m, n0, out); break;
    case 3: tile_dequantized<3>(wb.data(), x, k, m, n0, out); break;
    case 2: tile_dequantized<2>(wb.data(), x, k, m, n0, out); break;
    case 1: tile_dequantized<1>(wb.data(), x, k, m, n0, out); break;
    default: break;
  }
}

void to_bf16(const float* src, int64_t count, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  for (; i < count; ++i) dst[i] = bf16_bits(src[i]);
}
#else
// Portable fallback (no AVX-512): the same arithmetic, one product at a time.
void group(const uint8_t* wg, const float* sg, const uint16_t* x, int64_t k, int64_t t,
           int64_t n0, const Out& out) {
  for (int j = 0; j < kGroup; ++j)
    for (int64_t m = 0; m < t; ++m) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t at = (i / kBlock) * kGroup + j;
        const float w = (static_cast<float>(wg[at * kBlock + i % kBlock]) - 128.f) * sg[at];
        acc += bf16_value(bf16_bits(w)) * bf16_value(x[m * k + i]);
      }
      out.set(m, n0 + j, acc);
    }
}

void to_bf16(const float* src, int64_t count, uint16_t* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = bf16_bits(src[i]);
}
#endif

ffi::Error Q8LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> ws,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                        int32_t feature_major) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = ws.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("sluice_q8_linear: x must be 2-D, w and ws 3-D");
  const bool fm = feature_major != 0;
  const int64_t nl = wd[0], n = wd[1], k = wd[2];
  const int64_t t = fm ? xd[1] : xd[0];
  if ((fm ? xd[0] : xd[1]) != k || k % kBlock || n % kGroup || sd[0] != nl || sd[1] != n ||
      sd[2] != k / kBlock)
    return ffi::Error::InvalidArgument("sluice_q8_linear: shapes do not agree");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= nl) return ffi::Error::InvalidArgument("sluice_q8_linear: bad layer");
  if (t == 0) return ffi::Error::Success();
  const uint8_t* wl = w.typed_data() + l * n * k;
  const float* sl = ws.typed_data() + l * n * (k / kBlock);
  // The activations as bf16 [T, K] (transposed from feature-major), in a buffer reused
  // across calls: no allocation in steady state.
  thread_local std::vector<float> transposed;
  thread_local std::vector<uint16_t> xb;
  const float* xf = x.typed_data();
  if (fm && t > 1) {
    transposed.resize(t * k);
    for (int64_t i = 0; i < k; ++i)
      for (int64_t m = 0; m < t; ++m) transposed[m * k + i] = xf[i * t + m];
    xf = transposed.data();
  }
  xb.resize(t * k);
  to_bf16(xf, t * k, xb.data());
  const uint16_t* xt = xb.data();
  const Out o{out->typed_data(), fm ? 1 : n, fm ? t : 1};
  // Pieces of 16 groups (64 columns): enough to balance the threads, few enough that
  // each streams a long run of weights.
  constexpr int64_t kGroups = 16;
  const int64_t groups = n / kGroup;
  sluice::parallel_for(pool, (groups + kGroups - 1) / kGroups, [&](int64_t p) {
    for (int64_t g = p * kGroups; g < std::min(groups, (p + 1) * kGroups); ++g)
      group(wl + g * kGroup * k, sl + g * kGroup * (k / kBlock), xt, k, t, g * kGroup, o);
  });
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
                                  .Attr<int32_t>("feature_major"));

// 1 when built with the AVX-512 path, 0 for the portable one.
extern "C" int sluice_q8_avx512() {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}
