// SiLU-and-mul, the gated MLP's activation: out = silu(gate) * up for gate_up = [gate | up]
// ([tokens, 2I] -> [tokens, I]), one pass over the GEMM's output instead of torch's two
// (silu_ on the gate half, then mul_ by the up half) and a copy of the strided result.
//
// It reproduces the reference's rounding (transformers' `act_fn(gate) * up`, torch's CPU
// kernels): silu is x / (1 + exp(-x)) in float32 with at::vec's exp (the same Sleef
// function torch's vectorised silu calls), rounded to the dtype, then multiplied by up
// in float32 and rounded again.
#include "common.h"

namespace hotswap {
namespace {

// Elements a parallel task takes at least: below it, waking the other threads costs
// more than the work.
constexpr int64_t kElementsPerTask = 16384;

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t I) {
  const FVec one(1.f);
  for (int64_t i = 0; i < I; i += kLanes) {
    const int64_t n = std::min(kLanes, I - i);
    const FVec x = widen<T>(gate + i, n);
    const FVec silu = round_to<T>(x / (one + x.neg().exp()));
    narrow<T>(silu * widen<T>(up + i, n), out + i, n);
  }
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up [tokens, 2 * intermediate] with contiguous rows");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, I}, gate_up.options());
  if (rows == 0 || I == 0) return out;
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / I);
  HOTSWAP_DISPATCH(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r)
        silu_mul_row<scalar_t>(in + r * stride, in + r * stride + I, dst + r * I, I);
    });
  });
  return out;
}

}  // namespace hotswap
