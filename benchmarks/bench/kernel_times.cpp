#include "bench/kernel_times.h"

#include <cuda_runtime_api.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#ifndef FUSEMOE_NO_CUPTI
#include <cupti_activity.h>
#include <cupti_version.h>
#endif

namespace fusemoe::bench {
namespace {

double median_of(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string demangle(const std::string& name) {
  int status = 0;
  char* out = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  if (status != 0 || out == nullptr) return name;
  std::string result(out);
  std::free(out);
  return result;
}

#ifndef FUSEMOE_NO_CUPTI

// The CUPTI entry points the tracer uses, from the dlopen'ed library.
struct CuptiApi {
  void* library = nullptr;
  decltype(&cuptiGetVersion) get_version = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiActivityGetNumDroppedRecords) num_dropped = nullptr;
  decltype(&cuptiActivityPushExternalCorrelationId) push_id = nullptr;
  decltype(&cuptiActivityPopExternalCorrelationId) pop_id = nullptr;
};

// What the buffer callbacks (CUPTI's threads) hand to the tracer.
struct RawKernel {
  uint32_t correlation;
  uint64_t start, end;
  std::string name;
};
struct TraceState {
  std::mutex mutex;
  CuptiApi api;
  bool active = false;
  std::vector<RawKernel> kernels;
  std::unordered_map<uint32_t, uint64_t> tags;  // correlation id -> external id (the tag)
  uint64_t dropped = 0;
};
TraceState& state() {
  static TraceState s;
  return s;
}

constexpr CUpti_ExternalCorrelationKind kTagKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;
// A tag reaches a kernel through the API record of its launch (the external-correlation record
// precedes an API record, and only API records of enabled kinds are made): the runtime's and the
// driver's launches (the GEMMs go through cuLaunchKernelEx) are recorded and otherwise ignored.
constexpr CUpti_ActivityKind kTracedKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_RUNTIME,
                                               CUPTI_ACTIVITY_KIND_DRIVER, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION};
constexpr size_t kBufferBytes = size_t(8) << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_num_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_num_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream_id, uint8_t* buffer, size_t, size_t valid_bytes) {
  TraceState& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    CUpti_Activity* record = nullptr;
    while (valid_bytes > 0 && s.api.next_record(buffer, valid_bytes, &record) == CUPTI_SUCCESS) {
      if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        s.kernels.push_back({k->correlationId, k->start, k->end, k->name ? k->name : "?"});
      } else if (record->kind == CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) {
        const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
        if (e->externalKind == kTagKind) s.tags[e->correlationId] = e->externalId;
      }
    }
    size_t dropped = 0;
    if (s.api.num_dropped(context, stream_id, &dropped) == CUPTI_SUCCESS) s.dropped += dropped;
  }
  std::free(buffer);
}

std::string cupti_error(const CuptiApi& api, const char* what, CUptiResult result) {
  const char* text = nullptr;
  if (api.result_string) api.result_string(result, &text);
  return std::string(what) + " failed: " + (text ? text : "CUPTI error " + std::to_string(int(result)));
}

void check(const CuptiApi& api, const char* what, CUptiResult result) {
  if (result != CUPTI_SUCCESS) throw std::runtime_error(cupti_error(api, what, result));
}

// dlopen's candidates: an explicit path, the loader's path, then the toolkit's usual folders.
void* open_cupti(std::string* tried) {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("FUSEMOE_CUPTI_LIB"); path && *path) candidates.push_back(path);
  candidates.push_back("libcupti.so.13");
  candidates.push_back("libcupti.so");
  std::vector<std::string> roots;
  for (const char* env : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* root = std::getenv(env); root && *root) roots.push_back(root);
  }
  roots.push_back("/usr/local/cuda");
  roots.push_back("/usr/local/cuda-13.0");
  for (const std::string& root : roots) {
    for (const char* dir : {"/lib64/", "/lib/", "/extras/CUPTI/lib64/", "/targets/x86_64-linux/lib/"}) {
      candidates.push_back(root + dir + "libcupti.so.13");
    }
  }
  for (const std::string& candidate : candidates) {
    if (void* library = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) return library;
    *tried += (tried->empty() ? "" : ", ") + candidate;
  }
  return nullptr;
}

template <typename Fn>
bool load_symbol(void* library, const char* name, Fn* out, std::string* why) {
  *out = reinterpret_cast<Fn>(dlsym(library, name));
  if (*out == nullptr) *why = std::string("libcupti has no ") + name;
  return *out != nullptr;
}

#endif  // FUSEMOE_NO_CUPTI

}  // namespace

#ifndef FUSEMOE_NO_CUPTI

std::unique_ptr<KernelTracer> KernelTracer::start(std::string* why) {
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.active) {
    *why = "a kernel tracer is already active in this process";
    return nullptr;
  }
  CuptiApi& api = s.api;
  if (api.library == nullptr) {
    std::string tried;
    void* library = open_cupti(&tried);
    if (library == nullptr) {
      *why = "libcupti not found (tried " + tried + "; set FUSEMOE_CUPTI_LIB to its path)";
      return nullptr;
    }
    CuptiApi loaded;
    loaded.library = library;
    const bool ok = load_symbol(library, "cuptiGetVersion", &loaded.get_version, why) &&
                    load_symbol(library, "cuptiGetResultString", &loaded.result_string, why) &&
                    load_symbol(library, "cuptiActivityRegisterCallbacks", &loaded.register_callbacks, why) &&
                    load_symbol(library, "cuptiActivityEnable", &loaded.enable, why) &&
                    load_symbol(library, "cuptiActivityDisable", &loaded.disable, why) &&
                    load_symbol(library, "cuptiActivityFlushAll", &loaded.flush_all, why) &&
                    load_symbol(library, "cuptiActivityGetNextRecord", &loaded.next_record, why) &&
                    load_symbol(library, "cuptiActivityGetNumDroppedRecords", &loaded.num_dropped, why) &&
                    load_symbol(library, "cuptiActivityPushExternalCorrelationId", &loaded.push_id, why) &&
                    load_symbol(library, "cuptiActivityPopExternalCorrelationId", &loaded.pop_id, why);
    if (!ok) {
      dlclose(library);
      return nullptr;
    }
    // The kernel record is read as this header's CUpti_ActivityKernel10: an older library may
    // write an older layout.
    uint32_t version = 0;
    if (loaded.get_version(&version) != CUPTI_SUCCESS || version < CUPTI_API_VERSION) {
      *why = "libcupti API version " + std::to_string(version) + " is older than the " +
             std::to_string(CUPTI_API_VERSION) + " this bench was built against";
      dlclose(library);
      return nullptr;
    }
    api = loaded;
  }
  CUptiResult r = api.register_callbacks(buffer_requested, buffer_completed);
  for (CUpti_ActivityKind kind : kTracedKinds) {
    if (r == CUPTI_SUCCESS) r = api.enable(kind);
  }
  if (r != CUPTI_SUCCESS) {
    *why = cupti_error(api, "enabling CUPTI's kernel records", r);
    for (CUpti_ActivityKind kind : kTracedKinds) api.disable(kind);
    return nullptr;
  }
  s.kernels.clear();
  s.tags.clear();
  s.dropped = 0;
  s.active = true;
  return std::unique_ptr<KernelTracer>(new KernelTracer());
}

KernelTracer::~KernelTracer() {
  TraceState& s = state();
  cudaDeviceSynchronize();
  s.api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  for (CUpti_ActivityKind kind : kTracedKinds) s.api.disable(kind);
  std::lock_guard<std::mutex> lock(s.mutex);
  s.kernels.clear();
  s.tags.clear();
  s.active = false;
}

void KernelTracer::push(uint64_t tag) {
  check(state().api, "cuptiActivityPushExternalCorrelationId", state().api.push_id(kTagKind, tag));
}

void KernelTracer::pop() {
  uint64_t tag = 0;
  check(state().api, "cuptiActivityPopExternalCorrelationId", state().api.pop_id(kTagKind, &tag));
}

std::vector<KernelRecord> KernelTracer::take(uint64_t* dropped, uint64_t* untagged) {
  TraceState& s = state();
  const cudaError_t sync = cudaDeviceSynchronize();
  if (sync != cudaSuccess) throw std::runtime_error(std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(sync));
  check(s.api, "cuptiActivityFlushAll", s.api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<KernelRecord> out;
  std::unordered_map<std::string, std::string> demangled;  // a few names, many records
  *untagged = 0;
  for (const RawKernel& k : s.kernels) {
    const auto tag = s.tags.find(k.correlation);
    if (tag == s.tags.end()) {
      ++*untagged;
      continue;
    }
    auto name = demangled.find(k.name);
    if (name == demangled.end()) name = demangled.emplace(k.name, demangle(k.name)).first;
    out.push_back({tag->second, k.start, k.end, name->second});
  }
  *dropped = s.dropped;
  s.kernels.clear();
  s.tags.clear();
  s.dropped = 0;
  return out;
}

#else  // FUSEMOE_NO_CUPTI: built where CUPTI's headers were absent

std::unique_ptr<KernelTracer> KernelTracer::start(std::string* why) {
  *why = "this fusemoe_bench was built without CUPTI's headers (cupti_activity.h not in the CUDA toolkit)";
  return nullptr;
}
KernelTracer::~KernelTracer() = default;
void KernelTracer::push(uint64_t) {}
void KernelTracer::pop() {}
std::vector<KernelRecord> KernelTracer::take(uint64_t* dropped, uint64_t* untagged) {
  *dropped = 0;
  *untagged = 0;
  return {};
}

#endif

PassKernels summarize_pass(const std::vector<KernelRecord>& records, const std::vector<uint64_t>& call_tags) {
  PassKernels out;
  out.calls = static_cast<int>(call_tags.size());
  std::map<uint64_t, std::vector<const KernelRecord*>> by_call;
  for (uint64_t tag : call_tags) by_call[tag];
  for (const KernelRecord& r : records) {
    if (auto call = by_call.find(r.tag); call != by_call.end()) call->second.push_back(&r);
  }
  std::vector<uint64_t> ends;  // of every record, any call or pass
  for (const KernelRecord& r : records) ends.push_back(r.end_ns);
  std::sort(ends.begin(), ends.end());
  std::vector<double> sums, spans, gaps;
  bool same_sequence = true;
  const std::vector<const KernelRecord*>* first = nullptr;
  for (auto& [tag, kernels] : by_call) {
    std::sort(kernels.begin(), kernels.end(),
              [](const KernelRecord* a, const KernelRecord* b) { return a->start_ns < b->start_ns; });
    double sum = 0;
    for (const KernelRecord* k : kernels) sum += (k->end_ns - k->start_ns) * 1e-3;
    sums.push_back(sum);
    spans.push_back(kernels.empty() ? 0.0 : (kernels.back()->end_ns - kernels.front()->start_ns) * 1e-3);
    if (!kernels.empty()) {
      // The latest end at or before the call's first start (the call's own kernels end after it).
      const auto after = std::upper_bound(ends.begin(), ends.end(), kernels.front()->start_ns);
      if (after != ends.begin()) gaps.push_back((kernels.front()->start_ns - *(after - 1)) * 1e-3);
    }
    if (first == nullptr) {
      first = &kernels;
    } else if (kernels.size() != first->size() ||
               !std::equal(kernels.begin(), kernels.end(), first->begin(),
                           [](const KernelRecord* a, const KernelRecord* b) { return a->name == b->name; })) {
      same_sequence = false;
    }
  }
  out.kernels_median_us = median_of(sums);
  out.span_median_us = median_of(spans);
  out.gap_before_median_us = median_of(gaps);  // 0 with no call after another
  if (first == nullptr) return out;
  auto add = [&](const std::string& name, int count, const std::vector<double>& times) {
    KernelTime t;
    t.name = name;
    t.short_name = short_kernel_name(name);
    t.count = count;
    t.median_us = median_of(times);
    t.min_us = times.empty() ? 0.0 : *std::min_element(times.begin(), times.end());
    t.max_us = times.empty() ? 0.0 : *std::max_element(times.begin(), times.end());
    out.kernels.push_back(t);
  };
  if (same_sequence) {
    for (size_t i = 0; i < first->size(); ++i) {
      std::vector<double> times;
      for (const auto& [tag, kernels] : by_call) times.push_back((kernels[i]->end_ns - kernels[i]->start_ns) * 1e-3);
      add((*first)[i]->name, 1, times);
    }
    return out;
  }
  // Per name, in the order of first appearance: each call's summed time of that name.
  out.note = "the calls ran different kernel sequences: kernels grouped by name, each time a call's sum";
  std::vector<std::string> names;
  for (const auto& [tag, kernels] : by_call) {
    for (const KernelRecord* k : kernels) {
      if (std::find(names.begin(), names.end(), k->name) == names.end()) names.push_back(k->name);
    }
  }
  for (const std::string& name : names) {
    std::vector<double> times;
    size_t executions = 0;
    for (const auto& [tag, kernels] : by_call) {
      double sum = 0;
      for (const KernelRecord* k : kernels) {
        if (k->name == name) {
          sum += (k->end_ns - k->start_ns) * 1e-3;
          ++executions;
        }
      }
      times.push_back(sum);
    }
    add(name, static_cast<int>((executions + by_call.size() - 1) / by_call.size()), times);
  }
  return out;
}

std::string short_kernel_name(const std::string& demangled) {
  // The function's name and template arguments: up to its parameter list at bracket depth 0.
  static const std::string kAnonymous = "(anonymous namespace)";
  int depth = 0;
  size_t end = demangled.size();
  for (size_t i = 0; i < demangled.size(); ++i) {
    if (demangled.compare(i, kAnonymous.size(), kAnonymous) == 0) {
      i += kAnonymous.size() - 1;
      continue;
    }
    const char c = demangled[i];
    if (c == '<') ++depth;
    if (c == '>') --depth;
    if (c == '(' && depth == 0 && i > 0) {
      end = i;
      break;
    }
  }
  const std::string function = demangled.substr(0, end);
  auto strip_namespaces = [](std::string text) {
    for (const char* ns : {"fusemoe::sm90::", "fusemoe::", "(anonymous namespace)::"}) {
      const size_t length = std::string(ns).size();
      for (size_t at = text.find(ns); at != std::string::npos; at = text.find(ns)) text.erase(at, length);
    }
    return text;
  };
  // A grouped-GEMM instance: its epilogue's type, whole.
  if (const size_t at = function.find("Epilogue<"); at != std::string::npos) {
    size_t begin = at;
    while (begin > 0 && (std::isalnum(static_cast<unsigned char>(function[begin - 1])) || function[begin - 1] == '_')) {
      --begin;
    }
    size_t close = at + std::string("Epilogue").size();
    int level = 0;
    for (; close < function.size(); ++close) {
      if (function[close] == '<') ++level;
      if (function[close] == '>' && --level == 0) break;
    }
    return "gemm " + strip_namespaces(function.substr(begin, close + 1 - begin));
  }
  const std::string qualified = function.substr(0, function.find('<'));
  std::string base = qualified.substr(qualified.rfind(' ') == std::string::npos ? 0 : qualified.rfind(' ') + 1);
  if (const size_t colon = base.rfind("::"); colon != std::string::npos) base = base.substr(colon + 2);
  return base.empty() ? demangled : base;
}

}  // namespace fusemoe::bench
