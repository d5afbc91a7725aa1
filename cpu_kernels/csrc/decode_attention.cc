// Decode attention over each row's own pages, for the CPU backend (pallas_kernels/cpu.py):
// every row walks exactly its own keys, reading them where they lie in the page pool (no
// gather, no copy), with an online softmax started from the partial result of the row's
// shared prefix (which the cascade reads once for many rows, pallas_kernels/cascade.py).
//
// Registered with XLA as the FFI target "sluice_decode_attention" (native.py). Why: in
// jnp the rows were walked in groups, each as far as its longest row, through page
// gathers (a copy of every key and value) and small einsums; a long row made its
// neighbours walk its keys (docs/history/benchmarks-log.md, issue 20).
//
//   q       f32 [S, KVH, G, D]: one query per row, pre-scaled by 1/sqrt(D), its G heads
//           sharing KV head k;
//   k, v    f32 or uint16 (bf16 bit patterns, widened as read) [P, PS, KVH, D], or int8
//           [P, PS, KVH, D + 4] (each row's D values, then their f32 scale): the page
//           pool (all layers);
//   offset  int32 []: the pool row of this layer's page 0;
//   tables  int32 [S, W]: each row's page ids (this layer's numbering);
//   start   int32 [S]: the row's first own key (the end of its shared prefix);
//   ctx     int32 [S]: its keys in the pool (this step's included): own keys are
//           [start, ctx);
//   m, l    f32 [S, KVH, G], acc f32 [S, KVH, G, D]: the prefix's partial softmax (max,
//           sum, weighted values; m = -1e30, l = 0, acc = 0 for none);
//   out     f32 [S, KVH, G, D]: attention output, acc / l after the own keys.
// D must be a multiple of 16. AVX-512, AVX2 and portable forms of one walk.
//
// Work items are spans of a row's keys (at most kSpan), each walked for all the row's KV
// heads at once, so that pages are read whole and in order and one long row is shared by
// the threads; a row's spans are merged at the end. 2k own keys of one row took 15.7 ms
// for 30 layers walked per (row, head) with the group size read at run time, 6.2 ms now
// (2 cores, AVX2; docs/history/benchmarks-log.md).
//
// (About 420 lines: the walk's AVX-512, AVX2 and portable forms of one chunk, the span
// walk, and the entry point that splits and merges spans; they change together.)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
#ifdef __AVX512F__
using sluice::exp16;
#endif

namespace {

constexpr int kMaxG = 16;   // query heads per KV head
constexpr int kMaxD = 256;  // head dimension
constexpr int kChunk = 16;  // keys scored together
// Chunks ahead that the walk asks the L2 cache for (the next one goes to L1): a row's
// own keys rarely sit in a cache when a step reaches them (docs/history/benchmarks-log.md,
// twenty-seventh session: own keys from the L3 cache, 1.28x with the keys at a time below).
constexpr int64_t kL2Ahead = 4;



struct Args {
  const float *q, *m0, *l0, *acc0;
  const void *k, *v;  // the pool: float, uint16_t holding bf16 bits or int8 (walk_span's T)
  const int32_t *tables, *start, *ctx;
  float* out;
  int64_t kvh, g, d, hs, ps, w, offset, pages;  // hs: elements a head's row takes (d + 4: int8)
};

// x[j][i] *= the scale of row i (rows: n keys or values), for each of the g heads: an
// int8 pool's keys are scaled as scored, its values by weighting them (p_i s_i v_i), the
// softmax's sum left unscaled. f32 and bf16 rows have nothing to scale.
template <typename T>
inline void scale_by_rows(float (*x)[kChunk], const T* const* rows, int64_t n, int64_t g,
                          int64_t d) {
  if constexpr (std::is_same_v<T, int8_t>) {
    for (int i = 0; i < n; ++i) {
      const float scale = sluice::row_scale(rows[i], d);
      for (int64_t j = 0; j < g; ++j) x[j][i] *= scale;
    }
  }
}

// One chunk of n keys (kp, vp: where each lies) for the G query heads (q [G][D]) of one
// KV head: scores, the online softmax's update of m, l [G] and acc [G][D].
// G: the query heads per KV head when known at compile time (0: g at run time). Known,
// the heads' dot products and value sums stay in registers; with a run-time count they
// went through memory a product at a time and the walk ran 2-2.5x slower.
template <typename T, int G>
inline void head_chunk(const float* q, const T* const* kp, const T* const* vp, int64_t n,
                       int64_t g_run, int64_t d, float* m, float* l, float* acc) {
  const int64_t g = G ? G : g_run;
  alignas(64) float s[kMaxG][kChunk];
#ifdef __AVX512F__
  for (int i = 0; i < n; ++i) {  // scores: q . k for every head of the group
    __m512 dot[kMaxG];
    for (int64_t j = 0; j < g; ++j) dot[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 kv = sluice::widen16(kp[i] + c);
      for (int64_t j = 0; j < g; ++j)
        dot[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + c), kv, dot[j]);
    }
    for (int64_t j = 0; j < g; ++j) s[j][i] = _mm512_reduce_add_ps(dot[j]);
  }
  scale_by_rows<T>(s, kp, n, g, d);
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  alignas(64) float p[kMaxG][kChunk];
  float corr[kMaxG];
  for (int64_t j = 0; j < g; ++j) {
    const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-1e30f), valid, s[j]);
    const float m_new = std::max(m[j], _mm512_reduce_max_ps(sv));
    const __m512 pv = _mm512_maskz_mov_ps(
        valid, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
    _mm512_store_ps(p[j], pv);
    corr[j] = std::exp(m[j] - m_new);
    l[j] = l[j] * corr[j] + _mm512_reduce_add_ps(pv);
    m[j] = m_new;
  }
  scale_by_rows<T>(p, vp, n, g, d);
  for (int64_t c = 0; c < d; c += 16) {  // acc = acc * corr + sum_i p_i v_i
    __m512 av[kMaxG];
    for (int64_t j = 0; j < g; ++j)
      av[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * d + c), _mm512_set1_ps(corr[j]));
    for (int i = 0; i < n; ++i) {
      const __m512 vv = sluice::widen16(vp[i] + c);
      for (int64_t j = 0; j < g; ++j)
        av[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j][i]), vv, av[j]);
    }
    for (int64_t j = 0; j < g; ++j) _mm512_storeu_ps(acc + j * d + c, av[j]);
  }
#elif defined(SLUICE_AVX2)
  // The same on 8 lanes, a few keys at a time where the group is known and small: the G
  // sums of one key alone were G chains of dependent FMAs (3 for SmolLM2), a third of
  // what the FMA units take. Each sum still runs over its key's channels in order.
  constexpr int kKeys = G == 0 ? 1 : G <= 2 ? 4 : G == 3 ? 3 : G <= 6 ? 2 : 1;
  int first = 0;
  if constexpr (kKeys > 1) {
    for (; first + kKeys <= n; first += kKeys) {
      __m256 dot[kKeys][G > 0 ? G : 1];
      for (int u = 0; u < kKeys; ++u)
        for (int j = 0; j < G; ++j) dot[u][j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        __m256 kv[kKeys];
        for (int u = 0; u < kKeys; ++u) kv[u] = sluice::widen8(kp[first + u] + c);
        for (int j = 0; j < G; ++j) {
          const __m256 qj = _mm256_loadu_ps(q + j * d + c);
          for (int u = 0; u < kKeys; ++u) dot[u][j] = _mm256_fmadd_ps(qj, kv[u], dot[u][j]);
        }
      }
      for (int u = 0; u < kKeys; ++u)
        for (int j = 0; j < G; ++j) s[j][first + u] = sluice::sum8(dot[u][j]);
    }
  }
  for (int i = first; i < n; ++i) {
    __m256 dot[kMaxG];
    for (int64_t j = 0; j < g; ++j) dot[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 kv = sluice::widen8(kp[i] + c);
      for (int64_t j = 0; j < g; ++j)
        dot[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + c), kv, dot[j]);
    }
    for (int64_t j = 0; j < g; ++j) s[j][i] = sluice::sum8(dot[j]);
  }
  scale_by_rows<T>(s, kp, n, g, d);
  alignas(64) float p[kMaxG][kChunk];
  float corr[kMaxG];
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < g; ++j) {
    float m_new = m[j];
    for (int i = 0; i < n; ++i) m_new = std::max(m_new, s[j][i]);
    __m256 sum = _mm256_setzero_ps();
    for (int h = 0; h < kChunk; h += 8) {  // keys past n weigh 0
      const __m256 valid = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n - h)), index));
      const __m256 pv = _mm256_and_ps(
          valid, sluice::exp8(_mm256_sub_ps(_mm256_load_ps(s[j] + h), _mm256_set1_ps(m_new))));
      _mm256_store_ps(p[j] + h, pv);
      sum = _mm256_add_ps(sum, pv);
    }
    corr[j] = std::exp(m[j] - m_new);
    l[j] = l[j] * corr[j] + sluice::sum8(sum);
    m[j] = m_new;
  }
  scale_by_rows<T>(p, vp, n, g, d);
  for (int64_t c = 0; c < d; c += 16) {  // acc = acc * corr + sum_i p_i v_i, 16 channels
    // at a time: two sums a head in flight
    __m256 av[kMaxG], aw[kMaxG];
    for (int64_t j = 0; j < g; ++j) {
      av[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + j * d + c), _mm256_set1_ps(corr[j]));
      aw[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + j * d + c + 8), _mm256_set1_ps(corr[j]));
    }
    for (int i = 0; i < n; ++i) {
      const __m256 vv = sluice::widen8(vp[i] + c), vw = sluice::widen8(vp[i] + c + 8);
      for (int64_t j = 0; j < g; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j][i]);
        av[j] = _mm256_fmadd_ps(pj, vv, av[j]);
        aw[j] = _mm256_fmadd_ps(pj, vw, aw[j]);
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      _mm256_storeu_ps(acc + j * d + c, av[j]);
      _mm256_storeu_ps(acc + j * d + c + 8, aw[j]);
    }
  }
#else
  for (int i = 0; i < n; ++i)
    for (int64_t j = 0; j < g; ++j) {
      float dot = 0.f;
      for (int64_t c = 0; c < d; ++c) dot += q[j * d + c] * sluice::widen1(kp[i] + c);
      s[j][i] = dot * sluice::row_scale(kp[i], d);
    }
  for (int64_t j = 0; j < g; ++j) {
    float m_new = m[j];
    for (int i = 0; i < n; ++i) m_new = std::max(m_new, s[j][i]);
    const float corr = std::exp(m[j] - m_new);
    l[j] *= corr;
    for (int64_t c = 0; c < d; ++c) acc[j * d + c] *= corr;
    for (int i = 0; i < n; ++i) {
      const float p = std::exp(s[j][i] - m_new), pv = p * sluice::row_scale(vp[i], d);
      l[j] += p;
      for (int64_t c = 0; c < d; ++c) acc[j * d + c] += pv * sluice::widen1(vp[i] + c);
    }
    m[j] = m_new;
  }
#endif
}

// One span of a row's own keys, [t0, t1), for all its KV heads: m, l [KVH][G] and acc
// [KVH][G][D] hold the softmax so far (the prefix's for the row's first span, empty for
// the others). A chunk of keys is read once for every head: a token's keys and values
// for all heads lie side by side (KVH x D), so the walk reads whole pages in order,
// which the hardware prefetcher follows (a walk per head read a third of every token's
// bytes, strided, at under 4 GB/s for one row).
template <typename T, int G>
void walk_span(const Args& a, int64_t r, int64_t t0, int64_t t1, float* m, float* l,
               float* acc) {
  const T* kpool = static_cast<const T*>(a.k);
  const T* vpool = static_cast<const T*>(a.v);
  const int64_t g = G ? G : a.g, d = a.d, kvh = a.kvh;
  const int32_t* table = a.tables + r * a.w;
  const int64_t hs = a.hs, row_stride = kvh * hs;  // elements between a page's tokens
  auto chunk_at = [&](int64_t t, int64_t* n) {  // up to kChunk keys of one page
    const int64_t pi = t / a.ps, off = t - pi * a.ps;
    *n = std::min<int64_t>(std::min<int64_t>(kChunk, t1 - t), a.ps - off);
    const int64_t page = std::min<int64_t>(std::max<int32_t>(table[pi], 0),
                                           a.pages - 1 - a.offset) + a.offset;
    return (page * a.ps + off) * row_stride;
  };
  const T* kp[kChunk];
  const T* vp[kChunk];
  for (int64_t t = t0, n = 0; t < t1; t += n) {
    const int64_t at = chunk_at(t, &n);
    // The next chunk's keys and values on their way, a KV head's share of its lines before
    // each head's work (all at once, they overflowed the core's miss buffers).
    int64_t nj = 0, atj = 0;
    if (t + n < t1) atj = chunk_at(t + n, &nj);
    const int64_t lines = nj * row_stride, step = 64 / sizeof(T);
    // And the chunk kL2Ahead on, into the L2 cache, whose miss buffers are its own.
    if (t + kL2Ahead * kChunk < t1) {
      int64_t nf = 0;
      const int64_t atf = chunk_at(t + kL2Ahead * kChunk, &nf);
      for (int64_t i = 0; i < nf * row_stride; i += step) {
        _mm_prefetch(reinterpret_cast<const char*>(kpool + atf + i), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vpool + atf + i), _MM_HINT_T1);
      }
    }
    for (int64_t h = 0; h < kvh; ++h) {
      for (int64_t i = lines * h / kvh / step * step; i < lines * (h + 1) / kvh; i += step) {
        _mm_prefetch(reinterpret_cast<const char*>(kpool + atj + i), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vpool + atj + i), _MM_HINT_T0);
      }
      for (int i = 0; i < n; ++i) {
        kp[i] = kpool + at + i * row_stride + h * hs;
        vp[i] = vpool + at + i * row_stride + h * hs;
      }
      head_chunk<T, G>(a.q + (r * kvh + h) * g * d, kp, vp, n, g, d, m + h * g, l + h * g,
                       acc + h * g * d);
    }
  }
}

// walk_span with the group size as a constant for the common ones (1-8: Llama, Mistral,
// Qwen and SmolLM2 use 1, 3, 4, 7 or 8), else read at run time.
template <typename T, int G = 8>
void by_group(const Args& a, int64_t r, int64_t t0, int64_t t1, float* m, float* l,
              float* acc) {
  if constexpr (G == 0) {
    walk_span<T, 0>(a, r, t0, t1, m, l, acc);
  } else {
    if (a.g == G) walk_span<T, G>(a, r, t0, t1, m, l, acc);
    else by_group<T, (G > 1 ? G - 1 : 0)>(a, r, t0, t1, m, l, acc);
  }
}

// A row's own keys are walked in spans that end at multiples of kSpan (positions), each a
// work item: one long row is shared by the threads, and a row's spans, hence its result,
// do not depend on the other rows of the step. The spans' partial softmaxes are merged
// in order once all are done.
constexpr int64_t kSpan = 1024;

struct Span {
  int64_t r, t0, t1;
};

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> offset, ffi::Buffer<ffi::S32> tables,
                               ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> ctx,
                               ffi::Buffer<ffi::F32> m0, ffi::Buffer<ffi::F32> l0,
                               ffi::Buffer<ffi::F32> acc0, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("sluice_decode_attention: bad ranks");
  const auto et = k.element_type();
  if (v.element_type() != et ||
      (et != ffi::DataType::F32 && et != ffi::DataType::U16 && et != ffi::DataType::S8) ||
      v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument(
        "sluice_decode_attention: k and v must be one f32, uint16 (bf16 bits) or int8 pool "
        "shape");
  Args a;
  const int64_t rows = qd[0];
  a.kvh = qd[1];
  a.g = qd[2];
  a.d = qd[3];
  a.pages = kd[0];
  a.ps = kd[1];
  a.w = td[1];
  a.hs = a.d + (et == ffi::DataType::S8 ? sluice::kScaleBytes : 0);
  if (kd[2] != a.kvh || kd[3] != a.hs || td[0] != rows || a.g > kMaxG || a.d > kMaxD ||
      a.d % 16)
    return ffi::Error::InvalidArgument("sluice_decode_attention: shapes do not agree");
  a.offset = offset.typed_data()[0];
  a.q = q.typed_data();
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.m0 = m0.typed_data();
  a.l0 = l0.typed_data();
  a.acc0 = acc0.typed_data();
  a.tables = tables.typed_data();
  a.start = start.typed_data();
  a.ctx = ctx.typed_data();
  a.out = out->typed_data();
  const int64_t heads = a.kvh * a.g, hd = heads * a.d;  // per row: m, l [heads], acc [hd]
  thread_local std::vector<Span> spans;
  thread_local std::vector<int64_t> first;  // each row's first span
  thread_local std::vector<float> state;    // per span: m [heads], l [heads], acc [hd]
  spans.clear();
  first.resize(rows + 1);
  for (int64_t r = 0; r < rows; ++r) {
    first[r] = static_cast<int64_t>(spans.size());
    const int64_t t0 = a.start[r], end = std::min<int64_t>(a.ctx[r], a.w * a.ps);
    int64_t t = t0;
    do {  // at least one span, maybe empty (the prefix's state as it is)
      const int64_t t1 = std::max(t, std::min(end, (t / kSpan + 1) * kSpan));
      spans.push_back({r, t, t1});
      t = t1;
    } while (t < end);
  }
  first[rows] = static_cast<int64_t>(spans.size());
  const int64_t per = 2 * heads + hd;
  state.resize(spans.size() * per);
  float* st = state.data();
  const Span* sp = spans.data();
  const int64_t* fp = first.data();
  sluice::parallel_for(pool, static_cast<int64_t>(spans.size()), [&](int64_t i) {
    const Span& s = sp[i];
    float *m = st + i * per, *l = m + heads, *acc = l + heads;
    if (i == fp[s.r]) {  // the row's first span continues its prefix
      std::copy_n(a.m0 + s.r * heads, heads, m);
      std::copy_n(a.l0 + s.r * heads, heads, l);
      std::copy_n(a.acc0 + s.r * hd, hd, acc);
    } else {
      std::fill_n(m, heads, -1e30f);
      std::fill_n(l, heads, 0.f);
      std::fill_n(acc, hd, 0.f);
    }
    if (et == ffi::DataType::U16) by_group<uint16_t>(a, s.r, s.t0, s.t1, m, l, acc);
    else if (et == ffi::DataType::S8) by_group<int8_t>(a, s.r, s.t0, s.t1, m, l, acc);
    else by_group<float>(a, s.r, s.t0, s.t1, m, l, acc);
  });
  for (int64_t r = 0; r < rows; ++r) {  // merge each row's spans in order, normalize
    float* o = a.out + r * hd;
    for (int64_t j = 0; j < heads; ++j) {
      float m = -1e30f;
      for (int64_t i = fp[r]; i < fp[r + 1]; ++i) m = std::max(m, st[i * per + j]);
      float l = 0.f;
      float* oj = o + j * a.d;
      std::fill_n(oj, a.d, 0.f);
      for (int64_t i = fp[r]; i < fp[r + 1]; ++i) {
        const float* si = st + i * per;
        const float c = fp[r + 1] - fp[r] == 1 ? 1.f : std::exp(si[j] - m);
        l += si[heads + j] * c;
        const float* acc = si + 2 * heads + j * a.d;
        for (int64_t e = 0; e < a.d; ++e) oj[e] += acc[e] * c;
      }
      const float inv = l == 0.f ? 1.f : 1.f / l;
      for (int64_t e = 0; e < a.d; ++e) oj[e] *= inv;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceDecodeAttention, DecodeAttentionImpl,
                              sluice::paged_attention_binding()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ctx
                                  .Arg<ffi::Buffer<ffi::F32>>()   // m
                                  .Arg<ffi::Buffer<ffi::F32>>()   // l
                                  .Arg<ffi::Buffer<ffi::F32>>()   // acc
                                  .Ret<ffi::Buffer<ffi::F32>>());
