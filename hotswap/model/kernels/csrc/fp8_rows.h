// Blockwise FP8 weights' products on the calling thread, shared by the FP8 linear layers
// (fp8_linear.cpp) and the FP8 routed experts (moe.cpp), so that an expert's rows get the
// linear layer's exact results.
#pragma once

#include "common.h"

namespace hotswap {

// A weight of e4m3 codes [N, K] with one float32 scale per block of block_k input columns
// and some output rows: `rows[n]` is output row n's scale row.
struct Fp8Weight {
  const uint8_t* codes;  // [N, K]
  const float* scale;    // [scale rows, KB]
  const int32_t* rows;   // [N]
  int64_t N, K, KB, block_k;
  const float* scales_of(int64_t n) const { return scale + rows[n] * KB; }
};

// Input rows [M, K] prepared once for fp8_gemv_rows: bf16 in the order the AVX-512 VBMI
// decode wants where that path serves them (bf16 input, K and block_k multiples of 64, a
// build with VBMI), else float32. `vbmi` says which, and so the dtype the products are
// written in: the input's (bf16), or float32 for the caller to round once.
struct Fp8Rows {
  at::Tensor data;
  bool vbmi;
};
Fp8Rows fp8_prepare_rows(const at::Tensor& input, int64_t block_k);

// out[first + m, n] = input row first + m . weight row n, for m < M and n in [n0, n1).
// `out` is [rows, N], contiguous, bf16 when in.vbmi, else float32.
void fp8_gemv_rows(const Fp8Rows& in, int64_t first, int64_t M, const Fp8Weight& w, int64_t n0,
                   int64_t n1, at::Tensor& out);

// The weight's values into `out` [N, K] (contiguous, the activation dtype), in parallel.
void fp8_dequantize_into(const Fp8Weight& w, at::Tensor& out);

}  // namespace hotswap
