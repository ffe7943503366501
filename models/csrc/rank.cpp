// A large batch's decisions compiled: the early stop (`worth_drafting`), the keep set
// (`decide_cols`) and the path columns (`path_column`) of controller/early_stop.py,
// decision.py and step.py. Both decisions rank every candidate draft and take the best
// prefix (`rank`, controller/decision.py's `rank_best`; exposed as rank_best so the tests
// compare the two directly), several times a step when the early stop asks; many_rows.cpp
// holds a step's worth of them in one object.
//
// Why compiled: at batch 32-256 the rule's argsort, cumulative sums and temporaries took
// 0.07-0.11 ms a call between two forward passes, about half of the controller's time.
//
// Same answers as the numpy, bit for bit: the same int64 keys and sums, a stable sort
// (ties in index order, j-major; a radix sort here), IEEE double division of integers
// below 2^53, the min_gain divisors by repeated multiplication, and the first of equal
// scores (tests/test_decision.py compares both).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <numeric>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "decide.h"

namespace py = pybind11;

namespace {

constexpr int CONF_BITS = 12;  // controller/decision.py
constexpr int64_t CONF_ONE = int64_t(1) << CONF_BITS;
constexpr int RATIO_BITS = 24;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct Cand {  // a candidate draft: its ranking key, index (j * n + i) and sequence i
  int64_t key;
  int32_t at, seq;
};

// Largest key first, ties in input order (cands arrive in index order: the stable sort's
// order, as the numpy twin's). From 256 candidates a bucket sort on each key's distance
// below the largest: one stable pass into 2^B buckets by the distance's top B bits (B about
// log2 of twice the count, up to 13), then each bucket of several keys sorted on its own,
// by key and index. Where the distances have at most 13 bits (path probabilities have 12)
// the buckets are the keys and the pass alone sorts them. An LSD radix sort, a byte a pass,
// took 4-5 passes on the ratio keys (36% of an early stop's time at batch 256); std::sort
// spent most of its time on the many equal keys (0.3 ms at 7,000 candidates). Below 256
// candidates it stays, as clearing the counts would cost more.
void sort_desc(std::vector<Cand>& cands) {
  const size_t N = cands.size();
  auto before = [](const Cand& x, const Cand& y) { return x.key > y.key || (x.key == y.key && x.at < y.at); };
  if (N < 256) {  // few: comparisons beat clearing the counts
    std::sort(cands.begin(), cands.end(), before);
    return;
  }
  int64_t top = cands[0].key;
  for (const Cand& c : cands) top = std::max(top, c.key);
  uint64_t spread = 0;
  for (const Cand& c : cands) spread |= uint64_t(top) - uint64_t(c.key);  // distances, as unsigned bits
  int width = 0;  // bits of the largest distance
  while (width < 64 && (spread >> width)) ++width;
  int bits = 8;
  while (bits < 13 && (size_t(1) << bits) < 2 * N) ++bits;
  if (width <= 13) bits = std::max(width, 1);  // the buckets can be the keys themselves
  const int shift = std::max(0, width - bits);
  std::vector<uint32_t> count((size_t(1) << bits) + 1, 0u);
  auto bucket = [&](const Cand& c) { return size_t((uint64_t(top) - uint64_t(c.key)) >> shift); };
  for (const Cand& c : cands) ++count[bucket(c) + 1];
  for (size_t b = 1; b < count.size(); ++b) count[b] += count[b - 1];
  std::vector<Cand> out(N);
  for (const Cand& c : cands) out[count[bucket(c)]++] = c;  // count[b] now ends bucket b
  if (shift) {
    for (size_t b = 0, start = 0; b + 1 < count.size() && start < N; ++b) {
      const size_t end = count[b];
      if (end - start > 1) std::sort(out.begin() + start, out.begin() + end, before);
      start = end;
    }
  }
  cands.swap(out);
}

// floor(x / d) for 0 <= x < 2^53 and 0 < d < 2^53: the correctly rounded double quotient is
// within one of it, so one correction makes it exact (an integer division costs several
// times a double one, and a ranking made one per candidate).
inline int64_t floor_div(int64_t x, int64_t d) {
  int64_t q = int64_t(double(x) / double(d));
  if (q * d > x) --q;
  else if ((q + 1) * d <= x) ++q;
  return q;
}

// a: j-major quantised path probabilities (a[j * n + i] for sequence i's draft j), 0 where a
// draft may not be kept; the key of candidate (i, j) is a (mode 0), a << RATIO_BITS //
// (s + ctx_i) (mode 1) or a * d - e0 * CONF_ONE * ctx_i (mode 2). f: the validation time by
// added tokens, head: the step's other time.
Ranked rank(const int64_t* a, int64_t n, int64_t k, int mode, int64_t s, int64_t d, int64_t e0, const int64_t* ctx,
            const int64_t* f, int64_t f_len, int64_t head, int64_t per_token, double min_gain) {
  if (n * k >= (int64_t(1) << 31)) throw py::value_error("too many candidates to rank");
  std::vector<Cand> cands;
  cands.reserve(size_t(n * k));
  for (int64_t j = 0, at = 0; j < k; ++j) {
    for (int64_t i = 0; i < n; ++i, ++at) {
      const int64_t v = a[at];
      if (v <= 0) continue;
      int64_t key = v;
      if (mode == 1) {
        const int64_t x = v << RATIO_BITS, den = s + ctx[i];
        key = (x < (int64_t(1) << 53) && den > 0 && den < (int64_t(1) << 53)) ? floor_div(x, den) : x / den;
      } else if (mode == 2) {
        key = v * d - e0 * CONF_ONE * ctx[i];
      }
      cands.push_back({key, int32_t(at), int32_t(i)});
    }
  }
  sort_desc(cands);
  const int64_t live = int64_t(cands.size());
  if (f_len < live + 1) throw py::value_error("f is shorter than the candidates");
  Ranked best;
  int64_t e = n * CONF_ONE, cum_ctx = 0;
  double divisor = 1.0;
  const double scale = 1.0 + min_gain;
  for (int64_t c = 0; c <= live; ++c) {
    const int64_t t = head + f[c] + cum_ctx + ((per_token * e) >> CONF_BITS);
    double score = double(e) / double(std::max<int64_t>(t, 1));
    if (min_gain != 0.0) {
      score = score / divisor;
      divisor *= scale;
    }
    if (c == 0 || score > best.score) best.count = c, best.score = score, best.e = e, best.t = t;
    if (c < live) {
      const Cand& at = cands[size_t(c)];
      e += a[at.at];
      cum_ctx += ctx[at.seq];
    }
  }
  best.keep.assign(size_t(n), 0);
  for (int64_t c = 0; c < best.count; ++c) best.keep[size_t(cands[size_t(c)].seq)] += 1;
  return best;
}

// decide_paths' first ranking: by a alone where every sequence costs the same, else by the
// ratio key, s the average marginal token cost over the live candidates.
Ranked rank_ratio(const std::vector<int64_t>& a, int64_t n, int64_t k, bool uniform, const int64_t* ctx,
                  const int64_t* f, int64_t f_len, int64_t head, int64_t per_token, double min_gain) {
  int64_t s = 0;
  if (!uniform) {
    int64_t live = 0;
    for (int64_t at = 0; at < n * k; ++at) live += a[size_t(at)] > 0;
    if (f_len < live + 1) throw py::value_error("f is shorter than the candidates");
    s = std::max<int64_t>((f[live] - f[0]) / std::max<int64_t>(live, 1), 1);
  }
  return rank(a.data(), n, k, uniform ? 0 : 1, s, 0, 0, ctx, f, f_len, head, per_token, min_gain);
}

std::vector<int64_t> jmajor(const I64& a) {
  if (a.ndim() != 2) throw py::value_error("path probabilities must be an (n, k) array");
  const auto A = a.unchecked<2>();
  const int64_t n = A.shape(0), k = A.shape(1);
  std::vector<int64_t> out(size_t(n * k));
  for (int64_t j = 0; j < k; ++j)
    for (int64_t i = 0; i < n; ++i) out[size_t(j * n + i)] = A(i, j);
  return out;
}

// controller/step.py's path columns: position j's quantised estimates times the path
// probabilities of position j - 1 (none for the first), as decision.py's quantize and path_probs.
py::array_t<int64_t> path_column(py::array_t<double, py::array::c_style | py::array::forcecast> conf,
                                 std::optional<I64> prev) {
  const int64_t n = conf.size();
  if (prev && prev->size() != n) throw py::value_error("the previous path column must be as long as the estimates");
  const double* c = conf.data();
  const int64_t* before = prev ? prev->data() : nullptr;
  py::array_t<int64_t> out(n);
  path_column_on(c, before, n, out.mutable_data());
  return out;
}

// controller/decision.py's rank_best on an (n, k) array, for the tests. Returns (keep per
// sequence, kept count, score, E and T of the best prefix).
py::tuple rank_best(I64 a, int mode, int64_t s, int64_t d, int64_t e0, I64 ctx, I64 f, int64_t head,
                    int64_t per_token, double min_gain) {
  const std::vector<int64_t> aj = jmajor(a);
  const int64_t n = a.shape(0), k = a.shape(1);
  if (ctx.size() != n) throw py::value_error("ctx must hold one context length per sequence");
  const Ranked r = rank(aj.data(), n, k, mode, s, d, e0, ctx.data(), f.data(), f.size(), head, per_token, min_gain);
  return py::make_tuple(py::array_t<int64_t>(n, r.keep.data()), r.count, r.score, r.e, r.t);
}

Cols column_pointers(const std::vector<I64>& cols, int64_t n) {
  Cols out;
  for (const I64& c : cols) {
    if (c.size() != n) throw py::value_error("every column must hold one value per sequence");
    out.push_back(c.data());
  }
  return out;
}

std::vector<int64_t> capped_jmajor(const Cols& cols, int64_t n, const int64_t* caps, size_t extra) {
  const int64_t j = int64_t(cols.size());
  std::vector<int64_t> a;
  a.reserve(size_t(j * n) + extra);
  for (int64_t c = 0; c < j; ++c) {
    const int64_t* col = cols[size_t(c)];
    for (int64_t i = 0; i < n; ++i) a.push_back(c < caps[i] ? col[i] : 0);
  }
  return a;
}

py::tuple decide_cols(const std::vector<I64>& cols, I64 cap, I64 ctx, I64 f, int64_t head, int64_t per_token,
                      double min_gain, bool uniform, int rounds) {
  const int64_t n = cap.size();
  if (cols.empty() || ctx.size() != n) throw py::value_error("cols, cap and ctx must describe the same sequences");
  const Costs c{ctx.data(), f.data(), int64_t(f.size()), per_token, min_gain, uniform};
  const Ranked best = decide_cols_on(column_pointers(cols, n), n, cap.data(), c, head, rounds, nullptr);
  return py::make_tuple(py::array_t<int64_t>(n, best.keep.data()), best.score);
}

bool worth_drafting(const std::vector<I64>& cols, I64 cap, int64_t rate_q, I64 ctx, I64 f, int64_t head_stop,
                    int64_t head_go, int64_t per_token, double min_gain, bool uniform, double lam) {
  const int64_t n = cap.size();
  if (cols.empty() || ctx.size() != n) throw py::value_error("cols, cap and ctx must describe the same sequences");
  const Costs c{ctx.data(), f.data(), int64_t(f.size()), per_token, min_gain, uniform, lam};
  return worth_drafting_on(column_pointers(cols, n), n, cap.data(), rate_q, c, head_stop, head_go, nullptr);
}

}  // namespace

// controller/decision.py's decide_cols: the keep set from the drafted positions' path
// probabilities before the caps, with decide_paths' Dinkelbach rounds. first: its first
// ranking where the caller already made it (worth_drafting_on's `stop` on the same columns
// and head), else null.
Ranked decide_cols_on(const Cols& cols, int64_t n, const int64_t* caps, const Costs& c, int64_t head, int rounds,
                      const Ranked* first) {
  const int64_t k = int64_t(cols.size());
  const std::vector<int64_t> a = capped_jmajor(cols, n, caps, 0);
  Ranked best = first ? *first : rank_ratio(a, n, k, c.uniform, c.ctx, c.f, c.f_len, head, c.per_token, c.min_gain);
  for (int r = 0; r < (c.uniform ? 0 : rounds); ++r) {
    const int64_t d = best.t * CONF_ONE - best.e * c.per_token;
    if (d <= 0) break;
    Ranked got = rank(a.data(), n, k, 2, 0, d, best.e, c.ctx, c.f, c.f_len, head, c.per_token, c.min_gain);
    if (got.score <= best.score) break;
    best = std::move(got);
  }
  return best;
}

// controller/early_stop.py's worth_drafting_paths: cols, the j drafted positions' path
// probabilities before the caps; the next position at rate_q; the best keep set with it (at
// head_go) must keep a draft past j and beat the best without it (at head_stop): by Theta, or
// at the rate c.lam where that is set (beats_at_rate). stop: where
// given, receives the ranking without it when one was made (decide_cols_on's first at head_stop).
bool worth_drafting_on(const Cols& cols, int64_t n, const int64_t* caps, int64_t rate_q, const Costs& c,
                       int64_t head_stop, int64_t head_go, std::optional<Ranked>* stop) {
  const int64_t j = int64_t(cols.size());
  std::vector<int64_t> a = capped_jmajor(cols, n, caps, size_t(n));
  const int64_t* last = cols.back();
  for (int64_t i = 0; i < n; ++i) a.push_back(j < caps[i] ? (last[i] * rate_q) >> CONF_BITS : 0);
  const Ranked go = rank_ratio(a, n, j + 1, c.uniform, c.ctx, c.f, c.f_len, head_go, c.per_token, c.min_gain);
  if (*std::max_element(go.keep.begin(), go.keep.end()) <= j) return false;
  a.resize(size_t(j * n));  // j-major: the first j positions
  Ranked without = rank_ratio(a, n, j, c.uniform, c.ctx, c.f, c.f_len, head_stop, c.per_token, c.min_gain);
  const bool more = c.lam < 0 ? go.score > without.score
                              : beats_at_rate(go.score, std::max<int64_t>(go.t, 1), without.score,
                                              std::max<int64_t>(without.t, 1), c.lam);
  if (stop) *stop = std::move(without);
  return more;
}

// path_column's quantisation of one estimate (decision.py's quantize).
int64_t quantize_estimate(double conf) {
  const double r = std::nearbyint(conf * double(CONF_ONE));
  if (std::isnan(r)) throw py::value_error("an acceptance estimate is not a number");
  return r < 0 ? 0 : (r > double(CONF_ONE) ? CONF_ONE : int64_t(r));
}

void path_column_on(const double* conf, const int64_t* prev, int64_t n, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q = quantize_estimate(conf[i]);
    out[i] = prev ? (prev[i] * q) >> CONF_BITS : q;
  }
}

void bind_rank(py::module& m) {
  m.def("rank_best", &rank_best, "a batch's ranked candidates and their best prefix (controller/decision.py)",
        py::arg("a"), py::arg("mode"), py::arg("s"), py::arg("d"), py::arg("e0"), py::arg("ctx"), py::arg("f"),
        py::arg("head"), py::arg("per_token"), py::arg("min_gain"));
  m.def("path_column", &path_column, "a position's path probabilities (controller/step.py)", py::arg("conf"),
        py::arg("prev") = py::none());
  m.def("decide_cols", &decide_cols, "a large batch's keep set (controller/decision.py)", py::arg("cols"),
        py::arg("cap"), py::arg("ctx"), py::arg("f"), py::arg("head"), py::arg("per_token"), py::arg("min_gain"),
        py::arg("uniform"), py::arg("rounds"));
  m.def("worth_drafting", &worth_drafting, "a large batch's early stop (controller/early_stop.py)", py::arg("cols"),
        py::arg("cap"), py::arg("rate_q"), py::arg("ctx"), py::arg("f"), py::arg("head_stop"), py::arg("head_go"),
        py::arg("per_token"), py::arg("min_gain"), py::arg("uniform"), py::arg("lam") = -1.0);
}
