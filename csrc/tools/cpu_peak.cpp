// Compute peak of the x86 dot-product instructions the W4A16 / int8 kernels are built on, in multiply-accumulates
// per second: what a large-M GEMM on this CPU can reach at best. Standalone (not part of the hf_w4 library):
//
//   g++ -O2 -pthread -o /tmp/cpu_peak csrc/tools/cpu_peak.cpp && /tmp/cpu_peak [threads ...]
//
// Each probe is a tight loop of one instruction (or an even mix of two) over 24 independent zmm accumulators, so
// neither latency nor loads limit it; each thread runs it for ~0.3 s and reports its own rate from its thread CPU
// time (CLOCK_THREAD_CPUTIME_ID: a thread descheduled by another process on a shared host does not count), and
// the wall-clock total of all threads. MACs per instruction: vfmadd231ps 16, vdpbf16ps / vpdpwssd 32 (pairs of
// 16-bit products into 16 fp32 / int32 lanes), vpdpbusd 64 (quads of 8-bit products).
#include <immintrin.h>
#include <pthread.h>
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

// 24 accumulators zmm0-23, sources zmm24-25; ITER loop trips of 24 instructions (MIX: alternating A and B).
#define ACC24(I, S)                                                                                                \
  I " %%zmm24, %%zmm25, %%zmm0\n\t" I " %%zmm24, %%zmm25, %%zmm1\n\t" I " %%zmm24, %%zmm25, %%zmm2\n\t" I        \
  " %%zmm24, %%zmm25, %%zmm3\n\t" I " %%zmm24, %%zmm25, %%zmm4\n\t" I " %%zmm24, %%zmm25, %%zmm5\n\t" I          \
  " %%zmm24, %%zmm25, %%zmm6\n\t" I " %%zmm24, %%zmm25, %%zmm7\n\t" I " %%zmm24, %%zmm25, %%zmm8\n\t" I          \
  " %%zmm24, %%zmm25, %%zmm9\n\t" I " %%zmm24, %%zmm25, %%zmm10\n\t" I " %%zmm24, %%zmm25, %%zmm11\n\t" S         \
  " %%zmm24, %%zmm25, %%zmm12\n\t" S " %%zmm24, %%zmm25, %%zmm13\n\t" S " %%zmm24, %%zmm25, %%zmm14\n\t" S       \
  " %%zmm24, %%zmm25, %%zmm15\n\t" S " %%zmm24, %%zmm25, %%zmm16\n\t" S " %%zmm24, %%zmm25, %%zmm17\n\t" S       \
  " %%zmm24, %%zmm25, %%zmm18\n\t" S " %%zmm24, %%zmm25, %%zmm19\n\t" S " %%zmm24, %%zmm25, %%zmm20\n\t" S       \
  " %%zmm24, %%zmm25, %%zmm21\n\t" S " %%zmm24, %%zmm25, %%zmm22\n\t" S " %%zmm24, %%zmm25, %%zmm23\n\t"

#define CLOBBER24                                                                                                 \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",      \
      "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", \
      "xmm25"

#define PROBE(NAME, TARGET, A, B)                                                                                 \
  __attribute__((target(TARGET))) void NAME(long n) {                                                             \
    asm volatile("vpxord %%zmm24, %%zmm24, %%zmm24\n\tvpxord %%zmm25, %%zmm25, %%zmm25\n\t"                       \
                 "1:\n\t" ACC24(A, B) "dec %[n]\n\tjnz 1b\n\t"                                                     \
                 : [n] "+r"(n)                                                                                     \
                 :                                                                                                 \
                 : CLOBBER24, "cc");                                                                               \
  }

PROBE(p_fma, "avx512f", "vfmadd231ps", "vfmadd231ps")
PROBE(p_bf16, "avx512f,avx512bf16", "vdpbf16ps", "vdpbf16ps")
PROBE(p_wssd, "avx512f,avx512vnni", "vpdpwssd", "vpdpwssd")
PROBE(p_busd, "avx512f,avx512vnni", "vpdpbusd", "vpdpbusd")
PROBE(p_bf16_wssd, "avx512f,avx512bf16,avx512vnni", "vdpbf16ps", "vpdpwssd")
PROBE(p_fma_wssd, "avx512f,avx512vnni", "vfmadd231ps", "vpdpwssd")

// AVX2 (16 ymm registers, no 16-bit dot instruction): fp32 FMA into 12 accumulators, and vpmaddwd (16 int16
// products summed in pairs) + vpaddd into 7 accumulators ymm0-6 (temporaries ymm7-13); sources ymm14-15
#define MADD(T, A) "vpmaddwd %%ymm14, %%ymm15, %%ymm" T "\n\tvpaddd %%ymm" T ", %%ymm" A ", %%ymm" A "\n\t"
#define MADD7 MADD("7", "0") MADD("8", "1") MADD("9", "2") MADD("10", "3") MADD("11", "4") MADD("12", "5") MADD("13", "6")
#define CLOBBER16                                                                                                 \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",      \
      "xmm13", "xmm14", "xmm15"
__attribute__((target("avx2"))) void p_maddwd(long n) {
  n = n * 24 / 21;  // 21 pairs per trip: about as many MACs per call as the 24-instruction probes' pairs
  asm volatile("vpxor %%ymm14, %%ymm14, %%ymm14\n\tvpxor %%ymm15, %%ymm15, %%ymm15\n\t"
               "1:\n\t" MADD7 MADD7 MADD7 "dec %[n]\n\tjnz 1b\n\t"
               : [n] "+r"(n)
               :
               : CLOBBER16, "cc");
}
#define FMA_Y(A) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" A "\n\t"
__attribute__((target("avx2,fma"))) void p_fma_ymm(long n) {
  asm volatile("vpxor %%ymm14, %%ymm14, %%ymm14\n\tvpxor %%ymm15, %%ymm15, %%ymm15\n\t"
               "1:\n\t" FMA_Y("0") FMA_Y("1") FMA_Y("2") FMA_Y("3") FMA_Y("4") FMA_Y("5") FMA_Y("6") FMA_Y("7")
               FMA_Y("8") FMA_Y("9") FMA_Y("10") FMA_Y("11") FMA_Y("0") FMA_Y("1") FMA_Y("2") FMA_Y("3") FMA_Y("4")
               FMA_Y("5") FMA_Y("6") FMA_Y("7") FMA_Y("8") FMA_Y("9") FMA_Y("10") FMA_Y("11")
               "dec %[n]\n\tjnz 1b\n\t"
               : [n] "+r"(n)
               :
               : CLOBBER16, "cc");
}

struct Probe {
  const char* name;
  void (*fn)(long);
  double macs;  // per instruction (mixes: the average of the two)
  bool (*ok)();
};

bool has_bf16() { return __builtin_cpu_supports("avx512bf16"); }
bool has_vnni() { return __builtin_cpu_supports("avx512vnni"); }
bool has_f() { return __builtin_cpu_supports("avx512f"); }
bool has_both() { return has_bf16() && has_vnni(); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
double wall_seconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

}  // namespace

int main(int argc, char** argv) {
  const Probe probes[] = {
      {"vfmadd231ps (fp32)", p_fma, 16, has_f},        {"vdpbf16ps (bf16 pairs)", p_bf16, 32, has_bf16},
      {"vpdpwssd (int16 pairs)", p_wssd, 32, has_vnni}, {"vpdpbusd (int8 quads)", p_busd, 64, has_vnni},
      {"vdpbf16ps + vpdpwssd mix", p_bf16_wssd, 32, has_both}, {"vfmadd231ps + vpdpwssd mix", p_fma_wssd, 24, has_vnni},
      // per loop instruction: 24 x 8 MACs (ymm FMA); 24 vpmaddwd + 24 vpaddd = 24 x 16 MACs over 48 instructions
      {"vfmadd231ps ymm (AVX2)", p_fma_ymm, 8, has_avx2}, {"vpmaddwd+vpaddd ymm (AVX2)", p_maddwd, 16, has_avx2},
  };
  std::vector<int> threads;
  for (int i = 1; i < argc; ++i) threads.push_back(std::atoi(argv[i]));
  if (threads.empty()) threads = {1, 2};
  const long iters = 4000000;  // x 24 instructions: ~0.3 s at 2 per cycle and ~4 GHz
  std::printf("%-28s %7s %16s %16s %12s\n", "instruction", "threads", "GMAC/s per thr", "GMAC/s wall", "instr/ns/thr");
  for (const Probe& p : probes) {
    if (!p.ok()) {
      std::printf("%-28s   (not supported by this CPU)\n", p.name);
      continue;
    }
    p.fn(iters / 8);  // warm up (clock ramp)
    for (int nt : threads) {
      std::vector<double> cpu(nt);
      const double w0 = wall_seconds();
      std::vector<std::thread> ts;
      for (int t = 0; t < nt; ++t)
        ts.emplace_back([&, t] {
          const double c0 = thread_seconds();
          p.fn(iters);
          cpu[t] = thread_seconds() - c0;
        });
      for (auto& t : ts) t.join();
      const double wall = wall_seconds() - w0;
      double per_thread = 0;
      for (double c : cpu) per_thread += 24.0 * iters * p.macs / c / 1e9 / nt;
      const double total = nt * 24.0 * iters * p.macs / wall / 1e9;
      std::printf("%-28s %7d %16.1f %16.1f %12.2f\n", p.name, nt, per_thread, total, per_thread / p.macs);
    }
  }
  return 0;
}
