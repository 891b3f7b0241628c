/* Shared helpers for the GoogleTest suites. */
#ifndef LF_TEST_UTIL_H
#define LF_TEST_UTIL_H

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <sys/stat.h>
#include <vector>

#include "engine/backend.h"

/* Backend parameters for the tests: policy, budget slots in n_pools pools, the engine's sink (4)
 * and window (32); everything else zero. */
inline lf_backend_params lf_test_backend_params(lf_policy policy, int budget, int n_pools) {
  lf_backend_params p{};
  p.policy = policy;
  p.budget = budget;
  p.sink = 4;
  p.window = 32;
  p.n_pools = n_pools;
  return p;
}

/* Where ../shared-style test data lives: $LF_TEST_DATA, else the build-time default. */
inline std::string lf_test_data_dir() {
  const char *e = std::getenv("LF_TEST_DATA");
  return e && *e ? std::string(e) : std::string(LF_TEST_DATA_DEFAULT);
}

/* The repository's own test data (tests/data). */
inline std::string lf_repo_data_dir() {
  return std::string(LF_SOURCE_DIR) + "/tests/data";
}

inline bool lf_path_exists(const std::string &p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

/* A fresh seed per run (printed by the test so a failure can be replayed with LF_TEST_SEED). */
inline uint64_t lf_test_seed() {
  const char *e = std::getenv("LF_TEST_SEED");
  if (e && *e) return std::strtoull(e, nullptr, 10);
  return std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32);
}

/* A per-test stream derived from the run's one seed (printed, so LF_TEST_SEED replays every
 * test of the run). */
inline uint64_t lf_test_seed_for(const char *test) {
  static const uint64_t base = lf_test_seed();
  std::printf("[ seed     ] %s: LF_TEST_SEED=%llu\n", test, (unsigned long long)base);
  uint64_t h = base;
  for (const char *c = test; *c; c++) h = h * 1099511628211ull + (unsigned char)*c;
  return h;
}

/* n draws of N(0, sd^2). */
inline std::vector<float> lf_test_normal(std::mt19937_64 &gen, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> x(n);
  for (auto &e : x) e = d(gen);
  return x;
}

#endif
