// The expert-parallel layer across processes, its peer table built from CUDA IPC handles (the
// route docs/expert_parallel.md shows a C++ caller): R child processes on the one GPU (the GPU
// time-slices their contexts, so their kernels' waits on each other make progress), each rank
// publishing its symmetric workspace's handle through a file, opening the others', running a
// forward and a backward, and checking its own outputs bitwise against the single-GPU fused layer
// on the concatenated batch (which every child computes itself from the same seed).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "fusemoe/expert_parallel.h"
#include "gpu/ep_test_util.h"

extern char** environ;

namespace fusemoe::test {
namespace {

constexpr Dims kIpcDims{0, 256, 128, 8, 4};
constexpr int64_t kTokensPerRank = 96;

bool wait_for_file(const std::string& path, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (std::ifstream(path).good()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

void write_file_atomically(const std::string& path, const void* bytes, size_t size) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp, std::ios::binary).write(static_cast<const char*>(bytes), static_cast<std::streamsize>(size));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename " + tmp);
}

// One rank in its own process; returns the process exit code (0: outputs bitwise equal).
int run_child(int rank, int world_size, const std::string& dir) {
  Dims d = kIpcDims;
  d.T = kTokensPerRank * world_size;
  const HostProblem p = make_problem(d, Routing::kUniform, 77);
  const int64_t El = d.E / world_size, T = kTokensPerRank, t0 = rank * kTokensPerRank;
  EpConfig config;
  config.layer = config_of(d, T);
  config.world_size = world_size;
  config.rank = rank;

  // The symmetric workspace, zeroed once, and its handle for the others.
  DeviceBuffer symmetric(ep_symmetric_bytes(config));
  TEST_CUDA(cudaMemset(symmetric.get(), 0, symmetric.bytes()));
  // Done before the handle is published: a peer may write its message and flags into this buffer
  // as soon as it has opened it, and a zeroing that lands after them wipes them.
  TEST_CUDA(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle;
  TEST_CUDA(cudaIpcGetMemHandle(&handle, symmetric.get()));
  write_file_atomically(dir + "/handle_" + std::to_string(rank), &handle, sizeof(handle));
  std::vector<void*> peers(world_size, nullptr);
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) {
      peers[r] = symmetric.get();
      continue;
    }
    const std::string path = dir + "/handle_" + std::to_string(r);
    if (!wait_for_file(path, 60)) {
      std::fprintf(stderr, "rank %d: no handle from rank %d\n", rank, r);
      return 2;
    }
    cudaIpcMemHandle_t other;
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(&other), sizeof(other));
    TEST_CUDA(cudaIpcOpenMemHandle(&peers[r], other, cudaIpcMemLazyEnablePeerAccess));
  }

  const RankInputs in(p, t0, T, rank * El, El);
  DeviceBuffer y(T * d.H * 2), dx(T * d.H * 2), dtw(T * d.K * 4), dw13(El * 2 * d.I * d.H * 4),
      dw2(El * d.H * d.I * 4), ws(ep_workspace_bytes(config));
  for (DeviceBuffer* b : {&y, &dx, &dtw, &dw13, &dw2, &ws}) b->poison();
  EpForwardArgs fa;
  fa.call = in.call(T, peers.data(), ws);
  fa.y = y.get();
  EpBackwardArgs ba;
  ba.call = fa.call;
  ba.dy = in.dy.get();
  ba.dx = dx.get();
  ba.d_topk_weights = static_cast<float*>(dtw.get());
  ba.dw13 = dw13.get();
  ba.dw2 = dw2.get();
  try {
    ep_forward(config, fa);
    ep_backward(config, ba);
    TEST_CUDA(cudaDeviceSynchronize());
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 3;
  }
  // Nobody frees a workspace another rank may still read: every rank says it is done, then waits.
  const char done = 1;
  write_file_atomically(dir + "/done_" + std::to_string(rank), &done, 1);
  for (int r = 0; r < world_size; ++r) {
    if (!wait_for_file(dir + "/done_" + std::to_string(r), 60)) return 2;
  }
  for (int r = 0; r < world_size; ++r) {
    if (r != rank) TEST_CUDA(cudaIpcCloseMemHandle(peers[r]));
  }

  // The single-GPU fused layer on the whole batch (fp32 weight gradients, recomputed z).
  const LayerOutputs single = run_layer(Impl::kFused, p);
  // Compared as raw bits (-0 and +0 differ, as they would not as doubles). run_layer's outputs
  // are bf16 and fp32 values widened exactly to double, so narrowing them back gives their bits
  // for every finite value, zero and infinity; a NaN on either side fails.
  auto bf16_bits = [](const std::vector<double>& v) {
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = host::float_to_bf16_bits(static_cast<float>(v[i]));
    return bits;
  };
  auto fp32_bits = [](const std::vector<double>& v) {
    std::vector<uint32_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const float f = static_cast<float>(v[i]);
      std::memcpy(&bits[i], &f, sizeof(f));
    }
    return bits;
  };
  auto bf16_nan = [](uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x007Fu) != 0; };
  auto fp32_nan = [](uint32_t b) { return (b & 0x7F800000u) == 0x7F800000u && (b & 0x007FFFFFu) != 0; };
  int failures = 0;
  auto expect_bitwise = [&](const auto& got, const auto& want, auto is_nan, const char* what) {
    if (got.size() != want.size()) {
      std::fprintf(stderr, "rank %d %s: %zu elements, expected %zu\n", rank, what, got.size(), want.size());
      ++failures;
      return;
    }
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i] || is_nan(got[i]) || is_nan(want[i])) {
        std::fprintf(stderr, "rank %d %s: element %zu differs (bits 0x%llx vs 0x%llx)\n", rank, what, i,
                     static_cast<unsigned long long>(got[i]), static_cast<unsigned long long>(want[i]));
        ++failures;
        return;
      }
    }
  };
  expect_bitwise(y.to_host<uint16_t>(), bf16_bits(rows_of(single.y, t0, T, d.H)), bf16_nan, "y");
  expect_bitwise(dx.to_host<uint16_t>(), bf16_bits(rows_of(single.dx, t0, T, d.H)), bf16_nan, "dx");
  expect_bitwise(dtw.to_host<uint32_t>(), fp32_bits(rows_of(single.d_topk_w, t0, T, d.K)), fp32_nan,
                 "d_topk_weights");
  expect_bitwise(dw13.to_host<uint32_t>(), fp32_bits(rows_of(single.dw13, rank * El, El, 2 * d.I * d.H)), fp32_nan,
                 "dw13");
  expect_bitwise(dw2.to_host<uint32_t>(), fp32_bits(rows_of(single.dw2, rank * El, El, d.H * d.I)), fp32_nan, "dw2");
  return failures == 0 ? 0 : 1;
}

std::string g_self;  // this binary's path, for the children

class EpIpc : public ::testing::TestWithParam<int> {};

TEST_P(EpIpc, ProcessesOnOneGpuMatchTheSingleGpuLayer) {
  const int world_size = GetParam();
  char dir_template[] = "/tmp/fusemoe_ep_ipc.XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  std::vector<pid_t> children;
  for (int r = 0; r < world_size; ++r) {
    const std::string rank = std::to_string(r), size = std::to_string(world_size);
    std::vector<char*> argv = {const_cast<char*>(g_self.c_str()), const_cast<char*>("--ep-ipc-child"),
                               const_cast<char*>(rank.c_str()), const_cast<char*>(size.c_str()),
                               const_cast<char*>(dir.c_str()), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, g_self.c_str(), nullptr, nullptr, argv.data(), environ), 0);
    children.push_back(pid);
  }
  for (int r = 0; r < world_size; ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(children[r], &status, 0), children[r]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " exited with " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1)
        << " (1: outputs differ, 2: a peer never came, 3: an error; its stderr says which)";
  }
  std::system(("rm -rf " + dir).c_str());
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpIpc, ::testing::Values(2, 4));

}  // namespace

// Called by the suite's main before anything else: a child rank runs and exits here.
int maybe_run_ep_ipc_child(int argc, char** argv) {
  g_self = argv[0];
  if (argc == 5 && std::strcmp(argv[1], "--ep-ipc-child") == 0) {
    std::exit(run_child(std::atoi(argv[2]), std::atoi(argv[3]), argv[4]));
  }
  return 0;
}

}  // namespace fusemoe::test
