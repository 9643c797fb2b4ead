// The instruction sets the kernels pick from at run time, and what the kernel headers share: the
// AVX2 and AVX-512 target attributes and the vector helpers of several kernels. For cpu_ops.cpp.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Version.h>

#include <cstdint>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define HYPERSERVE_X86 1
#endif

namespace {

// The instruction sets the kernels are written for. kAvx512 (AVX-512 F/BW/VL with VNNI) only
// changes the quantized matrix kernel; everything else runs its AVX2 code there too.
enum class Isa { kPortable, kAvx2, kAvx512 };

#ifdef HYPERSERVE_X86
bool cpu_has_avx2() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}

// As the Python side decides (cpu_flags): HYPERSERVE_MAX_ISA=avx2 hides AVX-512, and so does a
// PyTorch CPU capability below AVX512 (ATEN_CPU_CAPABILITY set lower, or a CPU without it).
bool cpu_has_avx512() {
  static const bool has = [] {
    const char* cap = std::getenv("HYPERSERVE_MAX_ISA");
    const bool hidden = (cap && std::string(cap) == "avx2") || at::get_cpu_capability() != "AVX512";
    return !hidden && cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif

Isa best_isa() { return cpu_has_avx512() ? Isa::kAvx512 : cpu_has_avx2() ? Isa::kAvx2 : Isa::kPortable; }

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512_vnni" : isa == Isa::kAvx2 ? "avx2" : "portable";
}

// "" for the best this CPU has; a named one only where the CPU has it.
Isa parse_isa(const std::string& name) {
  if (name.empty()) return best_isa();
  for (const Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
    if (name != isa_name(isa)) continue;
    TORCH_CHECK(isa <= best_isa(), "quantized kernels: this CPU cannot run ", name);
    return isa;
  }
  TORCH_CHECK(false, "quantized kernels: isa must be portable, avx2 or avx512_vnni, got ", name);
}


#ifdef HYPERSERVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

AVX2 inline float hmax(__m128 m) {
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

AVX2 inline float hmax(__m256 v) {
  return hmax(_mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

AVX2 inline __m256 load8_half(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One instruction, not c10's bit twiddling.
AVX2 inline float half_to_float(const at::Half h) { return _cvtsh_ss(h.x); }
#endif

// ---- vector helpers of the attention and LoRA kernels ----

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

template <typename T>
float dot_portable(const float* q, const T* k, int64_t n) {
  float acc = 0.f;
  for (int64_t j = 0; j < n; ++j) acc += q[j] * to_float(k[j]);
  return acc;
}

template <typename T>
void axpy_portable(float a, const T* v, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] += a * to_float(v[j]);
}

#ifdef HYPERSERVE_X86
AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AVX2 inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is float32's upper half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Cephes' expf: e^x = 2^n e^r with |r| <= ln 2 / 2 and e^r a degree-6 polynomial, within ~2 ulp of
// std::exp; e^x below float's smallest normal gives 0.
AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.33f), one = _mm256_set1_ps(1.f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c :
       {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i two_n = _mm256_slli_epi32(biased, 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

template <typename T>
AVX2 float dot_avx2(const float* q, const T* k, int64_t n) {  // n: a multiple of 8
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), acc);
  return hsum(acc);
}

template <typename T>
AVX2 void axpy_avx2(float a, const T* v, float* out, int64_t n) {
  const __m256 scale = _mm256_set1_ps(a);
  for (int64_t j = 0; j < n; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_fmadd_ps(scale, load8(v + j), _mm256_loadu_ps(out + j)));
  }
}
#endif

}  // namespace
