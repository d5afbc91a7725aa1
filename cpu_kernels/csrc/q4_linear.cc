// Sluice's native CPU kernel for weights in llama.cpp's blocks of 32 values of a weight
// row: Q4_1 (4-bit q in 0..15, an f16 scale d and an f16 minimum m; the weight is d * q +
// m) or Q8_0 (int8 q, an f16 scale d; d * q), with the activations quantized to int8 as
// they come in (per row and block of 32: dx = max |x| / 127, qx = round(x / dx)), as
// llama.cpp multiplies Q4_1 weights by Q8_1 activations and Q8_0 by Q8_0. The products
// are integer: a block's 32 q * qx sum exactly in int16 / int32 lanes (VPMADDUBSW, below),
// then in f32, per row r, column c and block b in order from 0:
//     acc = fma(float(sum_i q[c, i] qx[r, i]), d[c] * dx[r], acc)
//     acc = fma(m[c], sx[r], acc)      (Q4_1 only; sx: the block's sum of x, in order)
// the same operations whatever the rows of the call: a row's result does not depend on
// its batch, and leaving all-zero rows out (dense_rows.h) changes no other row's bits.
//
// Registered with XLA as the FFI target "sluice_q4_linear" (cpu_kernels/native.py
// builds and loads it; model/quant.py packs the weights, `Q4Matrix`, and calls it). Why
// it exists: on a CPU without AVX-512 BF16 or AMX (the AVX2 machines), the int8 kernel
// (q8_linear.cc) multiplies in f32 FMAs, 8 products an instruction, after dequantizing
// each weight; here a VPMADDUBSW does 32 and the weights stay integers, and a weight is
// 0.625 bytes (Q4_1) instead of 1.125 (docs/benchmarks.md, "Q4_1 weights").
//
// Layout (the attribute `format`: 0 Q4_1, 1 Q8_0):
//   w     uint8 [L, N/8, K/32, 160 or 272]: columns in groups of 8 (N rounded up to 8,
//         zero columns); a group's block b is, in Q4_1, 160 bytes: 4 vectors of 32
//         bytes, byte 32v + 4c + j holding q[c, 4v + j] in its low nibble and q[c, 16 +
//         4v + j] in its high one (c the group's column 0..7, so that a vector is 8
//         columns x 4 consecutive k: VPMADDUBSW's pairs, then VPMADDWD's), then d[0..7]
//         and m[0..7] as f16; in Q8_0, 272 bytes: 8 vectors, byte 32v + 4c + j holding
//         q[c, 4v + j], then d[0..7] as f16;
//   x     f32 [K, T] (feature_major) or [T, K];
//   layer int32 []: which of the L layers;
//   out   f32 [N, T] (feature_major) or [T, N].
// K must be a multiple of 32. Work is split over XLA's intra-op thread pool by
// column ranges; the calling thread works too. Without AVX2 a portable loop computes the
// same operations one value at a time.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_rows.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using sluice::Out;

constexpr int64_t kBlock = 32;       // values per scale and minimum
constexpr int64_t kCols = 8;         // columns of a group
// Weight formats (the attribute `format`) and the bytes of a group's block in each.
constexpr int kQ4 = 0;  // Q4_1: 128 bytes of q (two a byte), 8 d, 8 m (f16)
constexpr int kQ8 = 1;  // Q8_0: 256 bytes of int8 q, 8 d (f16)
constexpr int64_t kFormatBytes[2] = {160, 272};
constexpr int64_t kItemGroups = 8;   // groups a work item: 64 columns

// The activations quantized: row r's block b is qx[r * K + 32 b ..] with scale
// dx[r * K/32 + b] and sum sx[...] (x's own values summed in order).
struct Acts {
  const int8_t* qx;
  const float* dx;
  const float* sx;
  int64_t k;
};

void quantize_rows(const float* x, int64_t t, int64_t k, int8_t* qx, float* dx, float* sx) {
  const int64_t kb = k / kBlock;
  for (int64_t r = 0; r < t; ++r)
    for (int64_t b = 0; b < kb; ++b) {
      const float* xb = x + r * k + b * kBlock;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        sum += xb[i];
      }
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      for (int64_t i = 0; i < kBlock; ++i)
        qx[r * k + b * kBlock + i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
      dx[r * kb + b] = d;
      sx[r * kb + b] = sum;
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLUICE_Q4_AVX2 1

// Rows [m0, m0 + MT) by G groups (8 columns each, the first at wg, the next gstride
// bytes on; columns from n0), over all K/32 blocks, weights of format F. Q4_1: each
// block's products sum in int16 lanes (8 VPMADDUBSW: at most 8 x 2 x 15 x 127 = 30,480),
// then VPMADDWD adds each column's pairs into int32. Q8_0: VPMADDUBSW takes |w| times qx
// signed as w (pairs at most 2 x 127 x 127 = 32,258), into int32 at once. The f32 steps
// above follow.
template <int F, int MT, int G>
inline void tile(const uint8_t* wg, int64_t gstride, const Acts& a, int64_t kb, int64_t m0,
                 int64_t n0, const Out& out) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const int64_t k = a.k;
  __m256 acc[MT][G];
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    __m256i s[MT][G];
    for (int m = 0; m < MT; ++m)
      for (int g = 0; g < G; ++g) s[m][g] = _mm256_setzero_si256();
    for (int v = 0; v < (F == kQ4 ? 4 : 8); ++v) {
      for (int g = 0; g < G; ++g) {
        const uint8_t* p = wg + g * gstride + b * kFormatBytes[F];
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v));
        if constexpr (F == kQ4) {
          const __m256i lo = _mm256_and_si256(w, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xq = a.qx + (m0 + m) * k + b * kBlock + 4 * v;
            int32_t x0, x1;
            std::memcpy(&x0, xq, 4);
            std::memcpy(&x1, xq + 16, 4);
            s[m][g] = _mm256_add_epi16(s[m][g],
                                       _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
            s[m][g] = _mm256_add_epi16(s[m][g],
                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
            asm("" : "+x"(s[m][g]));  // summed now (else GCC keeps 32 products, spilled)
          }
        } else {
          const __m256i aw = _mm256_abs_epi8(w);
          for (int m = 0; m < MT; ++m) {
            int32_t x0;
            std::memcpy(&x0, a.qx + (m0 + m) * k + b * kBlock + 4 * v, 4);
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x0), w);
            s[m][g] = _mm256_add_epi32(
                s[m][g], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
            asm("" : "+x"(s[m][g]));  // summed now (else GCC keeps 32 products, spilled)
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = wg + g * gstride + b * kFormatBytes[F] + (F == kQ4 ? 128 : 256);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      for (int m = 0; m < MT; ++m) {
        const int64_t rb = (m0 + m) * kb + b;
        const __m256 f = _mm256_cvtepi32_ps(F == kQ4 ? _mm256_madd_epi16(s[m][g], ones)
                                                     : s[m][g]);
        acc[m][g] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_broadcast_ss(a.dx + rb)),
                                    acc[m][g]);
        if constexpr (F == kQ4) {
          const __m256 mn =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
          acc[m][g] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(a.sx + rb), acc[m][g]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < G; ++g) {
      alignas(32) float o[kCols];
      _mm256_store_ps(o, acc[m][g]);
      for (int c = 0; c < kCols; ++c) out.set(m0 + m, n0 + g * kCols + c, o[c]);
    }
}

// Groups [g0, g1) for rows [m0, m0 + MT): G at a time (independent sums enough for the
// latencies at few rows), then one. The weights stream in order without software
// prefetches (the hardware's keep up: asking 4 blocks ahead measured no faster).
template <int F, int MT, int G>
void groups(const uint8_t* wl, int64_t gstride, const Acts& a, int64_t kb, int64_t m0,
            int64_t g0, int64_t g1, const Out& out) {
  int64_t g = g0;
  for (; g + G <= g1; g += G)
    tile<F, MT, G>(wl + g * gstride, gstride, a, kb, m0, g * kCols, out);
  for (; g < g1; ++g) tile<F, MT, 1>(wl + g * gstride, gstride, a, kb, m0, g * kCols, out);
}

// All t rows of groups [g0, g1): passes of up to 4 rows, each over the groups (a
// group's blocks stay in L1/L2 from one pass to the next; passes of 6 or 8 rows measured
// the same).
template <int F>
void item(const uint8_t* wl, int64_t gstride, const Acts& a, int64_t kb, int64_t t,
          int64_t g0, int64_t g1, const Out& out) {
  for (int64_t m = 0, r; m < t; m += r) {
    r = std::min<int64_t>(4, t - m);
    switch (r) {
      case 1: groups<F, 1, 4>(wl, gstride, a, kb, m, g0, g1, out); break;
      case 2: groups<F, 2, 2>(wl, gstride, a, kb, m, g0, g1, out); break;
      case 3: groups<F, 3, 1>(wl, gstride, a, kb, m, g0, g1, out); break;
      default: groups<F, 4, 1>(wl, gstride, a, kb, m, g0, g1, out); break;
    }
  }
}

#else
// Portable (no AVX2): the same operations, one value at a time.
inline float f16_value(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int F>
void item(const uint8_t* wl, int64_t gstride, const Acts& a, int64_t kb, int64_t t,
          int64_t g0, int64_t g1, const Out& out) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m = 0; m < t; ++m)
      for (int c = 0; c < kCols; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < kb; ++b) {
          const uint8_t* p = wl + g * gstride + b * kFormatBytes[F];
          int32_t sum = 0;
          for (int i = 0; i < kBlock; ++i) {
            const int quad = i / 4, v = F == kQ4 ? quad % 4 : quad;
            const uint8_t byte = p[32 * v + 4 * c + i % 4];
            const int q = F == kQ4 ? (quad < 4 ? (byte & 0x0f) : (byte >> 4))
                                   : static_cast<int8_t>(byte);
            sum += q * a.qx[m * a.k + b * kBlock + i];
          }
          const int64_t rb = m * kb + b;
          const uint8_t* sc = p + (F == kQ4 ? 128 : 256);
          acc = std::fma(static_cast<float>(sum), f16_value(sc + 2 * c) * a.dx[rb], acc);
          if (F == kQ4) acc = std::fma(f16_value(sc + 16 + 2 * c), a.sx[rb], acc);
        }
        out.set(m, g * kCols + c, acc);
      }
}
#endif

ffi::Error Q4LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                        ffi::ResultBuffer<ffi::F32> out, int32_t feature_major,
                        int32_t format) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2)
    return ffi::Error::InvalidArgument("sluice_q4_linear: x must be 2-D, w 4-D");
  const bool fm = feature_major != 0;
  const int64_t nl = wd[0], ng = wd[1], kb = wd[2], k = kb * kBlock;
  const int64_t t = fm ? xd[1] : xd[0], n = fm ? od[0] : od[1];
  if (format != kQ4 && format != kQ8)
    return ffi::Error::InvalidArgument("sluice_q4_linear: format must be 0 or 1");
  if ((fm ? xd[0] : xd[1]) != k || wd[3] != kFormatBytes[format] || n > ng * kCols ||
      ng * kCols - n >= kCols || (fm ? od[1] : od[0]) != t)
    return ffi::Error::InvalidArgument("sluice_q4_linear: shapes do not agree");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= nl) return ffi::Error::InvalidArgument("sluice_q4_linear: bad layer");
  if (t == 0) return ffi::Error::Success();
  const int64_t gstride = kb * kFormatBytes[format];
  const uint8_t* wl = w.typed_data() + l * ng * gstride;
  const float* xr = x.typed_data();
  Out o{nullptr, 0, 0, 0};
  const int64_t tl = sluice::live_rows(xr, t, k, fm, out->typed_data(), n, o);
  if (tl == 0) return ffi::Error::Success();
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> dx, sx;
  qx.resize(tl * k);
  dx.resize(tl * kb);
  sx.resize(tl * kb);
  quantize_rows(xr, tl, k, qx.data(), dx.data(), sx.data());
  const Acts a{qx.data(), dx.data(), sx.data(), k};
  const int64_t items = (ng + kItemGroups - 1) / kItemGroups;
  sluice::parallel_for(pool, items, [&](int64_t p) {
    const int64_t g0 = p * kItemGroups, g1 = std::min(ng, g0 + kItemGroups);
    if (format == kQ4)
      item<kQ4>(wl, gstride, a, kb, tl, g0, g1, o);
    else
      item<kQ8>(wl, gstride, a, kb, tl, g0, g1, o);
    o.clear(g0 * kCols, g1 * kCols);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceQ4Linear, Q4LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("feature_major")
                                  .Attr<int32_t>("format"));

// 1 when built with the AVX2 path, 0 for the portable one.
extern "C" int sluice_q4_avx2() {
#ifdef SLUICE_Q4_AVX2
  return 1;
#else
  return 0;
#endif
}
