// Scratch memory aligned to a cache line.
//
// The tiles and row loops read and write whole vectors (32 or 64 bytes) at row strides that are
// multiples of 64 bytes, so from a line-aligned start no access straddles two cache lines. glibc
// aligns its blocks to 16 bytes only (a large one, mapped afresh, starts 16 bytes into its page),
// and from such a start half the 32-byte accesses, and every 64-byte one, touch two lines.

#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace attnkit_native {
namespace {

constexpr std::align_val_t kCacheLine{64};

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kCacheLine)); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, kCacheLine); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept { return true; }
};

// A buffer whose first element starts a cache line.
template <class T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;
using Floats = LineVector<float>;

}  // namespace
}  // namespace attnkit_native
