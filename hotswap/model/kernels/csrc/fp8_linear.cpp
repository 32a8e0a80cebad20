// Linear layers over blockwise FP8 weights (e4m3 codes, one float32 scale per block of
// block_k input columns and some output rows): a GEMV for the few rows of a decode step
// that reads each code once (half the bytes of a bf16 weight), and a dequantization into
// the activation dtype for larger products (measured on the default model's layers: at 64
// rows, dequantizing and the GEMM library take 26 ms where packed bf16 takes 22 ms, and a
// kernel staging a few weight rows in bf16 at a time took 53).
//
// Which scale row an output row uses is given per row (`scale_rows`): a fused weight
// (q/k/v, gate/up) keeps each checkpoint tensor's own block grid, as a checkpoint or a
// trainer quantizes them one by one.
//
// Codes decode as fp8_codes.h says (exactly, times 2^-8, the 2^8 folded into the scales).
#include "fp8_codes.h"
#include "fp8_rows.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace hotswap {
namespace {

constexpr int64_t kRowsPerTask = 64;
constexpr int64_t kPrefetchRows = 16;

// y[m, n .. n + NR) for MR input rows (float32, [MR, K]): per block, float32 sums of
// code x input (MR x NR independent chains), then times each row's block scale.
template <int MR, int NR>
void dot_block(const float* x, const Fp8Weight& w, int64_t n, float* y) {
  FVec total[MR][NR];
  float tail[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) total[m][r] = FVec(0.f), tail[m][r] = 0.f;
  const char* ahead = reinterpret_cast<const char*>(w.codes + (n + kPrefetchRows) * w.K);
  const char* end = reinterpret_cast<const char*>(w.codes + w.N * w.K);
  for (int64_t kb = 0; kb < w.KB; ++kb) {
    const int64_t k0 = kb * w.block_k, k1 = std::min(w.K, k0 + w.block_k);
    const int64_t kmain = k0 + (k1 - k0) / kLanes * kLanes;
    FVec acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = FVec(0.f);
    for (int64_t k = k0; k < kmain; k += kLanes) {
      FVec wv[NR];
      for (int r = 0; r < NR; ++r) {
        const char* line = ahead + r * w.K + k;
        if (k % 64 == 0 && line < end) __builtin_prefetch(line, 0, 3);
        wv[r] = widen_codes(w.codes + (n + r) * w.K + k);
      }
      for (int m = 0; m < MR; ++m) {
        const FVec xv = FVec::loadu(x + m * w.K + k);
        for (int r = 0; r < NR; ++r) acc[m][r] = at::vec::fmadd(wv[r], xv, acc[m][r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float s = w.scales_of(n + r)[kb] * kHalfShift;
      const uint8_t* row = w.codes + (n + r) * w.K;
      for (int m = 0; m < MR; ++m) {
        total[m][r] = at::vec::fmadd(acc[m][r], FVec(s), total[m][r]);
        for (int64_t k = kmain; k < k1; ++k) tail[m][r] += code_value(row[k]) * x[m * w.K + k] * s;
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) y[m * w.N + n + r] = reduce_sum(total[m][r]) + tail[m][r];
}

// Weight rows [n0, n1): four at a time for one or two input rows, two at a time for more
// (their accumulators fill the registers), input rows four at a time.
template <int MR>
void dot_rows(const float* x, const Fp8Weight& w, int64_t n0, int64_t n1, float* y) {
  constexpr int NR = MR <= 2 ? 4 : 2;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) dot_block<MR, NR>(x, w, n, y);
  for (; n < n1; ++n) dot_block<MR, 1>(x, w, n, y);
}

void gemv_rows(const float* x, int64_t M, const Fp8Weight& w, int64_t n0, int64_t n1, float* y) {
  for (int64_t m = 0; m < M; m += 4) {
    const float* xm = x + m * w.K;
    float* ym = y + m * w.N;
    switch (std::min<int64_t>(4, M - m)) {
      case 1: dot_rows<1>(xm, w, n0, n1, ym); break;
      case 2: dot_rows<2>(xm, w, n0, n1, ym); break;
      case 3: dot_rows<3>(xm, w, n0, n1, ym); break;
      default: dot_rows<4>(xm, w, n0, n1, ym); break;
    }
  }
}

Fp8Weight check_weight(const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& scale_rows, int64_t block_k, const char* op) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kFloat8_e4m3fn && codes.is_contiguous(),
              op, ": codes must be a contiguous [N, K] float8_e4m3fn tensor");
  TORCH_CHECK(block_k > 0 && block_k % 16 == 0, op, ": block_k must be a multiple of 16");
  const int64_t N = codes.size(0), K = codes.size(1), KB = (K + block_k - 1) / block_k;
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(1) == KB,
              op, ": scale must be a contiguous float32 [rows, ceil(K / block_k)] tensor");
  TORCH_CHECK(scale_rows.dim() == 1 && scale_rows.size(0) == N &&
                  scale_rows.scalar_type() == at::kInt && scale_rows.is_contiguous(),
              op, ": scale_rows must be int32 [N]");
  const int32_t* rows = scale_rows.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(rows[n] >= 0 && rows[n] < scale.size(0), op, ": scale row out of range");
  return {static_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(), rows, N, K, KB,
          block_k};
}

template <typename T>
void dequantize_rows(const Fp8Weight& w, T* out, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.codes + n * w.K;
    const float* scales = w.scales_of(n);
    T* dst = out + n * w.K;
    for (int64_t kb = 0; kb < w.KB; ++kb) {
      const int64_t k0 = kb * w.block_k, k1 = std::min(w.K, k0 + w.block_k);
      const int64_t kmain = k0 + (k1 - k0) / kLanes * kLanes;
      const FVec s(scales[kb] * kHalfShift);
      for (int64_t k = k0; k < kmain; k += kLanes) narrow<T>(widen_codes(row + k) * s, dst + k);
      for (int64_t k = kmain; k < k1; ++k)
        dst[k] = static_cast<T>(code_value(row[k]) * (scales[kb] * kHalfShift));
    }
  }
}

#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define HOTSWAP_FP8_VBMI 1
// Where the CPU can index a 128-byte table per byte (AVX-512 VBMI), 64 codes become 64
// bf16 values in a few instructions: the low and high bytes of every e4m3 magnitude's bf16
// (exact: e4m3 has 4 significant bits, and its subnormals are normal bf16s) looked up by
// the code's low 7 bits, its sign OR-ed into the high byte, then bytes paired into words.
// The pairing interleaves within 128-bit lanes: one vector holds each 64-run's elements
// {0-7, 16-23, 32-39, 48-55}, the other the rest, and the input is permuted to match once
// per call. Then BF16 dot products, two per 64 codes and input row.
struct Fp8Tables {
  __m512i lo_a, lo_b, hi_a, hi_b;  // low / high bytes of magnitudes 0-63, 64-127
};

inline Fp8Tables make_tables() {
  alignas(64) uint8_t lo[128], hi[128];
  for (int m = 0; m < 128; ++m) {
    const uint16_t bits = c10::BFloat16(code_value(static_cast<uint8_t>(m)) * kHalfShift).x;
    lo[m] = static_cast<uint8_t>(bits & 0xFF);
    hi[m] = static_cast<uint8_t>(bits >> 8);
  }
  return {_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi),
          _mm512_load_si512(hi + 64)};
}

inline void widen64(const uint8_t* p, const Fp8Tables& t, __m512bh& a, __m512bh& b) {
  const __m512i c = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo_a, c, t.lo_b);
  const __m512i mag = _mm512_permutex2var_epi8(t.hi_a, c, t.hi_b);
  const __m512i hi = _mm512_ternarylogic_epi32(mag, c, _mm512_set1_epi8(char(0x80)), 0xF8);
  a = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
  b = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

// An input row in widen64's order: per run of 64, elements {0-7, 16-23, ...} then the rest.
void permute_row(const at::BFloat16* x, int64_t K, at::BFloat16* out) {
  for (int64_t k = 0; k < K; k += 64)
    for (int i = 0; i < 32; ++i) {
      const int64_t first = k + (i / 8) * 16 + i % 8;
      out[k + i] = x[first];
      out[k + 32 + i] = x[first + 8];
    }
}

template <int MR, int NR>
void dot_block_vbmi(const at::BFloat16* x, const Fp8Weight& w, const Fp8Tables& t, int64_t n,
                    at::BFloat16* y) {
  __m512 total[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) total[m][r] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(w.codes + (n + kPrefetchRows) * w.K);
  const char* end = reinterpret_cast<const char*>(w.codes + w.N * w.K);
  for (int64_t kb = 0; kb < w.KB; ++kb) {
    const int64_t k0 = kb * w.block_k, k1 = std::min(w.K, k0 + w.block_k);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 64) {
      __m512bh wa[NR], wb[NR];
      for (int r = 0; r < NR; ++r) {
        const char* line = ahead + r * w.K + k;
        if (line < end) __builtin_prefetch(line, 0, 3);
        widen64(w.codes + (n + r) * w.K + k, t, wa[r], wb[r]);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512bh xa = (__m512bh)_mm512_loadu_si512(x + m * w.K + k);
        const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + m * w.K + k + 32);
        for (int r = 0; r < NR; ++r)
          acc[m][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[m][r], wa[r], xa), wb[r], xb);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(w.scales_of(n + r)[kb]);
      for (int m = 0; m < MR; ++m) total[m][r] = _mm512_fmadd_ps(acc[m][r], s, total[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      y[m * w.N + n + r] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(total[m][r]));
}

template <int MR>
void dot_rows_vbmi(const at::BFloat16* x, const Fp8Weight& w, const Fp8Tables& t, int64_t n0,
                   int64_t n1, at::BFloat16* y) {
  constexpr int NR = MR <= 2 ? 4 : 2;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) dot_block_vbmi<MR, NR>(x, w, t, n, y);
  for (; n < n1; ++n) dot_block_vbmi<MR, 1>(x, w, t, n, y);
}

void gemv_rows_vbmi(const at::BFloat16* x, int64_t M, const Fp8Weight& w, int64_t n0,
                    int64_t n1, at::BFloat16* y) {
  const Fp8Tables t = make_tables();
  for (int64_t m = 0; m < M; m += 4) {
    const at::BFloat16* xm = x + m * w.K;
    at::BFloat16* ym = y + m * w.N;
    switch (std::min<int64_t>(4, M - m)) {
      case 1: dot_rows_vbmi<1>(xm, w, t, n0, n1, ym); break;
      case 2: dot_rows_vbmi<2>(xm, w, t, n0, n1, ym); break;
      case 3: dot_rows_vbmi<3>(xm, w, t, n0, n1, ym); break;
      default: dot_rows_vbmi<4>(xm, w, t, n0, n1, ym); break;
    }
  }
}
#endif

}  // namespace

Fp8Rows fp8_prepare_rows(const at::Tensor& input, int64_t block_k) {
  const int64_t M = input.size(0), K = input.size(1);
#if defined(HOTSWAP_FP8_VBMI)
  if (input.scalar_type() == at::kBFloat16 && K % 64 == 0 && block_k % 64 == 0) {
    const auto x = input.contiguous();
    at::Tensor permuted = at::empty({M, K}, x.options());
    for (int64_t m = 0; m < M; ++m)
      permute_row(x.data_ptr<at::BFloat16>() + m * K, K, permuted.data_ptr<at::BFloat16>() + m * K);
    return {permuted, true};
  }
#endif
  return {input.to(at::kFloat).contiguous(), false};
}

void fp8_gemv_rows(const Fp8Rows& in, int64_t first, int64_t M, const Fp8Weight& w, int64_t n0,
                   int64_t n1, at::Tensor& out) {
  if (M == 0 || n0 >= n1) return;
#if defined(HOTSWAP_FP8_VBMI)
  if (in.vbmi) {
    gemv_rows_vbmi(in.data.data_ptr<at::BFloat16>() + first * w.K, M, w, n0, n1,
                   out.data_ptr<at::BFloat16>() + first * w.N);
    return;
  }
#endif
  gemv_rows(in.data.data_ptr<float>() + first * w.K, M, w, n0, n1,
            out.data_ptr<float>() + first * w.N);
}

void fp8_dequantize_into(const Fp8Weight& w, at::Tensor& out) {
  HOTSWAP_DISPATCH(out.scalar_type(), "fp8_dequantize", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, w.N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
      dequantize_rows<scalar_t>(w, dst, n0, n1);
    });
  });
}

at::Tensor fp8_gemv(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scale,
                    const at::Tensor& scale_rows, int64_t block_k) {
  const Fp8Weight w = check_weight(codes, scale, scale_rows, block_k, "fp8_gemv");
  TORCH_CHECK(input.dim() == 2 && input.size(1) == w.K, "fp8_gemv: input must be [M, K]");
  const int64_t M = input.size(0);
  const Fp8Rows rows = fp8_prepare_rows(input, block_k);
  at::Tensor out = at::empty({M, w.N}, input.options().dtype(rows.vbmi ? at::kBFloat16 : at::kFloat));
  at::parallel_for(0, w.N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    fp8_gemv_rows(rows, 0, M, w, n0, n1, out);
  });
  return rows.vbmi ? out : out.to(input.scalar_type());
}

at::Tensor fp8_dequantize(const at::Tensor& codes, const at::Tensor& scale,
                          const at::Tensor& scale_rows, int64_t block_k, at::ScalarType dtype) {
  const Fp8Weight w = check_weight(codes, scale, scale_rows, block_k, "fp8_dequantize");
  auto out = at::empty({w.N, w.K}, codes.options().dtype(dtype));
  fp8_dequantize_into(w, out);
  return out;
}

}  // namespace hotswap
