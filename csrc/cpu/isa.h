// Small, stable run-time ISA selection shared by hf_w4's CPU kernels (no torch headers).
// HF_W4_ISA=avx512|avx2|generic caps the choice (it never selects an ISA the CPU lacks).
#pragma once
#include <cstdlib>
#include <cstring>

namespace hf_w4 {

enum class CpuIsa : int { generic = 0, avx2 = 1, avx512 = 2 };

inline const char* isa_name(CpuIsa i) {
  return i == CpuIsa::avx512 ? "avx512" : i == CpuIsa::avx2 ? "avx2" : "generic";
}

// __builtin_cpu_supports for an AVX-512 feature. The test-only build with HF_W4_EMULATE_AVX512 (simd512.h) runs the
// AVX-512 kernels on AVX2, so there every AVX-512 feature counts as present when AVX2 is (AMX never does).
#ifdef HF_W4_EMULATE_AVX512
#define HF_W4_CPU_HAS_AVX512(feature) __builtin_cpu_supports("avx2")
#else
#define HF_W4_CPU_HAS_AVX512(feature) __builtin_cpu_supports(feature)
#endif

// best ISA the CPU supports for our kernels. "avx512" means F+BW+VL+BF16+VNNI (vcvtne2ps2bf16, vpdpwssd; every
// CPU with AVX512-BF16 has VNNI);
// "avx2" means AVX2+FMA+F16C.
inline CpuIsa cpu_best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (HF_W4_CPU_HAS_AVX512("avx512f") && HF_W4_CPU_HAS_AVX512("avx512bw") && HF_W4_CPU_HAS_AVX512("avx512vl") &&
      HF_W4_CPU_HAS_AVX512("avx512bf16") && HF_W4_CPU_HAS_AVX512("avx512vnni"))
    return CpuIsa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return CpuIsa::avx2;
#endif
  return CpuIsa::generic;
}

// parse "avx512" / "avx2" / "generic"; returns -1 for "" or "auto", -2 for unknown text
inline int parse_isa(const char* s) {
  if (!s || !*s || !std::strcmp(s, "auto")) return -1;
  if (!std::strcmp(s, "avx512")) return 2;
  if (!std::strcmp(s, "avx2")) return 1;
  if (!std::strcmp(s, "generic")) return 0;
  return -2;
}

// An HF_W4_<FEATURE>=0 switch (HF_W4_AMX, HF_W4_AMX_FP16, HF_W4_VBMI): true when the variable is set and starts
// with '0', i.e. the feature is turned off and its fallback runs. Callers read it once (a static).
inline bool env_switched_off(const char* name) {
  const char* e = std::getenv(name);
  return e && *e == '0';
}

// The ISA to use: min(requested (argument, else env HF_W4_ISA, else best), best).
inline CpuIsa choose_isa(const char* requested) {
  static const CpuIsa best = cpu_best_isa();
  int r = parse_isa(requested);
  if (r == -1) r = parse_isa(std::getenv("HF_W4_ISA"));
  if (r < 0) return best;
  return r < static_cast<int>(best) ? static_cast<CpuIsa>(r) : best;
}

}  // namespace hf_w4
