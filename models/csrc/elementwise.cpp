// Fused float32 elementwise layers for the CPU, each one pass over its rows where torch
// takes four to eight small ops (about 4 us each here, more than the arithmetic at decode
// sizes): RMSNorm, the rotary embedding (in place) and SwiGLU's silu(gate) * up.
#include <torch/extension.h>
#include "thread_pool.h"

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// Rows per parallel task: small batches stay on one thread (a fork costs more than they do).
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

}  // namespace

// y = x / sqrt(mean(x^2) + eps) * weight, per row of x (T, H).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == torch::kFloat32,
              "weight must hold H contiguous floats");
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  auto y = torch::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  adaspec::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * ld;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      float* out = yp + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) out[i] = row[i] * inv * wp[i];
    }
  });
  return y;
}

// Neox-style rotation in place: qk (T, heads, hd) with contiguous heads (rows may be
// strided, e.g. the query and key heads of a fused qkv output); cos, sin (P, hd / 2).
void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(qk.device().is_cpu() && qk.scalar_type() == torch::kFloat32 && qk.dim() == 3, "qk must be (T, heads, hd)");
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "qk's heads must be contiguous");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == qk.size(0),
              "positions must be T contiguous int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) * 2 == qk.size(2), "cos/sin must be (P, hd/2)");
  const int64_t T = qk.size(0), heads = qk.size(1), hd = qk.size(2), half = hd / 2, ld = qk.stride(0);
  const int64_t P = cos.size(0);
  float* q = qk.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  adaspec::parallel_for(0, T, grain(heads * hd), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " is outside the rotary table");
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = q + t * ld + h * hd;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// silu(g) * u = g * sigmoid(g) * u, with exp(-|g|) <= 1: no overflow on either side.
inline adaspec::vec16 silu_mul16(adaspec::vec16 g, adaspec::vec16 u) {
  const adaspec::vec16 e = adaspec::exp16(g < 0.0f ? g : -g);
  const adaspec::vec16 d = 1.0f / (1.0f + e);
  return g * (g >= 0.0f ? d : e * d) * u;
}

// gate_up (T, 2I) -> silu(gate) * up (T, I).
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto y = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  adaspec::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    using adaspec::vec16;
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * ld;
      const float* u = g + I;
      float* out = yp + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) adaspec::store16(out + i, silu_mul16(adaspec::load16(g + i), adaspec::load16(u + i)));
      if (i < I) {  // the tail, through zero-padded buffers
        float gb[16] = {}, ub[16] = {};
        std::memcpy(gb, g + i, (I - i) * sizeof(float));
        std::memcpy(ub, u + i, (I - i) * sizeof(float));
        const vec16 r = silu_mul16(adaspec::load16(gb), adaspec::load16(ub));
        std::memcpy(out + i, &r, (I - i) * sizeof(float));
      }
    }
  });
  return y;
}
