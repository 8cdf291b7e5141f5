// ferry_info: prints the environment report (versions, CPU vector ISA, GPU present or not).
//   ferry_info [--json] [--key=value ...]   (any ferry Config option, e.g. --log-level=debug)
#include <iostream>

#include "../../ferry.h"

int main(int argc, char** argv) {
  // Errors (a bad option, a bad FERRY_CPU_ISA_MAX) print without a backtrace unless --log-level=debug.
  return ferry::cli::run_main("ferry_info", [&] {
    std::vector<std::string> rest;
    const ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
    ferry::log::configure(config.log_level, config.rank);
    bool json = false;
    ferry::cli::Options options("ferry_info");
    options.also_accepts("ferry options", ferry::Config::help());
    options.add_flag("json", &json, "the report as one JSON document");
    options.parse(rest);
    const ferry::EnvReport report = ferry::collect_env_report();
    if (json) {
      std::cout << ferry::env_report_json(report) << "\n";
    } else {
      std::cout << ferry::format_env_report(report);
      ferry::log::debug("config: ", config.to_string());
    }
    return 0;
  });
}
