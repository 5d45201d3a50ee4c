// CPU feature detection and the meaning of HF_W4_ISA, shared by every hf_w4 CPU kernel family (W4A16 and int8).
// No torch headers. See docs/cpu-kernels.md ("ISA dispatch").
//
// Three ISA levels, each a fixed feature set that a kernel family may rely on:
//   avx512  = AVX-512 F, BW, VL, DQ and VNNI (+ AVX2, FMA, F16C, BMI2)
//   avx2    = AVX2, FMA, F16C, BMI2
//   generic = portable C++
// Optional features (AVX512-BF16, AVX512-VBMI, AVX512-FP16, AVX-VNNI, AMX) are separate bits of CpuCaps; a kernel
// that uses one checks its bit. HF_W4_ISA (or an op's isa argument) names the level to use: "" / auto = the best
// the CPU has; a level the CPU lacks or an unknown name is an error that says what was found and what is supported.
#pragma once
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#ifndef HF_W4_X86  // (predefined to 0 only to check the non-x86 build on an x86 machine)
#if defined(__x86_64__) || defined(_M_X64)
#define HF_W4_X86 1
#else
#define HF_W4_X86 0
#endif
#endif
#if HF_W4_X86
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace hf_w4 {

enum class CpuIsa : int { generic = 0, avx2 = 1, avx512 = 2 };

inline const char* isa_name(CpuIsa i) {
  return i == CpuIsa::avx512 ? "avx512" : i == CpuIsa::avx2 ? "avx2" : "generic";
}

// What this CPU (and, for AMX, the OS) offers; detected once per process (cpu_caps()).
struct CpuCaps {
  bool avx2 = false;        // AVX2 + FMA + F16C + BMI2
  bool avx512 = false;      // AVX-512 F, BW, VL, DQ, VNNI
  bool avx512_bf16 = false;
  bool avx512_vbmi = false;
  bool avx512_fp16 = false;
  bool avx_vnni = false;    // the VEX-encoded vpdpbusd (AVX2 CPUs such as Alder Lake, Zen 5)
  bool amx_bf16 = false;    // AMX-TILE + AMX-BF16, and Linux granted the tile data state
  bool amx_int8 = false;    // AMX-TILE + AMX-INT8, likewise
  bool amd = false;         // AuthenticAMD: tuned thresholds differ by vendor (docs/cpu-kernels.md, "M crossovers")
  CpuIsa best() const { return avx512 ? CpuIsa::avx512 : avx2 ? CpuIsa::avx2 : CpuIsa::generic; }
  // e.g. "avx512 (avx512_bf16 avx512_vbmi avx_vnni amd)": what was found, for error messages and cpu_w4a16_info
  std::string describe() const {
    std::string s = isa_name(best());
    std::string extra;
    for (auto [on, name] : {std::pair{avx512_bf16, "avx512_bf16"}, {avx512_vbmi, "avx512_vbmi"},
                            {avx512_fp16, "avx512_fp16"}, {avx_vnni, "avx_vnni"}, {amx_bf16, "amx_bf16"},
                            {amx_int8, "amx_int8"}})
      if (on) extra += (extra.empty() ? "" : " ") + std::string(name);
    if (amd) extra += (extra.empty() ? "" : " ") + std::string("amd");
    return extra.empty() ? s : s + " (" + extra + ")";
  }
};

// The test-only build with HF_W4_EMULATE_AVX512 (common/simd512.h) runs the AVX-512 kernels on AVX2, so there every
// AVX-512 feature counts as present when AVX2 is; AMX never does.
#ifdef HF_W4_EMULATE_AVX512
#define HF_W4_CPU_HAS_AVX512(feature) __builtin_cpu_supports("avx2")
#else
#define HF_W4_CPU_HAS_AVX512(feature) __builtin_cpu_supports(feature)
#endif

namespace detail {

#if HF_W4_X86
// AMX needs the CPUID bits, the OS enabling the tile state in XCR0, and (Linux) a per-process permission request
// for the tile data (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18); without the request the first tile
// instruction faults.
inline bool amx_tiles_permitted() {
#if defined(__linux__) && !defined(HF_W4_EMULATE_AVX512)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return false;  // AMX-TILE
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;            // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG + XTILEDATA enabled by the OS
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}
#endif

inline CpuCaps detect() {
  CpuCaps c;
#if HF_W4_X86
  __builtin_cpu_init();
  c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("bmi2");
  c.avx512 = c.avx2 && HF_W4_CPU_HAS_AVX512("avx512f") && HF_W4_CPU_HAS_AVX512("avx512bw") &&
             HF_W4_CPU_HAS_AVX512("avx512vl") && HF_W4_CPU_HAS_AVX512("avx512dq") &&
             HF_W4_CPU_HAS_AVX512("avx512vnni");
  c.avx512_bf16 = c.avx512 && HF_W4_CPU_HAS_AVX512("avx512bf16");
  c.avx512_vbmi = c.avx512 && HF_W4_CPU_HAS_AVX512("avx512vbmi");
  c.avx_vnni = c.avx2 && __builtin_cpu_supports("avxvnni");
  unsigned a, b, cx, d;
  if (__get_cpuid(0, &a, &b, &cx, &d)) c.amd = b == 0x68747541u && d == 0x69746e65u && cx == 0x444d4163u;
#ifndef HF_W4_EMULATE_AVX512
  if (c.avx512 && __get_cpuid_count(7, 0, &a, &b, &cx, &d)) {
    c.avx512_fp16 = d & (1u << 23);
    if (amx_tiles_permitted()) {
      c.amx_bf16 = c.avx512_bf16 && (d & (1u << 22));
      c.amx_int8 = d & (1u << 25);
    }
  }
#endif
#endif
  return c;
}

}  // namespace detail

inline const CpuCaps& cpu_caps() {
  static const CpuCaps c = detail::detect();
  return c;
}

// An HF_W4_<FEATURE>=0 switch (HF_W4_AMX, HF_W4_AMX_FP16, HF_W4_VBMI): true when the variable is set and starts
// with '0', i.e. the feature is turned off and its fallback runs. Callers read it once (a static).
inline bool env_switched_off(const char* name) {
  const char* e = std::getenv(name);
  return e && *e == '0';
}

// HF_W4_AMX=0 (read once): no kernel family uses AMX, as on a CPU without it.
inline bool amx_allowed() {
  static const bool v = !env_switched_off("HF_W4_AMX");
  return v;
}

// "" / "auto" -> 0 (the best level), a level name -> 1 + level, anything else -> -1
inline int parse_isa(const char* s) {
  if (!s || !*s || !std::strcmp(s, "auto")) return 0;
  for (CpuIsa i : {CpuIsa::generic, CpuIsa::avx2, CpuIsa::avx512})
    if (!std::strcmp(s, isa_name(i))) return 1 + static_cast<int>(i);
  return -1;
}

// The ISA level for a request (an op's isa argument; when that is "" / auto, the environment's HF_W4_ISA; when that
// is unset too, the best level). On an unknown name or a level this CPU lacks, returns false and an error text in
// `err` that names the source, the value, what the CPU has and what is supported.
inline bool resolve_isa(const char* requested, CpuIsa& out, std::string& err) {
  const CpuCaps& caps = cpu_caps();
  const char* from = "isa";
  const char* v = requested ? requested : "";
  if (parse_isa(v) == 0) {
    const char* e = std::getenv("HF_W4_ISA");
    if (e && *e) { from = "HF_W4_ISA"; v = e; }
  }
  const int r = parse_isa(v);
  const CpuIsa best = caps.best();
  if (r >= 0 && r - 1 <= static_cast<int>(best)) {
    out = r == 0 ? best : static_cast<CpuIsa>(r - 1);
    return true;
  }
  std::string supported;  // (strings only on the error path: this runs on every op call)
  for (int i = static_cast<int>(best); i >= 0; --i) supported += std::string(", ") + isa_name(static_cast<CpuIsa>(i));
  if (r < 0) err = std::string(from) + "='" + v + "' is not an ISA name; use auto" + supported;
  else err = std::string(from) + "='" + v + "' is not available: this CPU has " + caps.describe() + "; use auto" +
             supported;
  return false;
}

}  // namespace hf_w4
