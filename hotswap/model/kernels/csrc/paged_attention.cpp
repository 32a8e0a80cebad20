// Paged decode attention over the natural cache layout [blocks, block_size, kv_heads, D]:
// one query token per sequence attends to its context read in place from the paged cache
// (no gather into a copy); online softmax over the blocks in order, float32 throughout.
// Any dtype, head size and group size; bf16 caches on CPUs with AVX-512 BF16 are kept in
// tiles instead and read by paged_attention_tiles.cpp. An FP8 cache (--kv-cache-dtype fp8,
// fp8_e5m2) holds e4m3 or e5m2 codes, read as their values / kShift (fp8_codes.h: 2^8 for
// e4m3, 1 for e5m2): the layer's k_scale and kShift fold into the query's scale, its
// v_scale and kShift into the output's, so a key or value costs no multiply of its own.
#include "fp8_codes.h"

namespace hotswap {
namespace {

// 2 * kLanes cache elements, and one, as float32: the model dtype's values, or FP8 codes'
// values / kShift.
template <typename C>
inline std::pair<FVec, FVec> load_cache_pair(const C* p) {
  if constexpr (kIsFp8Kv<C>) {
    const auto* codes = reinterpret_cast<const uint8_t*>(p);
    return {Fp8Kv<C>::widen(codes), Fp8Kv<C>::widen(codes + kLanes)};
  } else {
    return load_pair<C>(p);
  }
}
template <typename C>
inline float cache_value(C x) {
  if constexpr (kIsFp8Kv<C>)
    return Fp8Kv<C>::value(x.x);
  else
    return static_cast<float>(x);
}

// acc[0, D) += p * v[0, D), v a row of the value cache. The model dtype's caches keep the
// scalar loop (their results unchanged by the FP8 cache's arrival); FP8 rows go by vectors.
template <typename C>
inline void add_value_row(float* acc, float p, const C* v, int64_t D, int64_t dmain) {
  int64_t d = 0;
  if constexpr (kIsFp8Kv<C>) {
    const FVec pv(p);
    for (; d < dmain; d += 2 * kLanes) {
      auto [lo, hi] = load_cache_pair<C>(v + d);
      at::vec::fmadd(lo, pv, FVec::loadu(acc + d)).store(acc + d);
      at::vec::fmadd(hi, pv, FVec::loadu(acc + d + kLanes)).store(acc + d + kLanes);
    }
  }
  for (; d < D; ++d) acc[d] += p * cache_value<C>(v[d]);
}

// Paged decode attention, portable path: any dtype, head size and group size; C, the
// cache's element (T, or c10::Float8_e4m3fn / c10::Float8_e5m2 for FP8 codes). `scale`
// multiplies the query (the softmax scale, times an FP8 cache's k_scale * kShift),
// out_scale the output (1, or v_scale * kShift).
// One task per (sequence, kv head); its G query heads share every key and value row read.
template <typename T, typename C>
void decode_portable(const T* q, const C* kc, const C* vc, const int64_t* tables,
                     const int64_t* lens, float scale, float out_scale, T* out, int64_t B,
                     int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks,
                     int64_t q_stride) {
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
        const C* kb = kc + tables[b * max_blocks + j] * block_stride + h * D;
        const C* vb = vc + tables[b * max_blocks + j] * block_stride + h * D;
        for (int64_t t = 0; t < n; ++t) {
          const C* k = kb + t * pos_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            FVec a(0.f);
            for (int64_t d = 0; d < dmain; d += 2 * kLanes) {
              auto [lo, hi] = load_cache_pair<C>(k + d);
              a = at::vec::fmadd(lo, FVec::loadu(qg + d), a);
              a = at::vec::fmadd(hi, FVec::loadu(qg + d + kLanes), a);
            }
            float s = reduce_sum(a);
            for (int64_t d = dmain; d < D; ++d) s += cache_value<C>(k[d]) * qg[d];
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
          const C* v = vb + t * pos_stride;
          for (int64_t g = 0; g < G; ++g)
            add_value_row<C>(acc.data() + g * D, scores[g * bs + t], v, D, dmain);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* dst = out + (b * H + h * G + g) * D;
        const float inv = out_scale / row_sum[g];
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
                                  const at::Tensor& context_lens, double scale, double k_scale,
                                  double v_scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_decode_attention: query [B, H, D], caches [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention: query rows [H, D] and the caches must be contiguous");
  const bool e4m3 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool e5m2 = key_cache.scalar_type() == at::kFloat8_e5m2, fp8 = e4m3 || e5m2;
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                  (fp8 || query.scalar_type() == key_cache.scalar_type()),
              "paged_decode_attention: the caches must share the query's dtype or be float8_e4m3fn "
              "or float8_e5m2");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0),
              "paged_decode_attention: k_scale and v_scale apply to FP8 caches only");
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
    auto run = [&](auto* kc, auto* vc, float shift) {
      using C = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
      decode_portable<scalar_t, C>(query.data_ptr<scalar_t>(), kc, vc, tables, lens,
                                   static_cast<float>(scale * k_scale * shift),
                                   static_cast<float>(v_scale * shift), out.data_ptr<scalar_t>(), B, H,
                                   KVH, D, bs, max_blocks, query.stride(0));
    };
    if (e4m3)
      run(key_cache.data_ptr<c10::Float8_e4m3fn>(), value_cache.data_ptr<c10::Float8_e4m3fn>(),
          Fp8Kv<c10::Float8_e4m3fn>::kShift);
    else if (e5m2)
      run(key_cache.data_ptr<c10::Float8_e5m2>(), value_cache.data_ptr<c10::Float8_e5m2>(),
          Fp8Kv<c10::Float8_e5m2>::kShift);
    else
      run(key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), 1.f);
  });
  return out;
}

}  // namespace hotswap
