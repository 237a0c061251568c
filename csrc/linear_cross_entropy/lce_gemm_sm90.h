// Plain-C++ interface between the torch binding (linear_cross_entropy.cpp) and the CUTLASS
// GEMMs of flash.linear_cross_entropy's token chunks (lce_gemm_sm90.cuh): no torch or CUTLASS
// types cross it, so each side compiles without the other's headers.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace torch_flash {

// One GEMM of a chunk of C tokens, hidden H, vocabulary V; every matrix dense, row-major as
// torch holds it. The three entries differ in which operand is transposed:
//   logits:       d (M, N) = a (M, K) @ b (N, K)^T   hidden chunk (C, H) @ weight (V, H)^T
//   grad_hidden:  d (M, N) = a (M, K) @ b (K, N)     dlogits (C, V) @ weight (V, H)
//   grad_weight:  d (M, N) = a (K, M)^T @ b (K, N)   dlogits (C, V)^T @ hidden chunk (C, H)
// accumulate: d += the product (beta = 1, d read and written in place), else d = it. Sums in
// fp32, rounded once into d's dtype. K may be any size; rows (the leading dim of each
// operand) must be 16-byte multiples and the pointers 16-byte aligned (TMA).
struct LceGemmSm90Params {
  const void* a;
  const void* b;
  void* d;
  int m, n, k;
  bool bf16;  // else fp16
  bool accumulate;
  int raster;   // tile order: 0 the entry's choice, 1 along M, 2 along N, 3 CUTLASS's heuristic
  int swizzle;  // tiles per raster swizzle: 0 the entry's choice, else 1, 2, 4 or 8
  int device;
  int sm_count;
  // Device memory for the kernel's workspace: alloc(alloc_ctx, bytes) returns memory that work
  // queued on the stream may use until the call returns.
  void* (*alloc)(void* ctx, size_t bytes);
  void* alloc_ctx;
};

// The extension builds the logits GEMM (lce_gemm_sm90_logits.cu); for the other two cuBLAS ran
// as fast or faster than every configuration of scripts/sweep_lce_gemm_sm90.py on the H100
// (docs/perf/sweep_lce_gemm_sm90_h100.json), so torch.mm does them. Throws std::runtime_error
// when the GEMM cannot run the problem.
void lce_gemm_sm90_logits(const LceGemmSm90Params& p, cudaStream_t stream);

}  // namespace torch_flash
