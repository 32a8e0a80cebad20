// Paged decode attention: one query token per sequence attends to its context read in
// place from the paged cache (no gather into a copy); online softmax over the blocks in
// order, float32 throughout.
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

#if defined(__AVX512BF16__)
// out[e] = sum of the lanes of v[slot(e)], slot(e) = e % 4 + {0, 8, 4, 12}[e / 4]: sixteen
// horizontal sums in 45 instructions instead of sixteen separate reductions.
inline __m512 hsum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88),
                         _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD));
  const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x44), _mm512_shuffle_ps(z0, z1, 0xEE));
}
constexpr int kSlot[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
constexpr int64_t kPrefetchAhead = 16;  // positions: the next chunk, into L2 (measured best)
#define kPrefetchHint _MM_HINT_T1

// bf16 fast path: scores as BF16 dot products (exact products, float32 sums), sixteen
// positions at a time; values weighted by the bf16-rounded probabilities, also as BF16
// dot products with float32 sums. A task owns a sequence's kv heads
// `heads` at a time, so with all of them it reads each position's row of every head in
// one pass, front to back, and prefetches the next sixteen positions (the hardware
// prefetcher cannot follow the block table).
template <int D>
struct DecodeTask {
  static constexpr int QV = D / 32;  // bf16 vectors per head row
  static constexpr int FV = D / 16;  // float vectors per head row
  const at::BFloat16 *q, *kc, *vc;
  const int64_t *tables, *lens;
  float scale;
  at::BFloat16* out;
  int64_t H, KVH, G, bs, max_blocks, q_stride;

  void run(int64_t b, int64_t h0, int64_t heads, float* acc, uint16_t* probs, float* row_max,
           float* row_sum, __m512i* pairs) const {
    const int64_t len = lens[b], pos_stride = KVH * D, block_stride = bs * KVH * D;
    const int64_t rows = heads * G;  // query heads this task computes
    for (int64_t r = 0; r < rows; ++r) {
      row_max[r] = kNegInf;
      row_sum[r] = 0.f;
      for (int i = 0; i < FV; ++i) _mm512_storeu_ps(acc + r * D + 16 * i, _mm512_setzero_ps());
    }
    for (int64_t start = 0; start < len; start += 16) {
      // sixteen positions never straddle a block: the block size is a multiple of 16
      const int64_t n = std::min<int64_t>(16, len - start);
      const auto chunk = [&](int64_t pos) {
        return tables[b * max_blocks + pos / bs] * block_stride + (pos % bs) * pos_stride;
      };
      const int64_t base = chunk(start);
      // the same head rows kPrefetchAhead positions on, or none past the end
      const int64_t ahead = start + kPrefetchAhead < len ? chunk(start + kPrefetchAhead) : -1;
      for (int64_t hh = 0; hh < heads; ++hh)
        score_chunk(b, h0 + hh, kc + base + (h0 + hh) * D, n, acc + hh * G * D,
                    probs + hh * G * 16, row_max + hh * G, row_sum + hh * G,
                    ahead < 0 ? -1 : ahead + (h0 + hh) * D);
      for (int64_t hh = 0; hh < heads; ++hh)
        accumulate_values(vc + base + (h0 + hh) * D, n, probs + hh * G * 16, acc + hh * G * D,
                          pairs);
    }
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* dst = out + b * H * D + (h0 * G + r) * D;
      const float inv = 1.f / row_sum[r];
      for (int64_t slot = 0; slot < D; ++slot)
        dst[dim_of(slot)] = static_cast<at::BFloat16>(acc[r * D + slot] * inv);
    }
  }

  // One position's key and value rows of one head into cache, ahead of their use: spread
  // over the work, a line per line read, so the misses in flight stay within what the
  // core can track (a burst of a whole chunk's lines would stall it instead).
  void prefetch_row(int64_t offset) const {
    for (int64_t byte = 0; byte < D * 2; byte += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kc + offset) + byte, kPrefetchHint);
      _mm_prefetch(reinterpret_cast<const char*>(vc + offset) + byte, kPrefetchHint);
    }
  }

  // Scores of up to sixteen positions for kv head h's G query heads; online-softmax update.
  void score_chunk(int64_t b, int64_t h, const at::BFloat16* kb, int64_t n, float* acc,
                   uint16_t* probs, float* row_max, float* row_sum, int64_t ahead) const {
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    if (ahead >= 0)
      for (int64_t e = 0; e < 16; ++e) prefetch_row(ahead + e * KVH * D);
    for (int64_t g = 0; g < G; ++g) {
      const at::BFloat16* qrow = q + b * q_stride + (h * G + g) * D;
      __m512bh qv[QV];
      for (int i = 0; i < QV; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qrow + 32 * i);
      __m512 dots[16];
      for (int e = 0; e < 16; ++e) {
        __m512 a = _mm512_setzero_ps();
        if (e < n) {
          const at::BFloat16* k = kb + e * KVH * D;
          for (int i = 0; i < QV; ++i)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + 32 * i), qv[i]);
        }
        dots[kSlot[e]] = a;
      }
      __m512 s = _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale));
      s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf), s);
      const float m = std::max(row_max[g], _mm512_reduce_max_ps(s));
      const float correction = std::exp(row_max[g] - m);
      row_max[g] = m;
      // Probabilities in bf16 for the value products (as torch's flash attention does for
      // bf16); the sum is of the rounded values, so the weights applied sum to one.
      const __m256bh p = _mm512_cvtneps_pbh((FVec(s) - FVec(m)).exp());
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * 16), (__m256i)p);
      row_sum[g] = row_sum[g] * correction + _mm512_reduce_add_ps(_mm512_cvtpbh_ps(p));
      if (correction != 1.f) {
        const __m512 c = _mm512_set1_ps(correction);
        float* ag = acc + g * D;
        for (int i = 0; i < FV; ++i)
          _mm512_storeu_ps(ag + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * i), c));
      }
    }
  }

  // acc[g] += sum over the chunk's n positions of probs[g][e] * v[e], for one kv head, as
  // BF16 dot products over pairs of positions: the value rows are interleaved pairwise
  // once (`pairs`), then each query head's sums stay in registers. acc is kept in the
  // interleaved order (see `unpermute`).
  void accumulate_values(const at::BFloat16* v, int64_t n, const uint16_t* probs, float* acc,
                         __m512i* pairs) const {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t e = 0; e < n; e += 2) {
      for (int i = 0; i < QV; ++i) {
        const __m512i a = _mm512_loadu_si512(v + e * KVH * D + 32 * i);
        const __m512i b = e + 1 < n ? _mm512_loadu_si512(v + (e + 1) * KVH * D + 32 * i) : zero;
        pairs[(e / 2) * FV + 2 * i] = _mm512_unpacklo_epi16(a, b);
        pairs[(e / 2) * FV + 2 * i + 1] = _mm512_unpackhi_epi16(a, b);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* ag = acc + g * D;
      __m512 sum[FV];
      for (int i = 0; i < FV; ++i) sum[i] = _mm512_loadu_ps(ag + 16 * i);
      const uint16_t* pg = probs + g * 16;
      for (int64_t e = 0; e < n; e += 2) {
        const uint32_t second = e + 1 < n ? pg[e + 1] : 0;
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pg[e] | second << 16));
        for (int i = 0; i < FV; ++i)
          sum[i] = _mm512_dpbf16_ps(sum[i], (__m512bh)pairs[(e / 2) * FV + i], p);
      }
      for (int i = 0; i < FV; ++i) _mm512_storeu_ps(ag + 16 * i, sum[i]);
    }
  }

  // Accumulator lane -> head dimension: vector 2i (unpacklo of bf16 chunk i) holds, in
  // 128-bit lane L, dims 32i + 8L + 0..3; vector 2i + 1 (unpackhi) dims 32i + 8L + 4..7.
  static int64_t dim_of(int64_t slot) {
    const int64_t vec = slot / 16, lane = slot % 16;
    return 32 * (vec / 2) + 8 * (lane / 4) + 4 * (vec % 2) + lane % 4;
  }
};

template <int D>
void decode_bf16(const DecodeTask<D>& task, int64_t B) {
  // Whole sequences per task when there are enough of them to share out; else one kv
  // head per task, so a lone sequence still uses every thread.
  const int64_t heads = B >= 4 * at::get_num_threads() ? task.KVH : 1;
  const int64_t groups = task.KVH / heads;
  at::parallel_for(0, B * groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> acc(heads * task.G * D), row_max(heads * task.G), row_sum(heads * task.G);
    std::vector<uint16_t> probs(heads * task.G * 16);
    std::vector<__m512i> pairs(8 * DecodeTask<D>::FV);  // 16 positions' values, pairwise
    for (int64_t t = first; t < last; ++t)
      task.run(t / groups, (t % groups) * heads, heads, acc.data(), probs.data(),
               row_max.data(), row_sum.data(), pairs.data());
  });
}
#endif

void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t num_blocks,
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

}  // namespace

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
  check_tables(block_tables, context_lens, key_cache.size(0), bs);
  auto out = at::empty({B, H, D}, query.options());
  if (B == 0) return out;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
#if defined(__AVX512BF16__)
  if (query.scalar_type() == at::kBFloat16 && bs % 16 == 0 && (D == 64 || D == 128)) {
    const auto* q = query.data_ptr<at::BFloat16>();
    const auto* kc = key_cache.data_ptr<at::BFloat16>();
    const auto* vc = value_cache.data_ptr<at::BFloat16>();
    auto* o = out.data_ptr<at::BFloat16>();
    const float s = static_cast<float>(scale);
    const int64_t G = H / KVH, qs = query.stride(0);
    if (D == 64)
      decode_bf16<64>({q, kc, vc, tables, lens, s, o, H, KVH, G, bs, max_blocks, qs}, B);
    else
      decode_bf16<128>({q, kc, vc, tables, lens, s, o, H, KVH, G, bs, max_blocks, qs}, B);
    return out;
  }
#endif
  HOTSWAP_DISPATCH(query.scalar_type(), "paged_decode_attention", [&] {
    decode_portable<scalar_t>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                              value_cache.data_ptr<scalar_t>(), tables, lens,
                              static_cast<float>(scale), out.data_ptr<scalar_t>(), B, H, KVH, D,
                              bs, max_blocks, query.stride(0));
  });
  return out;
}

}  // namespace hotswap
