// A mixture of experts' routed experts in one call, for a CPU step: the contract of
// model/moe.py FusedExperts.forward (and of the Triton kernels on CUDA). The step's
// (token, slot) pairs are grouped by expert, stably by pair index; each expert's rows run
// gate/up, SiLU-and-mul and down; each token's slots are weighted and summed in float32,
// in slot order, and rounded once.
//
// Per expert, the products are those the torch path runs: up to kExpertMatvecRows rows of a
// bf16 model through the GEMV body, the rest through the GEMM library, so the results are that path's.
// What changes is the launching: the GEMVs of every expert a pass hits run as one
// parallel loop over (expert, weight-row chunk) items, so a decode step wakes the threads
// twice per layer instead of twice per expert hit, and no Python runs per expert. Nothing
// is read back to the caller, so a compiled decode graph can hold the call.
#include "common.h"
#include "fp8_rows.h"

namespace hotswap {
namespace {

// EXPERT_MATVEC_MAX_ROWS in model/moe.py, for bf16 and FP8 experts: an expert's matrix is
// small, and the GEMM library's fixed cost per call weighs more on it than on a dense
// layer's (the GEMVs are ahead to 16 rows, where a dense layer's crosses over near 12).
constexpr int64_t kExpertMatvecRows = 16;
constexpr int64_t kChunkRows = 64;     // weight rows per GEMV work item
constexpr int64_t kCombineElements = 16384;  // output elements a combine task takes at least

// The step's pairs (pair p = token * top_k + slot) grouped by expert; a pair whose id is
// -1 (another rank's expert, under expert parallelism) has no position and adds nothing.
struct ExpertGroups {
  std::vector<int64_t> pairs;     // the pair at each grouped position
  std::vector<int64_t> position;  // each pair's grouped position (-1: skipped)
  std::vector<int64_t> experts, starts, counts;  // the experts hit, ascending
};

ExpertGroups group_by_expert(const at::Tensor& ids, int64_t num_experts) {
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t n = flat.numel();
  std::vector<int64_t> next(num_experts, 0);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(id[p] >= -1 && id[p] < num_experts, "fused_moe: expert id ", id[p],
                " is not below the number of experts (", num_experts, ") or -1");
    if (id[p] >= 0) ++next[id[p]];
  }
  ExpertGroups g;
  int64_t offset = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = next[e];
    if (count) {
      g.experts.push_back(e);
      g.starts.push_back(offset);
      g.counts.push_back(count);
    }
    next[e] = offset;
    offset += count;
  }
  g.pairs.resize(offset);
  g.position.assign(n, -1);
  for (int64_t p = 0; p < n; ++p) {
    if (id[p] < 0) continue;
    const int64_t pos = next[id[p]]++;
    g.pairs[pos] = p;
    g.position[p] = pos;
  }
  return g;
}

// out[pos] = in[pos] @ weight[expert of pos]^T for every grouped position.
template <typename T>
void project(const at::Tensor& in, const at::Tensor& weight, at::Tensor& out,
             const ExpertGroups& g) {
  const int64_t N = weight.size(1), K = weight.size(2);
  std::vector<std::pair<int64_t, int64_t>> items;  // (group, first weight row)
  // as model/layers.py linear(): the GEMV serves bf16 weights only (the GEMM library's
  // float32 products already stream near memory speed)
  const int64_t matvec_rows = std::is_same_v<T, at::BFloat16> ? kExpertMatvecRows : 0;
  for (size_t i = 0; i < g.experts.size(); ++i) {
    if (g.counts[i] > matvec_rows) {  // the GEMM library parallelises within
      at::Tensor rows = out.narrow(0, g.starts[i], g.counts[i]);
      at::mm_out(rows, in.narrow(0, g.starts[i], g.counts[i]), weight[g.experts[i]].t());
      continue;
    }
    for (int64_t n = 0; n < N; n += kChunkRows) items.emplace_back(i, n);
  }
  const T* x = in.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const auto [i, n0] = items[item];
      const int64_t start = g.starts[i];
      gemv_range<T>(x + start * K, g.counts[i], w + g.experts[i] * N * K, y + start * N, n0,
                    std::min(N, n0 + kChunkRows), N, K);
    }
  });
}

// A layer's FP8 experts: codes [experts, N, K], scales [experts, scale rows, KB]; within an
// expert, output row n's scale row is n / block_n (model/quantized.py Fp8Stack).
struct Fp8Experts {
  const uint8_t* codes;
  const float* scale;
  std::vector<int32_t> rows;  // [N]
  int64_t N, K, KB, scale_rows, block_k;

  Fp8Experts(const at::Tensor& c, const at::Tensor& s, int64_t block_n, int64_t bk)
      : codes(static_cast<const uint8_t*>(c.data_ptr())), scale(s.data_ptr<float>()),
        N(c.size(1)), K(c.size(2)), KB(s.size(2)), scale_rows(s.size(1)), block_k(bk) {
    rows.resize(N);
    for (int64_t n = 0; n < N; ++n) rows[n] = static_cast<int32_t>(n / block_n);
  }
  Fp8Weight expert(int64_t e) const {
    return {codes + e * N * K, scale + e * scale_rows * KB, rows.data(), N, K, KB, block_k};
  }
};

// As project(), over FP8 experts, with the FP8 linear layer's products (model/quantized.py
// fp8_linear): up to kExpertMatvecRows rows through its GEMV, for any activation dtype; more
// through the expert's dequantized weight and the GEMM library.
template <typename T>
void project_fp8(const at::Tensor& in, const Fp8Experts& w, at::Tensor& out,
                 const ExpertGroups& g) {
  std::vector<std::pair<int64_t, int64_t>> items;  // (group, first weight row)
  std::vector<size_t> matvec_groups;
  for (size_t i = 0; i < g.experts.size(); ++i) {
    if (g.counts[i] > kExpertMatvecRows) {
      at::Tensor weight = at::empty({w.N, w.K}, in.options());
      fp8_dequantize_into(w.expert(g.experts[i]), weight);
      at::Tensor rows = out.narrow(0, g.starts[i], g.counts[i]);
      at::mm_out(rows, in.narrow(0, g.starts[i], g.counts[i]), weight.t());
      continue;
    }
    matvec_groups.push_back(i);
    for (int64_t n = 0; n < w.N; n += kChunkRows) items.emplace_back(i, n);
  }
  if (items.empty()) return;
  const Fp8Rows rows = fp8_prepare_rows(in, w.block_k);
  at::Tensor y = rows.vbmi ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const auto [i, n0] = items[item];
      fp8_gemv_rows(rows, g.starts[i], g.counts[i], w.expert(g.experts[i]), n0,
                    std::min(w.N, n0 + kChunkRows), y);
    }
  });
  if (rows.vbmi) return;
  for (const size_t i : matvec_groups)  // rounded once, as the linear layer's .to(dtype)
    out.narrow(0, g.starts[i], g.counts[i]).copy_(y.narrow(0, g.starts[i], g.counts[i]));
}

// Each grouped position's token row of x, in grouped order.
template <typename T>
at::Tensor gather_rows(const at::Tensor& x, const ExpertGroups& g, int64_t top_k) {
  const int64_t H = x.size(1), n = static_cast<int64_t>(g.pairs.size());
  at::Tensor rows = at::empty({n, H}, x.options());
  const T* src = x.data_ptr<T>();
  T* dst = rows.data_ptr<T>();
  for (int64_t pos = 0; pos < n; ++pos)
    std::copy_n(src + (g.pairs[pos] / top_k) * H, H, dst + pos * H);
  return rows;
}

// out[t] = sum over slots j, in order, of weights[t, j] * expert_out[position of (t, j)],
// in float32 (each product rounded, as torch's separate multiply and sum), rounded once.
template <typename T>
void combine(const at::Tensor& expert_out, const ExpertGroups& g, const at::Tensor& weights,
             at::Tensor& out) {
  const int64_t tokens = out.size(0), H = out.size(1), top_k = weights.size(1);
  const T* y = expert_out.data_ptr<T>();
  const float* w = weights.data_ptr<float>();
  T* dst = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kCombineElements / std::max<int64_t>(H, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; h += kLanes) {
        const int64_t n = std::min(kLanes, H - h);
        FVec acc(0.f);
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t pos = g.position[t * top_k + j];
          if (pos < 0) continue;  // another rank's expert
          const T* row = y + pos * H;
          acc = acc + FVec(w[t * top_k + j]) * widen<T>(row + h, n);
        }
        narrow<T>(acc, dst + t * H + h, n);
      }
    }
  });
}

void check_inputs(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                  const at::Tensor& ids, const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3,
              "fused_moe: x [tokens, hidden], gate_up [experts, 2 x inter, hidden], "
              "down [experts, hidden, inter]");
  TORCH_CHECK(gate_up.size(2) == x.size(1) && down.size(1) == x.size(1) &&
                  gate_up.size(1) == 2 * down.size(2) && gate_up.size(0) == down.size(0),
              "fused_moe: the experts' shapes do not match the input's");
  TORCH_CHECK(x.scalar_type() == gate_up.scalar_type() && x.scalar_type() == down.scalar_type(),
              "fused_moe: input and experts' dtypes differ");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(),
              "fused_moe: the experts' weights must be contiguous");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "fused_moe: ids [tokens, top_k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "fused_moe: weights [tokens, top_k] float32");
}

void check_fp8_scales(const at::Tensor& codes, const at::Tensor& scale, int64_t block_n,
                      int64_t block_k) {
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && codes.is_contiguous(),
              "fused_moe_fp8: the experts' codes must be contiguous float8_e4m3fn");
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == codes.size(0) &&
                  scale.size(1) == (codes.size(1) + block_n - 1) / block_n &&
                  scale.size(2) == (codes.size(2) + block_k - 1) / block_k,
              "fused_moe_fp8: scales must be contiguous float32 [experts, ceil(rows / block_n), "
              "ceil(columns / block_k)]");
}

void check_fp8_inputs(const at::Tensor& x, const at::Tensor& gate_up,
                      const at::Tensor& gate_up_scale, const at::Tensor& down,
                      const at::Tensor& down_scale, const at::Tensor& ids,
                      const at::Tensor& weights, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 &&
                  gate_up.size(2) == x.size(1) && down.size(1) == x.size(1) &&
                  gate_up.size(1) == 2 * down.size(2) && gate_up.size(0) == down.size(0),
              "fused_moe_fp8: x [tokens, hidden], gate_up [experts, 2 x inter, hidden], "
              "down [experts, hidden, inter]");
  TORCH_CHECK(block_n > 0 && block_k > 0 && block_k % 16 == 0,
              "fused_moe_fp8: block_n must be positive, block_k a multiple of 16");
  check_fp8_scales(gate_up, gate_up_scale, block_n, block_k);
  check_fp8_scales(down, down_scale, block_n, block_k);
  TORCH_CHECK(x.is_floating_point() && x.scalar_type() != at::kFloat8_e4m3fn,
              "fused_moe_fp8: x must be the activation dtype");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "fused_moe_fp8: ids [tokens, top_k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "fused_moe_fp8: weights [tokens, top_k] float32");
}

}  // namespace

namespace {

// gate/up, SiLU-and-mul, down and the weighted sum of slots over the step's pairs; `up`
// and `down` run a projection (input rows, output rows, groups) as project() does.
template <typename T, typename Up, typename Down>
at::Tensor run_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       int64_t num_experts, int64_t up_rows, Up&& up, Down&& down) {
  const int64_t tokens = x.size(0), top_k = ids.size(1);
  at::Tensor out = at::empty({tokens, x.size(1)}, x.options());
  if (tokens == 0 || top_k == 0) return out.zero_();
  const ExpertGroups g = group_by_expert(ids, num_experts);
  const int64_t pairs = static_cast<int64_t>(g.pairs.size());
  const at::Tensor rows = gather_rows<T>(x.contiguous(), g, top_k);
  at::Tensor projected = at::empty({pairs, up_rows}, x.options());
  up(rows, projected, g);
  const at::Tensor activated = silu_and_mul(projected);
  at::Tensor expert_out = at::empty({pairs, x.size(1)}, x.options());
  down(activated, expert_out, g);
  combine<T>(expert_out, g, weights.contiguous(), out);
  return out;
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                     const at::Tensor& ids, const at::Tensor& weights) {
  check_inputs(x, gate_up, down, ids, weights);
  at::Tensor out;
  HOTSWAP_DISPATCH(x.scalar_type(), "fused_moe", [&] {
    out = run_experts<scalar_t>(
        x, ids, weights, gate_up.size(0), gate_up.size(1),
        [&](const at::Tensor& in, at::Tensor& y, const ExpertGroups& g) {
          project<scalar_t>(in, gate_up, y, g);
        },
        [&](const at::Tensor& in, at::Tensor& y, const ExpertGroups& g) {
          project<scalar_t>(in, down, y, g);
        });
  });
  return out;
}

at::Tensor fused_moe_fp8(const at::Tensor& x, const at::Tensor& gate_up,
                         const at::Tensor& gate_up_scale, const at::Tensor& down,
                         const at::Tensor& down_scale, const at::Tensor& ids,
                         const at::Tensor& weights, int64_t block_n, int64_t block_k) {
  check_fp8_inputs(x, gate_up, gate_up_scale, down, down_scale, ids, weights, block_n, block_k);
  const Fp8Experts up_w(gate_up, gate_up_scale, block_n, block_k);
  const Fp8Experts down_w(down, down_scale, block_n, block_k);
  at::Tensor out;
  HOTSWAP_DISPATCH(x.scalar_type(), "fused_moe_fp8", [&] {
    out = run_experts<scalar_t>(
        x, ids, weights, gate_up.size(0), gate_up.size(1),
        [&](const at::Tensor& in, at::Tensor& y, const ExpertGroups& g) {
          project_fp8<scalar_t>(in, up_w, y, g);
        },
        [&](const at::Tensor& in, at::Tensor& y, const ExpertGroups& g) {
          project_fp8<scalar_t>(in, down_w, y, g);
        });
  });
  return out;
}

}  // namespace hotswap
