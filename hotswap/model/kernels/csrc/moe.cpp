// A mixture of experts' routed experts in one call, for a CPU step: the contract of
// model/moe.py FusedExperts.forward (and of the Triton kernels on CUDA). The step's
// (token, slot) pairs are grouped by expert, stably by pair index; each expert's rows run
// gate/up, SiLU-and-mul and down; each token's slots are weighted and summed in float32,
// in slot order, and rounded once.
//
// Per expert, the products are those the torch path runs: up to kMatvecMaxRows rows of a
// bf16 model through the GEMV body, the rest through the GEMM library, so the results are that path's.
// What changes is the launching: the GEMVs of every expert a pass hits run as one
// parallel loop over (expert, weight-row chunk) items, so a decode step wakes the threads
// twice per layer instead of twice per expert hit, and no Python runs per expert. Nothing
// is read back to the caller, so a compiled decode graph can hold the call.
#include "common.h"

namespace hotswap {
namespace {

constexpr int64_t kMatvecMaxRows = 8;  // MATVEC_MAX_ROWS in model/layers.py
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
  const int64_t matvec_rows = std::is_same_v<T, at::BFloat16> ? kMatvecMaxRows : 0;
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

}  // namespace

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                     const at::Tensor& ids, const at::Tensor& weights) {
  check_inputs(x, gate_up, down, ids, weights);
  const int64_t tokens = x.size(0), top_k = ids.size(1);
  at::Tensor out = at::empty({tokens, x.size(1)}, x.options());
  if (tokens == 0 || top_k == 0) return out.zero_();
  const ExpertGroups g = group_by_expert(ids, gate_up.size(0));
  const int64_t pairs = static_cast<int64_t>(g.pairs.size());
  const at::Tensor input = x.contiguous(), mix = weights.contiguous();
  HOTSWAP_DISPATCH(x.scalar_type(), "fused_moe", [&] {
    const at::Tensor rows = gather_rows<scalar_t>(input, g, top_k);
    at::Tensor projected = at::empty({pairs, gate_up.size(1)}, x.options());
    project<scalar_t>(rows, gate_up, projected, g);
    const at::Tensor activated = silu_and_mul(projected);
    at::Tensor expert_out = at::empty({pairs, down.size(1)}, x.options());
    project<scalar_t>(activated, down, expert_out, g);
    combine<scalar_t>(expert_out, g, mix, out);
  });
  return out;
}

}  // namespace hotswap
