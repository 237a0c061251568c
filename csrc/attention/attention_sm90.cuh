// What the Hopper attention kernels (attention_fwd_sm90.cuh, attention_bwd_sm90.cuh) share:
// the softmax scale as an argument of 88_hopper_fmha's mainloops, ALiBi, and the launch helpers.
#pragma once

#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cute/tensor.hpp"

namespace torch_flash::sm90 {

// 88_hopper_fmha's mainloops (forward and backward) fix the scale at 1/sqrt(D); this one takes it
// from the arguments.
template <class Base>
struct MainloopWithScale : Base {
  struct Arguments : Base::Arguments {
    float scale;
  };

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem, Arguments const& args) {
    return Base::can_implement(problem, args);
  }

  template <class ProblemShape>
  static typename Base::Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args,
                                                       void* workspace) {
    auto params = Base::to_underlying_arguments(problem, args, workspace);
    params.scale_softmax = args.scale;
    params.scale_softmax_log2 = args.scale * static_cast<float>(M_LOG2E);
    return params;
  }
};

// A thread's (row, column) index pairs of an accumulator tile, as the mainloops' identity tensors
// partition them, rise in both coordinates (GMMA's C layout steps column + 1, row + 8, column + 8,
// then the next atom): the first pair holds the thread's least row and column, the last its
// greatest. A mask can then skip the threads it leaves whole.
template <class Index>
CUTLASS_DEVICE auto least(Index const& index) {
  return index(0);
}
template <class Index>
CUTLASS_DEVICE auto greatest(Index const& index) {
  return index(cute::size(index) - 1);
}

// The problem shape that the mainloop's compute() passes on to the fusion, with the ALiBi bias
// of one key step for the tile's (batch, head): -slope / scale, the scores being scaled after
// the fusion (88_hopper_fmha hands before_softmax the problem shape, not the tile's head).
template <class ProblemShape>
struct AlibiProblem : ProblemShape {
  float bias_per_key;
};

// ALiBi on a mask: scores - slope * |i + Sk - Sq - j|, FlashAttention's distance to the
// bottom-right diagonal. Forward (Residual, CausalBottomRight; index pairs (query, key)): the
// mask's key steps, on which before_softmax masks and adds the bias, and its unmasked ones, on
// which the softmax adds the bias alone (attention_fwd_sm90_softmax.cuh). Backward (NoMaskBwd,
// CausalBottomRightBwd; kKeyFirst): before_softmax on every step, pairs (key, query).
template <class Mask, bool kKeyFirst = false>
struct Alibi : Mask {
  template <class AccQK, class IndexQK, class ProblemShape>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk, AlibiProblem<ProblemShape> const& problem) {
    // every element, without the mask's test for threads it leaves whole: a branch around the
    // mask made the three-warpgroup D=64 forwards spill (116 bytes causal, nvcc 13.0)
    Mask::mask(acc_qk, index_qk, problem);
    bias(acc_qk, index_qk, problem);
  }

  template <class AccQK, class IndexQK, class ProblemShape>
  CUTLASS_DEVICE void bias(AccQK& acc_qk, IndexQK const& index_qk, AlibiProblem<ProblemShape> const& problem) {
    const int diag = cute::get<3>(problem) - cute::get<2>(problem);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc_qk); i++) {
      auto pos = index_qk(i);
      const int row = kKeyFirst ? cute::get<1>(pos) : cute::get<0>(pos);
      const int key = kKeyFirst ? cute::get<0>(pos) : cute::get<1>(pos);
      // in floats: a thread's few rows and keys convert once, each score then costs an add and an FMA
      acc_qk(i) += problem.bias_per_key * fabsf(float(row + diag) - float(key));
    }
  }

  // Where the forward's scores of one warp lie against the rows' diagonals: 1 every key at or
  // left of every row's, -1 at or right, 0 astride (a vote: the warp takes one path).
  template <class IndexQK, class ProblemShape>
  CUTLASS_DEVICE float side_of_diagonal(IndexQK const& index_qk, ProblemShape const& problem) {
    if constexpr (Mask::kWholeStepsLeftOfDiagonal) return 1.f;  // the mask's whole steps
    const int diag = cute::get<3>(problem) - cute::get<2>(problem);
    auto first = least(index_qk), last = greatest(index_qk);
    if (__all_sync(0xffffffff, cute::get<1>(last) <= cute::get<0>(first) + diag)) return 1.f;
    if (__all_sync(0xffffffff, cute::get<1>(first) >= cute::get<0>(last) + diag)) return -1.f;
    return 0.f;
  }

  // The bias of a forward key step on one side of every row's diagonal (side_of_diagonal), split:
  // b |row + diag - key| = side b (row + diag - key0) - side b (key - key0), key0 the thread's
  // first key. The scores (rows, keys) get the key terms, one FFMA each (key - key0 is a constant
  // of the index layout), row_terms(i) the rest, which the softmax adds to row i once.
  template <class AccMN, class IndexMN, class ProblemShape, class RowTerms>
  CUTLASS_DEVICE void split_bias(AccMN& acc_mn, IndexMN const& index_mn, AlibiProblem<ProblemShape> const& problem,
                                 float side, RowTerms& row_terms) {
    const float b = side * problem.bias_per_key;
    const int key0 = cute::get<1>(index_mn(0, 0));
    const int diag = cute::get<3>(problem) - cute::get<2>(problem);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size<0>(acc_mn); i++) {
      row_terms(i) = b * float(cute::get<0>(index_mn(i, 0)) + diag - key0);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < cute::size<1>(acc_mn); j++) {
        acc_mn(i, j) = fmaf(-b, float(cute::get<1>(index_mn(i, j)) - key0), acc_mn(i, j));
      }
    }
  }
};

template <class Fusion>
constexpr bool kIsAlibi = false;
template <class Mask, bool kKeyFirst>
constexpr bool kIsAlibi<Alibi<Mask, kKeyFirst>> = true;

// A mainloop (forward or backward) under an Alibi fusion: the slopes in its arguments, and a
// compute() that hands the mainloop the problem shape with the bias of the tile's (batch, head).
template <class Base>
struct MainloopWithAlibi : Base {
  struct Arguments : Base::Arguments {
    const float* slopes;
    int slopes_batch_stride, slopes_head_stride;
  };
  struct Params : Base::Params {
    const float* slopes;
    int slopes_batch_stride, slopes_head_stride;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args, void* workspace) {
    return {Base::to_underlying_arguments(problem, args, workspace), args.slopes, args.slopes_batch_stride,
            args.slopes_head_stride};
  }

  template <class BlkCoord, class ProblemShape, class... Rest>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk_coord, BlkCoord const& wg_coord, Params const& params,
                              ProblemShape const& problem, Rest&&... rest) {
    const auto batch_head = cute::get<2>(blk_coord);
    const float slope = params.slopes[cute::get<0>(batch_head) * params.slopes_batch_stride +
                                      cute::get<1>(batch_head) * params.slopes_head_stride];
    return Base::compute(blk_coord, wg_coord, params,
                         AlibiProblem<ProblemShape>{problem, -slope / params.scale_softmax},
                         static_cast<Rest&&>(rest)...);
  }
};

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash.attention (sm90 kernel): ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// Raises the kernel's dynamic shared memory limit once per device (a CUDA function attribute
// is per device context).
template <class Kernel>
void allow_shared_memory(int device) {
  static std::once_flag flags[64];
  if (device < 0 || device >= 64) throw std::runtime_error("flash.attention (sm90 kernel): device index out of range");
  std::call_once(flags[device], [] {
    check_cuda(cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Kernel::SharedStorageSize),
               "cudaFuncSetAttribute");
  });
}

}  // namespace torch_flash::sm90
