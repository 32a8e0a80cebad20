// RMSNorm (optionally fused with the residual add before it) and rotate-half RoPE, one
// pass each instead of the eight and five torch operators they replace per call.
//
// Both reproduce the reference's rounding (Llama/Qwen in transformers, and hotswap's
// torch path) step for step: every intermediate the reference keeps in the activation
// dtype is rounded to it here too, and the build disables FMA contraction, so bf16 and
// float32 results match the torch path bit for bit except where a float32 sum of squares
// is added up in another order (RMSNorm's mean).
#include "common.h"

namespace hotswap {
namespace {

constexpr int64_t kRowsPerTask = 16;

// y = w * round_W(x * rsqrt(mean(x^2) + eps)): the normalised value is rounded to the
// weight's dtype W and scaled in it (the reference's `weight * x.to(weight.dtype)`).
template <typename T, typename W>
void norm_row(const T* x, const W* w, W* y, int64_t H, float eps) {
  FVec acc(0.f);
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes) {
    const FVec v = widen<T>(x + h);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = reduce_sum(acc);
  for (; h < H; ++h) sum += static_cast<float>(x[h]) * static_cast<float>(x[h]);
  const FVec inv(1.f / std::sqrt(sum / static_cast<float>(H) + eps));
  for (h = 0; h < H; h += kLanes) {
    const int64_t n = std::min(kLanes, H - h);
    const FVec normed = round_to<W>(widen<T>(x + h, n) * inv);
    narrow<W>(round_to<W>(widen<W>(w + h, n) * normed), y + h, n);
  }
}

// residual = round_T(residual + x), then the norm of it.
template <typename T, typename W>
void add_norm_row(const T* x, T* residual, const W* w, W* y, int64_t H, float eps) {
  for (int64_t h = 0; h < H; h += kLanes) {
    const int64_t n = std::min(kLanes, H - h);
    narrow<T>(widen<T>(residual + h, n) + widen<T>(x + h, n), residual + h, n);
  }
  norm_row<T, W>(residual, w, y, H, eps);
}

void check_norm(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1, "rms_norm: input [rows, H], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == input.size(1),
              "rms_norm: weight [H]");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat,
              "rms_norm: the weight has the input's dtype or float32");
}

template <typename F>
void for_rows(int64_t rows, const F& body) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) body(r);
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_norm(input, weight);
  const int64_t rows = input.size(0), H = input.size(1), stride = input.stride(0);
  auto out = at::empty({rows, H}, input.options().dtype(weight.scalar_type()));
  HOTSWAP_DISPATCH(input.scalar_type(), "rms_norm", [&] {
    using T = scalar_t;
    const T* x = input.data_ptr<T>();
    if (weight.scalar_type() == input.scalar_type()) {
      for_rows(rows, [&](int64_t r) {
        norm_row<T, T>(x + r * stride, weight.data_ptr<T>(), out.data_ptr<T>() + r * H, H, eps);
      });
    } else {
      for_rows(rows, [&](int64_t r) {
        norm_row<T, float>(x + r * stride, weight.data_ptr<float>(),
                           out.data_ptr<float>() + r * H, H, eps);
      });
    }
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_norm(input, weight);
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == input.scalar_type(),
              "add_rms_norm: the residual is contiguous and shaped and typed as the input");
  const int64_t rows = input.size(0), H = input.size(1), stride = input.stride(0);
  auto out = at::empty({rows, H}, input.options().dtype(weight.scalar_type()));
  HOTSWAP_DISPATCH(input.scalar_type(), "add_rms_norm", [&] {
    using T = scalar_t;
    const T* x = input.data_ptr<T>();
    T* res = residual.data_ptr<T>();
    if (weight.scalar_type() == input.scalar_type()) {
      for_rows(rows, [&](int64_t r) {
        add_norm_row<T, T>(x + r * stride, res + r * H, weight.data_ptr<T>(),
                           out.data_ptr<T>() + r * H, H, eps);
      });
    } else {
      for_rows(rows, [&](int64_t r) {
        add_norm_row<T, float>(x + r * stride, res + r * H, weight.data_ptr<float>(),
                               out.data_ptr<float>() + r * H, H, eps);
      });
    }
  });
  return out;
}

// In place on qk [tokens, heads, D] (any token stride): x * cos + rotate_half(x) * sin,
// each product and the sum rounded to the dtype, with cos/sin [tokens, D] (or [tokens, 1,
// D]) in that dtype.
void rotary_embedding(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "rotary_embedding: qk [tokens, heads, D] with contiguous heads");
  const int64_t T = qk.size(0), heads = qk.size(1), D = qk.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == qk.scalar_type() &&
                  sin.scalar_type() == qk.scalar_type(),
              "rotary_embedding: cos and sin [tokens, D], contiguous, in qk's dtype");
  HOTSWAP_DISPATCH(qk.scalar_type(), "rotary_embedding", [&] {
    using S = scalar_t;
    S* base = qk.data_ptr<S>();
    const S* c = cos.data_ptr<S>();
    const S* s = sin.data_ptr<S>();
    const int64_t stride = qk.stride(0);
    for_rows(T, [&](int64_t t) {
      const S* ct = c + t * D;
      const S* st = s + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        S* x = base + t * stride + h * D;
        for (int64_t i = 0; i < half; i += kLanes) {
          const int64_t n = std::min(kLanes, half - i);
          const FVec x1 = widen<S>(x + i, n), x2 = widen<S>(x + half + i, n);
          // first half: x1 * cos + (-x2) * sin; second: x2 * cos + x1 * sin
          const FVec y1 = round_to<S>(widen<S>(ct + i, n) * x1) -
                          round_to<S>(widen<S>(st + i, n) * x2);
          const FVec y2 = round_to<S>(widen<S>(ct + half + i, n) * x2) +
                          round_to<S>(widen<S>(st + half + i, n) * x1);
          narrow<S>(y1, x + i, n);
          narrow<S>(y2, x + half + i, n);
        }
      }
    });
  });
}

}  // namespace hotswap
