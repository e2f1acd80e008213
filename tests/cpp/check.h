// A minimal test harness for the C++ unit tests: CHECK records a failure with its location and goes on; main()
// returns the failure count, so ctest reports the test as failed and prints every message.
#pragma once

#include <cstdio>
#include <sstream>
#include <string>

namespace pyengine::test {

inline int& failures() {
  static int count = 0;
  return count;
}

inline void fail(const char* file, int line, const std::string& what) {
  if (++failures() <= 20) std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
}

inline int finish(const char* name) {
  if (failures() == 0) {
    std::printf("%s: all checks passed\n", name);
    return 0;
  }
  std::fprintf(stderr, "%s: %d check(s) failed\n", name, failures());
  return 1;
}

}  // namespace pyengine::test

// CHECK(cond, stream-expression describing the case): the case is only formatted on failure.
#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::ostringstream check_os_;                                        \
      check_os_ << #cond << " | " << __VA_ARGS__;                          \
      ::pyengine::test::fail(__FILE__, __LINE__, check_os_.str());         \
    }                                                                      \
  } while (0)
