// GEMV for the few rows of a decode step: y = x @ w^T with the weight rows streamed from
// memory once, in order, each output one float32 dot product over K. For bf16 the inputs'
// rows (up to 8 at a time) share every weight line loaded, so a handful of rows costs
// little more than one: the memory read is the whole cost.
#include "common.h"

namespace hotswap {
namespace {

constexpr int64_t kRowsPerTask = 64;  // weight rows per parallel chunk (at least)

template <typename T>
void gemv_portable(const float* x, const T* w, T* y, int64_t n0, int64_t n1, int64_t K) {
  const int64_t kmain = K - K % (2 * kLanes);
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * K;
    FVec a(0.f), b(0.f);
    for (int64_t k = 0; k < kmain; k += 2 * kLanes) {
      auto [lo, hi] = load_pair<T>(row + k);
      a = at::vec::fmadd(lo, FVec::loadu(x + k), a);
      b = at::vec::fmadd(hi, FVec::loadu(x + k + kLanes), b);
    }
    float s = reduce_sum(a + b);
    for (int64_t k = kmain; k < K; ++k) s += x[k] * static_cast<float>(row[k]);
    y[n] = static_cast<T>(s);
  }
}

#if defined(__AVX512BF16__)
using BF16 = at::BFloat16;
constexpr int64_t kPrefetchRows = 8;  // weight rows prefetched ahead of the ones read

// Outputs [m, n .. n + NR) for MR input rows: MR x NR float32 accumulators, one BF16 dot
// product instruction per (input row, weight line). `prefetch` (the first group of input
// rows only) pulls the weight rows kPrefetchRows ahead into cache line by line: the
// hardware prefetcher alone keeps too few lines in flight to stream at full speed.
template <int MR, int NR>
void dot_block(const BF16* x, int64_t K, const BF16* w, int64_t n, BF16* y, int64_t N,
               const char* end, bool prefetch) {
  const int64_t kmain = K - K % 32;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(w + (n + kPrefetchRows) * K);
  for (int64_t k = 0; k < kmain; k += 32) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) {
      const char* line = ahead + (r * K + k) * 2;
      if (prefetch && line < end) _mm_prefetch(line, _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      for (int64_t k = kmain; k < K; ++k)
        s += static_cast<float>(x[m * K + k]) * static_cast<float>(w[(n + r) * K + k]);
      y[m * N + n + r] = static_cast<BF16>(s);
    }
}

template <int NR>
void dot_rows(const BF16* x, int64_t M, int64_t K, const BF16* w, int64_t n, BF16* y,
              int64_t N, const char* end) {
  for (int64_t m = 0; m < M; m += 8) {
    const BF16* xm = x + m * K;
    BF16* ym = y + m * N;
    const bool first = m == 0;
    switch (std::min<int64_t>(8, M - m)) {
      case 1: dot_block<1, NR>(xm, K, w, n, ym, N, end, first); break;
      case 2: dot_block<2, NR>(xm, K, w, n, ym, N, end, first); break;
      case 3: dot_block<3, NR>(xm, K, w, n, ym, N, end, first); break;
      case 4: dot_block<4, NR>(xm, K, w, n, ym, N, end, first); break;
      case 5: dot_block<5, NR>(xm, K, w, n, ym, N, end, first); break;
      case 6: dot_block<6, NR>(xm, K, w, n, ym, N, end, first); break;
      case 7: dot_block<7, NR>(xm, K, w, n, ym, N, end, first); break;
      default: dot_block<8, NR>(xm, K, w, n, ym, N, end, first); break;
    }
  }
}

// Weight rows [n0, n1): four at a time for a single input row (more independent sums in
// flight), two at a time for several (their accumulators fill the registers).
void gemv_bf16(const BF16* x, int64_t M, const BF16* w, BF16* y, int64_t n0, int64_t n1,
               int64_t N, int64_t K) {
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  const int64_t step = M == 1 ? 4 : 2;
  int64_t n = n0;
  for (; n + step <= n1; n += step) {
    if (M == 1)
      dot_block<1, 4>(x, K, w, n, y, N, end, true);
    else
      dot_rows<2>(x, M, K, w, n, y, N, end);
  }
  for (; n < n1; ++n) dot_rows<1>(x, M, K, w, n, y, N, end);
}
#endif

template <typename T>
void gemv_impl(const T* x, int64_t M, const T* w, T* y, int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
      gemv_bf16(x, M, w, y, n0, n1, N, K);
    });
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    std::vector<float> xf(K);
    for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(x[m * K + k]);
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
      gemv_portable<T>(xf.data(), w, y + m * N, n0, n1, K);
    });
  }
}

}  // namespace

template <typename T>
void gemv_range(const T* x, int64_t M, const T* w, T* y, int64_t n0, int64_t n1, int64_t N,
                int64_t K) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    gemv_bf16(x, M, w, y, n0, n1, N, K);
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t m = 0; m < M; ++m) gemv_portable<T>(x + m * K, w, y + m * N, n0, n1, K);
  } else {
    std::vector<float> xf(K);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(x[m * K + k]);
      gemv_portable<T>(xf.data(), w, y + m * N, n0, n1, K);
    }
  }
}

template void gemv_range<float>(const float*, int64_t, const float*, float*, int64_t, int64_t,
                                int64_t, int64_t);
template void gemv_range<at::BFloat16>(const at::BFloat16*, int64_t, const at::BFloat16*,
                                       at::BFloat16*, int64_t, int64_t, int64_t, int64_t);
template void gemv_range<at::Half>(const at::Half*, int64_t, const at::Half*, at::Half*, int64_t,
                                   int64_t, int64_t, int64_t);

at::Tensor gemv(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && input.size(1) == weight.size(1),
              "gemv: input [M, K] and weight [N, K]");
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), "gemv: input and weight dtypes differ");
  TORCH_CHECK(weight.is_contiguous(), "gemv: the weight must be contiguous");
  const int64_t M = input.size(0), K = input.size(1), N = weight.size(0);
  const auto x = input.contiguous();
  auto y = at::empty({M, N}, input.options());
  if (M == 0 || N == 0) return y;
  HOTSWAP_DISPATCH(input.scalar_type(), "gemv", [&] {
    gemv_impl<scalar_t>(x.data_ptr<scalar_t>(), M, weight.data_ptr<scalar_t>(),
                        y.data_ptr<scalar_t>(), N, K);
  });
  return y;
}

}  // namespace hotswap
