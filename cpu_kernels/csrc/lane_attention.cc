// Attention for many queries that read the same keys, for the CPU backend
// (pallas_kernels/cpu.py): the tokens of a prefill block (one sequence's, causal) and the
// decode rows that share a prefix (a system prompt, read once for all of them).
//
// The queries that read one KV head's keys are laid across the 16 lanes of a vector
// register ("lanes": a block's tokens times the head's G query heads, or rows times G).
// Each key is scored against 16 queries at once by FMAs with the key's elements
// broadcast (the queries transposed once per walk, never the keys), each value is added
// to 16 accumulators the same way, and the online softmax runs down the lanes: no
// horizontal sums, no per-chunk transposes, keys and values read in place in the pool.
// Why: in jnp (pallas_kernels/cascade.py) these were XLA einsums over gathered blocks;
// a 16-token question after a 2,000-token system prompt spent ~45 ms in them
// (docs/history/benchmarks-log.md, "Attention in lanes").
// Over a bf16 pool, where the CPU has the AMX tile unit (and D is a multiple of 32), the
// products run on tiles instead (`walk_amx`): scores K Q^T and values P^T V in bf16 with
// f32 sums, the queries and the softmax weights rounded to bf16 as a GPU's flash
// attention does; the softmax stays in vectors. An f32 pool keeps the exact vector path.
// Over an int8 pool, where the CPU has VNNI, the scores are int8 dots (`walk_vnni`: the
// queries rounded to int8 in blocks of 32, as llama.cpp rounds them for its 8-bit key
// cache; the keys read as stored, never widened), and with AVX-512 BF16 the values are
// added two keys an instruction (the weights rounded to bf16). Without AVX-512, the AVX2 form
// (`walk8`) lays the lanes across vectors of 8.
//
// sluice_prefill_attention
//   q       f32 [S, NQ, KVH, G, D]: a block of NQ queries per row, pre-scaled by
//           1/sqrt(D); query i of row r sits at position ctx[r] - qlen[r] + i;
//   k, v    f32 or uint16 (bf16 bit patterns, widened as read) [P, PS, KVH, D], or int8
//           [P, PS, KVH, D + 4] (each row's D values, then their f32 scale; widened and
//           scaled as read, never on the tile unit): the page pool (all layers);
//   offset  int32 []: the pool row of this layer's page 0;
//   tables  int32 [S, W]: each row's page ids (this layer's numbering);
//   ctx     int32 [S]: the row's keys in the pool (this step's included);
//   qlen    int32 [S]: its real queries (0: a padding row);
//   out     f32 [S, NQ, KVH, G, D]: each query's attention over keys [0, its position];
//           zeros for queries past qlen.
// sluice_prefix_attention
//   q       f32 [S, KVH, G, D]: one query per row (decode), pre-scaled;
//   k, v, offset as above;
//   pages   int32 [NP, W]: the page ids of each shared prefix;
//   length  int32 [NP]: its tokens (0: unused);
//   rows    int32 [S]: 1 + the index of the row's prefix, 0: none;
//   m, l    f32 [S, KVH, G], acc f32 [S, KVH, G, D]: each row's partial softmax over its
//           prefix's keys (max, sum, weighted values; -1e30, 0, 0 for rows of none), for
//           sluice_decode_attention to continue over the row's own pages.
// D must be a multiple of 16 and at most 256.
//
// (About 1,130 lines: one walk, its AMX, AVX-512 (f32 and int8 dots), AVX2 and portable
// forms, the splitting and merging of long walks, and the two entry points that build its
// tasks; they change together.)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kV = 3;                  // vectors of 16 lanes a walk holds at most
constexpr int kMaxLanes = 16 * kV;
constexpr int kMaxD = 256;
constexpr int kChunk = 16;             // keys of one page scored together
constexpr int kMaxKeys = 32;           // keys of one softmax step at most (AMX: a tile's depth)
constexpr int64_t kPartKeys = 512;     // a walk is split in parts of at least this many keys
constexpr float kNeg = -1e30f;
// The AVX2 walk prefetches the chunk this many ahead (the next one only left the
// widening of each chunk waiting on memory; docs/history/benchmarks-log.md,
// twenty-seventh session).
constexpr int64_t kAhead = 4;

enum class Kind { f32, bf16, int8 };

struct Pool {
  const void *k, *v;  // float, uint16_t holding bf16 bits, or int8 (`kind`; widened as read)
  int64_t kvh, d, ps, pages, offset;
  int64_t hs;         // elements of a head's row: d, or d + 4 (int8: its scale follows)
  Kind kind;
};

// Up to 48 queries of one KV head that read the same keys, and their online softmax
// (the queries and the weighted values transposed: [dimension][lane]).
struct Lanes {
  int n = 0;
  int64_t at[kMaxLanes];                 // each lane's query: its offset in q (floats)
  alignas(64) int32_t pos[kMaxLanes];    // a lane sees key t iff t <= pos (-1: unused)
  alignas(64) float qt[kMaxD][kMaxLanes];
  alignas(64) float acc[kMaxD][kMaxLanes];
  alignas(64) float m[kMaxLanes];
  alignas(64) float l[kMaxLanes];

  void add(int64_t offset, int32_t p) {
    at[n] = offset;
    pos[n] = p;
    ++n;
  }

  int vectors() const { return (n + 15) / 16; }

  void begin(const float* q, int64_t d) {
    for (int j = n; j < kMaxLanes; ++j) pos[j] = -1;
    for (int64_t c = 0; c < d; ++c)
      for (int j = 0; j < kMaxLanes; ++j) {
        qt[c][j] = j < n ? q[at[j] + c] : 0.f;
        acc[c][j] = 0.f;
      }
    for (int j = 0; j < kMaxLanes; ++j) {
      m[j] = kNeg;
      l[j] = 0.f;
    }
  }

  int32_t last() const { return *std::max_element(pos, pos + n); }
};

// Where the chunk at key t of `table` lies in the pool (elements), and its keys (`n`: up
// to kChunk, within one page, before t1).
inline int64_t chunk_at(const Pool& P, const int32_t* table, int64_t h, int64_t t,
                        int64_t t1, int64_t* n) {
  const int64_t pi = t / P.ps, off = t - pi * P.ps;
  *n = std::min<int64_t>(std::min<int64_t>(kChunk, t1 - t), P.ps - off);
  const int64_t page = std::min<int64_t>(std::max<int32_t>(table[pi], 0),
                                         P.pages - 1 - P.offset) + P.offset;
  return ((page * P.ps + off) * P.kvh + h) * P.hs;
}

// A chunk's n key and value rows (from pool element `at`, rs apart) widened to f32 rows
// kw, vw, W floats apart, int8 rows scaled: the walks then read them as an f32 pool's.
template <typename T>
inline void widen_chunk(const Pool& P, int64_t at, int64_t n, float* kw, float* vw, int W) {
  const T* kpool = static_cast<const T*>(P.k);
  const T* vpool = static_cast<const T*>(P.v);
  const int64_t d = P.d, rs = P.kvh * P.hs;
  for (int64_t i = 0; i < n; ++i) {
    const T *kr = kpool + at + i * rs, *vr = vpool + at + i * rs;
    float *ko = kw + i * W, *vo = vw + i * W;
#ifdef __AVX512F__
    const __m512 ks = _mm512_set1_ps(sluice::row_scale(kr, d));
    const __m512 vs = _mm512_set1_ps(sluice::row_scale(vr, d));
    for (int64_t c = 0; c < d; c += 16) {
      if constexpr (sizeof(T) == 1) {
        _mm512_store_ps(ko + c, _mm512_mul_ps(sluice::widen16(kr + c), ks));
        _mm512_store_ps(vo + c, _mm512_mul_ps(sluice::widen16(vr + c), vs));
      } else {
        _mm512_store_ps(ko + c, sluice::widen16(kr + c));
        _mm512_store_ps(vo + c, sluice::widen16(vr + c));
      }
    }
#elif defined(SLUICE_AVX2)
    const __m256 ks = _mm256_set1_ps(sluice::row_scale(kr, d));
    const __m256 vs = _mm256_set1_ps(sluice::row_scale(vr, d));
    for (int64_t c = 0; c < d; c += 8) {
      if constexpr (sizeof(T) == 1) {
        _mm256_store_ps(ko + c, _mm256_mul_ps(sluice::widen8(kr + c), ks));
        _mm256_store_ps(vo + c, _mm256_mul_ps(sluice::widen8(vr + c), vs));
      } else {
        _mm256_store_ps(ko + c, sluice::widen8(kr + c));
        _mm256_store_ps(vo + c, sluice::widen8(vr + c));
      }
    }
#else
    (void)ko, (void)vo, (void)kr, (void)vr;
#endif
  }
}

// The chunk's key and value rows for a walk (kChunk of them: keys past n repeat the last,
// scored and unused): in place in an f32 pool, else the widened copies kw and vw.
template <typename T, int W>
inline void chunk_rows(const Pool& P, int64_t at, int64_t n, const float (*kw)[W],
                       const float (*vw)[W], const float** kp, const float** vp) {
  const int64_t rs = P.kvh * P.hs;
  for (int i = 0; i < kChunk; ++i) {
    const int64_t r = std::min<int64_t>(i, n - 1);
    if constexpr (sizeof(T) != 4) {
      kp[i] = kw[r];
      vp[i] = vw[r];
    } else {
      kp[i] = static_cast<const float*>(P.k) + at + r * rs;
      vp[i] = static_cast<const float*>(P.v) + at + r * rs;
    }
  }
}

// The chunk at key t (before t1) on its way to the cache, a line at a time, while the
// walk computes the one before it.
template <typename T>
inline void prefetch_chunk(const Pool& P, const int32_t* table, int64_t h, int64_t t,
                           int64_t t1) {
  if (t >= t1) return;
  int64_t n;
  const int64_t at = chunk_at(P, table, h, t, t1, &n), rs = P.kvh * P.hs;
  const T* k = static_cast<const T*>(P.k) + at;
  const T* v = static_cast<const T*>(P.v) + at;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < P.hs; c += 64 / sizeof(T)) {
      _mm_prefetch(reinterpret_cast<const char*>(k + i * rs + c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + i * rs + c), _MM_HINT_T0);
    }
}

#ifdef __AVX512F__
// The lanes' positions and running softmax (max, sum) in and out of registers.
template <int NV>
inline void state_in(const Lanes& L, __m512i* pos, __m512* m, __m512* l) {
  for (int v = 0; v < NV; ++v) {
    pos[v] = _mm512_load_si512(L.pos + 16 * v);
    m[v] = _mm512_load_ps(L.m + 16 * v);
    l[v] = _mm512_load_ps(L.l + 16 * v);
  }
}
template <int NV>
inline void state_out(Lanes& L, const __m512* m, const __m512* l) {
  for (int v = 0; v < NV; ++v) {
    _mm512_store_ps(L.m + 16 * v, m[v]);
    _mm512_store_ps(L.l + 16 * v, l[v]);
  }
}

// The online softmax's step over the scores s[i][16 v + lane] of keys t.. t + n (a lane
// sees key t + i iff t + i <= pos): the running max m and sum l move on, corr is what the
// lanes' weighted values must be scaled by, and s becomes the weights (0 where unseen).
template <int NV>
inline void softmax(float* s, int64_t n, int64_t t, const __m512i* pos, __m512* m,
                    __m512* l, __m512* corr) {
  constexpr int kRow = 16 * NV;
  for (int v = 0; v < NV; ++v) {
    // Every lane sees every key (a shared prefix; a prefill block's earlier keys): no
    // masks. Unused lanes (pos -1) see none and keep m = kNeg, l = 0.
    const int32_t* pv = reinterpret_cast<const int32_t*>(pos + v);
    int32_t first = INT_MAX;
    for (int j = 0; j < 16; ++j)
      if (pv[j] >= 0) first = std::min(first, pv[j]);
    const __mmask16 used = _mm512_cmp_epi32_mask(pos[v], _mm512_setzero_si512(), _MM_CMPINT_NLT);
    const bool all = t + n - 1 <= first;
    __mmask16 seen[kMaxKeys];
    __m512 mx = m[v];
    for (int i = 0; i < n; ++i) {
      seen[i] = all ? used : _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(t + i)),
                                                   pos[v], _MM_CMPINT_LE);
      mx = _mm512_max_ps(mx, _mm512_mask_load_ps(_mm512_set1_ps(kNeg), seen[i],
                                                 s + i * kRow + 16 * v));
    }
    corr[v] = sluice::exp16(_mm512_sub_ps(m[v], mx));
    l[v] = _mm512_mul_ps(l[v], corr[v]);
    for (int i = 0; i < n; ++i) {
      float* si = s + i * kRow + 16 * v;
      const __m512 p =
          _mm512_maskz_mov_ps(seen[i], sluice::exp16(_mm512_sub_ps(_mm512_load_ps(si), mx)));
      _mm512_store_ps(si, p);
      l[v] = _mm512_add_ps(l[v], p);
    }
    m[v] = mx;
  }
}

// acc = acc * corr + sum_i p_i v_i over a chunk's n keys (weights s [key][lane], value
// rows vp): 16 (NV = 1) or 8 dimensions at a time, each value element broadcast against
// every vector of weights.
template <int NV>
inline void values(Lanes& L, const float* const* vp, int64_t n, int64_t d, const float* s,
                   const __m512* corr) {
  constexpr int kDims = NV == 1 ? 16 : 8;
  for (int64_t c = 0; c < d; c += kDims) {
    __m512 a[NV][kDims];
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < kDims; ++j)
        a[v][j] = _mm512_mul_ps(_mm512_load_ps(L.acc[c + j] + 16 * v), corr[v]);
    for (int i = 0; i < n; ++i) {
      __m512 pv[NV];
      for (int v = 0; v < NV; ++v) pv[v] = _mm512_load_ps(s + i * 16 * NV + 16 * v);
      for (int j = 0; j < kDims; ++j) {
        const __m512 b = _mm512_set1_ps(vp[i][c + j]);
        for (int v = 0; v < NV; ++v) a[v][j] = _mm512_fmadd_ps(pv[v], b, a[v][j]);
      }
    }
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < kDims; ++j) _mm512_store_ps(L.acc[c + j] + 16 * v, a[v][j]);
  }
}

// The online softmax of NV vectors of lanes over keys [t0, t1). Scores: eight keys at a
// time, each of the d elements broadcast against every vector of queries (8 x NV
// independent sums); values: 16 (NV = 1) or 8 dimensions at a time, each value element
// broadcast against every vector of weights.
template <int NV, typename T>
void walk(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
          Lanes& L) {
  constexpr int kKeys = 8;
  constexpr bool kWiden = sizeof(T) != 4;
  const int64_t d = P.d;
  __m512i pos[NV];
  __m512 m[NV], l[NV];
  state_in<NV>(L, pos, m, l);
  alignas(64) float s[kChunk * 16 * NV];  // scores, then weights: [key][lane]
  // A chunk's keys and values widened to f32 (bf16 and int8 pools).
  alignas(64) float kw[kWiden ? kChunk : 1][kWiden ? kMaxD : 16];
  alignas(64) float vw[kWiden ? kChunk : 1][kWiden ? kMaxD : 16];
  for (int64_t t = t0, n; t < t1; t += n) {
    const int64_t at = chunk_at(P, table, h, t, t1, &n);
    const float* kp[kChunk];
    const float* vp[kChunk];
    if constexpr (kWiden) widen_chunk<T>(P, at, n, kw[0], vw[0], kMaxD);
    chunk_rows<T>(P, at, n, kw, vw, kp, vp);
    prefetch_chunk<T>(P, table, h, t + n, t1);
    for (int i = 0; i < n; i += kKeys) {
      __m512 a[NV][kKeys];
      for (int v = 0; v < NV; ++v)
        for (int kk = 0; kk < kKeys; ++kk) a[v][kk] = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; ++c) {
        __m512 qv[NV];
        for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(L.qt[c] + 16 * v);
        for (int kk = 0; kk < kKeys; ++kk) {
          const __m512 b = _mm512_set1_ps(kp[i + kk][c]);
          for (int v = 0; v < NV; ++v) a[v][kk] = _mm512_fmadd_ps(qv[v], b, a[v][kk]);
        }
      }
      for (int kk = 0; kk < kKeys; ++kk)
        for (int v = 0; v < NV; ++v) _mm512_store_ps(s + (i + kk) * 16 * NV + 16 * v, a[v][kk]);
    }
    __m512 corr[NV];
    softmax<NV>(s, n, t, pos, m, l, corr);
    values<NV>(L, vp, n, d, s, corr);
  }
  state_out<NV>(L, m, l);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SLUICE_LANE_VNNI 1
// The walk over an int8 pool where the CPU has VNNI: the scores are int8 dots. Each
// lane's query is rounded to int8 in blocks of 32 elements, each over its own largest
// (as llama.cpp's CPU attention rounds the query to Q8_0, the key cache's 8-bit type),
// once a walk, and stored + 128 as the unsigned operand of vpdpbusd, 4 elements of 16
// lanes a vector; each key's 4 elements are broadcast from the pool as they lie
// (signed), so one instruction adds 64 products and the keys are never widened (f32
// takes a widening and 4 FMAs for those 64). The + 128 adds 128 x (the key's sum over
// the block), taken off per key and block (sums of at most 32 x 255 x 127: no overflow);
// each block's sum is scaled by its query scale, the total by the key's. The values are
// added two keys an instruction in bf16 where the CPU has AVX-512 BF16 (`values_bf16`:
// the weights rounded to bf16, as the AMX walk and a GPU's flash attention round them),
// else in f32 (`values`), as the other walks add them.
// Benchmarks switch it off and on in one process (sluice_lane_int8_dots).
std::atomic<bool> lane_int8_dots{true};

constexpr int kQBlock = 32;                  // query elements sharing a scale
constexpr int kQBlocks = kMaxD / kQBlock;

struct Int8Queries {
  alignas(64) int32_t q[kV][kMaxD / 4][16];  // [vector][elements 4g.. 4g + 3][lane], + 128
  alignas(64) float scale[kQBlocks][kMaxLanes];
};

template <int NV>
inline void round_queries(const Lanes& L, int64_t d, Int8Queries& Q) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int v = 0; v < NV; ++v)
    for (int64_t c0 = 0, b = 0; c0 < d; c0 += kQBlock, ++b) {
      const int64_t c1 = std::min<int64_t>(d, c0 + kQBlock);
      __m512 mx = _mm512_setzero_ps();
      for (int64_t c = c0; c < c1; ++c)
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_load_ps(L.qt[c] + 16 * v)));
      const __mmask16 zero = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_EQ_OQ);
      const __m512 scale = _mm512_mask_mov_ps(_mm512_mul_ps(mx, _mm512_set1_ps(1.f / 127)),
                                              zero, _mm512_set1_ps(1.f));
      _mm512_store_ps(Q.scale[b] + 16 * v, scale);
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), scale);
      for (int64_t g = c0 / 4; g < c1 / 4; ++g) {
        __m512i word = _mm512_setzero_si512();
        for (int e = 0; e < 4; ++e) {
          const __m512i x = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(
              _mm512_mul_ps(_mm512_load_ps(L.qt[4 * g + e] + 16 * v), inv)), lo), hi);
          word = _mm512_or_si512(word, _mm512_slli_epi32(
              _mm512_add_epi32(x, _mm512_set1_epi32(128)), 8 * e));
        }
        _mm512_store_si512(Q.q[v][g], word);
      }
    }
}

// 128 x the sums of a pool row's int8 elements in each block of kQBlock (the + 128's
// share of its dots with the queries' blocks).
inline void offsets_of(const int8_t* row, int64_t d, int32_t* off) {
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t c = 0, b = 0; c < d; c += kQBlock, ++b) {
    const __mmask32 m = d - c >= kQBlock ? ~__mmask32(0) : (__mmask32(1) << (d - c)) - 1;
    const __m256i s8 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones,
                                           _mm256_maskz_loadu_epi8(m, row + c));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    off[b] = 128 * _mm_cvtsi128_si32(s4);
  }
}

#ifdef __AVX512BF16__
#define SLUICE_VALUES_BF16 1
// Benchmarks and tests switch it off and on in one process (sluice_lane_values_bf16).
std::atomic<bool> values_bf16_on{true};
// acc = acc * corr + sum_i p_i v_i over a chunk's n int8 value rows (row i at v + i * rs,
// its scale after its d values), two keys an instruction (vdpbf16ps): each weight times
// its row's scale rounded to bf16 (as a GPU's flash attention rounds its weights, and
// the AMX walk here), the values exact in bf16 (integers of 8 bits), f32 sums. Weights
// past n are taken as 0.
template <int NV>
inline void values_bf16(Lanes& L, const int8_t* v, int64_t rs, int64_t n, int64_t d,
                        float* s, const __m512* corr) {
  constexpr int kDims = NV == 1 ? 16 : 8;
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                         25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                         18, 2, 17, 1, 16, 0);
  const int64_t np = (n + 1) / 2;
  alignas(64) __m512i pw[kChunk / 2][NV];      // weights: key pairs, [lane][2] bf16
  alignas(64) uint32_t vv[kChunk / 2][kMaxD];  // values: key pairs, [dim][2] bf16
  for (int64_t k = 0; k < np; ++k) {
    const int64_t i0 = 2 * k, i1 = std::min<int64_t>(2 * k + 1, n - 1);
    const __m512 s0 = _mm512_set1_ps(sluice::row_scale(v + i0 * rs, d));
    const __m512 s1 = 2 * k + 1 < n ? _mm512_set1_ps(sluice::row_scale(v + i1 * rs, d))
                                    : _mm512_setzero_ps();
    for (int u = 0; u < NV; ++u) {
      const __m512 a = _mm512_mul_ps(_mm512_load_ps(s + i0 * 16 * NV + 16 * u), s0);
      const __m512 b = _mm512_mul_ps(_mm512_load_ps(s + i1 * 16 * NV + 16 * u), s1);
      pw[k][u] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    for (int64_t c = 0; c < d; c += 16) {  // bf16 of an 8-bit integer: its f32's top half
      const __m512i f0 = _mm512_castps_si512(sluice::widen16(v + i0 * rs + c));
      const __m512i f1 = _mm512_castps_si512(sluice::widen16(v + i1 * rs + c));
      _mm512_store_si512(vv[k] + c, _mm512_or_si512(
          _mm512_srli_epi32(f0, 16), _mm512_and_si512(f1, _mm512_set1_epi32(-65536))));
    }
  }
  for (int64_t c = 0; c < d; c += kDims) {
    __m512 a[NV][kDims];
    for (int u = 0; u < NV; ++u)
      for (int j = 0; j < kDims; ++j)
        a[u][j] = _mm512_mul_ps(_mm512_load_ps(L.acc[c + j] + 16 * u), corr[u]);
    for (int64_t k = 0; k < np; ++k)
      for (int j = 0; j < kDims; ++j) {
        const __m512i b = _mm512_set1_epi32(static_cast<int32_t>(vv[k][c + j]));
        for (int u = 0; u < NV; ++u)
          a[u][j] = _mm512_dpbf16_ps(a[u][j], (__m512bh)pw[k][u], (__m512bh)b);
      }
    for (int u = 0; u < NV; ++u)
      for (int j = 0; j < kDims; ++j) _mm512_store_ps(L.acc[c + j] + 16 * u, a[u][j]);
  }
}
#endif

template <int NV>
void walk_vnni(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
               Lanes& L) {
  constexpr int kKeys = NV == 1 ? 8 : 4;  // int and f32 sums: 2 x NV x kKeys registers
  const int64_t d = P.d, rs = P.kvh * P.hs, groups = d / 4;
  const int8_t* kpool = static_cast<const int8_t*>(P.k);
  const int8_t* vpool = static_cast<const int8_t*>(P.v);
  Int8Queries Q;
  round_queries<NV>(L, d, Q);
  __m512i pos[NV];
  __m512 m[NV], l[NV];
  state_in<NV>(L, pos, m, l);
  alignas(64) float s[kChunk * 16 * NV];  // scores, then weights: [key][lane]
  alignas(64) float vw[kChunk][kMaxD];    // the chunk's values widened and scaled
  for (int64_t t = t0, n; t < t1; t += n) {
    const int64_t at = chunk_at(P, table, h, t, t1, &n);
    const int8_t* kr[kChunk];
    int32_t off[kChunk][kQBlocks];
    float ks[kChunk];
    for (int i = 0; i < kChunk; ++i)  // keys past n repeat the last (scored, unused)
      kr[i] = kpool + at + std::min<int64_t>(i, n - 1) * rs;
    for (int i = 0; i < (n + kKeys - 1) / kKeys * kKeys; ++i) {
      offsets_of(kr[i], d, off[i]);
      ks[i] = sluice::row_scale(kr[i], d);
    }
    prefetch_chunk<int8_t>(P, table, h, t + n, t1);
    for (int i = 0; i < n; i += kKeys) {
      __m512 f[NV][kKeys];
      for (int v = 0; v < NV; ++v)
        for (int kk = 0; kk < kKeys; ++kk) f[v][kk] = _mm512_setzero_ps();
      for (int64_t g0 = 0, b = 0; g0 < groups; g0 += kQBlock / 4, ++b) {
        __m512i a[NV][kKeys];
        for (int v = 0; v < NV; ++v)
          for (int kk = 0; kk < kKeys; ++kk) a[v][kk] = _mm512_setzero_si512();
        for (int64_t g = g0; g < std::min<int64_t>(groups, g0 + kQBlock / 4); ++g) {
          __m512i qv[NV];
          for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_si512(Q.q[v][g]);
          for (int kk = 0; kk < kKeys; ++kk) {
            int32_t four;
            std::memcpy(&four, kr[i + kk] + 4 * g, 4);
            const __m512i k4 = _mm512_set1_epi32(four);
            for (int v = 0; v < NV; ++v) a[v][kk] = _mm512_dpbusd_epi32(a[v][kk], qv[v], k4);
          }
        }
        for (int v = 0; v < NV; ++v) {
          const __m512 qs = _mm512_load_ps(Q.scale[b] + 16 * v);
          for (int kk = 0; kk < kKeys; ++kk)
            f[v][kk] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
                a[v][kk], _mm512_set1_epi32(off[i + kk][b]))), qs, f[v][kk]);
        }
      }
      for (int kk = 0; kk < kKeys; ++kk)
        for (int v = 0; v < NV; ++v)
          _mm512_store_ps(s + (i + kk) * 16 * NV + 16 * v,
                          _mm512_mul_ps(f[v][kk], _mm512_set1_ps(ks[i + kk])));
    }
    __m512 corr[NV];
    softmax<NV>(s, n, t, pos, m, l, corr);
#ifdef SLUICE_VALUES_BF16
    if (values_bf16_on.load(std::memory_order_relaxed)) {
      values_bf16<NV>(L, vpool + at, rs, n, d, s, corr);
      continue;
    }
#endif
    const float* vp[kChunk];  // the values, widened and scaled (past n: the last)
    for (int64_t i = 0; i < kChunk; ++i) {
      vp[i] = vw[std::min<int64_t>(i, n - 1)];
      if (i >= n) continue;
      const int8_t* vr = vpool + at + i * rs;
      const __m512 vs = _mm512_set1_ps(sluice::row_scale(vr, d));
      for (int64_t c = 0; c < d; c += 16)
        _mm512_store_ps(vw[i] + c, _mm512_mul_ps(sluice::widen16(vr + c), vs));
    }
    values<NV>(L, vp, n, d, s, corr);
  }
  state_out<NV>(L, m, l);
}
#endif

#ifdef SLUICE_AVX2
// The walk on AVX2 (no AVX-512): lanes in vectors of 8, scores and values computed for
// up to two vectors at a time (16 registers), otherwise `walk`'s order of operations.
template <int VB>
inline void scores8(const Lanes& L, const float* const* kp, int64_t n, int64_t d, int v,
                    float* s) {
  constexpr int kKeys = 4;
  for (int i = 0; i < n; i += kKeys) {  // keys past n repeat the last (scored, unused)
    __m256 a[VB][kKeys];
    for (int u = 0; u < VB; ++u)
      for (int kk = 0; kk < kKeys; ++kk) a[u][kk] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      __m256 qv[VB];
      for (int u = 0; u < VB; ++u) {
        qv[u] = _mm256_load_ps(L.qt[c] + 8 * (v + u));
        asm("" : "+x"(qv[u]));  // loaded once for the keys (GCC re-read it per FMA)
      }
      for (int kk = 0; kk < kKeys; ++kk) {
        const __m256 b = _mm256_broadcast_ss(kp[i + kk] + c);
        for (int u = 0; u < VB; ++u) a[u][kk] = _mm256_fmadd_ps(qv[u], b, a[u][kk]);
      }
    }
    for (int kk = 0; kk < kKeys; ++kk)
      for (int u = 0; u < VB; ++u) _mm256_store_ps(s + (i + kk) * kMaxLanes + 8 * (v + u), a[u][kk]);
  }
}

template <int VB>
inline void values8(Lanes& L, const float* const* vp, int64_t n, int64_t c, int v,
                    const float* s, const float* corr) {
  constexpr int kDims = 4;
  __m256 a[VB][kDims];
  for (int u = 0; u < VB; ++u)
    for (int j = 0; j < kDims; ++j)
      a[u][j] = _mm256_mul_ps(_mm256_load_ps(L.acc[c + j] + 8 * (v + u)),
                              _mm256_load_ps(corr + 8 * (v + u)));
  for (int i = 0; i < n; ++i) {
    __m256 pv[VB];
    for (int u = 0; u < VB; ++u) {
      pv[u] = _mm256_load_ps(s + i * kMaxLanes + 8 * (v + u));
      asm("" : "+x"(pv[u]));  // loaded once for the dimensions, as above
    }
    for (int j = 0; j < kDims; ++j) {
      const __m256 b = _mm256_broadcast_ss(vp[i] + c + j);
      for (int u = 0; u < VB; ++u) a[u][j] = _mm256_fmadd_ps(pv[u], b, a[u][j]);
    }
  }
  for (int u = 0; u < VB; ++u)
    for (int j = 0; j < kDims; ++j) _mm256_store_ps(L.acc[c + j] + 8 * (v + u), a[u][j]);
}

template <typename T>
void walk8(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
           Lanes& L) {
  const int nv = (L.n + 7) / 8;
  constexpr bool kWiden = sizeof(T) != 4;
  const int64_t d = P.d;
  alignas(64) float s[kChunk * kMaxLanes];  // scores, then weights: [key][lane]
  alignas(64) float corr[kMaxLanes];
  alignas(64) float kw[kWiden ? kChunk : 1][kWiden ? kMaxD : 8];
  alignas(64) float vw[kWiden ? kChunk : 1][kWiden ? kMaxD : 8];
  for (int64_t j = 0; j + 1 < kAhead; ++j) prefetch_chunk<T>(P, table, h, t0 + j * kChunk, t1);
  for (int64_t t = t0, n; t < t1; t += n) {
    const int64_t at = chunk_at(P, table, h, t, t1, &n);
    const float* kp[kChunk];
    const float* vp[kChunk];
    if constexpr (kWiden) widen_chunk<T>(P, at, n, kw[0], vw[0], kMaxD);
    chunk_rows<T>(P, at, n, kw, vw, kp, vp);
    prefetch_chunk<T>(P, table, h, t + n + (kAhead - 1) * kChunk, t1);
    for (int v = 0; v < nv; v += 2) {
      if (v + 1 < nv) scores8<2>(L, kp, n, d, v, s);
      else scores8<1>(L, kp, n, d, v, s);
    }
    for (int v = 0; v < nv; ++v) {  // the online softmax, down the lanes
      const __m256i pos = _mm256_load_si256(reinterpret_cast<const __m256i*>(L.pos + 8 * v));
      const __m256 m = _mm256_load_ps(L.m + 8 * v);
      __m256 seen[kChunk];
      __m256 mx = m;
      for (int i = 0; i < n; ++i) {  // a lane sees key t + i iff t + i <= pos
        seen[i] = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(pos, _mm256_set1_epi32(static_cast<int32_t>(t + i - 1))));
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(kNeg),
                                                _mm256_load_ps(s + i * kMaxLanes + 8 * v),
                                                seen[i]));
      }
      const __m256 c = sluice::exp8(_mm256_sub_ps(m, mx));
      _mm256_store_ps(corr + 8 * v, c);
      __m256 l = _mm256_mul_ps(_mm256_load_ps(L.l + 8 * v), c);
      for (int i = 0; i < n; ++i) {
        float* si = s + i * kMaxLanes + 8 * v;
        const __m256 p = _mm256_and_ps(seen[i], sluice::exp8(_mm256_sub_ps(_mm256_load_ps(si), mx)));
        _mm256_store_ps(si, p);
        l = _mm256_add_ps(l, p);
      }
      _mm256_store_ps(L.m + 8 * v, mx);
      _mm256_store_ps(L.l + 8 * v, l);
    }
    for (int64_t c = 0; c < d; c += 4)  // acc = acc * corr + sum_i p_i v_i
      for (int v = 0; v < nv; v += 2) {
        if (v + 1 < nv) values8<2>(L, vp, n, c, v, s, corr);
        else values8<1>(L, vp, n, c, v, s, corr);
      }
  }
}
#endif

#if defined(SLUICE_AMX) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SLUICE_LANE_AMX 1
// Benchmarks switch the tile unit's path off and on in one process (sluice_lane_amx).
std::atomic<bool> lane_amx{true};

// The walk on the tile unit (bf16 pools; d a multiple of 32), blocks of kMaxKeys keys:
// the scores S [key][lane] = K Q^T (A: the block's keys as stored, 16 x 32 channels; B:
// the lanes' queries in bf16, "VNNI" order, built once a walk), the softmax on them in
// vectors as above, then acc^T [lane][channel] += P^T V (A: the weights transposed and
// rounded to bf16; B: the values with key pairs interleaved). acc^T's channels sit in
// the order the interleave leaves them (`amx_column`), put back once at the end.
// Tiles (all 16 rows x 64 bytes, sluice::tiles_on): 0-2 C, 3 A, 4-6 B.
struct AmxScratch {
  alignas(64) uint16_t q[kV][kMaxD / 32][512];  // [lanes][channel half]: [pair][lane][2]
  alignas(64) uint16_t k[kMaxKeys * kMaxD];     // the block's keys [key][channel]
  alignas(64) uint16_t vr[kMaxKeys * kMaxD];    // and values
  alignas(64) uint16_t v[kMaxD / 16][512];      // values: [key pair][16 channels][2]
  alignas(64) uint16_t p[kV][512];              // weights: [lane][key]
  alignas(64) float s[kMaxKeys * kMaxLanes];    // scores, then weights: [key][lane]
  alignas(64) float acc[kMaxLanes * kMaxD];     // [lane][channel in tile order]
  alignas(64) float corr[kMaxLanes];
};

// The channel in column i of acc^T's block cb: blocks 2h and 2h + 1 hold channels
// 32h.. 32h + 31 as unpacklo/hi_epi16 of two keys' 32 channels leave them: per 128-bit
// lane i/4, channels 8 (i/4) + i%4 (lo) and 8 (i/4) + 4 + i%4 (hi).
inline int64_t amx_column(int64_t cb, int i) {
  return 32 * (cb / 2) + 8 * (i / 4) + 4 * (cb % 2) + i % 4;
}

template <int NV>
void walk_amx(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
              Lanes& L) {
  thread_local AmxScratch S;
  const int64_t d = P.d, rs = P.kvh * d, halves = d / 32;
  const uint16_t* kpool = static_cast<const uint16_t*>(P.k);
  const uint16_t* vpool = static_cast<const uint16_t*>(P.v);
  // The queries as B tiles: pair cp of half hh, lane j: channels 32 hh + 2 cp (+1).
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                         25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                         18, 2, 17, 1, 16, 0);
  for (int v = 0; v < NV; ++v)
    for (int64_t hh = 0; hh < halves; ++hh)
      for (int cp = 0; cp < 16; ++cp) {
        const int64_t c = 32 * hh + 2 * cp;
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(
            _mm512_load_ps(L.qt[c + 1] + 16 * v), _mm512_load_ps(L.qt[c] + 16 * v));
        _mm512_store_si512(S.q[v][hh] + 32 * cp, _mm512_permutexvar_epi16(pairs, both));
      }
  // acc^T from the lanes' acc ([channel][lane]; zero on a fresh walk), 16 x 16 at a time.
  for (int v = 0; v < NV; ++v)
    for (int64_t cb = 0; cb < d / 16; ++cb) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(L.acc[amx_column(cb, i)] + 16 * v);
      sluice::transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(S.acc + (16 * v + j) * d + 16 * cb, r[j]);
    }
  __m512i pos[NV];
  __m512 m[NV], l[NV];
  state_in<NV>(L, pos, m, l);
  sluice::tiles_on();
  for (int64_t t = t0; t < t1;) {
    // The block's keys and values: two whole runs of 16 in their pages (pages of a
    // multiple of 16 keys, the block at a multiple of 16: the usual case) are read in
    // place, 16 at a stride of a pool row; otherwise they are gathered, zero-padded.
    const uint16_t *kin[2], *vin[2];
    int64_t n = 0, stride = rs;
    if (P.ps % 16 == 0 && t % 16 == 0 && t + kMaxKeys <= t1) {
      for (int sub = 0; sub < 2; ++sub) {
        int64_t c;
        const int64_t at = chunk_at(P, table, h, t + 16 * sub, t1, &c);
        kin[sub] = kpool + at;
        vin[sub] = vpool + at;
      }
      n = kMaxKeys;
    } else {
      while (n < kMaxKeys && t + n < t1) {
        int64_t c;
        const int64_t at = chunk_at(P, table, h, t + n, t1, &c);
        c = std::min<int64_t>(c, kMaxKeys - n);
        for (int64_t i = 0; i < c; ++i)
          for (int64_t x = 0; x < d; x += 32) {
            _mm512_store_si512(S.k + (n + i) * d + x,
                               _mm512_loadu_si512(kpool + at + i * rs + x));
            _mm512_store_si512(S.vr + (n + i) * d + x,
                               _mm512_loadu_si512(vpool + at + i * rs + x));
          }
        n += c;
      }
      if (n < kMaxKeys) {
        std::memset(S.k + n * d, 0, 2 * d * (kMaxKeys - n));
        std::memset(S.vr + n * d, 0, 2 * d * (kMaxKeys - n));
      }
      kin[0] = S.k, kin[1] = S.k + 16 * d, vin[0] = S.vr, vin[1] = S.vr + 16 * d;
      stride = d;
    }
    for (int64_t tn = t + n, i = 0, c; i < 2 && tn < t1; ++i, tn += c) {  // the next block
      const int64_t at = chunk_at(P, table, h, tn, t1, &c);
      for (int64_t r = 0; r < c; ++r)
        for (int64_t x = 0; x < d; x += 32) {
          _mm_prefetch(reinterpret_cast<const char*>(kpool + at + r * rs + x), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vpool + at + r * rs + x), _MM_HINT_T0);
        }
    }
    for (int kp = 0; kp < kMaxKeys / 2; ++kp)  // values as B tiles
      for (int64_t hh = 0; hh < halves; ++hh) {
        const uint16_t* row = vin[kp / 8] + (2 * kp % 16) * stride + 32 * hh;
        const __m512i a = _mm512_loadu_si512(row);
        const __m512i b = _mm512_loadu_si512(row + stride);
        _mm512_store_si512(S.v[2 * hh] + 32 * kp, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(S.v[2 * hh + 1] + 32 * kp, _mm512_unpackhi_epi16(a, b));
      }
    for (int sub = 0; sub < kMaxKeys / 16 && 16 * sub < n; ++sub) {  // scores
      _tile_zero(0);
      if constexpr (NV > 1) _tile_zero(1);
      if constexpr (NV > 2) _tile_zero(2);
      for (int64_t hh = 0; hh < halves; ++hh) {
        _tile_loadd(3, kin[sub] + 32 * hh, 2 * stride);
        _tile_loadd(4, S.q[0][hh], 64);
        _tile_dpbf16ps(0, 3, 4);
        if constexpr (NV > 1) {
          _tile_loadd(5, S.q[1][hh], 64);
          _tile_dpbf16ps(1, 3, 5);
        }
        if constexpr (NV > 2) {
          _tile_loadd(6, S.q[2][hh], 64);
          _tile_dpbf16ps(2, 3, 6);
        }
      }
      float* out = S.s + 16 * sub * 16 * NV;
      _tile_stored(0, out, 64 * NV);
      if constexpr (NV > 1) _tile_stored(1, out + 16, 64 * NV);
      if constexpr (NV > 2) _tile_stored(2, out + 32, 64 * NV);
    }
    __m512 corr[NV];
    softmax<NV>(S.s, n, t, pos, m, l, corr);
    for (int64_t i = n; i < kMaxKeys; ++i)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(S.s + (i * NV + v) * 16, _mm512_setzero_ps());
    for (int v = 0; v < NV; ++v) {  // the weights as A tiles, [lane][key]
      __m512 lo[16], hi[16];
      for (int i = 0; i < 16; ++i) {
        lo[i] = _mm512_load_ps(S.s + (i * NV + v) * 16);
        hi[i] = _mm512_load_ps(S.s + ((16 + i) * NV + v) * 16);
      }
      sluice::transpose16(lo);
      sluice::transpose16(hi);
      for (int j = 0; j < 16; ++j)
        _mm512_store_si512(S.p[v] + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(hi[j], lo[j]));
      // the lanes' values so far, scaled where their max moved
      if (_mm512_cmp_ps_mask(corr[v], _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) {
        _mm512_store_ps(S.corr + 16 * v, corr[v]);
        for (int j = 16 * v; j < 16 * v + 16; ++j) {
          const __m512 cj = _mm512_set1_ps(S.corr[j]);
          for (int64_t c = 0; c < d; c += 16)
            _mm512_store_ps(S.acc + j * d + c,
                            _mm512_mul_ps(_mm512_load_ps(S.acc + j * d + c), cj));
        }
      }
    }
    for (int v = 0; v < NV; ++v) {  // acc^T += P^T V, two column blocks in flight
      _tile_loadd(3, S.p[v], 64);
      float* a = S.acc + 16 * v * d;
      for (int64_t cb = 0; cb < d / 16; cb += 2) {
        _tile_loadd(0, a + 16 * cb, 4 * d);
        _tile_loadd(4, S.v[cb], 64);
        _tile_loadd(1, a + 16 * cb + 16, 4 * d);
        _tile_loadd(5, S.v[cb + 1], 64);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_stored(0, a + 16 * cb, 4 * d);
        _tile_stored(1, a + 16 * cb + 16, 4 * d);
      }
    }
    t += n;
  }
  _tile_release();
  state_out<NV>(L, m, l);
  for (int v = 0; v < NV; ++v)
    for (int64_t cb = 0; cb < d / 16; ++cb) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_load_ps(S.acc + (16 * v + j) * d + 16 * cb);
      sluice::transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(L.acc[amx_column(cb, i)] + 16 * v, r[i]);
    }
}
#endif

// The lanes' online softmax over keys [t0, t1) of one KV head, read through `table`.
template <typename T>
void walk_pool(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
               Lanes& L) {
#ifdef SLUICE_LANE_AMX
  if (sizeof(T) == 2 && P.d % 32 == 0 && lane_amx.load(std::memory_order_relaxed) &&
      sluice::amx_permitted()) {
    switch (L.vectors()) {
      case 1: return walk_amx<1>(P, table, h, t0, t1, L);
      case 2: return walk_amx<2>(P, table, h, t0, t1, L);
      default: return walk_amx<3>(P, table, h, t0, t1, L);
    }
  }
#endif
#ifdef SLUICE_LANE_VNNI
  if constexpr (sizeof(T) == 1)
    if (lane_int8_dots.load(std::memory_order_relaxed)) switch (L.vectors()) {
        case 1: return walk_vnni<1>(P, table, h, t0, t1, L);
        case 2: return walk_vnni<2>(P, table, h, t0, t1, L);
        default: return walk_vnni<3>(P, table, h, t0, t1, L);
      }
#endif
#ifdef __AVX512F__
  switch (L.vectors()) {
    case 1: return walk<1, T>(P, table, h, t0, t1, L);
    case 2: return walk<2, T>(P, table, h, t0, t1, L);
    default: return walk<3, T>(P, table, h, t0, t1, L);
  }
#elif defined(SLUICE_AVX2)
  return walk8<T>(P, table, h, t0, t1, L);
#else
  const int64_t d = P.d, rs = P.kvh * P.hs;
  const T* kpool = static_cast<const T*>(P.k);
  const T* vpool = static_cast<const T*>(P.v);
  for (int64_t t = t0, n; t < t1; t += n) {
    const int64_t at = chunk_at(P, table, h, t, t1, &n);
    for (int j = 0; j < L.n; ++j) {
      float s[kChunk], mx = L.m[j];
      for (int64_t i = 0; i < n; ++i) {
        float dot = 0.f;
        for (int64_t c = 0; c < d; ++c) dot += L.qt[c][j] * sluice::widen1(kpool + at + i * rs + c);
        dot *= sluice::row_scale(kpool + at + i * rs, d);
        s[i] = t + i <= L.pos[j] ? dot : kNeg;
        mx = std::max(mx, s[i]);
      }
      const float corr = std::exp(L.m[j] - mx);
      L.l[j] *= corr;
      for (int64_t c = 0; c < d; ++c) L.acc[c][j] *= corr;
      for (int64_t i = 0; i < n; ++i) {
        if (t + i > L.pos[j]) continue;
        const float p = std::exp(s[i] - mx);
        const float pv = p * sluice::row_scale(vpool + at + i * rs, d);
        L.l[j] += p;
        for (int64_t c = 0; c < d; ++c) L.acc[c][j] += pv * sluice::widen1(vpool + at + i * rs + c);
      }
      L.m[j] = mx;
    }
  }
#endif
}

void walk(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
          Lanes& L) {
  switch (P.kind) {
    case Kind::bf16: return walk_pool<uint16_t>(P, table, h, t0, t1, L);
    case Kind::int8: return walk_pool<int8_t>(P, table, h, t0, t1, L);
    default: return walk_pool<float>(P, table, h, t0, t1, L);
  }
}

// A set of lanes and the keys [0, end) they read through `table` (KV head h).
struct Task {
  const int32_t* table;
  int64_t h, end;
  int n;
  int64_t at[kMaxLanes];
  int32_t pos[kMaxLanes];
};

// Every task's lanes over its keys, split in parts over the thread pool so that a few
// long walks still keep every thread busy, merged: done(task, m, l, acc) gets each
// lane's softmax over all its keys (acc transposed, [dimension][lane]).
template <typename Done>
void run(ffi::ThreadPool& pool, const Pool& P, const float* q, const std::vector<Task>& tasks,
         Done done) {
  const int64_t d = P.d;
  const int64_t want = 4 * (int64_t(pool.num_threads()) + 1);  // items to aim for
  struct Item { int64_t task, t0, t1; };
  std::vector<Item> items;
  std::vector<int64_t> first(tasks.size() + 1, 0);  // each task's first item
  for (size_t i = 0; i < tasks.size(); ++i) {
    const int64_t keys = tasks[i].end;
    const int64_t split = std::max<int64_t>(1, std::min<int64_t>(
        keys / kPartKeys, (want + int64_t(tasks.size()) - 1) / int64_t(tasks.size())));
    // (Parts start at multiples of 32 keys, so that the tile walk reads its blocks in
    // place: `walk_amx`.)
    for (int64_t part = 0; part < split; ++part)
      items.push_back({int64_t(i), keys * part / split / 32 * 32,
                       part + 1 == split ? keys : keys * (part + 1) / split / 32 * 32});
    first[i + 1] = int64_t(items.size());
  }
  const int64_t stride = (d + 2) * kMaxLanes;  // an item's result: m, l, acc
  std::vector<float> parts(items.size() * stride);
  std::vector<int64_t> order(items.size());  // longest walks first
  for (size_t i = 0; i < items.size(); ++i) order[i] = int64_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return (items[a].t1 - items[a].t0) * tasks[items[a].task].n >
           (items[b].t1 - items[b].t0) * tasks[items[b].task].n;
  });
  sluice::parallel_for(pool, int64_t(items.size()), [&](int64_t k) {
    const Item it = items[order[k]];
    const Task& task = tasks[it.task];
    Lanes L;
    for (int j = 0; j < task.n; ++j) L.add(task.at[j], task.pos[j]);
    L.begin(q, d);
    walk(P, task.table, task.h, it.t0, it.t1, L);
    float* out = parts.data() + order[k] * stride;
    std::memcpy(out, L.m, sizeof(float) * kMaxLanes);
    std::memcpy(out + kMaxLanes, L.l, sizeof(float) * kMaxLanes);
    std::memcpy(out + 2 * kMaxLanes, L.acc, sizeof(float) * kMaxLanes * d);
  });
  std::vector<float> m(kMaxLanes), l(kMaxLanes), acc(d * kMaxLanes);
  for (size_t i = 0; i < tasks.size(); ++i) {
    std::fill(m.begin(), m.end(), kNeg);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k = first[i]; k < first[i + 1]; ++k) {
      const float* part = parts.data() + k * stride;
      for (int j = 0; j < tasks[i].n; ++j) {
        const float mx = std::max(m[j], part[j]);
        const float a = std::exp(m[j] - mx), b = std::exp(part[j] - mx);
        m[j] = mx;
        l[j] = l[j] * a + part[kMaxLanes + j] * b;
        for (int64_t c = 0; c < d; ++c)
          acc[c * kMaxLanes + j] = acc[c * kMaxLanes + j] * a +
                                   part[2 * kMaxLanes + c * kMaxLanes + j] * b;
      }
    }
    done(tasks[i], m.data(), l.data(), acc.data());
  }
}

bool check(const Pool& P, int64_t kvh, int64_t d, ffi::Span<const int64_t> kd) {
  return kd.size() == 4 && kd[2] == kvh && kd[3] == P.hs && d % 16 == 0 && d <= kMaxD &&
         P.ps > 0;
}

Pool pool_of(ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& offset,
             int64_t kvh, int64_t d) {
  const auto kd = k.dimensions();
  const auto et = k.element_type();
  const bool ok = (et == ffi::DataType::F32 || et == ffi::DataType::U16 ||
                   et == ffi::DataType::S8) && v.element_type() == et && kd.size() == 4;
  const Kind kind = et == ffi::DataType::U16 ? Kind::bf16
                    : et == ffi::DataType::S8 ? Kind::int8 : Kind::f32;
  return Pool{k.untyped_data(), v.untyped_data(), kvh, d, ok ? kd[1] : 0, ok ? kd[0] : 0,
              offset.typed_data()[0], d + (kind == Kind::int8 ? sluice::kScaleBytes : 0), kind};
}

ffi::Error PrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> offset, ffi::Buffer<ffi::S32> tables,
                                ffi::Buffer<ffi::S32> ctx, ffi::Buffer<ffi::S32> qlen,
                                ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), td = tables.dimensions();
  if (qd.size() != 5 || td.size() != 2 || td[0] != qd[0])
    return ffi::Error::InvalidArgument("sluice_prefill_attention: bad shapes");
  const int64_t rows = qd[0], nq = qd[1], kvh = qd[2], g = qd[3], d = qd[4], w = td[1];
  const Pool P = pool_of(k, v, offset, kvh, d);
  if (!check(P, kvh, d, k.dimensions()))
    return ffi::Error::InvalidArgument("sluice_prefill_attention: shapes do not agree");
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * rows * nq * kvh * g * d);
  const int32_t *cl = ctx.typed_data(), *ql = qlen.typed_data();
  // A task: up to 48 of a block's (query, head of the group) pairs; its keys end after
  // its last query's position, never past the table.
  std::vector<Task> tasks;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lanes = std::min<int64_t>(ql[r], nq) * g, first = cl[r] - ql[r];
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t j0 = 0; j0 < lanes; j0 += kMaxLanes) {
        Task t{tables.typed_data() + r * w, h, 0, 0};
        for (int64_t j = j0; j < std::min<int64_t>(lanes, j0 + kMaxLanes); ++j, ++t.n) {
          t.at[t.n] = (((r * nq + j / g) * kvh + h) * g + j % g) * d;
          t.pos[t.n] = static_cast<int32_t>(first + j / g);
          t.end = std::max<int64_t>(t.end, first + j / g + 1);
        }
        t.end = std::min<int64_t>(t.end, w * P.ps);
        tasks.push_back(t);
      }
  }
  run(pool, P, q.typed_data(), tasks, [&](const Task& t, const float* m, const float* l,
                                          const float* acc) {
    for (int j = 0; j < t.n; ++j) {
      const float inv = l[j] == 0.f ? 1.f : 1.f / l[j];
      for (int64_t c = 0; c < d; ++c) o[t.at[j] + c] = acc[c * kMaxLanes + j] * inv;
    }
  });
  return ffi::Error::Success();
}

ffi::Error PrefixAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> offset, ffi::Buffer<ffi::S32> pages,
                               ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::S32> rows_of,
                               ffi::ResultBuffer<ffi::F32> m_out,
                               ffi::ResultBuffer<ffi::F32> l_out,
                               ffi::ResultBuffer<ffi::F32> acc_out) {
  const auto qd = q.dimensions(), pd = pages.dimensions();
  if (qd.size() != 4 || pd.size() != 2 || length.element_count() != pd[0] ||
      rows_of.element_count() != qd[0])
    return ffi::Error::InvalidArgument("sluice_prefix_attention: bad shapes");
  const int64_t rows = qd[0], kvh = qd[1], g = qd[2], d = qd[3], w = pd[1];
  const Pool P = pool_of(k, v, offset, kvh, d);
  if (!check(P, kvh, d, k.dimensions()))
    return ffi::Error::InvalidArgument("sluice_prefix_attention: shapes do not agree");
  float *mo = m_out->typed_data(), *lo = l_out->typed_data(), *ao = acc_out->typed_data();
  std::fill(mo, mo + rows * kvh * g, kNeg);
  std::fill(lo, lo + rows * kvh * g, 0.f);
  std::fill(ao, ao + rows * kvh * g * d, 0.f);
  const int32_t *len = length.typed_data(), *of = rows_of.typed_data();
  std::vector<std::vector<int64_t>> members(pd[0]);
  for (int64_t r = 0; r < rows; ++r)
    if (of[r] > 0 && of[r] <= pd[0] && len[of[r] - 1] > 0) members[of[r] - 1].push_back(r);
  // A task: up to 48 of a prefix's (row, head of the group) pairs, over all its keys.
  std::vector<Task> tasks;
  for (int64_t p = 0; p < pd[0]; ++p) {
    const int64_t lanes = int64_t(members[p].size()) * g;
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t j0 = 0; j0 < lanes; j0 += kMaxLanes) {
        Task t{pages.typed_data() + p * w, h, std::min<int64_t>(len[p], w * P.ps), 0};
        for (int64_t j = j0; j < std::min<int64_t>(lanes, j0 + kMaxLanes); ++j, ++t.n) {
          t.at[t.n] = ((members[p][j / g] * kvh + h) * g + j % g) * d;
          t.pos[t.n] = INT_MAX;
        }
        tasks.push_back(t);
      }
  }
  run(pool, P, q.typed_data(), tasks, [&](const Task& t, const float* m, const float* l,
                                          const float* acc) {
    for (int j = 0; j < t.n; ++j) {
      mo[t.at[j] / d] = m[j];
      lo[t.at[j] / d] = l[j];
      for (int64_t c = 0; c < d; ++c) ao[t.at[j] + c] = acc[c * kMaxLanes + j];
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluicePrefillAttention, PrefillAttentionImpl,
                              sluice::paged_attention_binding()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ctx
                                  .Arg<ffi::Buffer<ffi::S32>>()   // qlen
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluicePrefixAttention, PrefixAttentionImpl,
                              sluice::paged_attention_binding()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // length
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>()   // l
                                  .Ret<ffi::Buffer<ffi::F32>>());  // acc

namespace {
// One of the walks' switches: `on` >= 0 sets it; whether it is on.
[[maybe_unused]] int switched(std::atomic<bool>& flag, int on) {
  if (on >= 0) flag.store(on != 0);
  return flag.load() ? 1 : 0;
}
}  // namespace

// Whether bf16 pools are read through the AMX tile unit (1 where it can be, 0 where this
// build or the OS has none); `on` >= 0 sets it (the A/B of
// benchmarks/experiments/attention_ab.py).
extern "C" int sluice_lane_amx(int on) {
#ifdef SLUICE_LANE_AMX
  return switched(lane_amx, on) && sluice::amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// Whether the walks over int8 pools score with int8 dots (VNNI: 1 where this build has
// them and they are on); `on` >= 0 sets it (benchmarks' and tests' A/B).
extern "C" int sluice_lane_int8_dots(int on) {
#ifdef SLUICE_LANE_VNNI
  return switched(lane_int8_dots, on);
#else
  return 0;
#endif
}

// Whether the int8-dot walk adds the values two keys an instruction in bf16 (AVX-512
// BF16: 1 where this build has it and it is on); `on` >= 0 sets it.
extern "C" int sluice_lane_values_bf16(int on) {
#ifdef SLUICE_VALUES_BF16
  return switched(values_bf16_on, on);
#else
  return 0;
#endif
}

// The lanes of one vector in the walk this build runs: 16 (AVX-512), 8 (AVX2), 1.
extern "C" int sluice_lane_width() {
#ifdef __AVX512F__
  return 16;
#elif defined(SLUICE_AVX2)
  return 8;
#else
  return 1;
#endif
}
