// Small-batch float32 linear layers for the CPU: y (M, N) = x (M, K) @ W^T (+ bias), with W
// packed once (float32, or bfloat16 for a draft's weights, widened in registers) into
// panels of 16 output features, (ceil(N / 16), K, 16): for each k, a
// panel's 16 weights are one vector, so a register tile of 4 rows x 64 columns takes one
// broadcast per row and four vector loads per k. Work is split over groups of 64 output
// columns, so both cores share even a one-row product (MKL runs those on one).
//
// Every output element is one fused multiply-add chain over k in order, whatever M, the
// tile or the thread that computes it: a row's result does not depend on the batch it was
// computed in (verification of k + 1 tokens gives the logits one-token decoding would).
#include <torch/extension.h>
#include "thread_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t LANES = 16;  // one AVX-512 vector of floats
constexpr int64_t PANELS = 4;  // panels per column group (64 columns)
constexpr int64_t ROWS = 4;    // rows per register tile

typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));

typedef uint16_t bf16x16 __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(2), may_alias));
typedef uint32_t u32x16 __attribute__((vector_size(LANES * sizeof(uint32_t))));

// One unaligned vector load (see vec_math.h: through std::memcpy GCC 12 made it 10x slower).
inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }

// 16 bfloat16 weights (their bits) as floats: a bfloat16 is the upper half of a float.
inline vec load(const uint16_t* p) {
  const u32x16 bits = __builtin_convertvector(*reinterpret_cast<const bf16x16*>(p), u32x16) << 16;
  return (vec)bits;
}

// Rows [0, R) of x against panels [0, P) starting at wp (float32 or bfloat16 weights, W);
// columns beyond `cols` are dropped.
template <int R, int P, typename W>
void tile(const float* x, int64_t K, const W* wp, const float* bias, float* y, int64_t ldy, int64_t cols) {
  // acc must stay in registers: its loops are unrolled and its address is never taken (the
  // bias and the stores go through copies). GCC 12 kept an addressed acc on the stack, one
  // load and store per multiply-add: 10x slower.
  vec acc[R][P];
#pragma GCC unroll 4
  for (int j = 0; j < P; ++j) {
    float lanes[LANES] = {};
    if (bias != nullptr) {
      for (int64_t l = 0; l < LANES && j * LANES + l < cols; ++l) lanes[l] = bias[j * LANES + l];
    }
    const vec b = load(lanes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    vec w[P];
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) w[j] = load(wp + (j * K + k) * LANES);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) acc[r][j] += xv * w[j];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) {
      const int64_t n = std::min<int64_t>(LANES, cols - j * LANES);
      if (n <= 0) break;
      const vec out = acc[r][j];
      if (n == LANES) {
        *reinterpret_cast<vec*>(y + r * ldy + j * LANES) = out;  // one vector store
      } else {
        std::memcpy(y + r * ldy + j * LANES, &out, n * sizeof(float));
      }
    }
  }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, const float*, float*, int64_t, int64_t);

template <int R, typename W>
TileFn<W> tile_for_panels(int64_t p) {
  switch (p) {
    case 1: return &tile<R, 1, W>;
    case 2: return &tile<R, 2, W>;
    case 3: return &tile<R, 3, W>;
    default: return &tile<R, 4, W>;
  }
}

template <typename W>
TileFn<W> tile_fn(int64_t rows, int64_t panels) {
  switch (rows) {
    case 1: return tile_for_panels<1, W>(panels);
    case 2: return tile_for_panels<2, W>(panels);
    case 3: return tile_for_panels<3, W>(panels);
    default: return tile_for_panels<4, W>(panels);
  }
}

template <typename W>
void linear_panels(const float* xp, const W* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N,
                   int64_t np) {
  const int64_t groups = (np + PANELS - 1) / PANELS;
  adaspec::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * PANELS, panels = std::min(PANELS, np - p0);
      const int64_t col0 = p0 * LANES, cols = std::min(panels * LANES, N - col0);
      for (int64_t m = 0; m < M; m += ROWS) {
        const int64_t rows = std::min(ROWS, M - m);
        tile_fn<W>(rows, panels)(xp + m * K, K, wp + p0 * K * LANES, bp ? bp + col0 : nullptr, yp + m * N + col0, N,
                                 cols);
      }
    }
  });
}

}  // namespace

// (N, K) weight -> (ceil(N / 16), K, 16) panels, zero-padded past N, of its dtype: float32,
// or bfloat16 (half the bytes to stream; a draft model's weights, whose rounding changes only
// which tokens are proposed, never what verification emits).
torch::Tensor pack_linear_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16) &&
                  w.device().is_cpu(),
              "weight must be a 2-D float32 or bfloat16 CPU tensor");
  const int64_t N = w.size(0), K = w.size(1), np = (N + LANES - 1) / LANES;
  auto padded = torch::zeros({np * LANES, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({np, LANES, K}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == LANES && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "packed weight does not match x: expected (ceil(N/16), ", x.size(1), ", 16)");
  TORCH_CHECK(packed.size(0) * LANES >= N && N > packed.size(0) * LANES - LANES, "N does not match the packed weight");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == torch::kFloat32,
                "bias must be N contiguous floats");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), np = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (packed.scalar_type() == torch::kBFloat16) {
    linear_panels(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bp,
                  y.data_ptr<float>(), M, K, N, np);
  } else {
    TORCH_CHECK(packed.scalar_type() == torch::kFloat32, "packed weight must be float32 or bfloat16");
    linear_panels(x.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, np);
  }
  return y;
}
