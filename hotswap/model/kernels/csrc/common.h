// Shared by hotswap's CPU kernels: vector helpers over at::vec (AVX-512, AVX2 or portable,
// chosen at build time through CPU_CAPABILITY) and the ops' declarations.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace hotswap {

using at::vec::Vectorized;
using FVec = Vectorized<float>;
constexpr int64_t kLanes = FVec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define HOTSWAP_DISPATCH(TYPE, NAME, ...)                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)            \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// 2 * kLanes elements of T as two float vectors.
template <typename T>
inline std::pair<FVec, FVec> load_pair(const T* p) {
  auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
  return {lo, hi};
}
template <>
inline std::pair<FVec, FVec> load_pair<float>(const float* p) {
  return {FVec::loadu(p), FVec::loadu(p + kLanes)};
}

// Between float vectors and n (<= kLanes) elements of T. round_to: a float vector rounded
// to T (to nearest even, as torch casts) and widened back. With AVX-512 BF16, bf16 rounds
// by the CPU's own conversion (one instruction against at::vec's ~8; it flushes float32
// denormals, below 1.2e-38, to zero where torch keeps them).
template <typename T>
inline FVec widen(const T* p, int64_t n = kLanes) {
  if constexpr (std::is_same_v<T, float>) {
    return FVec::loadu(p, n);
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p, n));
    return lo;
  }
}

template <typename T>
inline FVec round_to(const FVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
#if defined(__AVX512BF16__)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
#endif
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
    return lo;
  }
}

template <typename T>
inline void narrow(const FVec& v, T* p, int64_t n = kLanes) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
#if defined(__AVX512BF16__)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __mmask16 lanes = n >= kLanes ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
    _mm256_mask_storeu_epi16(p, lanes, (__m256i)_mm512_cvtneps_pbh(v));
#endif
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

inline float reduce_sum(FVec v) {
  return at::vec::vec_reduce_all<float>([](FVec& a, FVec& b) { return a + b; }, v);
}

// Checks every sequence's context fits its block table and each block it reads exists.
void check_block_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t num_blocks,
                        int64_t block_size);

// Query heads per kv head the tiled decode kernel is built for (MAX_TILE_GROUP in
// kernels/__init__.py).
constexpr int64_t kMaxTileGroup = 8;

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, double k_scale,
                                  double v_scale);
at::Tensor paged_decode_attention_tiles(const at::Tensor& query, const at::Tensor& key_tiles,
                                        const at::Tensor& value_tiles, const at::Tensor& block_tables,
                                        const at::Tensor& context_lens, double scale, double k_scale,
                                        double v_scale);
void write_kv_tiles(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_tiles,
                    at::Tensor& value_tiles, const at::Tensor& slot_mapping);
at::Tensor gemv(const at::Tensor& input, const at::Tensor& weight);
// Output columns [n0, n1) of y [M, N] = x [M, K] @ w [N, K]^T on the calling thread (the
// GEMV's body, which the fused experts run per expert).
template <typename T>
void gemv_range(const T* x, int64_t M, const T* w, T* y, int64_t n0, int64_t n1, int64_t N,
                int64_t K);
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                     const at::Tensor& ids, const at::Tensor& weights);
at::Tensor fused_moe_fp8(const at::Tensor& x, const at::Tensor& gate_up,
                         const at::Tensor& gate_up_scale, const at::Tensor& down,
                         const at::Tensor& down_scale, const at::Tensor& ids,
                         const at::Tensor& weights, int64_t block_n, int64_t block_k);
at::Tensor fp8_gemv(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scale,
                    const at::Tensor& scale_rows, int64_t block_k);
at::Tensor fp8_dequantize(const at::Tensor& codes, const at::Tensor& scale,
                          const at::Tensor& scale_rows, int64_t block_k, at::ScalarType dtype);
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void rotary_embedding(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
bool amx_linear_built();
at::Tensor amx_pack_weight(const at::Tensor& weight);
at::Tensor amx_linear(const at::Tensor& input, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias);

}  // namespace hotswap
