// hotswap's CPU kernels, registered as torch ops (torch.ops.hotswap_cpu.*):
//
//   paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
//                          k_scale, v_scale)
//       one query token per sequence attends to its context read in place from the paged
//       cache (no gather into a copy); online softmax over the blocks in order. An FP8
//       cache (float8_e4m3fn) is read as code x k_scale (keys), code x v_scale (values).
//   paged_decode_attention_tiles(query, key_tiles, value_tiles, block_tables, context_lens,
//                                scale, k_scale, v_scale), write_kv_tiles(key, value,
//                                key_tiles!, value_tiles!, slot_mapping)
//       the same over a bf16 (or FP8) cache kept in 16-position tiles laid out for AVX-512
//       (paged_attention_tiles.cpp), and the write of new tokens (or their codes) into it.
//   gemv(input, weight)
//       input [M, K] @ weight[N, K]^T for the few rows of a decode step: the weights are
//       streamed once, which is all a matrix-vector product can do.
//   fp8_gemv(input, codes, scale, scale_rows, block_k), fp8_dequantize(codes, scale,
//            scale_rows, block_k, dtype)
//       the same over blockwise FP8 weights (fp8_linear.cpp), reading one byte per weight;
//       and those weights' values in the activation dtype, for larger products.
//   rms_norm(input, weight, eps), add_rms_norm(input, residual!, weight, eps)
//       RMSNorm, after `residual += input` in the fused form (vLLM's fused_add_rms_norm).
//   rotary_embedding(qk!, cos, sin)
//       rotate-half RoPE in place.
//   amx_available(), amx_pack_weight(weight), amx_linear(input, packed, bias)
//       bf16 linear layers for decode-sized batches on AMX tiles, over a weight packed
//       for them (amx_linear.cpp); amx_available says whether this build and process
//       have the tiles.
//   silu_and_mul(gate_up)
//       the gated MLP's activation, silu(gate) * up, into a new [tokens, intermediate].
//   fused_moe(x, gate_up, down, ids, weights)
//       a mixture of experts' routed experts in one call (moe.cpp): every (token, slot)
//       pair through its expert, each token's slots weighted and summed.
//   fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, ids, weights, block_n, block_k)
//       the same over FP8 experts (e4m3 codes, float32 scales per block_n x block_k block
//       of each expert's matrix), each expert's rows as fp8_gemv / fp8_dequantize run them.
//
// Built at run time by hotswap/model/kernels/build.py for this machine's instruction set
// (AVX-512 with BF16 dot products where present; at::vec's portable vectors otherwise).
// Sums accumulate in float32. Every kernel is deterministic, and a row's result does not
// depend on the other rows of the batch.
#include "common.h"

TORCH_LIBRARY(hotswap_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, float k_scale, "
        "float v_scale) -> Tensor");
  m.def("paged_decode_attention_tiles(Tensor query, Tensor key_tiles, Tensor value_tiles, "
        "Tensor block_tables, Tensor context_lens, float scale, float k_scale, float v_scale) "
        "-> Tensor");
  m.def("write_kv_tiles(Tensor key, Tensor value, Tensor(a!) key_tiles, Tensor(b!) value_tiles, "
        "Tensor slot_mapping) -> ()");
  m.def("gemv(Tensor input, Tensor weight) -> Tensor");
  m.def("fp8_gemv(Tensor input, Tensor codes, Tensor scale, Tensor scale_rows, int block_k) "
        "-> Tensor");
  m.def("fp8_dequantize(Tensor codes, Tensor scale, Tensor scale_rows, int block_k, "
        "ScalarType dtype) -> Tensor");
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor input, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("fused_moe(Tensor x, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> Tensor");
  m.def("fused_moe_fp8(Tensor x, Tensor gate_up, Tensor gate_up_scale, Tensor down, "
        "Tensor down_scale, Tensor ids, Tensor weights, int block_n, int block_k) -> Tensor");
  m.def("amx_available() -> bool", &hotswap::amx_linear_built);
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor input, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap_cpu, CPU, m) {
  m.impl("paged_decode_attention", &hotswap::paged_decode_attention);
  m.impl("paged_decode_attention_tiles", &hotswap::paged_decode_attention_tiles);
  m.impl("write_kv_tiles", &hotswap::write_kv_tiles);
  m.impl("gemv", &hotswap::gemv);
  m.impl("fp8_gemv", &hotswap::fp8_gemv);
  m.impl("fp8_dequantize", &hotswap::fp8_dequantize);
  m.impl("rms_norm", &hotswap::rms_norm);
  m.impl("add_rms_norm", &hotswap::add_rms_norm);
  m.impl("rotary_embedding", &hotswap::rotary_embedding);
  m.impl("silu_and_mul", &hotswap::silu_and_mul);
  m.impl("fused_moe", &hotswap::fused_moe);
  m.impl("fused_moe_fp8", &hotswap::fused_moe_fp8);
  m.impl("amx_pack_weight", &hotswap::amx_pack_weight);
  m.impl("amx_linear", &hotswap::amx_linear);
}
