#pragma once
// Strict command-line options for ferry's programs (train_gpt, bench_gpt, train_resnet, ferry_info):
// `--name=value` (or `--name` for a flag). Every value must parse whole and lie in its range; errors
// name the option, what was expected and what was given, and unknown or repeated options are errors.
// ferry's own options (Config) are parsed by Config::from_args under the same rules; a program hands
// the arguments Config did not take to its Options.
//
//   int64_t steps = 300; bool ckpt = false; std::string save;
//   ferry::cli::Options opts("train_gpt");
//   opts.add("steps", &steps, "optimizer steps", 1).add_flag("checkpoint-activations", &ckpt, "...")
//       .add("save", &save, "save the training state into DIR at the end")
//       .also_accepts("ferry options", ferry::Config::help());
//   opts.parse(rest);                        // throws cli::UsageError, or cli::HelpRequested for --help
//   return ferry::cli::run_main("train_gpt", [&] { ...; return 0; });   // prints errors, no backtrace
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ferry::cli {

// A bad command line: the message says which option, what was expected and what was given.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// `--help` was given: what() is the program's usage text. run_main prints it on stdout and returns 0.
class HelpRequested : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Whole-string parsers, used by Options and by Config (`what` names the option in errors).
int64_t parse_int(const std::string& what, const std::string& text, int64_t min = std::numeric_limits<int64_t>::min(),
                  int64_t max = std::numeric_limits<int64_t>::max());
double parse_double(const std::string& what, const std::string& text,
                    double min = -std::numeric_limits<double>::max(), double max = std::numeric_limits<double>::max());
bool parse_bool(const std::string& what, const std::string& text);  // true|false|1|0|yes|no|on|off
// Whether argv gives `--key=...` (dashes or underscores alike): for a program whose default for a ferry
// option differs from the library's (train_gpt and bench_gpt plan activations, activations=auto).
bool option_given(int argc, const char* const* argv, const std::string& key);

class Options {
 public:
  // `synopsis` follows the program's name in the usage line ("--model=DIR [options]").
  explicit Options(std::string program, std::string synopsis = "[options]")
      : program_(std::move(program)), synopsis_(std::move(synopsis)) {}

  Options& add(const std::string& name, int64_t* out, const std::string& help,
               int64_t min = std::numeric_limits<int64_t>::min(), int64_t max = std::numeric_limits<int64_t>::max());
  Options& add(const std::string& name, double* out, const std::string& help,
               double min = -std::numeric_limits<double>::max(), double max = std::numeric_limits<double>::max());
  // An empty value is an error unless `may_be_empty`.
  Options& add(const std::string& name, std::string* out, const std::string& help, bool may_be_empty = false);
  // `--name` sets true; `--name=true|false` (1/0, yes/no, on/off) sets that.
  Options& add_flag(const std::string& name, bool* out, const std::string& help);

  // A section after the options in the usage text, e.g. ("ferry options", Config::help()) for a program
  // that hands its arguments to Config::from_args first.
  Options& also_accepts(const std::string& title, const std::string& help_text);

  // Parses `args` (each "--name=value" or "--name"). Throws UsageError; `--help` (or `-h`) anywhere
  // throws HelpRequested with usage() instead.
  void parse(const std::vector<std::string>& args);
  bool given(const std::string& name) const;
  // One line per option: "  --name=VALUE   help".
  std::string help() const;
  // "usage: PROGRAM SYNOPSIS [TITLE]...", help(), then each also_accepts() section under its title.
  std::string usage() const;

 private:
  struct Option {
    std::string name, value_name, help;
    std::function<void(const std::string& value, bool has_value)> set;
    bool given = false;
  };
  Option& option(const std::string& name);
  std::string program_, synopsis_;
  std::vector<Option> options_;
  std::vector<std::pair<std::string, std::string>> sections_;  // also_accepts(): title, help text
};

// An error's message; for a c10::Error without its C++ backtrace (for messages that quote another).
std::string message_of(const std::exception& e);

// Runs `body`; prints any error as "PROGRAM: message" on stderr (a UsageError adds "(try --help)" and
// returns 2; other errors return 1); a HelpRequested's text goes to stdout and returns 0. c10 errors are printed without their C++ backtrace unless the
// log level is debug or trace. Before `body`, prefer_expandable_segments().
int run_main(const char* program, const std::function<int()>& body);

// Unless the user configured the CUDA caching allocator (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF
// set), sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for this process; returns whether it did.
// Chunks of two sizes (bf16 parameters, fp32 state: twice as large) moving in and out fragment the
// default allocator's pool of large blocks: on an H100 a 12B run failed its second step with 9.1 GiB
// reserved but unallocated. Must run before the first CUDA allocation (the allocator reads it once);
// ferry's programs call it through run_main, and programs of users can call it first thing in main().
bool prefer_expandable_segments();

}  // namespace ferry::cli
