#pragma once
// Test helper: one Adam/AdamW step computed in fp64 from fp32 inputs (torch's formula), and the bound
// within which any correct fp32 implementation of that step must land.
//
// Why a per-step fp64 reference and not a run beside torch::optim::AdamW: two correct fp32 Adams differ
// by their op order (an ulp or so per step), and training amplifies such differences chaotically: an
// element whose gradient is near zero is a sum of +- terms with an absolute error, i.e. an unbounded
// relative one, and Adam's normalised step g/(|g| + eps) turns it into an lr-sized parameter
// difference. After a few steps no fixed tolerance is honest (issue 13: 1.06e-6 against a 1e-6 bound on
// one 2-core machine, thread-count dependent). Checked one step at a time from ferry's own state, the
// fp32 error has a bound:
//
// Error analysis (u = 2^-24, the fp32 unit roundoff). With g' = g * c (c = clip coefficient / loss
// scale; plus weight_decay * p for kAdam), an fp32 step does about ten roundings on the way to the
// update: g' (1), m (2: product, sum), v (3), sqrt(v) and /sqrt(bc2) (2), + eps (1), m / denom (1),
// * lr / bc1 (2); each contributes at most u times the magnitude of the terms it combines. m may cancel
// (beta1 m vs (1 - beta1) g'), so the update's error is bounded by the terms' magnitude
//     A = lr / bc1 * (beta1 |m_old| + (1 - beta1) |g'|) / denom >= |update|,
// not by |update|. The decay p * (1 - lr wd) and the final subtraction add two roundings of |p|. Both
// sides of a comparison may round (ferry's kernels fuse some operations, torch's do not), so with a
// factor of ~1.5 for slack the bound per element is
//     |p_fp32 - p_fp64| <= 16 u (|p_old| + A),     |m_fp32 - m_fp64| <= 8 u (beta1 |m_old| + (1 - beta1) |g'|),
//     |v_fp32 - v_fp64| <= 8 u (beta2 v_old + (1 - beta2) g'^2).
// These hold on every ISA and thread count: nothing in them depends on summation order.
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "../../cpu_adam/adam_options.h"

namespace ferry::test {

constexpr double kUnitRoundoff = 5.9604644775390625e-08;  // 2^-24

struct AdamStepFp64 {
  torch::Tensor param, exp_avg, exp_avg_sq;              // fp64 results
  torch::Tensor param_tol, exp_avg_tol, exp_avg_sq_tol;  // per-element bounds for fp32 results
};

// One step number `step` (1-based, as torch counts) of `o` on fp32 state p, g, m, v with gradient
// multiplier `grad_scale`.
inline AdamStepFp64 adam_step_fp64(const torch::Tensor& p32, const torch::Tensor& g32, const torch::Tensor& m32,
                                   const torch::Tensor& v32, const AdamOptions& o, int64_t step, double grad_scale) {
  const auto p = p32.to(torch::kDouble), m = m32.to(torch::kDouble), v = v32.to(torch::kDouble);
  auto g = g32.to(torch::kDouble) * grad_scale;
  auto g_mag = g.abs();
  if (o.mode == AdamMode::kAdam && o.weight_decay != 0) {
    g = g + o.weight_decay * p;
    g_mag = g_mag + o.weight_decay * p.abs();
  }
  const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(step));
  AdamStepFp64 r;
  r.exp_avg = o.beta1 * m + (1 - o.beta1) * g;
  r.exp_avg_sq = o.beta2 * v + (1 - o.beta2) * g * g;
  const auto denom = r.exp_avg_sq.sqrt() / std::sqrt(bc2) + o.eps;
  auto decayed = p;
  if (o.mode == AdamMode::kAdamW) decayed = p * (1 - o.lr * o.weight_decay);
  r.param = decayed - (o.lr / bc1) * r.exp_avg / denom;
  const auto m_terms = o.beta1 * m.abs() + (1 - o.beta1) * g_mag;
  const auto a = (o.lr / bc1) * m_terms / denom;
  r.param_tol = 16 * kUnitRoundoff * (p.abs() + a);
  r.exp_avg_tol = 8 * kUnitRoundoff * m_terms;
  r.exp_avg_sq_tol = 8 * kUnitRoundoff * (o.beta2 * v + (1 - o.beta2) * g_mag * g_mag);
  return r;
}

// max over elements of |actual - expected| / tol (<= 1 passes); tol 0 with an exact match counts 0.
inline double excess(const torch::Tensor& actual, const torch::Tensor& expected, const torch::Tensor& tol) {
  const auto diff = (actual.to(torch::kDouble) - expected).abs();
  const auto ratio = torch::where(diff == 0, torch::zeros_like(diff), diff / tol);
  return ratio.max().item<double>();
}

}  // namespace ferry::test
