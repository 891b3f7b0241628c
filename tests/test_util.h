/* Shared helpers for the GoogleTest suites. */
#ifndef LF_TEST_UTIL_H
#define LF_TEST_UTIL_H

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <sys/stat.h>

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

#endif
