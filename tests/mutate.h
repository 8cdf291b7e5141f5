#pragma once
// Random mutations of a document, for the tests that feed ferry's readers bytes from outside (JSON,
// safetensors headers, checkpoint manifests): each reader must either read a mutated document or
// refuse it with a c10::Error, never crash, hang or read outside its input. Deterministic per
// generator seed, so a failure names the iteration that reproduces it.
#include <cstddef>
#include <random>
#include <string>

namespace ferry::test {

// `text` with 1-4 mutations: a byte replaced (by a random one or one of the characters that shape
// JSON, numbers and manifests), inserted or deleted, a span duplicated or removed, a cut.
inline std::string mutate(std::string text, std::mt19937& rng) {
  static const std::string kShaping = "{}[]\":,.-+eE0123456789 \n\\u/x";
  const auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const int count = 1 + static_cast<int>(rng() % 4);
  for (int k = 0; k < count; ++k) {
    const size_t at = pick(text.size() + 1);
    const char c = rng() % 2 ? kShaping[pick(kShaping.size())] : static_cast<char>(rng() & 0xff);
    switch (rng() % 6) {
      case 0:
        if (at < text.size()) text[at] = c;
        break;
      case 1:
        text.insert(at, 1, c);
        break;
      case 2:
        if (at < text.size()) text.erase(at, 1);
        break;
      case 3: {  // a span duplicated in place
        const size_t len = pick(std::min<size_t>(32, text.size() - std::min(at, text.size())) + 1);
        text.insert(at, text.substr(std::min(at, text.size()), len));
        break;
      }
      case 4:  // a span removed
        if (at < text.size()) text.erase(at, 1 + pick(16));
        break;
      default:  // cut short
        text.resize(at);
        break;
    }
  }
  return text;
}

}  // namespace ferry::test
