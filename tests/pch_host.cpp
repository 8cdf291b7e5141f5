// The host of the tests' precompiled header (tests/CMakeLists.txt, D102): CMake compiles <torch/torch.h>
// and <gtest/gtest.h> once with this target's flags, and the tests that include them reuse the result.
// The program itself does nothing.
int main() { return 0; }
