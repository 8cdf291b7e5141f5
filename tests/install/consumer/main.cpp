// Built against an installed ferry by tests/install: uses the public API through <ferry/ferry.h>.
#include <ferry/ferry.h>

#include <iostream>

int main() {
  const ferry::Config config = ferry::Config::from_env({});
  const ferry::EnvReport report = ferry::collect_env_report();
  if (config.chunk_size_bytes != 0 || report.torch_version.empty()) return 1;  // 0: auto
  std::cout << "ferry consumer ok: ferry " << ferry::version() << ", torch " << report.torch_version
            << ", CPU kernels " << ferry::to_string(ferry::best_cpu_isa()) << "\n";
  return 0;
}
