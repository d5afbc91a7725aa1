// What the two weight-matmul kernels (q8_linear.cc, q4_linear.cc) share: where a product
// row goes in the output, and the rows they skip (all zero: a bucket's padding rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sluice {

struct Out {
  float* p;
  int64_t sm, sn;  // strides of a row m and a column n
  int64_t n;       // columns (packed weights may have a few more, all zero)
  const int64_t* rows = nullptr;  // row m of the product is out's row rows[m] (null: m)
  const int64_t* zero = nullptr;  // out's rows left at zero (no product row), `zeros` many
  int64_t zeros = 0;
  int64_t at(int64_t m) const { return rows ? rows[m] : m; }
  void set(int64_t m, int64_t c, float v) const {
    if (c < n) p[at(m) * sm + c * sn] = v;
  }
  // Columns [c0, c1) of the rows left at zero.
  void clear(int64_t c0, int64_t c1) const {
    for (int64_t i = 0; i < zeros; ++i)
      for (int64_t c = c0; c < std::min(c1, n); ++c) p[zero[i] * sm + c * sn] = 0.f;
  }
};

// The activations x (f32 [K, T] if feature-major, else [T, K]) as the rows a kernel
// multiplies, and the Out their products go to (out: f32 [N, T] or [T, N]). The rows
// are [T, K] (transposed from feature-major into a buffer reused across calls: no
// allocation in steady state). Rows that are all zero give zero results: a bucket's
// padding rows are such rows (model/llama.py keeps them at zero), so only the others are
// returned (gathered, `o.rows` saying where each goes, `o.zero` the rows to zero) and a
// step costs its real rows, not its bucket's. Returns the number of rows to multiply; 0:
// `out` is already zeroed. A kernel's row result must not depend on the other rows of
// its call, so that leaving rows out changes no other row's bits.
inline int64_t live_rows(const float*& x, int64_t t, int64_t k, bool fm, float* out,
                         int64_t n, Out& o) {
  thread_local std::vector<float> rows, xc;
  thread_local std::vector<int64_t> live, dead;
  if (fm && t > 1) {
    rows.resize(t * k);
    for (int64_t i = 0; i < k; ++i)
      for (int64_t m = 0; m < t; ++m) rows[m * k + i] = x[i * t + m];
    x = rows.data();
  }
  live.clear();
  dead.clear();
  for (int64_t m = 0; m < t; ++m) {
    const float* row = x + m * k;
    int64_t i = 0;
    while (i < k && row[i] == 0.f) ++i;
    (i < k ? live : dead).push_back(m);
  }
  const int64_t tl = static_cast<int64_t>(live.size());
  o = Out{out, fm ? 1 : n, fm ? t : 1, n};
  if (tl == 0) {
    std::memset(out, 0, sizeof(float) * t * n);
    return 0;
  }
  if (tl < t) {  // the live rows gathered as [tl, K]; their products go to their rows
    xc.resize(tl * k);
    for (int64_t r = 0; r < tl; ++r)
      std::memcpy(xc.data() + r * k, x + live[r] * k, sizeof(float) * k);
    x = xc.data();
    o.rows = live.data();
    o.zero = dead.data();
    o.zeros = t - tl;
  }
  return tl;
}

}  // namespace sluice
