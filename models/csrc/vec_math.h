// Vectorizable math shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace adaspec {

// exp(x) for x <= 0, in a form the compiler vectorizes (std::exp does not): x = n ln2 + r
// with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial (relative error about 2e-7),
// 2^n put straight into the exponent bits.
inline void exp_inplace(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);
    const float fn = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = (v - fn * 0.693359375f) + fn * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof(float));
    x[i] = y * two_n;
  }
}

}  // namespace adaspec
