// What one_row.cpp (batch 1) and rank.cpp (a large batch) share: the logistic acceptance
// estimate and its weights (controller/estimators.py).
#pragma once

#include <cstdint>
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
