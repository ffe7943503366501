// What one_row.cpp (batch 1), rank.cpp and many_rows.cpp (a large batch) share: the logistic
// acceptance estimate and its weights (controller/estimators.py), and a large batch's
// decisions on path-probability columns (rank.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

// The logistic model's weights, one (w0, w1, w2, w3) per draft position: converted once per
// calibration batch, not once per step.
struct LogisticWeights {
  explicit LogisticWeights(std::vector<std::vector<double>> w) : w(std::move(w)) {}
  std::vector<std::vector<double>> w;
};

// The logistic estimate for one draft (one_row.cpp): the same double as estimators.py's
// logistic_estimate, from its position's weights, top probability p and margin m.
double logistic_estimate(const std::vector<double>& w, double p, double m);

// A ranking's best prefix: keep per sequence, the kept count, and its score, E and T.
struct Ranked {
  std::vector<int64_t> keep;
  int64_t count = 0, e = 0, t = 0;
  double score = 0.0;
};

// Columns as pointers: the py arrays a call passes, or the columns a ManyRows holds.
using Cols = std::vector<const int64_t*>;

// The costs every ranking of one step reads.
struct Costs {
  const int64_t* ctx;
  const int64_t* f;
  int64_t f_len, per_token;
  double min_gain;
  bool uniform;
  double lam = -1.0;  // the early stop's rate (tokens per time unit, controller/early_stop.py); < 0: Theta's
};

// controller/decision.py's beats_at_rate: a keep set of score go in go_t (units, at least 1)
// against one of score stop in stop_t, each worth T (Theta - lam), in that order of operations.
#if defined(__clang__)
inline bool beats_at_rate(double go, int64_t go_t, double stop, int64_t stop_t, double lam) {
#pragma clang fp contract(off)
#else
__attribute__((optimize("fp-contract=off"))) inline bool beats_at_rate(double go, int64_t go_t, double stop,
                                                                        int64_t stop_t, double lam) {
#endif
  return (go - lam) * double(go_t) > (stop - lam) * double(stop_t);
}

// controller/decision.py's decide_cols on columns (rank.cpp); first: its first ranking, where
// already made (worth_drafting_on's stop on the same columns and head), else null.
Ranked decide_cols_on(const Cols& cols, int64_t n, const int64_t* caps, const Costs& c, int64_t head, int rounds,
                      const Ranked* first);
// controller/early_stop.py's worth_drafting_paths on columns (rank.cpp); stop, where given,
// receives its ranking without the next draft when it made one.
bool worth_drafting_on(const Cols& cols, int64_t n, const int64_t* caps, int64_t rate_q, const Costs& c,
                       int64_t head_stop, int64_t head_go, std::optional<Ranked>* stop);
// decision.py's quantize of one estimate: round half to even, clipped to [0, CONF_ONE] (rank.cpp).
int64_t quantize_estimate(double conf);
// A position's path column: each estimate quantised, times the previous position's path
// probability (prev; none for the first position), into out (rank.cpp's path_column).
void path_column_on(const double* conf, const int64_t* prev, int64_t n, int64_t* out);
