#pragma once
// The arrays of one span of compact state (cpu_adam/compact_state.h), its gradients and compute copy,
// for the tests of the compact update: random state across several decades, encoded; the span over
// them; the bits compared whole; the state decoded.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "../../cpu_adam/compact_state.h"

namespace ferry::test {

struct Compact {
  int64_t n = 0;
  at::ScalarType grad_dtype = at::kBFloat16;
  at::ScalarType lowp_dtype = at::ScalarType::Undefined;
  std::vector<uint16_t> master, g16, lowp;
  std::vector<float> g32, m_scale, u_scale;
  std::vector<uint8_t> m, u;

  Compact(int64_t n_, at::ScalarType gd, at::ScalarType ld) : n(n_), grad_dtype(gd), lowp_dtype(ld) {
    master.assign(n, 0);
    g16.assign(n, 0);
    lowp.assign(n, 0);
    g32.assign(n, 0);
    m.assign(n, 0);
    u.assign(n, 0);
    m_scale.assign(compact_blocks(n), 0);
    u_scale.assign(compact_blocks(n), 0);
  }
  CompactAdamSpan span(uint64_t offset = 0) {
    CompactAdamSpan s;
    s.master = master.data();
    s.grad = grad_dtype == at::kFloat ? static_cast<const void*>(g32.data()) : static_cast<const void*>(g16.data());
    s.grad_dtype = grad_dtype;
    s.exp_avg = m.data();
    s.exp_avg_scale = m_scale.data();
    s.exp_avg_sq = u.data();
    s.exp_avg_sq_scale = u_scale.data();
    if (lowp_dtype != at::ScalarType::Undefined) {
      s.param_lowp = lowp.data();
      s.lowp_dtype = lowp_dtype;
    }
    s.numel = n;
    s.element_offset = offset;
    return s;
  }
  // Random fp32 state (moments spanning several decades within a block), encoded; random grads.
  void fill(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> decades(-5.f, 0.f);
    std::vector<float> p(n), mm(n), vv(n);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = 0.05f * normal(rng);
      mm[i] = 1e-3f * std::pow(10.f, decades(rng)) * (normal(rng) < 0 ? -1.f : 1.f);
      vv[i] = 1e-6f * std::pow(10.f, 2 * decades(rng));
      if (i % 97 == 5) vv[i] = 0;  // never-updated elements
      set_grad(i, 1e-3f * normal(rng));
    }
    compact_from_fp32(span(), p.data(), mm.data(), vv.data());
  }
  void set_grad(int64_t i, float x) {
    g32[i] = x;
    if (grad_dtype == at::kBFloat16) g16[i] = c10::BFloat16(x).x;
    if (grad_dtype == at::kHalf) g16[i] = c10::Half(x).x;
  }
  float grad(int64_t i) const {
    if (grad_dtype == at::kBFloat16) return static_cast<float>(c10::BFloat16(g16[i], c10::BFloat16::from_bits()));
    if (grad_dtype == at::kHalf) return static_cast<float>(c10::Half(g16[i], c10::Half::from_bits()));
    return g32[i];
  }
  struct Decoded {
    std::vector<float> p, m, v;
  };
  Decoded decoded() {
    Decoded d{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
    compact_to_fp32(span(), d.p.data(), d.m.data(), d.v.data());
    return d;
  }
  bool same_bits(const Compact& o) const {
    return master == o.master && m == o.m && u == o.u && lowp == o.lowp &&
           std::memcmp(m_scale.data(), o.m_scale.data(), m_scale.size() * 4) == 0 &&
           std::memcmp(u_scale.data(), o.u_scale.data(), u_scale.size() * 4) == 0;
  }
};

}  // namespace ferry::test
