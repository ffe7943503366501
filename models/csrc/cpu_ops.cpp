// CPU kernels for the paged KV cache (float32), built on first use by models/kernels.py.
//
// Cache layout, per layer and per block of B positions:
//   keys   (num_blocks, nkv, hd, B): for a block and a KV head, each dimension's B keys are
//          contiguous, so one vector FMA scores B keys against one query value;
//   values (num_blocks, nkv, B, hd): each position's value vector is contiguous.
// Position p of a sequence lives in block table[p / B] at offset p % B. Attention reads the
// blocks where they lie: no gather of contexts, no padding of queries.
#include <torch/extension.h>
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

void check(const torch::Tensor& t, const char* name, int64_t dims, c10::ScalarType type) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == type, name, " has the wrong dtype");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// Write new keys and values (T, nkv, hd) at their slots (T,) (slot = block * B + offset).
void cache_write(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                 const torch::Tensor& slots) {
  check(k, "k", 3, torch::kFloat32);
  check(v, "v", 3, torch::kFloat32);
  check(k_cache, "k_cache", 4, torch::kFloat32);
  check(v_cache, "v_cache", 4, torch::kFloat32);
  check(slots, "slots", 1, torch::kInt64);
  const int64_t T = k.size(0), nkv = k.size(1), hd = k.size(2), B = k_cache.size(3);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = sl[t] / B, off = sl[t] % B;
    for (int64_t g = 0; g < nkv; ++g) {
      const float* ksrc = kp + (t * nkv + g) * hd;
      const float* vsrc = vp + (t * nkv + g) * hd;
      float* kdst = kc + ((block * nkv + g) * hd) * B + off;
      float* vdst = vc + ((block * nkv + g) * B + off) * hd;
      for (int64_t d = 0; d < hd; ++d) kdst[d * B] = ksrc[d];
      std::copy(vsrc, vsrc + hd, vdst);
    }
  }
}

// exp(s - max) over a row of P scores, in place; returns 1 / their sum (the caller scales
// its weighted sum of values once instead of every score).
static float softmax_unnormalised(float* srow, int64_t P) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t p = 0; p < P; ++p) m = std::max(m, srow[p]);
#pragma omp simd
  for (int64_t p = 0; p < P; ++p) srow[p] -= m;
  adaspec::exp_inplace(srow, P);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t p = 0; p < P; ++p) sum += srow[p];
  return 1.0f / sum;
}

// One (token, KV head) work item: the G query heads sharing KV head g attend to positions
// 0..P-1 through the block table. BB, HD and GG are the block size, head dimension and
// heads per KV head when known at compile time (0: read at run time); then the heads'
// accumulators stay in registers and their FMA chains interleave.
template <int BB, int HD, int GG>
void attend_item(const float* qg, const float* kc, const float* vc, const int64_t* table, int64_t P, int64_t g_rt,
                 int64_t nkv, int64_t g, int64_t b_rt, int64_t hd_rt, float scale, std::vector<float>& scores,
                 float* out) {
  constexpr int64_t MAXB = BB ? BB : 64, MAXHD = HD ? HD : 512, MAXG = GG ? GG : 16;
  const int64_t B = BB ? BB : b_rt, hd = HD ? HD : hd_rt, G = GG ? GG : g_rt;
  const int64_t nblocks = (P + B - 1) / B;
  scores.resize(G * nblocks * B);
  // scores[h][p] = scale * q_h . k_p: for each dimension, one vector FMA over the block's B keys per head
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* kt = kc + ((table[b] * nkv + g) * hd) * B;  // (hd, B)
    float acc[MAXG][MAXB] = {};
    for (int64_t d = 0; d < hd; ++d) {
      const float* krow = kt + d * B;
      for (int64_t h = 0; h < G; ++h) {
        const float qd = qg[h * hd + d];
#pragma omp simd
        for (int64_t i = 0; i < B; ++i) acc[h][i] += qd * krow[i];
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      float* srow = scores.data() + h * nblocks * B + b * B;
      for (int64_t i = 0; i < B; ++i) srow[i] = acc[h][i] * scale;
    }
  }
  float inv[MAXG];
  for (int64_t h = 0; h < G; ++h) inv[h] = softmax_unnormalised(scores.data() + h * nblocks * B, P);
  // out_h = sum_p w[h][p] v_p: each value row read once for all G heads
  float acc[MAXG][MAXHD] = {};
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* vb = vc + ((table[b] * nkv + g) * B) * hd;  // (B, hd)
    const int64_t n = std::min(B, P - b * B);
    for (int64_t i = 0; i < n; ++i) {
      const float* vrow = vb + i * hd;
      for (int64_t h = 0; h < G; ++h) {
        const float wi = scores[h * nblocks * B + b * B + i];
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) acc[h][d] += wi * vrow[d];
      }
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = acc[h][d] * inv[h];
}

// The same for block size 16 (one AVX-512 vector of keys per dimension, two AVX2 ones), with
// every accumulator an explicit vector so it stays in a register: G heads' scores of a block
// while its keys stream by, then G x C output vectors while the values do, C = HD / VL at once
// with AVX-512, or as many as keep G x C within 12 of AVX2's 16 registers (more passes over
// the values: the accumulators spilled to the stack otherwise). Each output is the same sum
// in the same order whatever C.
using adaspec::loadv;
using adaspec::storev;
using adaspec::vecf;
using adaspec::VL;

constexpr int64_t out_chunk(int64_t nv, [[maybe_unused]] int64_t g) {
#if defined(__AVX512F__)
  return nv;
#else
  int64_t c = nv;
  while (c > 1 && (g * c > 12 || nv % c)) --c;
  return c;
#endif
}

template <int HD, int G>
void attend_item16(const float* qg, const float* kc, const float* vc, const int64_t* table, int64_t P, int64_t,
                   int64_t nkv, int64_t g, int64_t, int64_t, float scale, std::vector<float>& scores, float* out) {
  constexpr int64_t B = 16, KV = B / VL, NV = HD / VL, C = out_chunk(NV, G);
  const int64_t nblocks = (P + B - 1) / B, stride = nblocks * B;
  scores.resize(G * stride);
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* kt = kc + ((table[b] * nkv + g) * HD) * B;  // (HD, 16)
    vecf acc[G][KV];
    for (int h = 0; h < G; ++h)
      for (int s = 0; s < KV; ++s) acc[h][s] = vecf{};
    for (int64_t d = 0; d < HD; ++d) {
      vecf k[KV];
      for (int s = 0; s < KV; ++s) k[s] = loadv(kt + d * B + s * VL);
      for (int h = 0; h < G; ++h)
        for (int s = 0; s < KV; ++s) acc[h][s] += qg[h * HD + d] * k[s];
    }
    for (int h = 0; h < G; ++h)
      for (int s = 0; s < KV; ++s) storev(scores.data() + h * stride + b * B + s * VL, acc[h][s] * scale);
  }
  float inv[G];
  for (int h = 0; h < G; ++h) inv[h] = softmax_unnormalised(scores.data() + h * stride, P);
  for (int64_t c0 = 0; c0 < NV; c0 += C) {
    vecf o[G][C];
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < C; ++j) o[h][j] = vecf{};
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* vb = vc + ((table[b] * nkv + g) * B) * HD + c0 * VL;  // (16, HD), from column c0 * VL
      const int64_t n = std::min(B, P - b * B);
      for (int64_t i = 0; i < n; ++i) {
        vecf v[C];
        for (int j = 0; j < C; ++j) v[j] = loadv(vb + i * HD + j * VL);
        for (int h = 0; h < G; ++h) {
          const float w = scores[h * stride + b * B + i];
          for (int j = 0; j < C; ++j) o[h][j] += w * v[j];
        }
      }
    }
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < C; ++j) storev(out + h * HD + (c0 + j) * VL, o[h][j] * inv[h]);
  }
}

// Attention of T query tokens (T, nh, hd) over the cache. Token t belongs to sequence
// q_seq[t] and sits at position q_pos[t]: it attends to that sequence's positions
// 0..q_pos[t] (which must already be in the cache). tables: (n, W) block tables.
// Work is split over (token, KV head): each reads its sequence's keys once for the
// nh / nkv query heads that share them.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& tables, const torch::Tensor& q_seq, const torch::Tensor& q_pos,
                              double scale) {
  check(q, "q", 3, torch::kFloat32);
  check(k_cache, "k_cache", 4, torch::kFloat32);
  check(v_cache, "v_cache", 4, torch::kFloat32);
  check(tables, "tables", 2, torch::kInt64);
  check(q_seq, "q_seq", 1, torch::kInt64);
  check(q_pos, "q_pos", 1, torch::kInt64);
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), B = k_cache.size(3), W = tables.size(1);
  TORCH_CHECK(nh % nkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(2) == hd && v_cache.size(3) == hd, "head dimension mismatch");
  TORCH_CHECK(B <= 64 && hd <= 512 && nh / nkv <= 16,
              "block size up to 64, head dimension up to 512 and 16 query heads per KV head");
  const int64_t G = nh / nkv;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* seq = q_seq.data_ptr<int64_t>();
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  auto item_fn = &attend_item<0, 0, 0>;  // specialised for the common shapes
  if (B == 16 && hd == 32 && G == 4) item_fn = &attend_item16<32, 4>;
  else if (B == 16 && hd == 64 && G == 4) item_fn = &attend_item16<64, 4>;
  else if (B == 16 && hd == 128 && G == 4) item_fn = &attend_item16<128, 4>;
  else if (B == 16 && hd == 128 && G == 8) item_fn = &attend_item16<128, 8>;
  else if (B == 16 && hd == 64) item_fn = &attend_item<16, 64, 0>;
  else if (B == 16 && hd == 128) item_fn = &attend_item<16, 128, 0>;

  adaspec::parallel_for(0, T * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / nkv, g = item % nkv;
      TORCH_CHECK((pos[t] + B) / B <= W, "position ", pos[t], " is past the sequence's block table");
      item_fn(qp + (t * nh + g * G) * hd, kc, vc, tab + seq[t] * W, pos[t] + 1, G, nkv, g, B, hd, fscale, scores,
              op + (t * nh + g * G) * hd);
    }
  });
  return out;
}

// gemm.cpp
torch::Tensor pack_linear_weight(const torch::Tensor& w);
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scale);

// elementwise.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& out, int64_t out_row);
void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void draft_top2(const torch::Tensor& logits, torch::Tensor& tokens, torch::Tensor& top, torch::Tensor& margin);
void draft_top2_at(const torch::Tensor& logits, torch::Tensor& tokens, torch::Tensor& inputs, int64_t j);
torch::Tensor argmax_rows(const torch::Tensor& logits);

// one_row.cpp: batch 1's speculation decisions
void bind_one_row(py::module& m);
void bind_rank(py::module& m);
void bind_many_rows(py::module& m);

// The kernels touch no Python object: they run without the interpreter lock, so other
// threads of the process (a server's request handling) go on meanwhile.
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (also copied into rows of out when given)", nogil(), py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("out") = py::none(), py::arg("out_row") = 0);
  m.def("rotary_", &rotary_, "neox rotary embedding, in place", nogil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", nogil());
  m.def("argmax_rows", &argmax_rows, "each row's first largest value's index", nogil());
  m.def("draft_top2", &draft_top2, "per row: the softmax's top token, its probability and the margin to the second", nogil());
  m.def("draft_top2_at", &draft_top2_at, "draft_top2 into draft position j of the draft loop's buffers", nogil(),
        py::arg("logits"), py::arg("tokens"), py::arg("inputs"), py::arg("j"));
  m.def("pack_linear_weight", &pack_linear_weight, "pack a linear weight into 16-wide panels", nogil());
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) with a packed W (int8: and its scales)", nogil(),
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("scale") = py::none());
  m.def("cache_write", &cache_write, "write keys and values into the paged cache", nogil());
  m.def("paged_attention", &paged_attention, "attention of ragged queries over the paged cache", nogil());
  m.def("set_num_threads", &adaspec::set_num_threads, "threads of the kernels' pool, the caller's included", nogil());
  m.def("get_num_threads", &adaspec::get_num_threads, "threads of the kernels' pool");
  bind_one_row(m);
  bind_rank(m);
  bind_many_rows(m);
}
