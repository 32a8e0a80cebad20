// Paged decode attention over the natural cache layout [blocks, block_size, kv_heads, D]:
// one query token per sequence attends to its context read in place from the paged cache
// (no gather into a copy); online softmax over the blocks in order, float32 throughout.
// Any dtype, head size and group size; bf16 caches on CPUs with AVX-512 BF16 are kept in
// tiles instead and read by paged_attention_tiles.cpp.
#include "common.h"

namespace hotswap {
namespace {

// Paged decode attention, portable path: any dtype, head size and group size.
// One task per (sequence, kv head); its G query heads share every key and value row read.
template <typename T>
void decode_portable(const T* q, const T* kc, const T* vc, const int64_t* tables,
                     const int64_t* lens, float scale, T* out, int64_t B, int64_t H,
                     int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks, int64_t q_stride) {
  const int64_t G = H / KVH, pos_stride = KVH * D, block_stride = bs * KVH * D;
  const int64_t dmain = D - D % (2 * kLanes);
  at::parallel_for(0, B * KVH, 1, [&](int64_t first, int64_t last) {
    std::vector<float> qf(G * D), acc(G * D), scores(G * bs), row_max(G), row_sum(G);
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / KVH, h = task % KVH, len = lens[b];
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q + b * q_stride + (h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(src[d]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      for (int64_t j = 0; j * bs < len; ++j) {
        const int64_t n = std::min(bs, len - j * bs);
        const T* kb = kc + tables[b * max_blocks + j] * block_stride + h * D;
        const T* vb = vc + tables[b * max_blocks + j] * block_stride + h * D;
        for (int64_t t = 0; t < n; ++t) {
          const T* k = kb + t * pos_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            FVec a(0.f);
            for (int64_t d = 0; d < dmain; d += 2 * kLanes) {
              auto [lo, hi] = load_pair<T>(k + d);
              a = at::vec::fmadd(lo, FVec::loadu(qg + d), a);
              a = at::vec::fmadd(hi, FVec::loadu(qg + d + kLanes), a);
            }
            float s = reduce_sum(a);
            for (int64_t d = dmain; d < D; ++d) s += static_cast<float>(k[d]) * qg[d];
            scores[g * bs + t] = s;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * bs;
          float m = row_max[g];
          for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
          const float correction = std::exp(row_max[g] - m);
          row_max[g] = m;
          float sum = row_sum[g] * correction;
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - m);
            sum += s[t];
          }
          row_sum[g] = sum;
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= correction;
        }
        for (int64_t t = 0; t < n; ++t) {
          const T* v = vb + t * pos_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * bs + t];
            float* ag = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(v[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* dst = out + (b * H + h * G + g) * D;
        const float inv = 1.f / row_sum[g];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
  });
}

}  // namespace

void check_block_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t num_blocks,
                  int64_t bs) {
  const int64_t B = tables.size(0), max_blocks = tables.size(1);
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(l[b] >= 1 && l[b] <= max_blocks * bs, "paged_decode_attention: context length ",
                l[b], " of sequence ", b, " does not fit its ", max_blocks, " blocks");
    for (int64_t j = 0; j * bs < l[b]; ++j)
      TORCH_CHECK(t[b * max_blocks + j] >= 0 && t[b * max_blocks + j] < num_blocks,
                  "paged_decode_attention: block ", t[b * max_blocks + j], " is not in the cache");
  }
}


at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_decode_attention: query [B, H, D], caches [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention: query rows [H, D] and the caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  query.scalar_type() == value_cache.scalar_type(),
              "paged_decode_attention: query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: block_tables and context_lens must be contiguous int64");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), KVH = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % KVH == 0, "paged_decode_attention: head shapes differ");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B,
              "paged_decode_attention: one block table and context length per sequence");
  check_block_tables(block_tables, context_lens, key_cache.size(0), bs);
  auto out = at::empty({B, H, D}, query.options());
  if (B == 0) return out;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  HOTSWAP_DISPATCH(query.scalar_type(), "paged_decode_attention", [&] {
    decode_portable<scalar_t>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                              value_cache.data_ptr<scalar_t>(), tables, lens,
                              static_cast<float>(scale), out.data_ptr<scalar_t>(), B, H, KVH, D,
                              bs, max_blocks, query.stride(0));
  });
  return out;
}

}  // namespace hotswap
