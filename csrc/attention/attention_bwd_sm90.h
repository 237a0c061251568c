// Plain-C++ interface between the torch binding (attention.cpp) and the CUTLASS backward
// kernels (attention_bwd_sm90_hdim*.cu), as attention_fwd_sm90.h is for the forward.
#pragma once

#include <cuda_runtime.h>

namespace torch_flash {

// The gradients of one multi-head problem: q, out, grad_out (B, Hq, Sq, D), k/v (B, Hkv, Sk, D),
// lse (B, Hq, Sq) fp32 natural log, as the forward wrote it. Strides in elements, the last dim
// contiguous. dq (B, Hq, Sq, D); dk/dv (B, Hkv, Sk, D) for each of G = Hq / Hkv query heads of a
// group: member g holds the gradients of heads g, g + G, ..., at dkv_member_stride elements
// from member 0, summed by the caller where G > 1. The workspace: dq_acc (B, Hq, Sq rounded up
// to kBwdQueryRowsMax, D) fp32 (each query tile's floats in the kernel's own order), zeroed
// unless dq_semaphore is given and every query tile sees a key (the first key block to add into
// a tile then stores), sum_odo (B, Hq, Sq) fp32, both contiguous.
// The fewest and the most query rows of a backward tile (64 or 128 a head dim): dQ is reduced one
// tile at a time, and dq_semaphore holds a counter for each tile of kBwdQueryRows rows.
constexpr int kBwdQueryRows = 64;
constexpr int kBwdQueryRowsMax = 128;

struct AttentionBwdSm90Params {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* grad_out;
  const float* lse;
  void* dq;
  void* dk;
  void* dv;
  float* dq_acc;
  float* sum_odo;
  // (B, Hq, ceil(Sq / kBwdQueryRows)) int32 zeros (enough for any tile): the key blocks add
  // into each dQ tile in a fixed order (bitwise reproducible dq); null: in any order, by atomic
  // reductions.
  int* dq_semaphore;
  int batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int q_batch_stride, q_head_stride, q_row_stride;
  int k_batch_stride, k_head_stride, k_row_stride;
  int v_batch_stride, v_head_stride, v_row_stride;
  int out_batch_stride, out_head_stride, out_row_stride;
  int grad_out_batch_stride, grad_out_head_stride, grad_out_row_stride;
  int lse_batch_stride, lse_head_stride;
  int dq_batch_stride, dq_head_stride, dq_row_stride;
  int dk_batch_stride, dk_head_stride, dk_row_stride;  // dk and dv share their layout
  long dkv_member_stride;  // between the G slices of dk and dv
  // ALiBi as the forward had it (null: none): head h of batch b's slope at
  // alibi_slopes[b * alibi_batch_stride + h * alibi_head_stride], h a query head (fp32).
  const float* alibi_slopes;
  int alibi_batch_stride, alibi_head_stride;
  float scale;
  bool bf16;    // else fp16
  bool causal;  // aligned bottom-right (row i sees keys j <= i + Sk - Sq), with Sq <= Sk
  int device;
  int sm_count;  // resident CTAs of the backward (one an SM)
  long l2_bytes;  // the device's L2 cache
  // Device memory for the split tail (BwdTailSplit): alloc(alloc_ctx, bytes) returns memory that
  // work queued on the stream may use until the op returns; null: no split.
  void* (*alloc)(void* ctx, size_t bytes);
  void* alloc_ctx;
};

// One entry per head dim, defined in attention_bwd_sm90_hdim{D}.cu (built when D is in
// FLASH_HDIMS). Throws std::runtime_error when the kernel cannot run the problem.
void attention_bwd_sm90_hdim64(const AttentionBwdSm90Params& p, cudaStream_t stream);
void attention_bwd_sm90_hdim128(const AttentionBwdSm90Params& p, cudaStream_t stream);

}  // namespace torch_flash
