#pragma once
// Note [One norm wherever the gradient lives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Clipping scales every update by max_norm / ||g||, so the norm's last bit is every parameter's last
// bit. ferry reduces a chunk's squared norm where its gradients are: on the host for host-state
// chunks that reached it, on the device for the others (D80). If the two sides summed in different
// orders, where the placement put a chunk (a device budget, an activation plan, round trips) would
// change the result of a clipped step. So the sum has one order, written here (constants in
// kernel_abi.h), and every kernel computes exactly it:
//
//   x_i    = fl(grad_i * grad_scale)                                  fp32 multiply
//   lane l of block b (elements b*1024 + 16*k + l, k = 0..63, those < n):
//          s_l = fma(x, x, s_l) over k in order, from +0              fp32
//   block  t_b = fold(s_0..s_15): for h = 8, 4, 2, 1: s_l = s_l + s_{l+h} for l < h; t_b = s_0
//   grain  G_q = sum over its blocks b in order of double(t_b), from 0   fp64 (32 blocks, 32K elements)
//   span   S   = sum over grains q in order of G_q, from 0                fp64
//
// HybridAdam's spans here are single parameters, and it totals them exactly (Note [One term per
// parameter], optim/chunk_updates.cpp; D87), so the layout changes no bit of the step's norm either.
//
// The CPU kernels (grad_stats_loop below: 16 / W vectors of W lanes per row; a last partial row
// through a zero-padded buffer, whose zeros add +0 to a lane: the same value) compute G_q for the
// grain their thread was given, and CpuAdam::grad_norm_sq adds them in grain order; the device kernel
// (adam_cuda.cu, its steps in norm_cuda_grain.h) runs one thread per lane, folds with warp shuffles in
// the same tree, and sums the grains in order on one thread. A non-finite gradient makes the sum
// non-finite on every side (squares are never negative, so no inf - inf); a sum that overflows with
// finite gradients does so on every side too.
//
// Accuracy: a lane sums at most 64 terms in fp32 and the fold 16 lanes, so a block total is within
// (64 + 4) * 2^-24 (~4e-6) of the exact sum of its fp32 squares (each nonnegative), and the fp64
// sums add ~1e-16 per term: ~4e-6 relative whatever the length (CpuAdamIsa.GradNormMatchesFp64 in
// tests/cpu_adam/test_cpu_adam.cpp holds every kernel to it against an fp64 sum).
//
// Included inside the anonymous namespace of the kernel files, from adam_body.h.

// The fold of a block's 16 lane sums, in the note's tree (`s` is overwritten).
FERRY_HD inline float norm_fold(float* s) {
  for (int h = static_cast<int>(ferry::cpu_adam::kNormLanes) / 2; h > 0; h /= 2) {
    for (int l = 0; l < h; ++l) s[l] = s[l] + s[l + h];
  }
  return s[0];
}

// G_q of the note for the blocks of [begin, end), begin a multiple of kNormBlock; `nonfinite` also
// from a separate test of each element (x * 0 stays 0 unless x is inf or NaN), so a caller that asks
// only whether the gradients are finite is not told no by a sum that overflowed.
template <class Ops, ferry::cpu_adam::GradType G>
ferry::cpu_adam::GradStats grad_stats_loop(const void* grad, float grad_scale, int64_t begin, int64_t end) {
  using F = typename Ops::F;
  using GE = typename GradElem<G>::type;
  constexpr int W = Ops::W;
  constexpr int kLanes = static_cast<int>(ferry::cpu_adam::kNormLanes);
  constexpr int R = kLanes / W;  // vectors per row
  static_assert(R * W == kLanes, "a row is whole vectors");
  const F scale = Ops::set1(grad_scale);
  const F zero = Ops::set1(0.0f);
  F bad = zero;
  double total = 0.0;
  for (int64_t block = begin; block < end; block += ferry::cpu_adam::kNormBlock) {
    const int64_t block_end = end < block + ferry::cpu_adam::kNormBlock ? end : block + ferry::cpu_adam::kNormBlock;
    F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = zero;
    int64_t i = block;
    for (; i + kLanes <= block_end; i += kLanes) {
      for (int r = 0; r < R; ++r) {
        const F x = Ops::mul(load_grad<Ops, G>(grad, i + r * W), scale);
        acc[r] = Ops::fma(x, x, acc[r]);
        bad = Ops::fma(x, zero, bad);
      }
    }
    if (i < block_end) {  // the last, partial row
      alignas(64) GE row[kLanes] = {};
      __builtin_memcpy(row, static_cast<const GE*>(grad) + i, (block_end - i) * sizeof(GE));
      for (int r = 0; r < R; ++r) {
        const F x = Ops::mul(load_grad<Ops, G>(row, r * W), scale);
        acc[r] = Ops::fma(x, x, acc[r]);
        bad = Ops::fma(x, zero, bad);
      }
    }
    alignas(64) float lanes[kLanes];
    for (int r = 0; r < R; ++r) Ops::store(lanes + r * W, acc[r]);
    total += static_cast<double>(norm_fold(lanes));
  }
  const float b = Ops::hsum(bad);
  return {total, b != 0.0f || b != b};
}
