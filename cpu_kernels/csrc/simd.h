// Vector helpers the native attention kernels share.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace sluice {

// Values stored as f32, as bf16 bit patterns (uint16: the upper half of an f32), or as
// int8 (a KV pool's int8 rows: D values, then their f32 scale; `row_scale`), widened to
// f32 where they are read (int8: not yet scaled).
inline float widen1(const float* p) { return *p; }
inline float widen1(const uint16_t* p) {
  const uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float widen1(const int8_t* p) { return static_cast<float>(*p); }

// The scale of a KV pool row of d values (1 but for int8 rows, whose f32 scale follows
// them: kScaleBytes more a row).
constexpr int64_t kScaleBytes = 4;
template <typename T>
inline float row_scale(const T*, int64_t) { return 1.f; }
inline float row_scale(const int8_t* row, int64_t d) {
  float f;
  std::memcpy(&f, row + d, 4);
  return f;
}

#ifdef __AVX512F__
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The lanes of `m` only (the rest 0, their memory not touched).
inline __m512 widen16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 widen16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#ifdef __AVX512F__
// exp(x) for 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6
// (relative error ~2e-7), n applied by scalef; x below -87 gives 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512 y = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ), y);
}
#endif

#ifdef __AVX512F__
// r[i] becomes column i of the 16 x 16 matrix whose rows were r[0..15].
inline void transpose16(__m512* r) {
  __m512 u[16];
  for (int i = 0; i < 8; ++i) {
    u[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    u[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  __m512 v[16];  // v[4i + k], 128-bit lane L: rows 4i..4i+3 at column 4L + k
  for (int i = 0; i < 4; ++i) {
    v[4 * i] = lo(u[4 * i], u[4 * i + 2]);
    v[4 * i + 1] = hi(u[4 * i], u[4 * i + 2]);
    v[4 * i + 2] = lo(u[4 * i + 1], u[4 * i + 3]);
    v[4 * i + 3] = hi(u[4 * i + 1], u[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 a = _mm512_shuffle_f32x4(v[k], v[4 + k], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(v[k], v[4 + k], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(v[8 + k], v[12 + k], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(v[8 + k], v[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(a, c, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(a, c, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(b, d, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The AVX2 forms: 8 lanes. The attention and LoRA kernels take them where the CPU has no
// AVX-512 (their AVX-512 forms come first), the int8 matmul where it has no AVX-512 BF16.
#define SLUICE_AVX2 1
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// r[i] becomes column i of the 8 x 8 matrix whose rows were r[0..7].
inline void transpose8(__m256* r) {
  __m256 u[8], v[8];
  for (int i = 0; i < 4; ++i) {
    u[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    u[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // v[4i + k], 128-bit lane L: rows 4i..4i+3 at column 4L + k
    v[4 * i] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0x44);
    v[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0xEE);
    v[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0x44);
    v[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(v[k], v[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(v[k], v[4 + k], 0x31);
  }
}

inline float sum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

inline float max8(__m256 v) {
  const __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}

// exp(x) for 8 lanes: exp16's polynomial, 2^n applied through the exponent bits;
// x below -87 gives 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GT_OQ));
}
#endif

}  // namespace sluice
