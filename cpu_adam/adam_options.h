#pragma once
// Hyper-parameters of one Adam/AdamW parameter group, shared by CpuAdam and (later) HybridAdam.
namespace ferry {

enum class AdamMode {
  kAdam,   // L2 penalty: grad += weight_decay * param (torch::optim::Adam)
  kAdamW,  // decoupled decay: param *= 1 - lr * weight_decay (torch::optim::AdamW)
};

// The defaults are torch::optim::AdamWOptions' (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay
// 1e-2): a default AdamOptions is torch's AdamW.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  AdamMode mode = AdamMode::kAdamW;

  // Chainable setters, in the style of torch::optim::AdamWOptions(lr).weight_decay(...):
  //   ferry::AdamOptions().with_lr(3e-4).with_betas(0.9, 0.95).with_weight_decay(0.1)
  AdamOptions& with_lr(double v) { lr = v; return *this; }
  AdamOptions& with_betas(double b1, double b2) { beta1 = b1; beta2 = b2; return *this; }
  AdamOptions& with_eps(double v) { eps = v; return *this; }
  AdamOptions& with_weight_decay(double v) { weight_decay = v; return *this; }
  AdamOptions& with_mode(AdamMode m) { mode = m; return *this; }

  // TORCH_CHECKs: lr >= 0, 0 <= beta1, beta2 < 1, eps > 0, weight_decay >= 0, all finite.
  void validate() const;
};

const char* to_string(AdamMode mode);

}  // namespace ferry
