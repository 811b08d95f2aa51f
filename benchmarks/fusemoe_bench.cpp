// fusemoe_bench: times the fusemoe MoE layer (forward, backward, forward + backward) on one
// Hopper GPU, after checking every implementation against the library's fp32 GPU reference.
//   useful FLOPs per valid routed row: 6·H·I forward (gate/up 4·H·I, down 2·H·I), 12·H·I
//   backward, 18·H·I forward + backward; masked slots count nothing.
// One run: GPU facts → the expert count that fits the free memory (bench/memory.h: the
// preset's E, halved until it fits, said in the output) → bf16 GEMM ceiling (cuBLAS 8192³) →
// weights → per token count: routing on the host, correctness check (NaN-poisoned outputs),
// timings (CUDA events, median, L2 flushed before every timed call, the implementations
// interleaved call by call) → table on stdout, progress on stderr, figures in --json. The
// parts: bench/options (command line), bench/memory (what it allocates), bench/run (calls and
// timings), bench/checks (against the reference), bench/report (table, JSON).
// Exit: 0 ok, 1 a correctness check failed, 2 bad arguments, 3 no Hopper GPU, 4 runtime error.
// Shapes: T tokens, H hidden, I expert intermediate, E experts, K top-k, R valid routed rows.
#include <cstdio>
#include <exception>
#include <string>

#include "bench/options.h"
#include "bench/report.h"
#include "bench/run.h"

int main(int argc, char** argv) {
  using namespace fusemoe::bench;
  int exit_code = kExitOk;
  BenchParams params;
  if (!parse_command_line("fusemoe_bench", kUsage, [&] { return parse_args(argc, argv); }, &params, &exit_code)) {
    return exit_code;
  }
  BenchResult result;
  if (!gather_facts("fusemoe_bench", &result.facts)) return kExitNoHopper;

  try {
    result.memory = fit_to_device(&params, result.facts.l2_flush_bytes);
    print_header(params, result);
    if (!run_bench(params, result)) {
      std::printf("\nfusemoe_bench: CORRECTNESS FAILURE (see the FAIL lines above)\n");
      exit_code = kExitCheckFailed;
    }
  } catch (const std::exception& error) {
    result.error = error.what();
    std::fprintf(stderr, "fusemoe_bench: %s\n", error.what());
    exit_code = kExitRuntimeError;
  }
  if (!params.json_path.empty()) {
    if (!write_json(params.json_path, params, result) && exit_code == kExitOk) {
      exit_code = kExitRuntimeError;
    }
    std::fprintf(stderr, "[bench] wrote %s\n", params.json_path.c_str());
  }
  return exit_code;
}
