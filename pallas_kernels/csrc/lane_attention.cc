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
// (docs/benchmarks.md, "Attention in lanes").
//
// sluice_prefill_attention
//   q       f32 [S, NQ, KVH, G, D]: a block of NQ queries per row, pre-scaled by
//           1/sqrt(D); query i of row r sits at position ctx[r] - qlen[r] + i;
//   k, v    f32 or uint16 (bf16 bit patterns, widened as read) [P, PS, KVH, D]: the page
//           pool (all layers);
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
// (About 470 lines: one walk, its AVX-512 and portable forms, the splitting and merging
// of long walks, and the two entry points that build its tasks; they change together.)

#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kV = 3;                  // vectors of 16 lanes a walk holds at most
constexpr int kMaxLanes = 16 * kV;
constexpr int kMaxD = 256;
constexpr int kChunk = 16;             // keys of one page scored together
constexpr int64_t kPartKeys = 512;     // a walk is split in parts of at least this many keys
constexpr float kNeg = -1e30f;

struct Pool {
  const void *k, *v;  // float, or uint16_t holding bf16 bits (`bits`; widened as read)
  int64_t kvh, d, ps, pages, offset;
  bool bits;
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

// Where the chunk at key t of `table` lies in the pool (floats), and its keys (`n`: up to
// kChunk, within one page, before t1).
inline int64_t chunk_at(const Pool& P, const int32_t* table, int64_t h, int64_t t,
                        int64_t t1, int64_t* n) {
  const int64_t pi = t / P.ps, off = t - pi * P.ps;
  *n = std::min<int64_t>(std::min<int64_t>(kChunk, t1 - t), P.ps - off);
  const int64_t page = std::min<int64_t>(std::max<int32_t>(table[pi], 0),
                                         P.pages - 1 - P.offset) + P.offset;
  return ((page * P.ps + off) * P.kvh + h) * P.d;
}

#ifdef __AVX512F__
// The online softmax of NV vectors of lanes over keys [t0, t1). Scores: eight keys at a
// time, each of the d elements broadcast against every vector of queries (8 x NV
// independent sums); values: 16 (NV = 1) or 8 dimensions at a time, each value element
// broadcast against every vector of weights.
template <int NV, typename T>
void walk(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
          Lanes& L) {
  constexpr int kKeys = 8, kDims = NV == 1 ? 16 : 8;
  const int64_t d = P.d, rs = P.kvh * d;  // rs: values between a page's tokens
  const T* kpool = static_cast<const T*>(P.k);
  const T* vpool = static_cast<const T*>(P.v);
  __m512i pos[NV];
  __m512 m[NV], l[NV];
  for (int v = 0; v < NV; ++v) {
    pos[v] = _mm512_load_si512(L.pos + 16 * v);
    m[v] = _mm512_load_ps(L.m + 16 * v);
    l[v] = _mm512_load_ps(L.l + 16 * v);
  }
  alignas(64) float s[kChunk][16 * NV];  // scores, then weights
  // A chunk's keys and values widened to f32 (bf16 pools only).
  alignas(64) float kw[sizeof(T) == 2 ? kChunk : 1][sizeof(T) == 2 ? kMaxD : 16];
  alignas(64) float vw[sizeof(T) == 2 ? kChunk : 1][sizeof(T) == 2 ? kMaxD : 16];
  for (int64_t t = t0, n; t < t1; t += n) {
    const int64_t at = chunk_at(P, table, h, t, t1, &n);
    const float* kp[kChunk];
    const float* vp[kChunk];
    if constexpr (sizeof(T) == 2) {  // bf16 bits: the chunk widened once, then as f32
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < d; c += 16) {
          _mm512_store_ps(kw[i] + c, sluice::widen16(kpool + at + i * rs + c));
          _mm512_store_ps(vw[i] + c, sluice::widen16(vpool + at + i * rs + c));
        }
      for (int i = 0; i < kChunk; ++i) {  // keys past n repeat the last (scored, unused)
        kp[i] = kw[std::min<int64_t>(i, n - 1)];
        vp[i] = vw[std::min<int64_t>(i, n - 1)];
      }
    } else {
      for (int i = 0; i < kChunk; ++i) {
        kp[i] = kpool + at + std::min<int64_t>(i, n - 1) * rs;
        vp[i] = vpool + at + std::min<int64_t>(i, n - 1) * rs;
      }
    }
    if (t + n < t1) {  // the next chunk on its way while this one is computed
      int64_t nj;
      const int64_t atj = chunk_at(P, table, h, t + n, t1, &nj);
      for (int64_t i = 0; i < nj; ++i)
        for (int64_t c = 0; c < d; c += 64 / sizeof(T)) {  // a cache line at a time
          _mm_prefetch(reinterpret_cast<const char*>(kpool + atj + i * rs + c), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vpool + atj + i * rs + c), _MM_HINT_T0);
        }
    }
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
        for (int v = 0; v < NV; ++v) _mm512_store_ps(s[i + kk] + 16 * v, a[v][kk]);
    }
    __m512 corr[NV];
    for (int v = 0; v < NV; ++v) {
      __mmask16 seen[kChunk];
      __m512 mx = m[v];
      for (int i = 0; i < n; ++i) {
        seen[i] = _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(t + i)),
                                        pos[v], _MM_CMPINT_LE);
        mx = _mm512_max_ps(mx, _mm512_mask_load_ps(_mm512_set1_ps(kNeg), seen[i],
                                                   s[i] + 16 * v));
      }
      corr[v] = sluice::exp16(_mm512_sub_ps(m[v], mx));
      l[v] = _mm512_mul_ps(l[v], corr[v]);
      for (int i = 0; i < n; ++i) {
        const __m512 p = _mm512_maskz_mov_ps(
            seen[i], sluice::exp16(_mm512_sub_ps(_mm512_load_ps(s[i] + 16 * v), mx)));
        _mm512_store_ps(s[i] + 16 * v, p);
        l[v] = _mm512_add_ps(l[v], p);
      }
      m[v] = mx;
    }
    for (int64_t c = 0; c < d; c += kDims) {  // acc = acc * corr + sum_i p_i v_i
      __m512 a[NV][kDims];
      for (int v = 0; v < NV; ++v)
        for (int j = 0; j < kDims; ++j)
          a[v][j] = _mm512_mul_ps(_mm512_load_ps(L.acc[c + j] + 16 * v), corr[v]);
      for (int i = 0; i < n; ++i) {
        __m512 pv[NV];
        for (int v = 0; v < NV; ++v) pv[v] = _mm512_load_ps(s[i] + 16 * v);
        for (int j = 0; j < kDims; ++j) {
          const __m512 b = _mm512_set1_ps(vp[i][c + j]);
          for (int v = 0; v < NV; ++v) a[v][j] = _mm512_fmadd_ps(pv[v], b, a[v][j]);
        }
      }
      for (int v = 0; v < NV; ++v)
        for (int j = 0; j < kDims; ++j) _mm512_store_ps(L.acc[c + j] + 16 * v, a[v][j]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    _mm512_store_ps(L.m + 16 * v, m[v]);
    _mm512_store_ps(L.l + 16 * v, l[v]);
  }
}
#endif

// The lanes' online softmax over keys [t0, t1) of one KV head, read through `table`.
template <typename T>
void walk_pool(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
               Lanes& L) {
#ifdef __AVX512F__
  switch (L.vectors()) {
    case 1: return walk<1, T>(P, table, h, t0, t1, L);
    case 2: return walk<2, T>(P, table, h, t0, t1, L);
    default: return walk<3, T>(P, table, h, t0, t1, L);
  }
#else
  const int64_t d = P.d, rs = P.kvh * d;
  const T* kpool = static_cast<const T*>(P.k);
  const T* vpool = static_cast<const T*>(P.v);
  for (int64_t t = t0, n; t < t1; t += n) {
    const int64_t at = chunk_at(P, table, h, t, t1, &n);
    for (int j = 0; j < L.n; ++j) {
      float s[kChunk], mx = L.m[j];
      for (int64_t i = 0; i < n; ++i) {
        float dot = 0.f;
        for (int64_t c = 0; c < d; ++c) dot += L.qt[c][j] * sluice::widen1(kpool + at + i * rs + c);
        s[i] = t + i <= L.pos[j] ? dot : kNeg;
        mx = std::max(mx, s[i]);
      }
      const float corr = std::exp(L.m[j] - mx);
      L.l[j] *= corr;
      for (int64_t c = 0; c < d; ++c) L.acc[c][j] *= corr;
      for (int64_t i = 0; i < n; ++i) {
        if (t + i > L.pos[j]) continue;
        const float p = std::exp(s[i] - mx);
        L.l[j] += p;
        for (int64_t c = 0; c < d; ++c) L.acc[c][j] += p * sluice::widen1(vpool + at + i * rs + c);
      }
      L.m[j] = mx;
    }
  }
#endif
}

void walk(const Pool& P, const int32_t* table, int64_t h, int64_t t0, int64_t t1,
          Lanes& L) {
  if (P.bits) walk_pool<uint16_t>(P, table, h, t0, t1, L);
  else walk_pool<float>(P, table, h, t0, t1, L);
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
    for (int64_t part = 0; part < split; ++part)
      items.push_back({int64_t(i), keys * part / split, keys * (part + 1) / split});
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
  return kd.size() == 4 && kd[2] == kvh && kd[3] == d && d % 16 == 0 && d <= kMaxD &&
         P.ps > 0;
}

Pool pool_of(ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& offset,
             int64_t kvh, int64_t d) {
  const auto kd = k.dimensions();
  const auto et = k.element_type();
  const bool ok = (et == ffi::DataType::F32 || et == ffi::DataType::U16) &&
                  v.element_type() == et && kd.size() == 4;
  return Pool{k.untyped_data(), v.untyped_data(), kvh, d, ok ? kd[1] : 0, ok ? kd[0] : 0,
              offset.typed_data()[0], et == ffi::DataType::U16};
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
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k pool
                                  .Arg<ffi::AnyBuffer>()          // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offset
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ctx
                                  .Arg<ffi::Buffer<ffi::S32>>()   // qlen
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluicePrefixAttention, PrefixAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k pool
                                  .Arg<ffi::AnyBuffer>()          // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offset
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // length
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>()   // l
                                  .Ret<ffi::Buffer<ffi::F32>>());  // acc
