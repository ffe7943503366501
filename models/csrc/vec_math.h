// Vectorizable math shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace adaspec {

// may_alias: floats are read and written through these types.
typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));  // one AVX-512 register of floats
typedef int32_t ivec16 __attribute__((vector_size(64), aligned(4), may_alias));

// Loads and stores are plain accesses through the vector type, one instruction each. (Through
// std::memcpy, GCC 12 tuned for 256-bit moves split a load into two 32-byte stores and a
// 64-byte reload that cannot be forwarded: the kernels ran 4-10x slower.)
inline vec16 load16(const float* p) { return *reinterpret_cast<const vec16*>(p); }

inline void store16(float* p, vec16 v) { *reinterpret_cast<vec16*>(p) = v; }

// exp(x) for x <= 0, sixteen at a time: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by
// Cephes' degree-6 polynomial (relative error about 2e-7), 2^n put straight into the
// exponent bits. Written on vector types because the compiler does not vectorize std::exp.
inline vec16 exp16(vec16 x) {
  const vec16 lo = vec16{} - 87.0f;
  const vec16 v = x < lo ? lo : x;
  const vec16 t = v * 1.44269504088896341f + 0.5f;
  const vec16 tr = __builtin_convertvector(__builtin_convertvector(t, ivec16), vec16);  // toward zero
  const vec16 fn = tr - (tr > t ? vec16{} + 1.0f : vec16{});                            // floor
  const vec16 r = (v - fn * 0.693359375f) + fn * 2.12194440e-4f;
  vec16 p = vec16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec16 y = p * r * r + r + 1.0f;
  const ivec16 bits = (__builtin_convertvector(fn, ivec16) + 127) << 23;
  return y * reinterpret_cast<const vec16&>(bits);  // the same bits, as floats
}

// exp of n floats x <= 0, in place.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(x + i, exp16(load16(x + i)));
  if (i < n) {
    float tail[16] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    const vec16 e = exp16(load16(tail));
    std::memcpy(x + i, &e, (n - i) * sizeof(float));
  }
}

}  // namespace adaspec
