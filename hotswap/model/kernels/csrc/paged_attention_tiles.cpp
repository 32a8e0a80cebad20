// Paged decode attention over a bf16 cache kept in 16-position tiles, laid out so that
// vector instructions read them without rearranging:
//
//   key tile   [D/2][16][2]  dims 2i, 2i+1 of 16 positions: a vector of 16 positions
//   value tile [8][D][2]     positions 2e, 2e+1 of every dim: a vector of 16 dims
//
// cache [blocks, kv_heads, block_size / 16, 16 * D]: one head's tile is 16 * D contiguous
// values. A query's scores for 16 positions come out of D float32 FMAs as one vector (the
// key tile's bf16 pairs split into two float vectors by a shift and a mask: no horizontal
// sums, and on this CPU two FMAs a cycle beat one BF16 dot product per two), and the
// values are weighted by BF16 dot products over pairs of positions. The softmax takes two
// passes over the scores of the whole context (kept in a per-thread buffer): no running
// rescale of the accumulators. Float32 sums throughout; probabilities are rounded to bf16
// for the value products (as torch's flash attention does for bf16) and summed as rounded.
//
// An FP8 cache (--kv-cache-dtype fp8 or fp8_e5m2, bf16 queries) keeps e4m3 or e5m2 codes
// in the same tiles, a byte each: a key line of 32 codes widens to 32 float16 values (the
// codes' values / kShift, exact: fp8_codes.h; e4m3 by a sign extension, shift and mask,
// e5m2 by a shift alone) whose even and odd lanes become the two float vectors; a value
// line the same, the pair of positions then weighted by two FMAs instead of one BF16 dot
// product. The layer's k_scale and kShift fold into the query's scale, v_scale and kShift
// into the output's: half the bytes read, no multiply per element.
#include "fp8_codes.h"

namespace hotswap {

#if defined(__AVX512BF16__)
namespace {

// e^x for x <= 0 (-inf gives 0), relative error ~2e-7 (the result is rounded to bf16):
// 2^(x log2 e) as an integer power (scalef) times a degree-6 polynomial on [-0.5, 0.5].
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Positions a prefetch runs ahead, in tiles (4 measured best of 1-4; the hardware
// prefetcher cannot follow the block table). Issued a line or two per step of the dot
// products, so the misses in flight stay within what one core tracks.
constexpr int64_t kPrefetchTiles = 4;

// 32 cache elements (16 pairs) as two float vectors: the even elements, the odd ones.
inline std::pair<__m512, __m512> split_pairs(const at::BFloat16* p) {
  const __m512i x = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
// 32 float16 values (as 16-bit lanes) as two float vectors: the even lanes, the odd ones.
inline std::pair<__m512, __m512> split_halves(__m512i half) {
  return {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(half)),
          _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(half, 16)))};
}
inline std::pair<__m512, __m512> split_pairs(const c10::Float8_e4m3fn* p) {  // codes / 2^8
  const __m512i c = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return split_halves(_mm512_and_si512(_mm512_slli_epi16(c, 7), _mm512_set1_epi16(-0x4001)));
}
inline std::pair<__m512, __m512> split_pairs(const c10::Float8_e5m2* p) {  // codes' values
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return split_halves(_mm512_slli_epi16(c, 8));
}

// C: the cache's element, at::BFloat16, c10::Float8_e4m3fn or c10::Float8_e5m2.
template <int D, int G, typename C>
struct TileTask {
  static constexpr int FV = D / 16;  // float vectors per head row
  static constexpr int TILE = 16 * D;
  static constexpr int TILE_LINES = TILE * static_cast<int>(sizeof(C)) / 64;
  static constexpr int ROWS = FV * G <= 16 ? G : 16 / FV;  // query heads per value pass
  const at::BFloat16* q;
  const C *kc, *vc;
  const int64_t *tables, *lens;
  float scale, out_scale;
  at::BFloat16* out;
  int64_t H, KVH, tiles_per_block, max_blocks, q_stride;

  int64_t tile(int64_t b, int64_t h, int64_t c) const {
    const int64_t block = tables[b * max_blocks + c / tiles_per_block];
    return ((block * KVH + h) * tiles_per_block + c % tiles_per_block) * TILE;
  }

  // Sequence b, kv head h. scores: [G][len16] floats, probs: [G][len16] bf16, acc: [G][D].
  void run(int64_t b, int64_t h, float* scores, uint16_t* probs, float* acc) const {
    const int64_t len = lens[b], tiles = (len + 15) / 16, len16 = tiles * 16;
    float inv_sum[G];
    score_pass(b, h, len, tiles, len16, scores, probs, inv_sum);
    for (int i = 0; i < G * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
    for (int64_t c = 0; c < tiles; ++c) {
      const int pairs = static_cast<int>(std::min<int64_t>(16, len - 16 * c) + 1) / 2;
      const C* vt = vc + tile(b, h, c);
      const char* ahead = reinterpret_cast<const char*>(vc + tile(b, h, std::min(c + kPrefetchTiles, tiles - 1)));
      for (int g0 = 0; g0 < G; g0 += ROWS)
        value_rows(vt, pairs, probs + g0 * len16 + 16 * c, len16, acc + g0 * D,
                   std::min(ROWS, G - g0), g0 == 0 ? ahead : nullptr);
    }
    for (int g = 0; g < G; ++g) {
      at::BFloat16* dst = out + b * H * D + (h * G + g) * D;
      const __m512 inv = _mm512_set1_ps(inv_sum[g] * out_scale);
      for (int i = 0; i < FV; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * i), inv)));
    }
  }

  // Every position's scaled score (-inf past the end), then bf16 probabilities and 1/sum.
  void score_pass(int64_t b, int64_t h, int64_t len, int64_t tiles, int64_t len16, float* scores,
                  uint16_t* probs, float* inv_sum) const {
    alignas(64) float qf[G * D];  // the queries in float32 (exact)
    for (int i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[b * q_stride + h * G * D + i]);
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512 row_max[G];
    for (int g = 0; g < G; ++g) row_max[g] = _mm512_set1_ps(kNegInf);
    for (int64_t c = 0; c < tiles; ++c) {
      const C* kt = kc + tile(b, h, c);
      const char* ahead = reinterpret_cast<const char*>(kc + tile(b, h, std::min(c + kPrefetchTiles, tiles - 1)));
      __m512 even[G], odd[G];  // even and odd dims: two chains per query head
      for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_ps();
      for (int i = 0; i < D / 2; ++i) {
        if (i < TILE_LINES) _mm_prefetch(ahead + 64 * i, _MM_HINT_T0);
        const auto [k_even, k_odd] = split_pairs(kt + 32 * i);  // dims 2i, 2i+1 of 16 positions
        for (int g = 0; g < G; ++g) {
          even[g] = _mm512_fmadd_ps(k_even, _mm512_set1_ps(qf[g * D + 2 * i]), even[g]);
          odd[g] = _mm512_fmadd_ps(k_odd, _mm512_set1_ps(qf[g * D + 2 * i + 1]), odd[g]);
        }
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, len - 16 * c)) - 1u);
      for (int g = 0; g < G; ++g) {
        const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf),
                                              _mm512_mul_ps(_mm512_add_ps(even[g], odd[g]), scale_v));
        row_max[g] = _mm512_max_ps(row_max[g], s);
        _mm512_storeu_ps(scores + g * len16 + 16 * c, s);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(row_max[g]));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = g * len16; i < (g + 1) * len16; i += 16) {
        const __m256bh p = _mm512_cvtneps_pbh(exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + i), m)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + i), (__m256i)p);
        sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(p));
      }
      inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
    }
  }

  // acc[r] += sum over the tile's positions of p[r][pos] * v[pos] for `rows` query heads,
  // two positions per dot product (probabilities past the end are exactly 0).
  void value_rows(const C* vt, int pairs, const uint16_t* p, int64_t len16, float* acc,
                  int rows, const char* ahead) const {
    constexpr int kPairBytes = 2 * D * static_cast<int>(sizeof(C));  // one pair of positions
    __m512 sums[ROWS][FV];
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < FV; ++i) sums[r][i] = _mm512_loadu_ps(acc + r * D + 16 * i);
    const uint32_t* pp = reinterpret_cast<const uint32_t*>(p);
    for (int e = 0; e < 8; ++e) {
      if (ahead != nullptr)
        for (int line = 0; line < kPairBytes / 64; ++line) _mm_prefetch(ahead + kPairBytes * e + 64 * line, _MM_HINT_T0);
      if (e >= pairs) continue;
      for (int r = 0; r < rows; ++r) {
        const uint32_t pair = pp[r * len16 / 2 + e];
        if constexpr (std::is_same_v<C, at::BFloat16>) {
          const __m512bh pr = (__m512bh)_mm512_set1_epi32(pair);
          for (int i = 0; i < FV; ++i)
            sums[r][i] = _mm512_dpbf16_ps(sums[r][i], (__m512bh)_mm512_loadu_si512(vt + 2 * D * e + 32 * i), pr);
        } else {  // the pair's probabilities as floats, two FMAs per line of values
          const __m512 p_even = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair << 16)));
          const __m512 p_odd = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair & 0xFFFF0000u)));
          for (int i = 0; i < FV; ++i) {
            const auto [v_even, v_odd] = split_pairs(vt + 2 * D * e + 32 * i);
            sums[r][i] = _mm512_fmadd_ps(v_odd, p_odd, _mm512_fmadd_ps(v_even, p_even, sums[r][i]));
          }
        }
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < FV; ++i) _mm512_storeu_ps(acc + r * D + 16 * i, sums[r][i]);
  }
};

template <int D, int G, typename C>
void decode_tiles(const TileTask<D, G, C>& task, int64_t B) {
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, task.lens[b]);
  const int64_t len16 = (longest + 15) / 16 * 16;
  // One task per (sequence, kv head): a lone sequence still uses every thread.
  at::parallel_for(0, B * task.KVH, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(G * len16), acc(G * D);
    std::vector<uint16_t> probs(G * len16);
    for (int64_t t = first; t < last; ++t)
      task.run(t / task.KVH, t % task.KVH, scores.data(), probs.data(), acc.data());
  });
}

template <int D, typename C>
void decode_for_group(int64_t G, const at::BFloat16* q, const C* kc, const C* vc,
                      const int64_t* tables, const int64_t* lens, float scale, float out_scale,
                      at::BFloat16* out, int64_t H, int64_t KVH, int64_t tpb, int64_t max_blocks,
                      int64_t qs, int64_t B) {
  switch (G) {
#define HOTSWAP_GROUP(g) \
  case g: return decode_tiles<D, g, C>({q, kc, vc, tables, lens, scale, out_scale, out, H, KVH, tpb, max_blocks, qs}, B);
    HOTSWAP_GROUP(1) HOTSWAP_GROUP(2) HOTSWAP_GROUP(3) HOTSWAP_GROUP(4)
    HOTSWAP_GROUP(5) HOTSWAP_GROUP(6) HOTSWAP_GROUP(7) HOTSWAP_GROUP(8)
#undef HOTSWAP_GROUP
  }
  TORCH_CHECK(false, "paged_decode_attention_tiles: ", G, " query heads per kv head (at most ", kMaxTileGroup, ")");
}

}  // namespace
#endif

at::Tensor paged_decode_attention_tiles(const at::Tensor& query, const at::Tensor& key_tiles,
                                        const at::Tensor& value_tiles, const at::Tensor& block_tables,
                                        const at::Tensor& context_lens, double scale, double k_scale,
                                        double v_scale) {
  TORCH_CHECK(query.dim() == 3 && key_tiles.dim() == 4 && value_tiles.sizes() == key_tiles.sizes(),
              "paged_decode_attention_tiles: query [B, H, D], caches [blocks, kv_heads, block_size/16, 16*D]");
  const bool e4m3 = key_tiles.scalar_type() == at::kFloat8_e4m3fn;
  const bool e5m2 = key_tiles.scalar_type() == at::kFloat8_e5m2, fp8 = e4m3 || e5m2;
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && value_tiles.scalar_type() == key_tiles.scalar_type() &&
                  (fp8 || key_tiles.scalar_type() == at::kBFloat16),
              "paged_decode_attention_tiles: a bf16 query, bf16, float8_e4m3fn or float8_e5m2 caches");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0),
              "paged_decode_attention_tiles: k_scale and v_scale apply to FP8 caches only");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && key_tiles.is_contiguous() &&
                  value_tiles.is_contiguous(),
              "paged_decode_attention_tiles: query rows [H, D] and the caches must be contiguous");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = key_tiles.size(1), tpb = key_tiles.size(2);
  TORCH_CHECK((D == 64 || D == 128) && key_tiles.size(3) == 16 * D && H % KVH == 0,
              "paged_decode_attention_tiles: head size 64 or 128, tiles of 16 positions");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B,
              "paged_decode_attention_tiles: one block table and context length per sequence");
  check_block_tables(block_tables, context_lens, key_tiles.size(0), 16 * tpb);
  auto out = at::empty({B, H, D}, query.options());
  if (B == 0) return out;
#if defined(__AVX512BF16__)
  auto run = [&](auto* kc, auto* vc) {
    using C = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    float shift = 1.f;  // a bf16 cache's (its scales are 1)
    if constexpr (kIsFp8Kv<C>) shift = Fp8Kv<C>::kShift;
    const float query_scale = static_cast<float>(scale * k_scale * shift);
    const float out_scale = static_cast<float>(v_scale * shift);
    const auto args = std::make_tuple(query.data_ptr<at::BFloat16>(), kc, vc, block_tables.data_ptr<int64_t>(),
                                      context_lens.data_ptr<int64_t>(), query_scale, out_scale,
                                      out.data_ptr<at::BFloat16>(), H, KVH, tpb, block_tables.size(1),
                                      query.stride(0), B);
    if (D == 64)
      std::apply([&](auto... a) { decode_for_group<64>(H / KVH, a...); }, args);
    else
      std::apply([&](auto... a) { decode_for_group<128>(H / KVH, a...); }, args);
  };
  if (e4m3)
    run(key_tiles.data_ptr<c10::Float8_e4m3fn>(), value_tiles.data_ptr<c10::Float8_e4m3fn>());
  else if (e5m2)
    run(key_tiles.data_ptr<c10::Float8_e5m2>(), value_tiles.data_ptr<c10::Float8_e5m2>());
  else
    run(key_tiles.data_ptr<at::BFloat16>(), value_tiles.data_ptr<at::BFloat16>());
  return out;
#else
  TORCH_CHECK(false, "paged_decode_attention_tiles: built without AVX-512 BF16");
#endif
}

namespace {

template <typename E>  // the elements' bits: uint16_t (bf16, float16), uint8_t (FP8 codes)
void copy_into_tiles(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_tiles,
                     at::Tensor& value_tiles, const int64_t* slot) {
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2), tpb = key_tiles.size(2);
  const int64_t bs = 16 * tpb;
  const auto* k = reinterpret_cast<const E*>(key.data_ptr());
  const auto* v = reinterpret_cast<const E*>(value.data_ptr());
  auto* kt = reinterpret_cast<E*>(key_tiles.data_ptr());
  auto* vt = reinterpret_cast<E*>(value_tiles.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  at::parallel_for(0, T * KVH, 64, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t t = task / KVH, h = task % KVH, block = slot[t] / bs, offset = slot[t] % bs;
      const int64_t base = ((block * KVH + h) * tpb + offset / 16) * 16 * D;
      const int64_t pos = offset % 16;
      const E* kr = k + t * ks0 + h * ks1;
      const E* vr = v + t * vs0 + h * vs1;
      for (int64_t d = 0; d < D; ++d) {
        kt[base + (d / 2) * 32 + pos * 2 + d % 2] = kr[d];
        vt[base + (pos / 2) * 2 * D + d * 2 + pos % 2] = vr[d];
      }
    }
  });
}

}  // namespace

// key/value [T, kv_heads, D] of new tokens into their slots' tiles (slot = block * block_size
// + offset); any 2-byte dtype, or e4m3 or e5m2 codes (an FP8 cache's, already quantized),
// as the copy only moves bits.
void write_kv_tiles(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_tiles,
                    at::Tensor& value_tiles, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv_tiles: key and value [tokens, kv_heads, D] with contiguous rows");
  TORCH_CHECK(key_tiles.is_contiguous() && value_tiles.is_contiguous() && key_tiles.dim() == 4 &&
                  value_tiles.sizes() == key_tiles.sizes() &&
                  (key_tiles.element_size() == 2 || key_tiles.scalar_type() == at::kFloat8_e4m3fn ||
                   key_tiles.scalar_type() == at::kFloat8_e5m2) &&
                  key.scalar_type() == key_tiles.scalar_type() && value.scalar_type() == key_tiles.scalar_type(),
              "write_kv_tiles: contiguous 2-byte, float8_e4m3fn or float8_e5m2 caches [blocks, kv_heads, block_size/16, 16*D] "
              "of the keys' dtype");
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2), tpb = key_tiles.size(2);
  TORCH_CHECK(key_tiles.size(1) == KVH && key_tiles.size(3) == 16 * D && D % 2 == 0,
              "write_kv_tiles: cache heads or head size differ from the keys'");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "write_kv_tiles: one int64 slot per token");
  const int64_t bs = 16 * tpb, slots = key_tiles.size(0) * bs;
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "write_kv_tiles: slot ", slot[t], " is not in the cache");
  if (key_tiles.element_size() == 1)
    copy_into_tiles<uint8_t>(key, value, key_tiles, value_tiles, slot);
  else
    copy_into_tiles<uint16_t>(key, value, key_tiles, value_tiles, slot);
}

}  // namespace hotswap
