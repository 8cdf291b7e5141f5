#pragma once
// The compact update of one block of kCompactBlock elements as the device runs it (adam_cuda.cu's
// compact_kernel: one warp per block), written as the steps between its shuffles so that the same code
// also runs on the host, one lane after another (run_on_host: tests). Lane l of the warp takes the
// block's elements l, l + 32, ..., l + 224 (kPerLane of them: each of its loads and stores is one
// coalesced access of the warp) and runs CompactLoop::element on each; the block's new scales are the
// maxima of |m| and u over its elements (each lane's own, then across the warp by xor shuffles: maxima
// are exact in any order, and the gradients are finite, so no NaN decides one); then each lane encodes
// its own elements. Elements past the end of a partial last block take zero moments and gradients, as
// the CPU loop's zero-padded buffer does, and store nothing.
//
// Why a warp and not, as first written, one thread per element and a block of 256 threads: that kernel
// had one element's 6 bytes in flight per thread between two trees of barriers, about 1.6 MB across an
// H200, under half of HBM's bandwidth-latency product, and measured 914 GB/s, 4.4x its floor (D84). A
// lane here loads its kPerLane elements' bytes before it computes any (48 B in flight, bf16), and no
// barrier stalls the block.
//
// Included inside the anonymous namespace of its users, after cuda_ops.h (internal linkage, see
// kernel_abi.h).

template <ferry::cpu_adam::GradType G, ferry::cpu_adam::LowpType L, bool kDecoupled, bool kDecay>
struct CompactWarpSteps {
  using Loop = CompactLoop<CudaOps, G, L, kDecoupled, kDecay>;
  using Codes = CompactCodes<CudaOps>;
  using Consts = typename Loop::Consts;
  using Updated = typename Loop::Updated;
  using Args = ferry::cpu_adam::CompactAdamArgs;
  static constexpr int kLanes = 32;
  static constexpr int kPerLane = static_cast<int>(ferry::cpu_adam::kCompactBlock) / kLanes;
  static_assert(kPerLane * kLanes == static_cast<int>(ferry::cpu_adam::kCompactBlock), "a block is whole warps");

  // A lane's elements updated, not stored yet, and its maxima of |m| and u.
  struct Lane {
    Updated e[kPerLane];
    float max_m, max_u;
  };

  // Element j of lane `lane` in block b.
  FERRY_HD static int64_t index(int64_t b, int lane, int j) {
    return b * ferry::cpu_adam::kCompactBlock + lane + static_cast<int64_t>(j) * kLanes;
  }

  // An update skipped for a non-finite gradient: master, moments and scales stay; the compute copy,
  // which may stand where the gradient was, gets the master's value back (device_adam.h).
  FERRY_HD static void restore_copy(const Args& a, int64_t n, int64_t b, int lane) {
    FERRY_UNROLL
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = index(b, lane, j);
      if (i >= n) return;
      if constexpr (L == ferry::cpu_adam::LowpType::kBf16) {
        static_cast<uint16_t*>(a.param_lowp)[i] = a.master[i];
      } else if constexpr (L == ferry::cpu_adam::LowpType::kF16) {
        static_cast<uint16_t*>(a.param_lowp)[i] = f32_to_f16(bf16_to_f32(a.master[i]));
      }
    }
  }

  // Step 1, lane `lane` of block b: every load first (in flight together), then its elements' updates
  // and its maxima.
  FERRY_HD static void update(const Consts& c, const Args& a, int64_t n, int64_t b, int lane, Lane& out) {
    float grad[kPerLane], p[kPerLane];
    uint32_t m_code[kPerLane], u_code[kPerLane];
    FERRY_UNROLL
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = index(b, lane, j);
      const bool live = i < n;
      grad[j] = live ? load_grad<CudaOps, G>(a.grad, i) : 0.0f;
      p[j] = live ? bf16_to_f32(a.master[i]) : 0.0f;
      m_code[j] = live ? a.exp_avg[i] : 0u;
      u_code[j] = live ? a.exp_avg_sq[i] : 0u;
    }
    const float s_m_beta1 = CudaOps::mul(a.exp_avg_scale[b], c.beta1);
    const float s_u_beta2 = CudaOps::mul(a.exp_avg_sq_scale[b], c.sqrt_beta2);
    out.max_m = 0.0f;
    out.max_u = 0.0f;
    FERRY_UNROLL
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = index(b, lane, j);
      const uint32_t counter = a.element_offset + static_cast<uint32_t>(i) + a.rounding_seed;
      out.e[j] = Loop::element(c, grad[j], p[j], Codes::place_m(m_code[j]), Codes::place_u(u_code[j]), s_m_beta1,
                               s_u_beta2, counter * Codes::kGolden);
      if (i < n) {
        out.max_m = CudaOps::max(out.max_m, CudaOps::abs(out.e[j].m));
        out.max_u = CudaOps::max(out.max_u, out.e[j].u);
      }
    }
  }

  // Step 2, for off = 16, 8, 4, 2, 1: each lane takes the maxima of lane (its own ^ off) (on the device
  // an xor shuffle). Every lane then holds the block's maxima.
  FERRY_HD static void fold(Lane& mine, float other_m, float other_u) {
    mine.max_m = CudaOps::max(mine.max_m, other_m);
    mine.max_u = CudaOps::max(mine.max_u, other_u);
  }

  // Step 3, lane `lane`: its elements stored, the moments encoded with the block's new scales sm, su.
  FERRY_HD static void store(const Args& a, int64_t n, int64_t b, int lane, const Lane& k, float sm, float su) {
    const float inv_m = sm > 0.0f ? CudaOps::div(1.0f, sm) : 0.0f, inv_u = su > 0.0f ? CudaOps::div(1.0f, su) : 0.0f;
    FERRY_UNROLL
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = index(b, lane, j);
      if (i >= n) return;
      const Updated& e = k.e[j];
      const uint16_t master = static_cast<uint16_t>(e.master >> 16);
      a.master[i] = master;
      if constexpr (L == ferry::cpu_adam::LowpType::kBf16) {
        static_cast<uint16_t*>(a.param_lowp)[i] = master;
      } else if constexpr (L == ferry::cpu_adam::LowpType::kF16) {
        static_cast<uint16_t*>(a.param_lowp)[i] = f32_to_f16(bf16_to_f32(master));
      }
      a.exp_avg[i] = static_cast<uint8_t>(Codes::encode_m(CudaOps::mul(e.m, inv_m)));
      a.exp_avg_sq[i] = static_cast<uint8_t>(Codes::encode_u(CudaOps::mul(e.u, inv_u), e.u));
    }
  }

  // Step 4, lane 0: the block's new scales (each lane read its own copy of the maxima: no barrier).
  FERRY_HD static void store_scales(const Args& a, int64_t b, float sm, float su) {
    a.exp_avg_scale[b] = sm;
    a.exp_avg_sq_scale[b] = su;
  }

  // The whole update of n elements on the host, block by block and lane by lane in the steps' order:
  // what the device kernel computes (tests).
  static void run_on_host(const Args& a, int64_t n, bool skip) {
    const Consts c = Loop::consts(a.hyper);
    Lane lanes[kLanes];
    for (int64_t b = 0; b * ferry::cpu_adam::kCompactBlock < n; ++b) {
      if (skip) {
        for (int l = 0; l < kLanes; ++l) restore_copy(a, n, b, l);
        continue;
      }
      for (int l = 0; l < kLanes; ++l) update(c, a, n, b, l, lanes[l]);
      for (int off = kLanes / 2; off > 0; off /= 2) {
        float m[kLanes], u[kLanes];  // what the shuffle hands each lane: taken before any lane folds
        for (int l = 0; l < kLanes; ++l) {
          m[l] = lanes[l ^ off].max_m;
          u[l] = lanes[l ^ off].max_u;
        }
        for (int l = 0; l < kLanes; ++l) fold(lanes[l], m[l], u[l]);
      }
      for (int l = 0; l < kLanes; ++l) store(a, n, b, l, lanes[l], lanes[l].max_m, lanes[l].max_u);
      store_scales(a, b, lanes[0].max_m, lanes[0].max_u);
    }
  }
};
