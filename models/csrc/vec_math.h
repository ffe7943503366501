// Vectorizable math shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace adaspec {

// Vectors of the machine's width: VL floats, one register (AVX-512: 16; else 8, AVX2's
// width). A 64-byte type on a CPU without 64-byte registers lives on the stack, each
// operation a load and a store: the kernels ran 2-20x slower than torch's on an AVX2 CPU.
// may_alias: floats are read and written through these types.
#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vecf __attribute__((vector_size(VL * sizeof(float)), aligned(4), may_alias));
typedef int32_t veci __attribute__((vector_size(VL * sizeof(int32_t)), aligned(4), may_alias));

// Loads and stores are plain accesses through the vector type, one instruction each. (Through
// std::memcpy, GCC 12 tuned for 256-bit moves split a load into two 32-byte stores and a
// 64-byte reload that cannot be forwarded: the kernels ran 4-10x slower.)
inline vecf loadv(const float* p) { return *reinterpret_cast<const vecf*>(p); }

inline void storev(float* p, vecf v) { *reinterpret_cast<vecf*>(p) = v; }

// exp(x) for x <= 0, VL at a time: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by
// Cephes' degree-6 polynomial (relative error about 2e-7), 2^n put straight into the
// exponent bits. Written on vector types because the compiler does not vectorize std::exp.
inline vecf expv(vecf x) {
  const vecf lo = vecf{} - 87.0f;
  const vecf v = x < lo ? lo : x;
  const vecf t = v * 1.44269504088896341f + 0.5f;
  const vecf tr = __builtin_convertvector(__builtin_convertvector(t, veci), vecf);  // toward zero
  const vecf fn = tr - (tr > t ? vecf{} + 1.0f : vecf{});                            // floor
  const vecf r = (v - fn * 0.693359375f) + fn * 2.12194440e-4f;
  vecf p = vecf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vecf y = p * r * r + r + 1.0f;
  const veci bits = (__builtin_convertvector(fn, veci) + 127) << 23;
  return y * reinterpret_cast<const vecf&>(bits);  // the same bits, as floats
}

// exp of n floats x <= 0, in place.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + VL <= n; i += VL) storev(x + i, expv(loadv(x + i)));
  if (i < n) {
    float tail[VL] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    const vecf e = expv(loadv(tail));
    std::memcpy(x + i, &e, (n - i) * sizeof(float));
  }
}

}  // namespace adaspec
