// The native kernels' shared plumbing: run work items on XLA's intra-op thread pool (the
// FFI's ThreadPool context) and the calling thread together; the FFI arguments the paged
// attention kernels begin with.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace sluice {

// Run fn(0..n-1) on the calling thread and the pool; returns when all have run.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n,
                         const std::function<void(int64_t)>& fn) {
  struct Job {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  const std::function<void(int64_t)>* f = &fn;
  // A helper that starts after the last item was taken only touches `job` (kept alive by
  // its own reference), never `fn`, which lives on the caller's frame.
  auto work = [job, f, n]() {
    int64_t i;
    while ((i = job->next.fetch_add(1)) < n) {
      (*f)(i);
      job->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  while (job->done.load(std::memory_order_acquire) < n) _mm_pause();
}

// The paged attention kernels' first FFI arguments: XLA's thread pool, the queries, the K
// and V pools (f32, bf16 bit patterns or int8 rows with their scales) and the pool's
// layer offset; each kernel appends its own.
inline auto paged_attention_binding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // q
      .Arg<xla::ffi::AnyBuffer>()               // k pool
      .Arg<xla::ffi::AnyBuffer>()               // v pool
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>();  // offset
}

}  // namespace sluice
