// The Hopper forward's online softmax: 88_hopper_fmha's (CollectiveSoftmax), with the output's
// rescaling made conditional as in FlashAttention 4. A row's running maximum m is raised only
// when a key tile's scores pass it by more than 2^kRescaleLog2 (in exp2 units of the scaled
// scores); otherwise the tile's exponentials are taken against the stale m (each at most
// 2^kRescaleLog2: safe in fp32 and in the 16-bit P) and the output accumulator and row sum keep
// their scale, so that most key tiles skip the FMULs over the accumulator. A warp decides for
// all its rows at once (a vote): the rescaling branch does not diverge. The log-sum-exp stays
// exact: the sum is taken against the m that the tail adds back.
#pragma once

#include <cmath>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"

#include "88_hopper_fmha/collective/fmha_collective_softmax.hpp"
#include "88_hopper_fmha/collective/fmha_common.hpp"

#include "attention/attention_sm90.cuh"

namespace torch_flash::sm90 {

constexpr float kRescaleLog2 = 8.f;

template <class Fusion, class Params>
struct LazyRescaleSoftmax {
  Params const& params;
  CUTLASS_DEVICE explicit LazyRescaleSoftmax(Params const& params) : params(params) {}

  // (running maximum in unscaled score units, row sum against it), a thread's rows
  template <class AccPV, class TiledMmaPV>
  CUTLASS_DEVICE auto init(AccPV const& acc_pv, TiledMmaPV const& tiled_mma_pv) {
    using cutlass::fmha::collective::layout_acc_mn;
    cute::Tensor s_max = cute::make_fragment_like<float>(cute::size<0>(layout_acc_mn(tiled_mma_pv, acc_pv.layout())));
    cute::Tensor a_sum = cute::make_fragment_like<float>(s_max);
    return cute::make_tuple(s_max, a_sum);
  }

  // row_max(i) = max(row_max(i), row i of acc_mn), in this thread
  template <class AccMN, class RowMax>
  CUTLASS_DEVICE static void thread_max(AccMN const& acc_mn, RowMax& row_max) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size<0>(acc_mn); i++) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < cute::size<1>(acc_mn); j++) row_max(i) = fmaxf(row_max(i), acc_mn(i, j));
    }
  }

  // row_max(i) = max(row_max(i), row i of acc_mn), over the threads sharing the row too
  template <class AccMN, class TiledMma, class RowMax>
  CUTLASS_DEVICE static void reduce_max(AccMN const& acc_mn, TiledMma const& tiled_mma, RowMax& row_max) {
    thread_max(acc_mn, row_max);
    share_max(tiled_mma, row_max);
  }

  // row_max(i) = the maximum of the threads sharing row i
  template <class TiledMma, class RowMax>
  CUTLASS_DEVICE static void share_max(TiledMma const& tiled_mma, RowMax& row_max) {
    share_rows(tiled_mma, row_max, [](float a, float b) { return fmaxf(a, b); });
  }

  // values(i) = op over the values(i) of the threads sharing row i (a butterfly of shuffles)
  template <class TiledMma, class RowValues, class Op>
  CUTLASS_DEVICE static void share_rows(TiledMma const& tiled_mma, RowValues& values, Op op) {
    auto target = cutlass::fmha::collective::reduction_target_n(tiled_mma);
    cute::for_each(cute::make_seq<decltype(cute::rank(target))::value>{}, [&](auto r) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 1; j < cute::shape<r>(target); j *= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(values); i++) {
          values(i) = op(values(i), __shfl_xor_sync(0xffffffff, values(i), cute::stride<r>(target) * j));
        }
      }
    });
  }

  // P = exp2(scale (S + row_terms - m)) in place, its row sums added to a_sum (a row without
  // keys so far, m = -inf, takes m = 0: its P is 0); row_terms: none, or the split bias's
  template <class AccMN, class State, class... RowTerms>
  CUTLASS_DEVICE void exponentiate(AccMN& acc_mn, State& state, RowTerms const&... row_terms) {
    auto& s_max = cute::get<0>(state);
    auto& a_sum = cute::get<1>(state);
    const float scale = params.scale_softmax_log2;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size<0>(acc_mn); i++) {
      const float scale_max = scale * ((s_max(i) == -INFINITY ? 0.f : s_max(i)) - ... - row_terms(i));
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < cute::size<1>(acc_mn); j++) {
        acc_mn(i, j) = ::exp2f(scale * acc_mn(i, j) - scale_max);
        sum += acc_mn(i, j);
      }
      a_sum(i) += sum;
    }
  }

  // The first key tile: no output yet.
  template <class AccQK, class TiledMmaQK, class CountQK, class State, class ProblemShape>
  CUTLASS_DEVICE void step(AccQK& acc_qk, TiledMmaQK const& tiled_mma_qk, CountQK const& count_qk, State& state,
                           ProblemShape const& problem_shape) {
    Fusion{}.before_softmax(acc_qk, count_qk, problem_shape);
    cute::Tensor acc_mn = cute::make_tensor(acc_qk.data(), cutlass::fmha::collective::layout_acc_mn(tiled_mma_qk, acc_qk.layout()));
    auto& s_max = cute::get<0>(state);
    auto& a_sum = cute::get<1>(state);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(s_max); i++) {
      s_max(i) = -INFINITY;
      a_sum(i) = 0.f;
    }
    reduce_max(acc_mn, tiled_mma_qk, s_max);
    exponentiate(acc_mn, state);
  }

  template <bool kUseFusion = true, class AccQK, class TiledMmaQK, class CountQK, class State, class AccPV,
            class TiledMmaPV, class ProblemShape>
  CUTLASS_DEVICE void step(AccQK& acc_qk, TiledMmaQK const& tiled_mma_qk, CountQK const& count_qk, State& state,
                           AccPV& acc_pv, TiledMmaPV const& tiled_mma_pv, ProblemShape const& problem_shape) {
    using cutlass::fmha::collective::layout_acc_mn;
    cute::Tensor acc_mn = cute::make_tensor(acc_qk.data(), layout_acc_mn(tiled_mma_qk, acc_qk.layout()));
    cute::Tensor pv_mn = cute::make_tensor(acc_pv.data(), layout_acc_mn(tiled_mma_pv, acc_pv.layout()));
    auto& s_max = cute::get<0>(state);
    auto new_max = cute::make_fragment_like(s_max);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(s_max); i++) new_max(i) = s_max(i);

    if constexpr (kUseFusion) {
      Fusion{}.before_softmax(acc_qk, count_qk, problem_shape);
    } else if constexpr (kIsAlibi<Fusion>) {  // a key step the mask leaves whole: the bias alone
      const float side = Fusion{}.side_of_diagonal(count_qk, problem_shape);
      if (side != 0.f) {
        // split: the scores hold the key terms, the maxima and exponents take the row terms
        auto row_terms = cute::make_fragment_like(s_max);
        Fusion{}.split_bias(acc_mn, cute::make_tensor(count_qk.data(), layout_acc_mn(tiled_mma_qk, count_qk.layout())),
                            problem_shape, side, row_terms);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(s_max); i++) new_max(i) -= row_terms(i);
        thread_max(acc_mn, new_max);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(s_max); i++) new_max(i) += row_terms(i);
        share_max(tiled_mma_qk, new_max);
        rescale(new_max, state, pv_mn);
        exponentiate(acc_mn, state, row_terms);
        return;
      }
      Fusion{}.bias(acc_qk, count_qk, problem_shape);
    }
    reduce_max(acc_mn, tiled_mma_qk, new_max);
    rescale(new_max, state, pv_mn);
    exponentiate(acc_mn, state);
  }

  // The running maxima raised to new_max, and the output and row sums rescaled, where a row of
  // the warp climbs past kRescaleLog2.
  template <class RowMax, class State, class PvMN>
  CUTLASS_DEVICE void rescale(RowMax const& new_max, State& state, PvMN& pv_mn) {
    auto& s_max = cute::get<0>(state);
    auto& a_sum = cute::get<1>(state);
    const float scale = params.scale_softmax_log2;
    bool grows = false;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(s_max); i++) grows |= (new_max(i) - s_max(i)) * scale > kRescaleLog2;  // -inf - -inf: no
    if (__any_sync(0xffffffff, grows)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(s_max); i++) {
        const float factor = ::exp2f((s_max(i) - (new_max(i) == -INFINITY ? 0.f : new_max(i))) * scale);
        s_max(i) = new_max(i);
        a_sum(i) *= factor;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < cute::size<1>(pv_mn); j++) pv_mn(i, j) *= factor;
      }
    }
  }

  // The output divided by the row sums (summed over the threads sharing a row first); the rows'
  // log-sum-exp, INFINITY for a row without keys (its output 0).
  template <class State, class AccPV, class TiledMmaPV>
  CUTLASS_DEVICE auto tail(State& state, AccPV& acc_pv, TiledMmaPV const& tiled_mma_pv) {
    auto& s_max = cute::get<0>(state);
    auto& a_sum = cute::get<1>(state);
    cute::Tensor pv_mn = cute::make_tensor(acc_pv.data(), cutlass::fmha::collective::layout_acc_mn(tiled_mma_pv, acc_pv.layout()));
    share_rows(tiled_mma_pv, a_sum, [](float a, float b) { return a + b; });
    auto lse = cute::make_fragment_like(a_sum);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(a_sum); i++) {
      const float sum = a_sum(i);
      const bool empty = sum == 0.f || sum != sum;
      lse(i) = empty ? INFINITY : s_max(i) * params.scale_softmax + __logf(sum);
      const float factor = params.rp_dropout * (empty ? 1.f : __frcp_rn(sum));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < cute::size<1>(pv_mn); j++) pv_mn(i, j) *= factor;
    }
    return lse;
  }
};

}  // namespace torch_flash::sm90

// Every forward kernel of this extension (fp32 scores) runs the lazy-rescaling softmax.
template <class Fusion, class Params>
struct cutlass::fmha::collective::CollectiveSoftmax<float, Fusion, Params>
    : torch_flash::sm90::LazyRescaleSoftmax<Fusion, Params> {
  using torch_flash::sm90::LazyRescaleSoftmax<Fusion, Params>::LazyRescaleSoftmax;
};
