// Instruction sets of the CPU backend: its vocabulary and attention loops are compiled once per set
// (isa_variants.inc) and the best one this CPU runs is chosen at run time, as PyTorch dispatches its own
// kernels, so that one build runs on any x86-64 CPU. PAD_MULTI_ISA (set by setup.py on x86-64) enables
// the AVX2 and AVX-512 variants; elsewhere only the baseline is built.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

#ifndef PAD_MULTI_ISA
#define PAD_MULTI_ISA 0
#endif

namespace pad_cpu {

enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "baseline";
}

// The widest set this CPU (and its operating system, which must save the wider registers) supports.
inline Isa best_isa() {
#if PAD_MULTI_ISA
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi2");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

inline std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{static_cast<int>(best_isa())};  // one per process: inline function
  return slot;
}

inline Isa active_isa() { return static_cast<Isa>(isa_slot().load(std::memory_order_relaxed)); }

// "auto" (the best supported), "avx512", "avx2" or "baseline"; a set this CPU lacks raises instead of
// crashing later with an illegal instruction. Returns the name now in use.
inline std::string set_isa(const std::string& name) {
  const Isa best = best_isa();
  Isa want;
  if (name == "auto") want = best;
  else if (name == "avx512") want = Isa::kAvx512;
  else if (name == "avx2") want = Isa::kAvx2;
  else if (name == "baseline") want = Isa::kBaseline;
  else throw std::invalid_argument("unknown instruction set '" + name + "': choose auto, avx512, avx2 or baseline");
  if (static_cast<int>(want) > static_cast<int>(best))
    throw std::invalid_argument(std::string("this CPU (or this build) cannot run ") + isa_name(want) +
                                "; the widest it runs is " + isa_name(best));
  isa_slot().store(static_cast<int>(want), std::memory_order_relaxed);
  return isa_name(want);
}

}  // namespace pad_cpu

// Calls fn of the namespace (baseline, avx2, avx512) that isa_variants.inc made for the active set.
#if PAD_MULTI_ISA
#define PAD_ISA_CALL(fn, ...)                                                         \
  do {                                                                                \
    switch (pad_cpu::active_isa()) {                                                  \
      case pad_cpu::Isa::kAvx512: avx512::fn(__VA_ARGS__); break;                     \
      case pad_cpu::Isa::kAvx2: avx2::fn(__VA_ARGS__); break;                         \
      default: baseline::fn(__VA_ARGS__); break;                                      \
    }                                                                                 \
  } while (0)
#else
#define PAD_ISA_CALL(fn, ...) baseline::fn(__VA_ARGS__)
#endif
