// Plain-C++ interface between the torch binding (attention.cpp) and the CUTLASS kernels
// (attention_fwd_sm90_hdim*.cu): no torch or CUTLASS types cross it, so each side compiles
// without the other's headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace torch_flash {

// One multi-head problem: q (B, H, Sq, D), k/v (B, H, Sk, D), out (B, H, Sq, D), lse (B, H, Sq)
// fp32 in natural log. Strides are in elements, the last dim contiguous. GQA calls this once
// per query head of a group, with q/out/lse head strides scaled by the group size.
struct AttentionFwdSm90Params {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  int batch, heads, seqlen_q, seqlen_k, head_dim;
  int q_batch_stride, q_head_stride, q_row_stride;
  int k_batch_stride, k_head_stride, k_row_stride;
  int v_batch_stride, v_head_stride, v_row_stride;
  int out_batch_stride, out_head_stride, out_row_stride;
  int lse_batch_stride, lse_head_stride;
  // Attention sinks (null: none): head h's sink logit at sinks[h * sinks_head_stride], one more
  // softmax column that adds no value (out scaled by exp(lse0 - lse), lse = logaddexp(lse0, sink)).
  const float* sinks;
  int sinks_head_stride;
  // ALiBi (null: none): scores - slope * |i + Sk - Sq - j| with head h of batch b's slope at
  // alibi_slopes[b * alibi_batch_stride + h * alibi_head_stride] (fp32).
  const float* alibi_slopes;
  int alibi_batch_stride, alibi_head_stride;
  float scale;
  bool bf16;    // else fp16
  bool causal;  // aligned bottom-right (row i sees keys j <= i + Sk - Sq), with Sq <= Sk
  int device;
  int sm_count;
  // Device memory for the split tail of a persistent launch (attention_fwd_sm90.cuh,
  // TailSplit): alloc(alloc_ctx, bytes) returns memory that work queued on the stream may
  // use until the call returns. Null: no split.
  void* (*alloc)(void* ctx, size_t bytes);
  void* alloc_ctx;
};

// One entry per head dim, defined in attention_fwd_sm90_hdim{D}.cu (built when D is in
// FLASH_HDIMS). Throws std::runtime_error when the kernel cannot run the problem.
void attention_fwd_sm90_hdim64(const AttentionFwdSm90Params& p, cudaStream_t stream);
void attention_fwd_sm90_hdim128(const AttentionFwdSm90Params& p, cudaStream_t stream);
void attention_fwd_sm90_hdim256(const AttentionFwdSm90Params& p, cudaStream_t stream);

}  // namespace torch_flash
