// GGUF: malformed and truncated files built in memory must fail with a message that says why,
// before allocating what absurd counts would ask for.
#include "tests/gguf_util.h"

using namespace gguf_test;

namespace {

// ---- malformed files ----------------------------------------------------------------------------

TEST(Gguf, EveryTruncationFails) {
  for (const std::vector<uint8_t> &full :
       {build(Spec{}), read_file(gguf_path("meta.gguf")), read_file(gguf_path("quant.gguf"))}) {
    ASSERT_FALSE(full.empty());
    // Files may end in padding after the last tensor: every prefix short of its end must fail.
    size_t need = 0;
    {
      Parsed ok(full);
      ASSERT_EQ(ok.st, LF_OK) << ok.err;
      for (int64_t i = 0; i < lf_gguf_tensor_count(ok.g); i++) {
        const lf_gguf_tensor *t = lf_gguf_tensor_at(ok.g, i);
        need = std::max(need, size_t(static_cast<const uint8_t *>(t->data) - full.data()) +
                                  size_t(t->nbytes));
      }
      ASSERT_GT(need, full.size() - 64);
    }
    for (size_t n = 0; n < need; n++) {
      // An exact-size heap copy, so ASan catches any read past the end.
      std::vector<uint8_t> cut(full.begin(), full.begin() + long(n));
      Parsed p(cut);
      ASSERT_NE(p.st, LF_OK) << "a " << n << "-byte prefix of " << full.size() << " parsed";
      ASSERT_EQ(p.g, nullptr);
      ASSERT_FALSE(p.err.empty());
    }
  }
}

TEST(Gguf, BadMagicAndVersions) {
  Spec s;
  s.magic = "GGML";
  expect_fails(build(s), LF_ERR_FORMAT, "not a GGUF file");
  s = Spec{};
  s.version = 1;
  expect_fails(build(s), LF_ERR_UNSUPPORTED, "version 1");
  s.version = 4;
  expect_fails(build(s), LF_ERR_UNSUPPORTED, "version 4");
  s.version = 0;
  expect_fails(build(s), LF_ERR_FORMAT, "version 0");
  expect_fails(std::vector<uint8_t>{'G', 'G'}, LF_ERR_FORMAT, "too short");
  expect_fails(std::vector<uint8_t>{}, LF_ERR_FORMAT, "too short");
}

TEST(Gguf, TensorOffsetsChecked) {
  Spec s;
  s.offset = 1024; // aligned, past the end
  expect_fails(build(s), LF_ERR_FORMAT, "tensor w");
  s.offset = 4; // inside, misaligned
  expect_fails(build(s), LF_ERR_FORMAT, "alignment");
  s.offset = 32; // aligned, but the tensor's 68 bytes then run past the end
  expect_fails(build(s), LF_ERR_FORMAT, "past its end");
  s.offset = UINT64_MAX - 31; // aligned, near 2^64
  expect_fails(build(s), LF_ERR_FORMAT, "tensor w");
  // A larger alignment moves the data section.
  s = Spec{};
  s.alignment_key = true;
  s.alignment = 256;
  {
    std::vector<uint8_t> b = build(s);
    Parsed p(b);
    ASSERT_EQ(p.st, LF_OK) << p.err;
    EXPECT_EQ(lf_gguf_data_offset(p.g), 256u);
  }
  s.offset = 32; // a multiple of 32, not of 256
  expect_fails(build(s), LF_ERR_FORMAT, "alignment");
  s = Spec{};
  s.alignment_key = true;
  s.alignment = 48;
  expect_fails(build(s), LF_ERR_FORMAT, "power of two");
  s.alignment = 0;
  expect_fails(build(s), LF_ERR_FORMAT, "power of two");
}

TEST(Gguf, TensorTypesAndShapesChecked) {
  Spec s;
  s.type = 99;
  expect_fails(build(s), LF_ERR_UNSUPPORTED, "99");
  expect_fails(build(s), LF_ERR_UNSUPPORTED, "tensor w");
  s.type = 4; // retired Q4_2
  expect_fails(build(s), LF_ERR_UNSUPPORTED, "type 4");
  s = Spec{};
  s.n_dims = 5;
  s.ne = {32, 2, 1, 1, 1};
  expect_fails(build(s), LF_ERR_FORMAT, "5 dimensions");
  s = Spec{};
  s.n_dims = 3;
  s.ne = {1ull << 32, 1ull << 32, 1ull << 32};
  expect_fails(build(s), LF_ERR_FORMAT, "overflow");
  s.ne = {32, 1ull << 62, 4};
  expect_fails(build(s), LF_ERR_FORMAT, "overflow");
  s = Spec{};
  s.ne = {33, 2}; // not whole Q8_0 blocks
  expect_fails(build(s), LF_ERR_FORMAT, "multiple");
  s.ne = {32, uint64_t(-2)}; // "negative"
  expect_fails(build(s), LF_ERR_FORMAT, "negative");
  // A zero dimension is an empty tensor.
  s.ne = {32, 0};
  {
    std::vector<uint8_t> b = build(s);
    Parsed p(b);
    ASSERT_EQ(p.st, LF_OK) << p.err;
    EXPECT_EQ(lf_gguf_tensor_at(p.g, 0)->nbytes, 0u);
  }
  s = Spec{};
  s.tensor_names = {"w", "v", "w"};
  expect_fails(build(s), LF_ERR_FORMAT, "duplicate tensor 'w'");
  s.tensor_names = {""};
  expect_fails(build(s), LF_ERR_FORMAT, "empty");
}

TEST(Gguf, AbsurdCountsFailBeforeAllocating) {
  const uint64_t huge = 1ull << 62;
  Spec s;
  s.n_tensors = int64_t(huge);
  expect_fails(build(s), LF_ERR_FORMAT, "tensors");
  s = Spec{};
  s.n_kv = int64_t(huge);
  expect_fails(build(s), LF_ERR_FORMAT, "metadata");
  s = Spec{};
  s.str_len = huge;
  expect_fails(build(s), LF_ERR_FORMAT, "string length");
  s.str_len = UINT64_MAX;
  expect_fails(build(s), LF_ERR_FORMAT, "string length");
  s = Spec{};
  s.arr_count = huge;
  expect_fails(build(s), LF_ERR_FORMAT, "array");
  s.arr_type = LF_GGUF_STRING;
  expect_fails(build(s), LF_ERR_FORMAT, "strings");
  s.arr_count = UINT64_MAX;
  s.arr_type = LF_GGUF_UINT64;
  expect_fails(build(s), LF_ERR_FORMAT, "array");
  s.arr_type = LF_GGUF_UINT8;
  expect_fails(build(s), LF_ERR_FORMAT, "array");
}

TEST(Gguf, ValueTypesChecked) {
  Spec s;
  s.value_type = 13;
  expect_fails(build(s), LF_ERR_FORMAT, "unknown value type 13");
  s = Spec{};
  s.arr_type = 13;
  expect_fails(build(s), LF_ERR_FORMAT, "unknown value type 13");
  s.arr_type = LF_GGUF_ARRAY;
  expect_fails(build(s), LF_ERR_FORMAT, "array of arrays");
  s = Spec{};
  s.key2 = "general.name";
  expect_fails(build(s), LF_ERR_FORMAT, "duplicate key 'general.name'");
  // Bools are 0 or 1, in arrays too.
  s = Spec{};
  s.arr_type = LF_GGUF_BOOL;
  s.arr_bytes = {1, 2, 0};
  expect_fails(build(s), LF_ERR_FORMAT, "bool element 1 is 2");
  s.arr_bytes = {1, 0, 1};
  {
    std::vector<uint8_t> b = build(s);
    Parsed p(b);
    ASSERT_EQ(p.st, LF_OK) << p.err;
    int v = -1;
    ASSERT_EQ(lf_gguf_arr_bool(p.g, lf_gguf_find_key(p.g, "test.arr"), 2, &v), LF_OK);
    EXPECT_EQ(v, 1);
  }
  // An empty array parses.
  s = Spec{};
  s.arr_count = 0;
  s.arr_bytes.clear();
  {
    std::vector<uint8_t> b = build(s);
    Parsed p(b);
    ASSERT_EQ(p.st, LF_OK) << p.err;
    uint64_t n = 99;
    lf_gguf_vtype et;
    int64_t k = lf_gguf_find_key(p.g, "test.arr");
    ASSERT_EQ(lf_gguf_arr_info(p.g, k, &et, &n), LF_OK);
    EXPECT_EQ(et, LF_GGUF_UINT32);
    EXPECT_EQ(n, 0u);
    int64_t v;
    EXPECT_EQ(lf_gguf_arr_int(p.g, k, 0, &v), LF_ERR_INVALID_ARG);
  }
  // An array of strings, empty ones included.
  s = Spec{};
  s.arr_type = LF_GGUF_STRING;
  s.arr_count = 2;
  s.arr_bytes = {0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 'h', 'i'};
  {
    std::vector<uint8_t> b = build(s);
    Parsed p(b);
    ASSERT_EQ(p.st, LF_OK) << p.err;
    lf_gguf_str str{};
    int64_t k = lf_gguf_find_key(p.g, "test.arr");
    ASSERT_EQ(lf_gguf_arr_str(p.g, k, 0, &str), LF_OK);
    EXPECT_EQ(str.len, 0u);
    ASSERT_EQ(lf_gguf_arr_str(p.g, k, 1, &str), LF_OK);
    EXPECT_EQ(std::string(str.ptr, str.len), "hi");
  }
  // A wrongly typed general.alignment.
  s = Spec{};
  s.key2 = "general.alignment";
  expect_fails(build(s), LF_ERR_FORMAT, "general.alignment");
}

TEST(Gguf, UndequantizableTypeRefusedByTheSetLoader) {
  // Q5_0 (6): a known type, so the parse succeeds; the tensor set cannot hold it.
  Spec s;
  s.type = 6;
  s.data_bytes = 2 * 22;
  std::vector<uint8_t> b = build(s);
  {
    Parsed p(b);
    ASSERT_EQ(p.st, LF_OK) << p.err;
    EXPECT_EQ(lf_gguf_tensor_at(p.g, 0)->nbytes, 44u);
  }
  char path[] = "/tmp/lf_test_gguf_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, b.data(), b.size()), ssize_t(b.size()));
  close(fd);
  Set set;
  EXPECT_EQ(lf_gguf_tensor_set_load(&set.s, path, &set.meta), LF_ERR_UNSUPPORTED);
  std::string err = lf_last_error();
  EXPECT_NE(err.find("Q5_0"), std::string::npos) << err;
  EXPECT_NE(err.find("tensor w"), std::string::npos) << err;
  EXPECT_EQ(set.meta, nullptr);
  EXPECT_EQ(set.s.n, 0);
  EXPECT_EQ(set.s.n_maps, 0);
  unlink(path);
  // Not a GGUF file at all.
  EXPECT_EQ(lf_gguf_tensor_set_load(&set.s, (lf_repo_data_dir() + "/hf_tiny").c_str(), nullptr),
            LF_ERR_IO);
}

} // namespace
