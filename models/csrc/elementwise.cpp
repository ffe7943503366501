// Fused float32 elementwise layers for the CPU, each one pass over its rows where torch
// takes four to eight small ops (about 4 us each here, more than the arithmetic at decode
// sizes): RMSNorm, the rotary embedding (in place), SwiGLU's silu(gate) * up, and a draft
// step's softmax top two and each row's argmax.
#include <torch/extension.h>
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// Copies n floats to dst with stores that bypass the caches where the CPU has them (dst
// aligned to a vector, n a multiple of its floats, AVX-512 or AVX; else a plain copy). For rows written now and
// read many steps later (the MTP's hidden log): a plain store first reads each line of the
// never-cached destination in, which made a batch-16 step's final norm 30-40 us dearer.
void stream_row(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__)
  if ((reinterpret_cast<uintptr_t>(dst) & 63) == 0 && n % 16 == 0) {
    for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
    return;
  }
#elif defined(__AVX__)
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0 && n % 8 == 0) {
    for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

// Streamed stores are weakly ordered: fence them before another thread may read the rows.
void stream_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_sfence();
#endif
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// Rows per parallel task: small batches stay on one thread (a fork costs more than they do).
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

}  // namespace

// y = x / sqrt(mean(x^2) + eps) * weight, per row of x (T, H). With `out`, y is also copied into
// its rows out_row .. out_row + T - 1 (the MTP's hidden log), past the caches (stream_row): y itself
// is a new tensor, which the head reads while it is still in the core's caches.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& out, int64_t out_row) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == torch::kFloat32,
              "weight must hold H contiguous floats");
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  float* copy = nullptr;
  if (out.has_value()) {
    check_rows(*out, "out");
    TORCH_CHECK(out->is_contiguous() && out->size(1) == H && out_row >= 0 && out_row + T <= out->size(0),
                "out must be contiguous with rows out_row .. out_row + T - 1 of H floats");
    copy = out->data_ptr<float>() + out_row * H;
  }
  torch::Tensor y = torch::empty({T, H}, x.options());
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
      float* o = yp + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = row[i] * inv * wp[i];
      if (copy != nullptr) stream_row(copy + t * H, o, H);
    }
    if (copy != nullptr) stream_fence();
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
inline adaspec::vecf silu_mul_v(adaspec::vecf g, adaspec::vecf u) {
  const adaspec::vecf e = adaspec::expv(g < 0.0f ? g : -g);
  const adaspec::vecf d = 1.0f / (1.0f + e);
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
    using adaspec::VL;
    using adaspec::loadv;
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * ld;
      const float* u = g + I;
      float* out = yp + t * I;
      int64_t i = 0;
      for (; i + VL <= I; i += VL) adaspec::storev(out + i, silu_mul_v(loadv(g + i), loadv(u + i)));
      if (i < I) {  // the tail, through zero-padded buffers
        float gb[VL] = {}, ub[VL] = {};
        std::memcpy(gb, g + i, (I - i) * sizeof(float));
        std::memcpy(ub, u + i, (I - i) * sizeof(float));
        const adaspec::vecf r = silu_mul_v(loadv(gb), loadv(ub));
        std::memcpy(out + i, &r, (I - i) * sizeof(float));
      }
    }
  });
  return y;
}

// A draft step's confidence inputs in one pass per row: for each row of logits (n, V), the
// softmax's top token (the first of equal maxima), its probability and the margin to the
// second largest probability (equal maxima: 0), into tokens (n,) int64, top and margin (n,)
// float64 (both 0 for a row that is no distribution). Where torch took a softmax, a top-2
// and their conversions (about 110 us a draft step at batch 1, between forward passes), this
// is one call. Sums run in a fixed order: the same bits on every rank.
namespace {

// draft_top2 over n rows of logits (row stride ld) into n tokens, top probabilities and margins.
void top2_rows(const float* lp, int64_t n, int64_t V, int64_t ld, int64_t* tp, double* pp, double* mp);

}  // namespace

void draft_top2(const torch::Tensor& logits, torch::Tensor& tokens, torch::Tensor& top, torch::Tensor& margin) {
  check_rows(logits, "logits");
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 2, "logits need at least two columns");
  for (const torch::Tensor* t : {&tokens, &top, &margin}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->is_contiguous() && t->numel() == n,
                "tokens, top and margin must be (n,) contiguous on the CPU");
  }
  TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && top.scalar_type() == torch::kFloat64 &&
              margin.scalar_type() == torch::kFloat64, "tokens must be int64, top and margin float64");
  top2_rows(logits.data_ptr<float>(), n, V, logits.stride(0), tokens.data_ptr<int64_t>(), top.data_ptr<double>(),
            margin.data_ptr<double>());
}

// draft_top2 into draft position j of the draft loop's buffers: tokens (budget, n) int64,
// contiguous, and inputs (3, budget, n) float64 with contiguous rows (top probability, margin,
// and the drafted token's probability, set to the top one: a greedy row's). Where the loop had
// taken three views of them and copied a row between forward passes, this is one call.
void draft_top2_at(const torch::Tensor& logits, torch::Tensor& tokens, torch::Tensor& inputs, int64_t j) {
  check_rows(logits, "logits");
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 2, "logits need at least two columns");
  TORCH_CHECK(tokens.device().is_cpu() && tokens.dim() == 2 && tokens.is_contiguous() && tokens.size(1) == n &&
              tokens.scalar_type() == torch::kInt64, "tokens must be a contiguous (budget, n) int64 CPU tensor");
  TORCH_CHECK(inputs.device().is_cpu() && inputs.dim() == 3 && inputs.size(0) == 3 &&
              inputs.size(1) == tokens.size(0) && inputs.size(2) == n && inputs.stride(2) == 1 &&
              inputs.scalar_type() == torch::kFloat64,
              "inputs must be a (3, budget, n) float64 CPU tensor with contiguous rows");
  TORCH_CHECK(0 <= j && j < tokens.size(0), "draft_top2_at: no draft position ", j, " in buffers of ", tokens.size(0));
  double* top = inputs.data_ptr<double>() + j * inputs.stride(1);
  double* margin = top + inputs.stride(0);
  double* chosen = margin + inputs.stride(0);
  top2_rows(logits.data_ptr<float>(), n, V, logits.stride(0), tokens.data_ptr<int64_t>() + j * n, top, margin);
  std::copy(top, top + n, chosen);
}

namespace {

void top2_rows(const float* lp, int64_t n, int64_t V, int64_t ld, int64_t* tp, double* pp, double* mp) {
  adaspec::parallel_for(0, n, grain(V), [&](int64_t begin, int64_t end) {
    using adaspec::VL;
    using adaspec::vecf;
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * ld;
      // per lane, its largest and second largest value
      vecf m1 = vecf{} - inf, m2 = vecf{} - inf;
      const int64_t body = V / VL * VL;
      for (int64_t i = 0; i < body; i += VL) {
        const vecf v = adaspec::loadv(x + i);
        const vecf lo = v < m1 ? v : m1;
        m2 = lo > m2 ? lo : m2;
        m1 = v > m1 ? v : m1;
      }
      float best = -inf, second = -inf;
      auto offer = [&](float v) {
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      };
      for (int l = 0; l < VL; ++l) {
        offer(m1[l]);
        offer(m2[l]);
      }
      for (int64_t i = body; i < V; ++i) offer(x[i]);
      int64_t arg = 0;
      while (arg < V - 1 && !(x[arg] == best)) ++arg;
      // 16 partial sums (one AVX-512 vector, two AVX2 ones) over the first V / 16 * 16 entries, the
      // rest one at a time: the same sums in the same order whatever the vector width
      constexpr int S = 16 / VL;
      const int64_t body16 = V / 16 * 16;
      vecf s[S] = {};
      for (int64_t i = 0; i < body16; i += 16)
        for (int j = 0; j < S; ++j) s[j] += adaspec::expv(adaspec::loadv(x + i + j * VL) - best);
      double sum = 0.0;
      for (int j = 0; j < S; ++j)
        for (int l = 0; l < VL; ++l) sum += static_cast<double>(s[j][l]);
      for (int64_t i = body16; i < V; ++i) sum += std::exp(static_cast<double>(x[i]) - best);
      const double p1 = 1.0 / sum, p2 = std::exp(static_cast<double>(second) - best) / sum;
      tp[r] = arg;
      // a row that is no distribution (NaN, or an infinite logit: a draft that overflowed) gives
      // no confidence; its token is a valid index all the same, and validation decides on it
      const bool valid = p1 > 0.0 && p1 <= 1.0 && p2 >= 0.0 && p2 <= p1;
      pp[r] = valid ? p1 : 0.0;
      mp[r] = valid ? p1 - p2 : 0.0;
    }
  });
}

}  // namespace

// The index of each row's largest value (the first of equal maxima): (T, V) -> (T,) int64.
// torch's argmax took 48 us for 4 x 4096 here (137 us between forward passes).
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V >= 1, "logits need at least one column");
  auto out = torch::empty({T}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  adaspec::parallel_for(0, T, grain(V), [&](int64_t begin, int64_t end) {
    using adaspec::VL;
    using adaspec::vecf;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * ld;
      vecf m = vecf{} - std::numeric_limits<float>::infinity();
      const int64_t body = V / VL * VL;
      for (int64_t i = 0; i < body; i += VL) {
        const vecf v = adaspec::loadv(x + i);
        m = v > m ? v : m;
      }
      float best = -std::numeric_limits<float>::infinity();
      for (int l = 0; l < VL; ++l) best = m[l] > best ? m[l] : best;
      for (int64_t i = body; i < V; ++i) best = x[i] > best ? x[i] : best;
      int64_t arg = 0;
      while (arg < V - 1 && !(x[arg] == best)) ++arg;
      op[r] = arg;
    }
  });
  return out;
}
