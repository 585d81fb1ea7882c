// Runs the Adam and cast kernels of libcapstan on fixed inputs and prints one
// line per result: a name and an FNV-1a hash of the output bytes. The same
// program built for two machines (or ISAs) must print the same lines; the
// kernels are bit-identical by design (-ffp-contract=off, explicit fma).
// Used by tools/check_native_aarch64.py; only the C ABI of capstan.h.
//
//   native_parity_harness [isa]     isa: scalar|avx2|avx512|avx512bf16 (default: best)
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "capstan.h"

namespace {

uint64_t g_state = 0x9E3779B97F4A7C15ull;

uint32_t next_u32() {  // xorshift64*
  g_state ^= g_state >> 12;
  g_state ^= g_state << 25;
  g_state ^= g_state >> 27;
  return (uint32_t)((g_state * 0x2545F4914F6CDD1Dull) >> 32);
}

float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u32() >> 8) / 16777216.0f; }

uint64_t fnv1a(const void* p, size_t n) {
  const unsigned char* b = (const unsigned char*)p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

void report(const char* name, const void* p, size_t n) {
  printf("%s %016llx\n", name, (unsigned long long)fnv1a(p, n));
}

void check(int rc, const char* what) {
  if (rc != CAPSTAN_OK) {
    fprintf(stderr, "%s: %s\n", what, capstan_strerror(rc));
    exit(2);
  }
}

// Values that exercise rounding: ordinary numbers over many binades, values
// at and near the bf16/fp16 halfway points, fp16 overflow and subnormals,
// float subnormals, signed zeros, inf and NaN.
std::vector<float> cast_inputs(int64_t n) {
  std::vector<float> v((size_t)n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    switch (i % 8) {
      case 0: v[i] = uniform(-4.0f, 4.0f); break;
      case 1: v[i] = uniform(-1.0f, 1.0f) * 70000.0f; break;  // fp16 overflow
      case 2: v[i] = uniform(-1.0f, 1.0f) * 1e-6f; break;     // fp16 subnormals
      case 3: bits = next_u32(); memcpy(&v[i], &bits, 4); break;  // any bit pattern
      case 4: bits = (next_u32() & 0xFFFF0000u) | 0x8000u; memcpy(&v[i], &bits, 4); break;  // bf16 ties
      case 5: bits = (next_u32() & 0x807FFFFFu); memcpy(&v[i], &bits, 4); break;  // f32 subnormal
      case 6: v[i] = uniform(-1.0f, 1.0f) * 1e30f; break;
      default: v[i] = (i / 8) % 3 == 0 ? -0.0f : ((i / 8) % 3 == 1 ? 1.0f / 0.0f : uniform(-9, 9));
    }
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    int isa = -1;
    for (int i = CAPSTAN_ISA_SCALAR; i <= CAPSTAN_ISA_AVX512BF16; ++i)
      if (!strcmp(argv[1], capstan_isa_name(i))) isa = i;
    if (isa < 0 || capstan_set_isa(isa) != CAPSTAN_OK) {
      fprintf(stderr, "ISA %s not usable here\n", argv[1]);
      return 3;
    }
  }
  check(capstan_set_num_threads(2), "set_num_threads");
  // Identity lines (differ between machines; the checker reads them, never compares them).
  printf("#abi %d\n#features %u\n#compiled %u\n#isa %s\n", capstan_abi_version(),
         capstan_cpu_features(), capstan_compiled_isas(), capstan_isa_name(capstan_get_isa()));

  const int64_t n = 4099;  // odd: vector bodies plus scalar tails
  std::vector<float> src = cast_inputs(n);
  std::vector<uint16_t> h16((size_t)n), b16((size_t)n);
  std::vector<float> back((size_t)n);
  check(capstan_cast(src.data(), CAPSTAN_F32, b16.data(), CAPSTAN_BF16, n), "cast f32->bf16");
  report("cast_f32_bf16", b16.data(), n * 2);
  check(capstan_cast(src.data(), CAPSTAN_F32, h16.data(), CAPSTAN_F16, n), "cast f32->f16");
  report("cast_f32_f16", h16.data(), n * 2);
  check(capstan_cast(b16.data(), CAPSTAN_BF16, back.data(), CAPSTAN_F32, n), "cast bf16->f32");
  report("cast_bf16_f32", back.data(), n * 4);
  check(capstan_cast(h16.data(), CAPSTAN_F16, back.data(), CAPSTAN_F32, n), "cast f16->f32");
  report("cast_f16_f32", back.data(), n * 4);
  check(capstan_cast(b16.data(), CAPSTAN_BF16, h16.data(), CAPSTAN_F16, n), "cast bf16->f16");
  report("cast_bf16_f16", h16.data(), n * 2);

  // Adam / AdamW: fp32, bf16 and fp16 grads, 16-bit copies of the param, 5 steps.
  const int grad_dtypes[] = {CAPSTAN_F32, CAPSTAN_BF16, CAPSTAN_F16};
  for (int adamw = 0; adamw < 2; ++adamw) {
    for (int gd : grad_dtypes) {
      std::vector<float> p((size_t)n), m((size_t)n, 0.0f), v((size_t)n, 0.0f), g32((size_t)n);
      std::vector<uint16_t> g16((size_t)n), out((size_t)n);
      for (int64_t i = 0; i < n; ++i) p[i] = uniform(-1.0f, 1.0f);
      for (int step = 1; step <= 5; ++step) {
        for (int64_t i = 0; i < n; ++i) g32[i] = uniform(-1.0f, 1.0f) * (i % 7 == 0 ? 1e-3f : 1.0f);
        const void* g = g32.data();
        if (gd != CAPSTAN_F32) {
          check(capstan_cast(g32.data(), CAPSTAN_F32, g16.data(), gd, n), "cast grad");
          g = g16.data();
        }
        const int out_dtype = step % 2 ? CAPSTAN_BF16 : CAPSTAN_F16;
        int overflow = -1;
        check(capstan_adam_step(p.data(), CAPSTAN_F32, g, gd, m.data(), v.data(), CAPSTAN_F32, 0, 0, n, step,
                                1e-3, 0.9, 0.999,
                                1e-8, adamw ? 0.01 : 0.001, adamw, 0.5, 1, out.data(), out_dtype,
                                &overflow),
              "adam_step");
        if (overflow != 0) {
          fprintf(stderr, "adam_step: unexpected overflow\n");
          return 2;
        }
        char name[64];
        snprintf(name, sizeof name, "adam%s_g%d_step%d_param", adamw ? "w" : "", gd, step);
        report(name, p.data(), n * 4);
        snprintf(name, sizeof name, "adam%s_g%d_step%d_moments", adamw ? "w" : "", gd, step);
        std::vector<float> mv(m);
        mv.insert(mv.end(), v.begin(), v.end());
        report(name, mv.data(), mv.size() * 4);
        snprintf(name, sizeof name, "adam%s_g%d_step%d_out", adamw ? "w" : "", gd, step);
        report(name, out.data(), n * 2);
      }
    }
  }
  return 0;
}
