// Half-precision inputs and outputs (bfloat16, float16): the kernel computes in float32 on rows it
// converts as it reads them, and rounds its outputs once, as it writes them.
//
// This is the float32-convert path: products accumulate and the softmax runs in float32 from the
// exact float32 values of the half-precision inputs (every bf16 and fp16 value is a float32), so a
// result differs from the float32 kernel's on the same (upcast) inputs only by its final rounding.
// Each thread converts the rows of one (sequence, head) it is working on into its own buffer, and
// extends that buffer as its blocks move along the keys: consecutive blocks share most of their
// key span, so each key row is converted about once per thread and read back from cache. Converting
// whole tensors up front with ATen took 20 ms per 8.4M elements into fresh memory (page faults) and
// 3.7 ms into memory already mapped: a tenth and more of a window forward's time (L = 16384, H = 8,
// D = 64, 2 threads, AVX2), where the rows converted here are read again while still in L2.
//
// F16C (every AVX2 CPU has it) converts float16; bfloat16 is the upper half of a float32, and
// rounds to nearest even as c10::BFloat16 does (NaN to 0x7FC0), so outputs equal torch's `.to()`.

#pragma once

#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "aligned.h"
#include "kept_memory.h"

namespace attnkit_native {
namespace {

// The dtypes the kernel takes; the call's inputs share one.
inline bool kernel_dtype(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

// n elements of `type` (bfloat16 or float16) from src, as float32 into dst.
inline void to_float(const void* src, at::ScalarType type, int64_t n, float* dst) {
  const auto* in = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (type == at::kBFloat16) {
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(c10::BFloat16(in[i], c10::BFloat16::from_bits()));
  } else {
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
    }
#endif
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(in[i], c10::Half::from_bits()));
  }
}

// n float32 values from src rounded to nearest even into `type` (bfloat16 or float16) at dst.
inline void from_float(const float* src, int64_t n, at::ScalarType type, void* dst) {
  auto* out = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  if (type == at::kBFloat16) {
    const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7FFF), nan = _mm256_set1_epi32(0x7FC0);
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(src + i);
      const __m256i u = _mm256_castps_si256(x);
      const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), one), half_ulp);
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
      r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan),
                                               _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
      // packus works within 128-bit halves: [0-3 0-3 | 4-7 4-7]; the permute brings 0-7 together
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
    }
    for (; i < n; ++i) out[i] = c10::BFloat16(src[i]).x;
  } else {
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
    }
#endif
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    }
    for (; i < n; ++i) out[i] = c10::Half(src[i]).x;
  }
}

// One [B, heads, L, C] tensor of any kernel dtype: its bytes and element strides.
struct Rows {
  const char* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // s3: the backward's [B, Hkv, parts, Lk, C] copies
  int64_t width = 0;                       // C
  int64_t bytes = 4;                       // per element
  at::ScalarType type = at::kFloat;

  Rows() = default;
  explicit Rows(const at::Tensor& t)
      : data(static_cast<const char*>(t.data_ptr())), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)),
        s3(t.dim() > 4 ? t.stride(3) : 1), width(t.size(-1)), bytes(t.element_size()), type(t.scalar_type()) {}
  bool is_float() const { return type == at::kFloat; }
  const char* at(int64_t b, int64_t h, int64_t i) const { return data + (b * s0 + h * s1 + i * s2) * bytes; }
  // For float32 tensors only: element [b][h][i][0] (for the copies: [b][h][part], rows s3 apart).
  const float* floats(int64_t b, int64_t h, int64_t i) const { return reinterpret_cast<const float*>(at(b, h, i)); }
  float* mutable_floats(int64_t b, int64_t h, int64_t i) const { return const_cast<float*>(floats(b, h, i)); }
};

// One input's rows converted for one thread (each row of `in.width` elements into `width`
// elements of T by `convert`), in a buffer that holds the rows [base_, hi_) of the (sequence, head)
// last asked for. Blocks move forward along the rows, so a request that starts inside the held rows
// keeps them, converts only the rows past hi_, and drops the rows before its start when the buffer
// is full; any other request starts over. The buffer holds about two requests' rows, not the
// head's (a buffer of whole heads, zeroed as it grew, cost 3-4% of a window forward in page
// faults and copies).
template <typename T>
class HeldRows {
 public:
  using Convert = void (*)(const void* src, at::ScalarType type, int64_t n, T* dst);
  HeldRows(const Rows& rows, int64_t width, Convert convert) : in_(rows), w_(width), convert_(convert) {}

  // A pointer p with row i of (b, h) at p + i * stride for rows [first, last), and the stride (p lies
  // before the buffer when rows before `first` were dropped; only rows in [first, last) are read
  // through it).
  std::pair<const T*, int64_t> head(int64_t b, int64_t h, int64_t first, int64_t last) {
    const int64_t w = w_;
    if (b != b_ || h != h_ || first < base_ || first > hi_) b_ = b, h_ = h, base_ = hi_ = first;
    if (last > hi_) {
      if (last - base_ > capacity_) {
        // keep rows [first, hi_) at the buffer's start; grow it if that is still too small
        const int64_t kept = hi_ - first, needed = last - first;
        if (needed > capacity_) {
          const int64_t grown = std::max<int64_t>(2 * needed, 64);
          // not zeroed: every row read is written first
          Buffer larger(static_cast<T*>(::operator new(grown * w * sizeof(T), kCacheLine)));
          std::memcpy(larger.get(), buffer_.get() + (first - base_) * w, kept * w * sizeof(T));
          buffer_ = std::move(larger), capacity_ = grown;
        } else {
          std::memmove(buffer_.get(), buffer_.get() + (first - base_) * w, kept * w * sizeof(T));
        }
        base_ = first;
      }
      for (int64_t i = hi_; i < last; ++i) convert_(in_.at(b_, h_, i), in_.type, in_.width, buffer_.get() + (i - base_) * w);
      hi_ = last;
    }
    return {reinterpret_cast<const T*>(reinterpret_cast<uintptr_t>(buffer_.get()) -
                                       static_cast<uintptr_t>(base_ * w * sizeof(T))),
            w};
  }

 private:
  struct Release {
    void operator()(T* p) const { ::operator delete(p, kCacheLine); }
  };
  using Buffer = std::unique_ptr<T, Release>;

  Rows in_;
  int64_t w_;
  Convert convert_;
  Buffer buffer_;
  int64_t capacity_ = 0;  // rows
  int64_t b_ = -1, h_ = -1, base_ = 0, hi_ = 0;  // rows [base_, hi_) held, row base_ at the buffer's start
};

// One input's rows as float32 for one thread: a float32 tensor's own rows, or a half-precision
// tensor's converted as it reads them (HeldRows).
class FloatRows {
 public:
  explicit FloatRows(const Rows& rows) : in_(rows), held_(rows, rows.width, to_float) {}

  // A pointer p with row i of (b, h) at p + i * stride for rows [first, last), and the stride. An
  // absent tensor (Rows()) gives {nullptr, 0}.
  std::pair<const float*, int64_t> head(int64_t b, int64_t h, int64_t first, int64_t last) {
    if (in_.data == nullptr) return {nullptr, 0};
    if (in_.is_float()) return {in_.floats(b, h, 0), in_.s2};
    return held_.head(b, h, first, last);
  }

 private:
  Rows in_;
  HeldRows<float> held_;
};

// Where a block's float32 results go before the output: the output's own rows (float32), or a
// thread's buffer of `rows` x C floats rounded into the output's rows by `store`. With `low` (a
// tensor like the half-precision output), `store` also writes what the rounding took off, rounded
// in its turn: out + low holds the float32 result to about 16 bits more, for the backward's row
// term (backward.h), which would otherwise read the rounded output.
class OutputRows {
 public:
  explicit OutputRows(const Rows& out, const Rows& low = Rows()) : out_(out), low_(low) {}

  // Rows [first, first + rows) of (b, h): a float32 destination and its row stride.
  std::pair<float*, int64_t> block(int64_t b, int64_t h, int64_t first, int64_t rows) {
    b_ = b, h_ = h, first_ = first, rows_ = rows;
    if (out_.is_float()) return {out_.mutable_floats(b, h, first), out_.s2};
    if (static_cast<int64_t>(buffer_.size()) < rows * out_.width) buffer_.resize(rows * out_.width);
    return {buffer_.data(), out_.width};
  }

  // The block's results into a half-precision output (nothing to do for float32).
  void store() {
    if (out_.is_float()) return;
    const int64_t w = out_.width;
    if (low_.data != nullptr && static_cast<int64_t>(rounded_.size()) < w) rounded_.resize(w);
    for (int64_t j = 0; j < rows_; ++j) {
      const float* exact = buffer_.data() + j * w;
      char* row = const_cast<char*>(out_.at(b_, h_, first_ + j));
      from_float(exact, w, out_.type, row);
      if (low_.data == nullptr) continue;
      to_float(row, out_.type, w, rounded_.data());
      // exact in float32 (the two are within a rounding of each other); 0 where the output is not
      // finite (inf - inf would be NaN), so that out + low is the output itself there
      for (int64_t d = 0; d < w; ++d) rounded_[d] = std::isfinite(exact[d]) ? exact[d] - rounded_[d] : 0.0f;
      from_float(rounded_.data(), w, out_.type, const_cast<char*>(low_.at(b_, h_, first_ + j)));
    }
  }

 private:
  Rows out_, low_;
  Floats buffer_, rounded_;
  int64_t b_ = 0, h_ = 0, first_ = 0, rows_ = 0;
};

// Where a backward task's float32 sums of dK (or dV) for one (sequence, kv head) go: `rows`, the
// float32 copies [B, Hkv, parts, Lk, C] (the gradient itself in one part; summed and rounded after
// the tasks in several); or, where `rows` is the half-precision gradient itself [B, Hkv, Lk, C]
// (one part), a thread's buffer, rounded into it when the task ends, so no float32 copy of the
// whole gradient is made, faulted in and read again.
//
// The sums are zeroed key row by key row just before the task first adds to them (`reach`), one
// interval [reached) of key rows growing over the task: zeroed whole up front, the float32 copies
// cost a pass of their own that the products then read back from memory (4.7 ms of a 205 ms
// window backward, L = 16384, 2 threads, where the zeroed rows were already out of the caches).
class KeyGradRows {
 public:
  KeyGradRows(const Rows& rows, int64_t keys, int64_t parts) : rows_(rows), keys_(keys), parts_(parts) {}

  // The (b, kv, part) sums: a float32 destination and its row stride, no key row reached yet.
  std::pair<float*, int64_t> start(int64_t b, int64_t kv, int64_t part) {
    b_ = b, kv_ = kv, lo_ = hi_ = 0;
    if (rows_.is_float()) {
      sums_ = rows_.mutable_floats(b, kv, part), stride_ = rows_.s3;
    } else {
      // not zeroed: reach() zeroes each row before it is first added to, finish() reads only those
      const size_t bytes = static_cast<size_t>(keys_ * rows_.width) * sizeof(float);
      if (buffer_bytes_ < bytes) buffer_ = KeptMappings::instance().scratch(bytes), buffer_bytes_ = bytes;
      sums_ = static_cast<float*>(buffer_.get()), stride_ = rows_.width;
    }
    return {sums_, stride_};
  }

  // Key rows [from, to) (clipped to the keys) are about to be added to: those not reached yet are
  // zeroed, and so is any gap between them and the rows reached, which stay one interval.
  void reach(int64_t from, int64_t to) {
    from = std::max<int64_t>(from, 0), to = std::min(to, keys_);
    if (from >= to) return;
    if (lo_ == hi_) lo_ = hi_ = from;  // none reached yet
    if (from < lo_) zero(from, lo_), lo_ = from;
    if (to > hi_) zero(hi_, to), hi_ = to;
  }

  // The key rows the task's sums hold (zeros and sums): where several parts are summed, the only
  // rows of this part's copy to read.
  std::pair<int64_t, int64_t> reached() const { return {lo_, hi_}; }

  // Ends the task: in one part, the key rows never reached become zeros, and half-precision sums
  // are rounded into the gradient (once).
  void finish() {
    if (rows_.is_float()) {
      if (parts_ == 1) zero(0, lo_), zero(hi_, keys_);
      return;
    }
    const Floats zeros(rows_.width, 0.0f);
    for (int64_t i = 0; i < keys_; ++i) {
      const float* sums = i >= lo_ && i < hi_ ? sums_ + i * stride_ : zeros.data();
      from_float(sums, rows_.width, rows_.type, const_cast<char*>(rows_.at(b_, kv_, i)));
    }
  }

 private:
  void zero(int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) std::fill(sums_ + i * stride_, sums_ + i * stride_ + rows_.width, 0.0f);
  }

  Rows rows_;
  int64_t keys_, parts_;
  c10::DataPtr buffer_;  // half precision: the task's float32 sums (kept_memory.h)
  size_t buffer_bytes_ = 0;
  float* sums_ = nullptr;
  int64_t stride_ = 0, b_ = 0, kv_ = 0, lo_ = 0, hi_ = 0;
};

}  // namespace
}  // namespace attnkit_native
