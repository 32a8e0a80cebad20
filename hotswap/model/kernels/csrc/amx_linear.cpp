// bf16 linear layers for decode-sized batches through AMX tiles: y = x @ w^T + bias.
//
// A decode step's GEMMs are a memory stream: every weight is read once per step, and for
// tens of rows the multiply-adds cost little beside it (a tile product does 16x16x32 of
// them at once). The weight is packed once (amx_pack_weight) so that it streams in order,
// 32 outputs at a time:
//
//   packed [N/32, K/32, 2, 16, 16, 2]: for each pair of 16-output blocks and each 32-wide
//   slice of K, two B tiles of [16 K-pairs][16 outputs][2] (1 KB each), back to back
//
// and the rows of x (few; they stay in cache) are loaded as A tiles over and over. Each
// thread takes a contiguous range of output pairs and prefetches the stream a few KB
// ahead of the tiles it computes on. Sums are float32 and the result is rounded once to bf16
// (as the GEMM library does); a row's result does not depend on the other rows.
#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hotswap {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t kRowsPerTile = 16;
constexpr int64_t kTileK = 32;     // bf16 values of K per tile row
constexpr int64_t kPairN = 32;     // outputs per pair of B tiles
constexpr int64_t kTileElems = 512;  // bf16 in one B tile (1 KB)
// How far ahead of the tiles in use the stream is prefetched (measured: 4-8 KB best, 16 KB
// and none 10-20% slower at 16-32 rows; the hardware prefetcher alone falls behind).
constexpr int64_t kPrefetchBytes = 8192;

// Tiles: 0-1 the A tiles of two 16-row groups, 2-3 the pair's B tiles, 4-7 their four
// products (C[m][n] in tile 4 + 2m + n). All 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// Linux hands out the tile registers' state only to a process that asks for it.
bool tiles_granted() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Output pairs [p0, p1) for rows [0, M) of x (padded to whole tiles, Mp rows).
void pairs_range(const at::BFloat16* x, int64_t Mp, int64_t M, int64_t K, const at::BFloat16* packed,
                 const at::BFloat16* bias, at::BFloat16* y, int64_t N, int64_t p0, int64_t p1) {
  const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t KB = K / kTileK, pair_elems = KB * 2 * kTileElems, stride = K * 2;
  alignas(64) float c[2 * kRowsPerTile][kPairN];
  const char* end = reinterpret_cast<const char*>(packed + p1 * pair_elems);
  for (int64_t p = p0; p < p1; ++p) {
    const at::BFloat16* w = packed + p * pair_elems;
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kRowsPerTile) {
      const bool two = m0 + kRowsPerTile < Mp;
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t kb = 0; kb < KB; ++kb) {
        if (m0 == 0)  // the 2 KB kPrefetchBytes ahead of this slice's
          for (int line = 0; line < 32; ++line) {
            const char* ahead = reinterpret_cast<const char*>(w + kb * 2 * kTileElems) + kPrefetchBytes + line * 64;
            if (ahead < end) _mm_prefetch(ahead, _MM_HINT_T0);
          }
        const at::BFloat16* b = w + kb * 2 * kTileElems;
        _tile_loadd(2, b, 64);
        _tile_loadd(3, b + kTileElems, 64);
        _tile_loadd(0, x + m0 * K + kb * kTileK, stride);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (two) {
          _tile_loadd(1, x + (m0 + kRowsPerTile) * K + kb * kTileK, stride);
          _tile_dpbf16ps(6, 1, 2);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
      _tile_stored(4, &c[0][0], kPairN * 4);
      _tile_stored(5, &c[0][16], kPairN * 4);
      if (two) {
        _tile_stored(6, &c[16][0], kPairN * 4);
        _tile_stored(7, &c[16][16], kPairN * 4);
      }
      const int64_t rows = std::min<int64_t>(M - m0, two ? 32 : 16);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < kPairN; h += 16) {
          __m512 v = _mm512_load_ps(&c[r][h]);
          if (bias != nullptr)
            v = _mm512_add_ps(v, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(bias + p * kPairN + h))));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * N + p * kPairN + h),
                              (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
  }
  _tile_release();
}

}  // namespace
#endif

bool amx_linear_built() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return tiles_granted();
#else
  return false;
#endif
}

// weight [N, K] bf16 -> [N/32, K/32, 2, 16, 16, 2] (see the top of this file).
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_pack_weight: a bf16 weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "amx_pack_weight: N and K multiples of 32, not ", N, "x", K);
  return weight.reshape({N / 32, 2, 16, K / 32, 16, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous();
}

at::Tensor amx_linear(const at::Tensor& input, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kBFloat16, "amx_linear: bf16 input [M, K]");
  TORCH_CHECK(packed.dim() == 6 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 16 && packed.size(5) == 2,
              "amx_linear: a weight packed by amx_pack_weight");
  const int64_t M = input.size(0), K = packed.size(1) * 32, N = packed.size(0) * 32;
  TORCH_CHECK(input.size(1) == K, "amx_linear: input has ", input.size(1), " features, the weight ", K);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->is_contiguous() &&
                                    bias->scalar_type() == at::kBFloat16),
              "amx_linear: a contiguous bf16 bias of ", N);
  auto y = at::empty({M, N}, input.options());
  if (M == 0) return y;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(tiles_granted(), "amx_linear: the kernel refused this process the AMX tiles");
  // Whole tiles of rows: the rows past M are zeros, read and then dropped.
  const int64_t Mp = (M + kRowsPerTile - 1) / kRowsPerTile * kRowsPerTile;
  at::Tensor x = input.contiguous();
  if (Mp != M) x = at::constant_pad_nd(x, {0, 0, 0, Mp - M});
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  const auto* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / kPairN, 1, [&](int64_t p0, int64_t p1) {
    pairs_range(xp, Mp, M, K, wp, bp, yp, N, p0, p1);
  });
  return y;
#else
  TORCH_CHECK(false, "amx_linear: built without AMX");
#endif
}

}  // namespace hotswap
