#include "cli.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "config.h"
#include "logging.h"

namespace ferry::cli {
namespace {

std::string quoted(const std::string& s) { return "'" + s + "'"; }

}  // namespace

int64_t parse_int(const std::string& what, const std::string& text, int64_t min, int64_t max) {
  char* end = nullptr;
  errno = 0;
  const long long v = text.empty() ? 0 : std::strtoll(text.c_str(), &end, 10);
  const bool whole = !text.empty() && !std::isspace(static_cast<unsigned char>(text[0])) &&
                     end == text.c_str() + text.size();
  if (!whole || errno == ERANGE) {
    throw UsageError(what + ": expected an integer, got " + quoted(text));
  }
  if (v < min || v > max) {
    std::ostringstream os;
    os << what << ": expected an integer";
    if (min != std::numeric_limits<int64_t>::min() && max != std::numeric_limits<int64_t>::max()) {
      os << " in [" << min << ", " << max << "]";
    } else if (min != std::numeric_limits<int64_t>::min()) {
      os << " >= " << min;
    } else {
      os << " <= " << max;
    }
    os << ", got " << text;
    throw UsageError(os.str());
  }
  return v;
}

double parse_double(const std::string& what, const std::string& text, double min, double max) {
  char* end = nullptr;
  errno = 0;
  const double v = text.empty() ? 0 : std::strtod(text.c_str(), &end);
  const bool whole = !text.empty() && !std::isspace(static_cast<unsigned char>(text[0])) &&
                     end == text.c_str() + text.size();
  if (!whole || errno == ERANGE || !std::isfinite(v)) {
    throw UsageError(what + ": expected a finite number, got " + quoted(text));
  }
  if (v < min || v > max) {
    std::ostringstream os;
    os << what << ": expected a number in [" << min << ", " << max << "], got " << text;
    throw UsageError(os.str());
  }
  return v;
}

bool parse_bool(const std::string& what, const std::string& text) {
  std::string s;
  for (char c : text) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  throw UsageError(what + ": expected true or false, got " + quoted(text));
}

Options::Option& Options::option(const std::string& name) {
  for (const auto& o : options_) {
    if (o.name == name) throw std::logic_error(program_ + ": option --" + name + " declared twice");
  }
  options_.push_back({name, "", "", nullptr, false});
  return options_.back();
}

Options& Options::add(const std::string& name, int64_t* out, const std::string& help, int64_t min, int64_t max) {
  Option& o = option(name);
  o.value_name = "N";
  o.help = help;
  o.set = [name, out, min, max](const std::string& v, bool has_value) {
    if (!has_value) throw UsageError("--" + name + ": expected --" + name + "=N");
    *out = parse_int("--" + name, v, min, max);
  };
  return *this;
}

Options& Options::add(const std::string& name, double* out, const std::string& help, double min, double max) {
  Option& o = option(name);
  o.value_name = "X";
  o.help = help;
  o.set = [name, out, min, max](const std::string& v, bool has_value) {
    if (!has_value) throw UsageError("--" + name + ": expected --" + name + "=X");
    *out = parse_double("--" + name, v, min, max);
  };
  return *this;
}

Options& Options::add(const std::string& name, std::string* out, const std::string& help, bool may_be_empty) {
  Option& o = option(name);
  o.value_name = "VALUE";
  o.help = help;
  o.set = [name, out, may_be_empty](const std::string& v, bool has_value) {
    if (!has_value || (v.empty() && !may_be_empty)) {
      throw UsageError("--" + name + ": expected a non-empty value (--" + name + "=VALUE), got " +
                       (has_value ? "''" : "none"));
    }
    *out = v;
  };
  return *this;
}

Options& Options::add_flag(const std::string& name, bool* out, const std::string& help) {
  Option& o = option(name);
  o.value_name = "";
  o.help = help;
  o.set = [name, out](const std::string& v, bool has_value) { *out = has_value ? parse_bool("--" + name, v) : true; };
  return *this;
}

Options& Options::also_accepts(const std::string& title, const std::string& help_text) {
  sections_.emplace_back(title, help_text);
  return *this;
}

std::string Options::usage() const {
  std::string line = "usage: " + program_ + " " + synopsis_, body;
  for (const auto& [title, text] : sections_) {
    line += " [" + title + "]";
    body += title + ":\n" + text + (text.empty() || text.back() == '\n' ? "" : "\n");
  }
  return line + "\n" + help() + body;
}

void Options::parse(const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") throw HelpRequested(usage());
  }
  for (const std::string& arg : args) {
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      throw UsageError("expected options of the form --name=value, got " + quoted(arg));
    }
    const auto eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const bool has_value = eq != std::string::npos;
    const std::string value = has_value ? arg.substr(eq + 1) : std::string();
    Option* found = nullptr;
    for (auto& o : options_) {
      if (o.name == name) found = &o;
    }
    if (!found) throw UsageError("unknown option --" + name);
    if (found->given) throw UsageError("--" + name + " given twice");
    found->set(value, has_value);
    found->given = true;
  }
}

bool Options::given(const std::string& name) const {
  for (const auto& o : options_) {
    if (o.name == name) return o.given;
  }
  return false;
}

std::string Options::help() const {
  std::ostringstream os;
  for (const auto& o : options_) {
    std::string left = "  --" + o.name + (o.value_name.empty() ? "" : "=" + o.value_name);
    if (left.size() < 32) left.resize(32, ' ');
    else left += ' ';
    os << left << o.help << "\n";
  }
  return os.str();
}

std::string message_of(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) return c10e->what_without_backtrace();
  return e.what();
}

bool prefer_expandable_segments() {
  if (cuda_allocator_configured()) return false;  // read where the environment is read (config.cpp)
  return ::setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", /*overwrite=*/0) == 0;
}

int run_main(const char* program, const std::function<int()>& body) {
  prefer_expandable_segments();
  try {
    return body();
  } catch (const HelpRequested& e) {
    std::cout << e.what();
    return 0;
  } catch (const UsageError& e) {
    std::cerr << program << ": " << e.what() << " (try --help)\n";
    return 2;
  } catch (const c10::Error& e) {
    const bool verbose = log::enabled(log::Level::kDebug);
    std::cerr << program << ": " << (verbose ? e.what() : message_of(e)) << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << "\n";
    return 1;
  }
}

bool option_given(int argc, const char* const* argv, const std::string& key) {
  auto spelt = [](std::string s, char from, char to) {
    std::replace(s.begin(), s.end(), from, to);
    return "--" + s + "=";
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg(argv[i]);
    for (const std::string& prefix : {spelt(key, '_', '-'), spelt(key, '-', '_')}) {
      if (arg.rfind(prefix, 0) == 0) return true;
    }
  }
  return false;
}

}  // namespace ferry::cli
