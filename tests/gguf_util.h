// Shared helpers of the GGUF suites (test_gguf, test_gguf_malformed): the checked-in test files,
// self-freeing parses and tensor sets, and a writer for hand-made (and broken) GGUF files.
#ifndef LF_TESTS_GGUF_UTIL_H
#define LF_TESTS_GGUF_UTIL_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include "base/error.h"
#include "gguf.h"
#include "quant.h"
#include "tensor.h"
#include "tests/test_util.h"

namespace gguf_test {

inline std::string gguf_path(const char *name) {
  return lf_repo_data_dir() + "/gguf/" + name;
}

inline std::vector<uint8_t> read_file(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// A parsed buffer that frees itself.
struct Parsed {
  lf_gguf *g = nullptr;
  lf_status st = LF_OK;
  std::string err;
  Parsed(const std::vector<uint8_t> &b, const char *name = "test.gguf") {
    st = lf_gguf_parse(b.empty() ? nullptr : b.data(), b.size(), name, &g);
    if (st != LF_OK) err = lf_last_error();
  }
  ~Parsed() {
    lf_gguf_free(g);
  }
  Parsed(const Parsed &) = delete;
  Parsed &operator=(const Parsed &) = delete;
};

// A tensor set that frees itself.
struct Set {
  lf_tensor_set s{};
  lf_gguf *meta = nullptr;
  ~Set() {
    lf_gguf_free(meta);
    lf_tensor_set_free(&s);
  }
};

// ---- a GGUF writer for hand-made (and broken) files -----------------------------------------

struct Bytes {
  std::vector<uint8_t> b;
  void raw(const void *p, size_t n) {
    const uint8_t *c = static_cast<const uint8_t *>(p);
    b.insert(b.end(), c, c + n);
  }
  void u8(uint8_t v) {
    b.push_back(v);
  }
  void u32(uint32_t v) {
    raw(&v, 4);
  }
  void u64(uint64_t v) {
    raw(&v, 8);
  }
  void str(const std::string &s) {
    u64(s.size());
    raw(s.data(), s.size());
  }
};

// The fields of a small file: one string key, one u32 array key, one tensor. Tests break one.
struct Spec {
  uint32_t version = 3;
  const char *magic = "GGUF";
  int64_t n_tensors = -1, n_kv = -1; // -1: the real counts
  uint64_t str_len = 4;              // of the string value "tiny"
  uint32_t arr_type = LF_GGUF_UINT32;
  uint64_t arr_count = 3;
  std::vector<uint8_t> arr_bytes = {7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0};
  uint32_t value_type = LF_GGUF_STRING; // of the string key
  std::string key2 = "test.arr";
  bool alignment_key = false;
  uint32_t alignment = 32;
  std::vector<std::string> tensor_names = {"w"};
  uint32_t n_dims = 2;
  std::vector<uint64_t> ne = {32, 2};
  uint32_t type = LF_GGML_Q8_0;
  uint64_t offset = 0;
  size_t data_bytes = 2 * 34; // [2] Q8_0 blocks
};

inline std::vector<uint8_t> build(const Spec &sp) {
  Bytes f;
  f.raw(sp.magic, 4);
  f.u32(sp.version);
  const uint64_t n_kv = 2 + (sp.alignment_key ? 1 : 0);
  f.u64(sp.n_tensors >= 0 ? uint64_t(sp.n_tensors) : sp.tensor_names.size());
  f.u64(sp.n_kv >= 0 ? uint64_t(sp.n_kv) : n_kv);
  // key 1: general.name = "tiny"
  f.str("general.name");
  f.u32(sp.value_type);
  f.u64(sp.str_len);
  f.raw("tiny", 4);
  // key 2: an array (three uint32 by default)
  f.str(sp.key2);
  f.u32(LF_GGUF_ARRAY);
  f.u32(sp.arr_type);
  f.u64(sp.arr_count);
  f.raw(sp.arr_bytes.data(), sp.arr_bytes.size());
  if (sp.alignment_key) {
    f.str("general.alignment");
    f.u32(LF_GGUF_UINT32);
    f.u32(sp.alignment);
  }
  for (size_t i = 0; i < sp.tensor_names.size(); i++) {
    f.str(sp.tensor_names[i]);
    f.u32(sp.n_dims);
    for (uint64_t v : sp.ne)
      f.u64(v);
    f.u32(sp.type);
    f.u64(sp.offset + i * 96);
  }
  uint32_t align = sp.alignment_key ? sp.alignment : 32;
  while (align && f.b.size() % align)
    f.u8(0);
  // Q8_0 blocks with d = 1.0 (0x3C00) and qs = 0, 1, 2, ...; the rest zeros.
  for (size_t i = 0; i < sp.data_bytes * sp.tensor_names.size(); i++)
    f.u8(i % 34 == 0 ? 0x00 : i % 34 == 1 ? 0x3C : uint8_t(i % 34 - 2));
  return f.b;
}

inline void expect_fails(const std::vector<uint8_t> &b, lf_status want, const char *needle) {
  Parsed p(b);
  EXPECT_EQ(p.st, want) << p.err;
  EXPECT_EQ(p.g, nullptr);
  EXPECT_FALSE(p.err.empty());
  if (needle) {
    EXPECT_NE(p.err.find(needle), std::string::npos) << p.err;
  }
}

} // namespace gguf_test

#endif
