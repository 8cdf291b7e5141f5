#pragma once
// The gradient norm of one grain as the device computes it (adam_cuda.cu's norm_grain_kernel: one block of
// kThreads threads per grain, one thread per lane of each of the grain's kNormBlock-element blocks),
// written as the steps between its warp shuffles and barrier so that the same code also runs on the
// host, one thread after another (run_on_host: tests). The order is Note [One norm wherever the
// gradient lives] (norm_body.h); so are the bits.
//
// Included inside the anonymous namespace of its users, after cuda_ops.h (internal linkage, see
// kernel_abi.h).

// Up to kNormRanges ranges of one gradient array, one launch's worth (adam_cuda.cu passes it by value):
// range k is elements [begin[k], begin[k] + n[k]); its grains are first_grain[k] .. first_grain[k + 1]
// - 1 of the launch's.
constexpr int kNormRanges = 64;
struct NormRanges {
  int count = 0;
  int64_t begin[kNormRanges];
  int64_t n[kNormRanges];
  int64_t first_grain[kNormRanges + 1];

  // Ranges first .. first + kNormRanges - 1 (those below `total`) of [begins[k], ends[k]).
  static NormRanges batch(const int64_t* begins, const int64_t* ends, int64_t total, int64_t first) {
    NormRanges r;
    r.count = static_cast<int>(total - first < kNormRanges ? total - first : kNormRanges);
    r.first_grain[0] = 0;
    for (int k = 0; k < r.count; ++k) {
      r.begin[k] = begins[first + k];
      r.n[k] = ends[first + k] - begins[first + k];
      r.first_grain[k + 1] = r.first_grain[k] + (r.n[k] + ferry::cpu_adam::kNormGrain - 1) / ferry::cpu_adam::kNormGrain;
    }
    return r;
  }
  FERRY_HD int64_t grains() const { return first_grain[count]; }
  // The range of the launch's grain g, from range k up (a block visits its grains in increasing order,
  // so it never looks back; ranges without grains are passed over).
  FERRY_HD int range_of(int64_t g, int k) const {
    while (g >= first_grain[k + 1]) ++k;
    return k;
  }
};

template <ferry::cpu_adam::GradType G>
struct NormGrainSteps {
  static constexpr int kLanes = static_cast<int>(ferry::cpu_adam::kNormLanes);
  static constexpr int kBlocks = static_cast<int>(ferry::cpu_adam::kNormGrain / ferry::cpu_adam::kNormBlock);
  static constexpr int kThreads = kLanes * kBlocks;

  // Step 1, thread t of grain q: the sum of its lane over its block's rows (elements >= n: none). Where
  // every row of the lane is inside the span (all but a span's last block), a batch of rows is loaded
  // before its fmas run: the loads are in flight together (one at a time, a thread would wait for each;
  // HBM needs many in flight), the fmas in the same order as one row at a time.
  FERRY_HD static float lane_sum(const void* grad, float scale, int64_t n, int64_t q, int t) {
    constexpr int kRows = static_cast<int>(ferry::cpu_adam::kNormBlock / ferry::cpu_adam::kNormLanes);
    constexpr int kBatch = 16;
    static_assert(kRows % kBatch == 0, "whole batches of rows");
    const int64_t first = q * ferry::cpu_adam::kNormGrain + (t / kLanes) * ferry::cpu_adam::kNormBlock + t % kLanes;
    float s = 0.0f;
    if (first + (kRows - 1) * kLanes < n) {
      for (int r = 0; r < kRows; r += kBatch) {
        float x[kBatch];
        FERRY_UNROLL
        for (int k = 0; k < kBatch; ++k) x[k] = CudaOps::mul(load_grad<CudaOps, G>(grad, first + (r + k) * kLanes), scale);
        FERRY_UNROLL
        for (int k = 0; k < kBatch; ++k) s = CudaOps::fma(x[k], x[k], s);
      }
      return s;
    }
    for (int64_t i = first; i < first + ferry::cpu_adam::kNormBlock && i < n; i += kLanes) {
      const float x = CudaOps::mul(load_grad<CudaOps, G>(grad, i), scale);
      s = CudaOps::fma(x, x, s);
    }
    return s;
  }

  // Step 2, for h = 8, 4, 2, 1: lane l < h of a block adds lane l + h's sum to its own (on the device
  // a shuffle down by h within the block's 16 lanes; lanes >= h compute values nobody reads).
  FERRY_HD static float fold(float mine, float from_lane_plus_h) { return CudaOps::add(mine, from_lane_plus_h); }

  // Step 3, thread 0 after a barrier: the grain's total from its blocks' (lane 0's) totals, in order.
  FERRY_HD static double grain_total(const float* block_totals, int64_t n, int64_t q) {
    const int64_t left = n - q * ferry::cpu_adam::kNormGrain;
    const int64_t blocks = (left + ferry::cpu_adam::kNormBlock - 1) / ferry::cpu_adam::kNormBlock;
    double total = 0.0;
    for (int b = 0; b < kBlocks && b < blocks; ++b) total += static_cast<double>(block_totals[b]);
    return total;
  }

  // The range kernel (adam_cuda.cu's norm_range_kernel): a block of kRangeThreads threads per range
  // stages its grain totals in shared memory kRangeTile at a time (`stage`, thread t: coalesced loads,
  // all in flight together), and after a barrier thread 0 adds the tile to the range's total in order
  // (`add_tile`): the span's total S of Note [One norm wherever the gradient lives], its grains in
  // order. One thread reading the totals from global memory one after another waited a load's latency
  // per grain (2,048 grains for 64M elements: the bulk of the CUDA norm's 5.2x of its floor on an H200).
  static constexpr int kRangeThreads = 256;
  static constexpr int kRangeTile = 1024;
  FERRY_HD static void stage(double* tile, const double* grain_totals, int64_t at, int64_t len, int t) {
    for (int64_t i = t; i < len; i += kRangeThreads) tile[i] = grain_totals[at + i];
  }
  FERRY_HD static double add_tile(double total, const double* tile, int64_t len) {
    for (int64_t i = 0; i < len; ++i) total += tile[i];
    return total;
  }
  // One range's total as the range kernel computes it, thread by thread (tests).
  static double range_on_host(const double* grain_totals, int64_t grains) {
    double tile[kRangeTile];
    double total = 0.0;
    for (int64_t at = 0; at < grains; at += kRangeTile) {
      const int64_t len = grains - at < kRangeTile ? grains - at : kRangeTile;
      for (int t = 0; t < kRangeThreads; ++t) stage(tile, grain_totals, at, len, t);
      total = add_tile(total, tile, len);
    }
    return total;
  }

  // One launch pair over `r` on the host, as the device runs it with a grid of `grid` blocks (each
  // visiting grains grid apart), thread by thread in the steps' order: out[k] for each range (tests).
  static void run_ranges_on_host(const void* grad, float scale, const NormRanges& r, int grid, double* out) {
    using GE = typename GradElem<G>::type;
    double* totals = new double[r.grains() > 0 ? r.grains() : 1];
    for (int b = 0; b < grid; ++b) {
      int k = 0;
      for (int64_t g = b; g < r.grains(); g += grid) {
        k = r.range_of(g, k);
        const void* base = static_cast<const GE*>(grad) + r.begin[k];
        totals[g] = grain_on_host(base, scale, r.n[k], g - r.first_grain[k]);
      }
    }
    for (int k = 0; k < r.count; ++k) out[k] = range_on_host(totals + r.first_grain[k], r.first_grain[k + 1] - r.first_grain[k]);
    delete[] totals;
  }

  // Grain q of n elements on the host, thread by thread: lanes, shuffles, the block totals.
  static double grain_on_host(const void* grad, float scale, int64_t n, int64_t q) {
    float s[kThreads];
    for (int t = 0; t < kThreads; ++t) s[t] = lane_sum(grad, scale, n, q, t);
    for (int h = kLanes / 2; h > 0; h /= 2) {
      float shuffled[kThreads];  // what a shuffle down by h within 16 lanes hands each thread
      for (int t = 0; t < kThreads; ++t) shuffled[t] = t % kLanes + h < kLanes ? s[t + h] : s[t];
      for (int t = 0; t < kThreads; ++t) s[t] = fold(s[t], shuffled[t]);
    }
    float block_totals[kBlocks];
    for (int b = 0; b < kBlocks; ++b) block_totals[b] = s[b * kLanes];
    return grain_total(block_totals, n, q);
  }

  // The whole reduction of n elements on the host, thread by thread in the steps' order: what the
  // device computes for one range (tests).
  static double run_on_host(const void* grad, float scale, int64_t n) {
    const int64_t begin = 0;
    const NormRanges r = NormRanges::batch(&begin, &n, 1, 0);
    double out = 0.0;
    run_ranges_on_host(grad, scale, r, 1, &out);
    return out;
  }
};
