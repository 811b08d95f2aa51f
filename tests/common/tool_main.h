// The main() of the GPU test programs that are not GoogleTest suites (the pressure and soak
// tests): parse the options (exit 2 on a bad one), run, and turn an exception into a FAIL line
// and exit 1 (the programs' own exits: 0 pass, 1 fail, 77 skipped).
#pragma once

#include <cstdio>
#include <exception>

namespace fusemoe::harness {

template <typename Options, typename Parse, typename Run>
int tool_main(int argc, char** argv, Parse parse, Run run) {
  Options options;
  if (!parse(argc, argv, &options)) return 2;
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
}

}  // namespace fusemoe::harness
