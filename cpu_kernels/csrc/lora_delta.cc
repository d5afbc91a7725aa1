// Sluice's native LoRA kernel for the CPU backend: every token's own adapter delta, added
// in place to one fused projection's output, y += B[slot] @ (A[slot] @ x), per token.
//
// Registered with XLA as the FFI target "sluice_lora_delta" (cpu_kernels/native.py
// builds and loads it; model/adapter_slots.py's `NativeLora` calls it). Why it exists:
// XLA's "stacked mask" form (model/llama.py, `_lora_delta`) multiplies every token by
// every slot's A and B and masks the result: it reads all `max_loras` adapters' weights
// every step and pays `max_loras` x the FLOPs. With the int8 base weights (134 MB a step
// for the embedded model), 4 slots of rank 16 on all seven projections in f32 (78 MB) cost
// +30% on a decode step of 16 (docs/history/benchmarks-log.md). Here each token reads only its own
// slot's rows (SGMV-style, as Punica and S-LoRA do on GPUs), the slots may be stored in
// bf16 (half the bytes; the int8 path rounds its activations to bf16 anyway) and the
// result is added to y in place (XLA aliases y to the output).
//
// Layouts (one fused group: q/k/v, o, gate/up or down; J targets side by side):
//   y, out f32 [N, T] (feature_major) or [T, N]: the base projection; out aliases y;
//   x      f32 [K, T] (feature_major) or [T, K]: the projection's input;
//   a      f32 or bf16 [L, J, S, R, K]: target j's A of slot s, rank rows r, layer l;
//   b      f32 or bf16 [L, S, NB, R, 16]: B of every target (the LoRA scale folded in),
//          packed in blocks of 16 columns, each block's R rows contiguous: target j's
//          columns [bounds[j], bounds[j + 1]) of the output, rounded up to blocks (zero
//          columns), after the blocks of the targets before it (`native.pack_lora_b`);
//   slots  int32 [T]: each token's slot, < 0 or >= S: none (the base model);
//   layer  int32 []: which of the L layers;
//   bounds int32 [J + 1]: the targets' column ranges, bounds[J] = N.
// A token's result depends only on its own x and slot (each sum runs in one order), so
// a batch gives each token what it would get alone. Tokens are grouped by slot so that a
// slot's weights, once loaded, serve several tokens: A in passes of 4 rows x 4 tokens of
// one slot, B a block of 16 columns x 16 rank rows held in registers for a chunk of 16
// tokens (b_chunk; on AVX2 each rank row widened once for 4 tokens of its slot, their
// rows added back in 8 x 8 transposes). Prompt chunks are split over XLA's intra-op thread pool: groups of 4
// tokens for A, blocks of 16 columns for B.
//
// (About 490 lines: both phases in their AVX-512, AVX2 and portable forms, the transpositions,
// the prefetching and the entry point read one packing and change together.)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SLUICE_LORA_AVX512 1
#endif

namespace {

constexpr int kTok = 4;   // tokens of one slot multiplied together
constexpr int kRows = 4;  // A rows a pass (kTok x kRows accumulators)
constexpr int kCols = 16; // B columns a block, and the rank rows held in registers
constexpr int64_t kParallelTokens = 32;  // fewer tokens under adapters: one thread
// The AVX2 form of phase 1 asks for the A rows this many on as it reads a pair (on Zen 3,
// 30 layers of 16 tokens over 4 slots: 6.8 -> 5.8 ms; 2 rows on: 7.3, 16: 6.3;
// docs/history/benchmarks-log.md, thirty-first session).
constexpr int64_t kAheadRows = 8;

// Phase 1 for up to kTok tokens of one slot: hq[q][j * Rp + r] = A[j, r, :] . x_q for the
// slot's rows of one layer (row (j, r) at a + j * stride_j + r * k). `xs[q]`: token q's
// inputs, contiguous (a missing token repeats one: its results are not stored).
// A slot's rows are short streams (a row of the embedded model's q is 1,152 bytes of
// bf16), too short for the hardware prefetcher to find, and the weights of a decode step's
// adapters come from memory: each pass asks for the next pass's rows ahead of its own
// loads, a cache line per row every 64 bytes it reads (4 rows at a time gave 2-3 GB/s).
template <typename W>
void a_rows(const W* a, int64_t j_n, int64_t stride_j, int64_t r_n, int64_t rp, int64_t k,
            const float* const* xs, int nt, float* const* hq, const W* next_a) {
  constexpr int64_t kLine = 64 / sizeof(W);  // elements a cache line
  for (int64_t j = 0; j < j_n; ++j) {
    const W* aj = a + j * stride_j;
    for (int64_t r0 = 0; r0 < r_n; r0 += kRows) {
      const W* rows[kRows];
      for (int i = 0; i < kRows; ++i) rows[i] = aj + std::min<int64_t>(r0 + i, r_n - 1) * k;
#ifdef SLUICE_LORA_AVX512
      // The next pass's rows: the same target's next ones, or the next target's first.
      const bool last = r0 + kRows >= r_n && j + 1 == j_n;
      const W* next = r0 + kRows < r_n ? aj + (r0 + kRows) * k : aj + stride_j;
      const int64_t next_n = std::min<int64_t>(kRows, r0 + kRows < r_n ? r_n - r0 - kRows : r_n);
      if (j == 0 && r0 == 0)  // this pass's own rows, the first time
        for (int i = 0; i < kRows && i < r_n; ++i)
          for (int64_t c = 0; c < k; c += kLine)
            _mm_prefetch(reinterpret_cast<const char*>(rows[i] + c), _MM_HINT_T0);
      __m512 acc[kRows][kTok];
      for (int i = 0; i < kRows; ++i)
        for (int q = 0; q < kTok; ++q) acc[i][q] = _mm512_setzero_ps();
      for (int64_t c = 0; c < k; c += 16) {
        if (!last && c % kLine == 0)
          for (int64_t i = 0; i < next_n; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c), _MM_HINT_T0);
        const __mmask16 m = k - c >= 16 ? 0xFFFF : (__mmask16)((1u << (k - c)) - 1);
        __m512 xv[kTok];
        for (int q = 0; q < kTok; ++q) xv[q] = _mm512_maskz_loadu_ps(m, xs[q] + c);
        for (int i = 0; i < kRows; ++i) {
          const __m512 av = sluice::widen16(rows[i] + c, m);
          for (int q = 0; q < kTok; ++q) acc[i][q] = _mm512_fmadd_ps(av, xv[q], acc[i][q]);
        }
      }
      for (int q = 0; q < nt; ++q)
        for (int i = 0; i < kRows && r0 + i < r_n; ++i)
          hq[q][j * rp + r0 + i] = _mm512_reduce_add_ps(acc[i][q]);
#elif defined(SLUICE_AVX2)
      // 8 lanes: two rows x kTok tokens at a time (16 registers); a K past the last
      // multiple of 8 is summed one by one after the lanes.
      const int64_t k8 = k - k % 8;
      for (int i0 = 0; i0 < kRows && r0 + i0 < r_n; i0 += 2) {
        __m256 acc[2][kTok];
        for (int i = 0; i < 2; ++i)
          for (int q = 0; q < kTok; ++q) acc[i][q] = _mm256_setzero_ps();
        // The rows kAheadRows on (this target's, else the next target's first, else the
        // next work item's first: `next_a`), a line of each every 64 bytes read, as the
        // AVX-512 form asks for the next pass's.
        const W* ahead[2];
        int n_ahead = 0;
        for (int i = 0; i < 2; ++i) {
          const int64_t rr = r0 + i0 + i + kAheadRows;
          if (rr < r_n) ahead[n_ahead++] = aj + rr * k;
          else if (j + 1 < j_n && rr - r_n < r_n) ahead[n_ahead++] = aj + stride_j + (rr - r_n) * k;
          else if (j + 1 == j_n && next_a && rr - r_n < r_n) ahead[n_ahead++] = next_a + (rr - r_n) * k;
        }
        for (int64_t c = 0; c < k8; c += 8) {
          if (c % kLine == 0)
            for (int i = 0; i < n_ahead; ++i)
              _mm_prefetch(reinterpret_cast<const char*>(ahead[i] + c), _MM_HINT_T0);
          __m256 xv[kTok];
          for (int q = 0; q < kTok; ++q) xv[q] = _mm256_loadu_ps(xs[q] + c);
          for (int i = 0; i < 2; ++i) {
            const __m256 av = sluice::widen8(rows[i0 + i] + c);
            for (int q = 0; q < kTok; ++q) acc[i][q] = _mm256_fmadd_ps(av, xv[q], acc[i][q]);
          }
        }
        for (int q = 0; q < nt; ++q)
          for (int i = 0; i < 2 && r0 + i0 + i < r_n; ++i) {
            float v = sluice::sum8(acc[i][q]);
            for (int64_t c = k8; c < k; ++c) v += sluice::widen1(rows[i0 + i] + c) * xs[q][c];
            hq[q][j * rp + r0 + i0 + i] = v;
          }
      }
#else
      for (int q = 0; q < nt; ++q)
        for (int i = 0; i < kRows && r0 + i < r_n; ++i) {
          float acc = 0.f;
          for (int64_t c = 0; c < k; ++c) acc += sluice::widen1(rows[i] + c) * xs[q][c];
          hq[q][j * rp + r0 + i] = acc;
        }
#endif
    }
  }
}

// Phase 2 for one block of kCols output columns [o0, o0 + w) of target j (`blk`: its
// B block in every slot, R rows of kCols contiguous) and the tokens [c0, c0 + nt)
// (nt <= 16): out += B[slot] @ h for each token under an adapter. The chunk's tokens are
// visited slot by slot, so that a slot's block, held in registers, serves all of them;
// their results, one row of 16 columns per token, are transposed in registers and added
// to the output rows with one vector each (feature-major).
template <typename W>
void b_chunk(const W* blk, int64_t slot_stride, int64_t r_n, int64_t rp, int64_t j,
             const float* h, int64_t h_stride, const int32_t* slots,
             int64_t c0, int nt, const int* toks, int cnt, int64_t o0, int64_t w,
             float* out, bool fm, int64_t t, int64_t n) {
  // toks: the chunk's cnt tokens under an adapter (offsets from c0), sorted by slot
  if (cnt == 0) return;
#ifdef SLUICE_LORA_AVX512
  const __mmask16 wm = w >= 16 ? 0xFFFF : (__mmask16)((1u << w) - 1);
  __m512 tile[16];
  for (int q = 0; q < 16; ++q) tile[q] = _mm512_setzero_ps();
  for (int i0 = 0; i0 < cnt;) {
    const int32_t s = slots[c0 + toks[i0]];
    int i1 = i0;
    while (i1 < cnt && slots[c0 + toks[i1]] == s) ++i1;
    const W* bs = blk + s * slot_stride;
    for (int64_t r0 = 0; r0 < rp; r0 += kCols) {
      __m512 bv[kCols];
      for (int i = 0; i < kCols; ++i)
        bv[i] = r0 + i < r_n ? sluice::widen16(bs + (r0 + i) * kCols, wm) : _mm512_setzero_ps();
      for (int g = i0; g < i1; g += kTok) {
        __m512 acc[kTok];
        const float* hq[kTok];
        for (int q = 0; q < kTok; ++q) {
          acc[q] = _mm512_setzero_ps();
          hq[q] = h + (c0 + toks[std::min(g + q, i1 - 1)]) * h_stride + j * rp + r0;
        }
        for (int i = 0; i < kCols; ++i)
          for (int q = 0; q < kTok; ++q)
            acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(hq[q][i]), bv[i], acc[q]);
        for (int q = 0; q < kTok && g + q < i1; ++q)
          tile[toks[g + q]] = _mm512_add_ps(tile[toks[g + q]], acc[q]);
      }
    }
    i0 = i1;
  }
  if (fm) {
    __mmask16 tm = 0;  // the lanes (tokens) to add
    for (int i = 0; i < cnt; ++i) tm |= (__mmask16)(1u << toks[i]);
    sluice::transpose16(tile);
    for (int64_t i = 0; i < w; ++i) {
      float* p = out + (o0 + i) * t + c0;
      _mm512_mask_storeu_ps(p, tm, _mm512_add_ps(_mm512_maskz_loadu_ps(tm, p), tile[i]));
    }
  } else {
    for (int i = 0; i < cnt; ++i) {
      float* p = out + (c0 + toks[i]) * n + o0;
      _mm512_mask_storeu_ps(p, wm, _mm512_add_ps(_mm512_maskz_loadu_ps(wm, p),
                                                 tile[toks[i]]));
    }
  }
#elif defined(SLUICE_AVX2)
  // Up to kTok tokens of one slot at a time: each rank row of the slot's block widened
  // once for all of them (8 accumulators), their rows of 16 columns into `tile`; then
  // added to the output, feature-major in 8 x 8 transposes (a vector per column).
  alignas(32) float tile[16][kCols];
  int under[16] = {};  // 1 where the chunk's token is under an adapter
  for (int i0 = 0; i0 < cnt;) {
    const int32_t s = slots[c0 + toks[i0]];
    int i1 = i0;
    while (i1 < cnt && slots[c0 + toks[i1]] == s) ++i1;
    const W* bs = blk + s * slot_stride;
    for (int g = i0; g < i1; g += kTok) {
      __m256 acc[kTok][2];
      const float* hq[kTok];
      for (int q = 0; q < kTok; ++q) {
        acc[q][0] = acc[q][1] = _mm256_setzero_ps();
        hq[q] = h + (c0 + toks[std::min(g + q, i1 - 1)]) * h_stride + j * rp;
      }
      for (int64_t r = 0; r < r_n; ++r) {
        const __m256 b0 = sluice::widen8(bs + r * kCols), b1 = sluice::widen8(bs + r * kCols + 8);
        for (int q = 0; q < kTok; ++q) {
          const __m256 hv = _mm256_broadcast_ss(hq[q] + r);
          acc[q][0] = _mm256_fmadd_ps(hv, b0, acc[q][0]);
          acc[q][1] = _mm256_fmadd_ps(hv, b1, acc[q][1]);
        }
      }
      for (int q = 0; q < kTok && g + q < i1; ++q) {
        _mm256_store_ps(tile[toks[g + q]], acc[q][0]);
        _mm256_store_ps(tile[toks[g + q]] + 8, acc[q][1]);
        under[toks[g + q]] = 1;
      }
    }
    i0 = i1;
  }
  if (fm) {
    for (int q0 = 0; q0 < nt; q0 += 8) {
      const int qn = std::min(8, nt - q0);
      for (int q = qn; q < 8; ++q) under[q0 + q] = 0;  // (past the chunk: not stored)
      bool any = false;
      for (int q = 0; q < qn; ++q) any |= under[q0 + q] != 0;
      if (!any) continue;
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(under + q0)),
          _mm256_setzero_si256()));
      for (int64_t h0 = 0; h0 < w; h0 += 8) {
        __m256 v[8];
        for (int q = 0; q < 8; ++q)
          v[q] = q < qn && under[q0 + q] ? _mm256_load_ps(tile[q0 + q] + h0) : _mm256_setzero_ps();
        sluice::transpose8(v);  // v[i]: column h0 + i for the 8 tokens
        for (int64_t i = 0; i < 8 && h0 + i < w; ++i) {
          float* p = out + (o0 + h0 + i) * t + c0 + q0;
          if (qn == 8) {  // the tokens under no adapter keep their values exactly
            const __m256 o = _mm256_loadu_ps(p);
            _mm256_storeu_ps(p, _mm256_blendv_ps(_mm256_add_ps(o, v[i]), o, keep));
          } else {
            alignas(32) float col[8];
            _mm256_store_ps(col, v[i]);
            for (int q = 0; q < qn; ++q)
              if (under[q0 + q]) p[q] += col[q];
          }
        }
      }
    }
  } else {
    for (int i = 0; i < cnt; ++i) {
      float* p = out + (c0 + toks[i]) * n + o0;
      if (w == kCols) {
        _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_load_ps(tile[toks[i]])));
        _mm256_storeu_ps(p + 8, _mm256_add_ps(_mm256_loadu_ps(p + 8),
                                              _mm256_load_ps(tile[toks[i]] + 8)));
      } else {
        for (int64_t c = 0; c < w; ++c) p[c] += tile[toks[i]][c];
      }
    }
  }
#else
  for (int i = 0; i < cnt; ++i) {
    const int64_t ti = c0 + toks[i];
    const W* bs = blk + slots[ti] * slot_stride;
    const float* hm = h + ti * h_stride + j * rp;
    for (int64_t c = 0; c < w; ++c) {
      float acc = 0.f;
      for (int64_t r = 0; r < r_n; ++r) acc += hm[r] * sluice::widen1(bs + r * kCols + c);
      out[fm ? (o0 + c) * t + ti : ti * n + o0 + c] += acc;
    }
  }
#endif
}

// Columns [c_begin, c_end) of in [rows, cols] as rows of out [cols, rows] (out = in^T):
// 16 x 16 blocks in registers (a decode step's feature-major x is [K, 16]), edges one by
// one.
inline void transpose_into(const float* in, int64_t rows, int64_t cols, int64_t c_begin,
                           int64_t c_end, float* out) {
  int64_t r0 = 0, c0 = c_begin;
#ifdef SLUICE_LORA_AVX512
  for (; r0 + 16 <= rows; r0 += 16)
    for (c0 = c_begin; c0 + 16 <= c_end; c0 += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(in + (r0 + i) * cols + c0);
      sluice::transpose16(v);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + (c0 + i) * rows + r0, v[i]);
    }
  // the blocks' rows at the columns past the last whole block
  for (int64_t r = 0; r < r0; ++r)
    for (int64_t c = c0; c < c_end; ++c) out[c * rows + r] = in[r * cols + c];
#elif defined(SLUICE_AVX2)
  for (; r0 + 8 <= rows; r0 += 8)
    for (c0 = c_begin; c0 + 8 <= c_end; c0 += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(in + (r0 + i) * cols + c0);
      sluice::transpose8(v);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + (c0 + i) * rows + r0, v[i]);
    }
  for (int64_t r = 0; r < r0; ++r)
    for (int64_t c = c0; c < c_end; ++c) out[c * rows + r] = in[r * cols + c];
#endif
  for (int64_t r = r0; r < rows; ++r)  // the rows past the last whole block
    for (int64_t c = c_begin; c < c_end; ++c) out[c * rows + r] = in[r * cols + c];
}

// Blocks of kCols columns in the packed B: each target's columns rounded up.
inline int64_t b_blocks(const int32_t* bounds, int64_t j_n) {
  int64_t nb = 0;
  for (int64_t j = 0; j < j_n; ++j) nb += (bounds[j + 1] - bounds[j] + kCols - 1) / kCols;
  return nb;
}

template <typename W>
void delta(ffi::ThreadPool& pool, const float* x, const W* a, const W* b,
           const int32_t* slots, const int32_t* bounds, float* out, bool fm, int64_t t,
           int64_t k, int64_t n, int64_t j_n, int64_t s_n, int64_t r_n, int64_t l) {
  // The tokens under an adapter, sorted by slot (a counting sort), and each slot's run.
  thread_local std::vector<int32_t> order, start;
  order.clear();
  start.assign(s_n + 1, 0);
  for (int64_t i = 0; i < t; ++i)
    if (slots[i] >= 0 && slots[i] < s_n) ++start[slots[i] + 1];
  for (int64_t s = 0; s < s_n; ++s) start[s + 1] += start[s];
  const int64_t m_n = start[s_n];
  if (m_n == 0) return;
  order.resize(m_n);
  {
    thread_local std::vector<int32_t> fill;
    fill.assign(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < t; ++i)
      if (slots[i] >= 0 && slots[i] < s_n) order[fill[slots[i]]++] = static_cast<int32_t>(i);
  }
  const int32_t* op = order.data();
  const int32_t* sp = start.data();
  // Work items of phase 1: kTok tokens of one slot.
  thread_local std::vector<int64_t> groups;
  groups.clear();
  for (int64_t s = 0; s < s_n; ++s)
    for (int64_t m = sp[s]; m < sp[s + 1]; m += kTok) groups.push_back(m);
  const int64_t* gp = groups.data();
  const int64_t rp = (r_n + kCols - 1) / kCols * kCols, h_stride = j_n * rp;
  thread_local std::vector<float> hbuf, xbuf;
  hbuf.assign(t * h_stride, 0.f);  // by token (rows of tokens under no adapter unused)
  float* h = hbuf.data();
  // Each token's input contiguous: x itself, or x^T ([T, K]) from a feature-major x.
  const float* xt = x;
  // A decode step's few tokens run on the calling thread: handing them to the pool cost
  // more than it saved (16 tokens, 30 layers of the embedded model: 8.2 ms a step alone,
  // 9.4-13.4 ms on both cores); a prompt chunk's are split.
  auto pf = [&](int64_t n_items, const std::function<void(int64_t)>& fn) {
    if (m_n < kParallelTokens)
      for (int64_t i = 0; i < n_items; ++i) fn(i);
    else
      sluice::parallel_for(pool, n_items, fn);
  };
  if (fm) {
    xbuf.resize(t * k);
    float* xw = xbuf.data();
    pf((t + 15) / 16, [&](int64_t i) {
      transpose_into(x, k, t, 16 * i, std::min<int64_t>(t, 16 * i + 16), xw);
    });
    xt = xw;
  }
  const W* al = a + l * j_n * s_n * r_n * k;
  const int64_t nb = b_blocks(bounds, j_n);
  const W* bl = b + l * s_n * nb * r_n * kCols;
  // h = A[slot] @ x, kTok tokens of one slot a work item.
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  pf(n_groups, [&](int64_t g) {
    const int64_t m0 = gp[g], s = slots[op[m0]];
    const int nt = static_cast<int>(std::min<int64_t>(kTok, sp[s + 1] - m0));
    const float* xs[kTok];
    float* hq[kTok];
    for (int q = 0; q < kTok; ++q) {
      const int64_t ti = op[m0 + std::min(q, nt - 1)];
      xs[q] = xt + ti * k;
      hq[q] = h + ti * h_stride;
    }
    // the next item's slot (on the calling thread, the one read next)
    const W* next_a = g + 1 < n_groups ? al + slots[op[gp[g + 1]]] * r_n * k : nullptr;
    a_rows(al + s * r_n * k, j_n, s_n * r_n * k, r_n, rp, k, xs, nt, hq, next_a);
  });
  // out += B[slot] @ h, a block of kCols columns of one target a work item.
  struct Item { int64_t j, o0, blk; };
  thread_local std::vector<Item> items;
  items.clear();
  for (int64_t j = 0, blk = 0; j < j_n; ++j)
    for (int64_t o = bounds[j]; o < bounds[j + 1]; o += kCols) items.push_back({j, o, blk++});
  const Item* ip = items.data();
  // Each chunk of 16 tokens' tokens under an adapter, sorted by slot (`order` is, and
  // keeps token order within a slot), for every block's b_chunk.
  const int64_t n_chunks = (t + 15) / 16;
  thread_local std::vector<int> ctoks, ccnt;
  ctoks.assign(n_chunks * 16, 0);
  ccnt.assign(n_chunks, 0);
  for (int64_t m = 0; m < m_n; ++m) {
    const int64_t ti = op[m], c = ti / 16;
    ctoks[c * 16 + ccnt[c]++] = static_cast<int>(ti - c * 16);
  }
  const int* ctp = ctoks.data();
  const int* ccp = ccnt.data();
  const int64_t blk_n = r_n * kCols, blk_bytes = blk_n * int64_t(sizeof(W));
  pf(static_cast<int64_t>(items.size()), [&](int64_t p) {
    const int64_t j = ip[p].j, o0 = ip[p].o0;
    const int64_t w = std::min<int64_t>(kCols, bounds[j + 1] - o0);
    if (ip[p].blk + 1 < nb)  // the next block of each slot in use, as a_rows does
      for (int64_t s = 0; s < s_n; ++s)
        if (sp[s + 1] > sp[s])
          for (int64_t off = 0; off < blk_bytes; off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(bl + (s * nb + ip[p].blk + 1) * blk_n) +
                         off, _MM_HINT_T0);
    for (int64_t c0 = 0; c0 < t; c0 += 16)
      b_chunk(bl + ip[p].blk * blk_n, nb * blk_n, r_n, rp, j, h, h_stride,
              slots, c0, static_cast<int>(std::min<int64_t>(16, t - c0)),
              ctp + c0, ccp[c0 / 16], o0, w, out, fm, t, n);
  });
}

ffi::Error LoraDeltaImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y,
                         ffi::Buffer<ffi::F32> x, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> bounds, ffi::ResultBuffer<ffi::F32> out,
                         int32_t feature_major) {
  const auto ad = a.dimensions(), bd = b.dimensions(), yd = y.dimensions();
  if (ad.size() != 5 || bd.size() != 5 || yd.size() != 2)
    return ffi::Error::InvalidArgument("lora_delta: a and b must be 5-D, y 2-D");
  if (a.element_type() != b.element_type() ||
      (a.element_type() != ffi::DataType::F32 && a.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("lora_delta: a and b must both be f32 or bf16");
  const bool fm = feature_major != 0;
  const int64_t l_n = ad[0], j_n = ad[1], s_n = ad[2], r_n = ad[3], k = ad[4];
  const int64_t n = fm ? yd[0] : yd[1], t = fm ? yd[1] : yd[0];
  if (bounds.element_count() != static_cast<size_t>(j_n + 1) ||
      bounds.typed_data()[0] != 0 || bounds.typed_data()[j_n] != n ||
      bd[1] != s_n || bd[2] != b_blocks(bounds.typed_data(), j_n) || bd[3] != r_n ||
      bd[4] != kCols)
    return ffi::Error::InvalidArgument("lora_delta: b or bounds do not match a and y");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= l_n) return ffi::Error::InvalidArgument("lora_delta: layer out of range");
  float* o = out->typed_data();
  if (o != y.typed_data()) std::memcpy(o, y.typed_data(), t * n * sizeof(float));
  if (a.element_type() == ffi::DataType::BF16)
    delta(pool, x.typed_data(), a.reinterpret_data<uint16_t>(),
          b.reinterpret_data<uint16_t>(), slots.typed_data(), bounds.typed_data(), o, fm, t,
          k, n, j_n, s_n, r_n, l);
  else
    delta(pool, x.typed_data(), a.reinterpret_data<float>(), b.reinterpret_data<float>(),
          slots.typed_data(), bounds.typed_data(), o, fm, t, k, n, j_n, s_n, r_n, l);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceLoraDelta, LoraDeltaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("feature_major"));
