// Kept memory: the allocator of the kernel's large outputs and gradients, and their layout.
//
// glibc maps every allocation of 32 MiB or more afresh and unmaps it when it is freed, so such an
// output (a [1, 8, 16384, 64] float32 output or gradient is exactly 32 MiB) faults in each of its
// 4 KiB pages on first touch: 7.4 ms per 32 MiB with 2 threads writing, where the window forward
// at L = 16384 takes ~80 ms. The kernel's outputs and gradients of that size come from this
// allocator instead, which keeps the mappings of freed ones (the most recently freed first, at
// most kKeptBytes in all) and hands one out again to a request of the same size: the next call,
// or the next training step's output and gradients, writes to pages already there (window
// forward 82-84 -> 75-77 ms, training step 317-319 -> 282-289 ms). attnkit.kernel.release_memory()
// unmaps what is kept. A fresh mapping gets the huge-page advice where that cannot stall.
// From 8 MiB, not 32: with a half-precision output and its residual (16 MiB each at that size,
// forward.h) alive together, glibc mapped one of them afresh on every call, 7,500 page faults a
// window forward (L = 16384, bf16), its cost 4-9%; from 8 MiB, 2 faults a call.
// (MADV_FREE on the kept mappings, to let the system reclaim them, cost half the gain.)

#pragma once

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <sys/mman.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>

namespace attnkit_native {
namespace {

// Where transparent huge pages can be asked for without stalls: not where the kernel compacts
// memory synchronously to find them for advised regions (transparent_hugepage/defrag "always",
// "madvise" or "defer+madvise"): after a large free (SDPA's dense-mask call, 1.3 GiB) the next
// window call stalled in that compaction, 111 ms against 86 unadvised (L = 16384, 2 threads),
// where the advice gained ~4% (81-83 ms against 85) on an unfragmented machine.
bool huge_pages_without_stalls() {
  std::FILE* file = std::fopen("/sys/kernel/mm/transparent_hugepage/defrag", "r");
  if (file == nullptr) return false;
  char line[128] = {0};
  const bool read = std::fgets(line, sizeof line, file) != nullptr;
  std::fclose(file);
  return read && (std::strstr(line, "[defer]") != nullptr || std::strstr(line, "[never]") != nullptr);
}

class KeptMappings final : public c10::Allocator {
 public:
  static constexpr size_t kFromBytes = size_t{8} << 20, kKeptBytes = size_t{256} << 20;

  static KeptMappings& instance() {
    static KeptMappings* const pool = [] {
      auto* created = new KeptMappings;  // never destroyed: tensors may outlive statics
      // A fork while another thread holds the lock (freeing a tensor) would leave it held forever
      // in the child (a DataLoader worker): hold it across fork, release it on both sides.
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
      return created;
    }();
    return *pool;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kFromBytes) return c10::GetCPUAllocator()->allocate(n);
    return scratch(n);
  }

  // n bytes, not zeroed, from the kept mappings whatever the size: a thread's float32 sums of the
  // half-precision backward (4 MiB a gradient at Lk = 16384, D = 64), which the next call then
  // writes without faulting its pages in (allocated and zeroed afresh each call: 3,700 page faults
  // a float16 window backward, none in float32).
  c10::DataPtr scratch(size_t n) {
    const size_t page = 4096, bytes = (n + page - 1) / page * page;
    void* data = take(bytes);
    if (data == nullptr) data = fresh(bytes);
    return {data, new Mapping{data, bytes}, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Unmaps every kept mapping; returns the bytes released.
  int64_t release() {
    std::deque<Mapping> kept;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept.swap(kept_);
      kept_bytes_ = 0;
    }
    int64_t bytes = 0;
    for (const Mapping& m : kept) munmap(m.data, m.bytes), bytes += static_cast<int64_t>(m.bytes);
    return bytes;
  }

 private:
  struct Mapping {
    void* data;
    size_t bytes;
  };

  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes == bytes) {
        void* data = it->data;
        kept_bytes_ -= bytes;
        kept_.erase(it);
        return data;
      }
    }
    return nullptr;
  }

  static void* fresh(size_t bytes) {
    void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK_WITH(OutOfMemoryError, data != MAP_FAILED, "attnkit native kernel: cannot map ", bytes,
                     " bytes for an output");
#ifdef MADV_HUGEPAGE
    static const bool advise = huge_pages_without_stalls();
    if (advise) madvise(data, bytes, MADV_HUGEPAGE);  // advice: failure is harmless
#endif
    return data;
  }

  static void give_back(void* context) {
    const Mapping m = *static_cast<Mapping*>(context);
    delete static_cast<Mapping*>(context);
    std::deque<Mapping> evicted;
    if (m.bytes <= kKeptBytes) {
      KeptMappings& pool = instance();
      std::lock_guard<std::mutex> lock(pool.mutex_);
      pool.kept_.push_front(m);
      pool.kept_bytes_ += m.bytes;
      while (pool.kept_bytes_ > kKeptBytes) {
        evicted.push_back(pool.kept_.back());
        pool.kept_bytes_ -= pool.kept_.back().bytes;
        pool.kept_.pop_back();
      }
    } else {
      evicted.push_back(m);
    }
    for (const Mapping& e : evicted) munmap(e.data, e.bytes);  // outside the lock
  }

  std::mutex mutex_;
  std::deque<Mapping> kept_;  // most recently freed first
  size_t kept_bytes_ = 0;
};

int64_t release_kept_memory() { return KeptMappings::instance().release(); }

// A fresh [B, heads, L, C] tensor (C the last dim), with its rows outer to its heads where `like`
// has them so ([B, L, H, D] in memory, as a model's projections viewed as heads give): then the
// caller's view back to [B, L, H * C] needs no copy, as with SDPA's outputs and gradients.
// Its dtype is `dtype` (float32 unless given).
at::Tensor like_layout(const at::Tensor& like, int64_t B, int64_t heads, int64_t L, int64_t C,
                       at::ScalarType dtype = at::kFloat) {
  const bool rows_outer = like.size(1) > 1 && like.size(2) > 1 && like.stride(1) < like.stride(2);
  const auto empty = [dtype](std::initializer_list<int64_t> sizes) {
    return at::Tensor(at::detail::empty_generic(sizes, &KeptMappings::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                dtype, std::nullopt));
  };
  return rows_outer ? empty({B, L, heads, C}).transpose(1, 2) : empty({B, heads, L, C});
}

// Zero `rows` rows of `width` floats, `stride` apart (a block of an output laid out by like_layout).
void zero_rows(float* first, int64_t rows, int64_t stride, int64_t width) {
  for (int64_t j = 0; j < rows; ++j) std::fill(first + j * stride, first + j * stride + width, 0.0f);
}

}  // namespace
}  // namespace attnkit_native
