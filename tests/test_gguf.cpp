// GGUF: the parser (valid files and metadata accessors, hand-made files built in memory),
// dequantization against the python gguf package (tests/data/gguf, written by
// tools/make_gguf_testdata.py) bit for bit, GGUF tensors in an lf_tensor_set, and reading rows
// stored in llama.cpp's rotary Q/K order. Malformed and truncated files: test_gguf_malformed.cpp.
#include "tests/gguf_util.h"

using namespace gguf_test;

namespace {

// ---- valid files ------------------------------------------------------------------------------

TEST(Gguf, SmallHandMadeFileParses) {
  std::vector<uint8_t> b = build(Spec{});
  Parsed p(b);
  ASSERT_EQ(p.st, LF_OK) << p.err;
  EXPECT_EQ(lf_gguf_version(p.g), 3u);
  EXPECT_EQ(lf_gguf_alignment(p.g), 32u);
  EXPECT_EQ(lf_gguf_kv_count(p.g), 2);
  ASSERT_EQ(lf_gguf_tensor_count(p.g), 1);
  const lf_gguf_tensor *t = lf_gguf_tensor_at(p.g, 0);
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(lf_gguf_str_eq(t->name, "w"));
  EXPECT_EQ(t->n_dims, 2);
  EXPECT_EQ(t->ne[0], 32);
  EXPECT_EQ(t->ne[1], 2);
  EXPECT_EQ(t->ne[2], 1);
  EXPECT_EQ(t->type, uint32_t(LF_GGML_Q8_0));
  EXPECT_EQ(t->nbytes, 68u);
  EXPECT_EQ(static_cast<const uint8_t *>(t->data), b.data() + lf_gguf_data_offset(p.g));
  EXPECT_EQ(lf_gguf_data_offset(p.g) % 32, 0u);
  EXPECT_EQ(lf_gguf_tensor_at(p.g, 1), nullptr);
  EXPECT_EQ(lf_gguf_find_tensor(p.g, "w"), 0);
  EXPECT_EQ(lf_gguf_find_tensor(p.g, "x"), -1);
  float row[32];
  ASSERT_EQ(lf_quant_dequant_row(t->type, t->data, 32, row), LF_OK);
  for (int i = 0; i < 32; i++)
    EXPECT_EQ(row[i], float(i));

  // Version 2 has the same layout.
  b[4] = 2;
  Parsed p2(b);
  EXPECT_EQ(p2.st, LF_OK) << p2.err;
  EXPECT_EQ(lf_gguf_version(p2.g), 2u);
}

TEST(Gguf, MetadataOfEveryType) {
  std::vector<uint8_t> b = read_file(gguf_path("meta.gguf"));
  ASSERT_FALSE(b.empty()) << "run tools/make_gguf_testdata.py";
  Parsed p(b, "meta.gguf");
  ASSERT_EQ(p.st, LF_OK) << p.err;
  const lf_gguf *g = p.g;
  EXPECT_EQ(lf_gguf_alignment(g), 64u);
  EXPECT_EQ(lf_gguf_data_offset(g) % 64, 0u);

  int64_t v = 0;
  double d = 0;
  int bl = -1;
  lf_gguf_str s{};
  struct IntKey {
    const char *key;
    int64_t want;
    lf_gguf_vtype type;
  };
  for (const IntKey &k : {IntKey{"test.u8", 200, LF_GGUF_UINT8},
                          {"test.i8", -100, LF_GGUF_INT8},
                          {"test.u16", 60000, LF_GGUF_UINT16},
                          {"test.i16", -30000, LF_GGUF_INT16},
                          {"test.u32", 4000000000LL, LF_GGUF_UINT32},
                          {"test.i32", -2000000000LL, LF_GGUF_INT32},
                          {"test.u64_small", 12345, LF_GGUF_UINT64},
                          {"test.i64", -(1LL << 62), LF_GGUF_INT64},
                          {"general.alignment", 64, LF_GGUF_UINT32}}) {
    SCOPED_TRACE(k.key);
    int64_t i = lf_gguf_find_key(g, k.key);
    ASSERT_GE(i, 0);
    EXPECT_EQ(lf_gguf_kv_type(g, i), k.type);
    EXPECT_TRUE(lf_gguf_str_eq(lf_gguf_kv_key(g, i), k.key));
    ASSERT_EQ(lf_gguf_get_int(g, k.key, &v), LF_OK) << lf_last_error();
    EXPECT_EQ(v, k.want);
    ASSERT_EQ(lf_gguf_get_float(g, k.key, &d), LF_OK); // integers read as numbers too
    EXPECT_EQ(d, double(k.want));
    EXPECT_EQ(lf_gguf_get_str(g, k.key, &s), LF_ERR_FORMAT);
    EXPECT_EQ(lf_gguf_get_bool(g, k.key, &bl), LF_ERR_FORMAT);
  }
  // A uint64 beyond int64: not an int64, but a number.
  EXPECT_EQ(lf_gguf_get_int(g, "test.u64_big", &v), LF_ERR_FORMAT);
  EXPECT_NE(std::string(lf_last_error()).find("test.u64_big"), std::string::npos);
  ASSERT_EQ(lf_gguf_get_float(g, "test.u64_big", &d), LF_OK);
  EXPECT_EQ(d, 9223372036854775813.0);

  ASSERT_EQ(lf_gguf_get_float(g, "test.f32", &d), LF_OK);
  EXPECT_EQ(d, 0.15625);
  ASSERT_EQ(lf_gguf_get_float(g, "test.f64", &d), LF_OK);
  EXPECT_EQ(d, 2.718281828459045);
  EXPECT_EQ(lf_gguf_get_int(g, "test.f64", &v), LF_ERR_FORMAT);

  ASSERT_EQ(lf_gguf_get_bool(g, "test.bool_t", &bl), LF_OK);
  EXPECT_EQ(bl, 1);
  ASSERT_EQ(lf_gguf_get_bool(g, "test.bool_f", &bl), LF_OK);
  EXPECT_EQ(bl, 0);
  EXPECT_EQ(lf_gguf_get_int(g, "test.bool_t", &v), LF_ERR_FORMAT);

  ASSERT_EQ(lf_gguf_get_str(g, "test.str", &s), LF_OK);
  EXPECT_EQ(std::string(s.ptr, s.len), "hello, GGUF \xe2\x9c\x93");
  char buf[64];
  ASSERT_EQ(lf_gguf_str_copy(s, buf, sizeof buf), LF_OK);
  EXPECT_STREQ(buf, "hello, GGUF \xe2\x9c\x93");
  EXPECT_EQ(lf_gguf_str_copy(s, buf, 5), LF_ERR_INVALID_ARG); // does not fit
  EXPECT_EQ(lf_gguf_get_int(g, "test.str", &v), LF_ERR_FORMAT);
  EXPECT_NE(std::string(lf_last_error()).find("string"), std::string::npos) << lf_last_error();
  ASSERT_EQ(lf_gguf_get_str(g, "test.empty_str", &s), LF_OK);
  EXPECT_EQ(s.len, 0u);
  ASSERT_EQ(lf_gguf_str_copy(s, buf, 1), LF_OK);
  EXPECT_STREQ(buf, "");
  ASSERT_EQ(lf_gguf_get_str(g, "general.architecture", &s), LF_OK);
  EXPECT_TRUE(lf_gguf_str_eq(s, "lftest"));

  // Missing keys.
  EXPECT_EQ(lf_gguf_find_key(g, "test.nope"), -1);
  EXPECT_EQ(lf_gguf_get_int(g, "test.nope", &v), LF_ERR_NOT_FOUND);
  EXPECT_NE(std::string(lf_last_error()).find("test.nope"), std::string::npos);
  EXPECT_EQ(lf_gguf_kv_int(g, lf_gguf_kv_count(g), &v), LF_ERR_INVALID_ARG);

  // Arrays.
  lf_gguf_vtype et;
  uint64_t n = 0;
  int64_t i = lf_gguf_find_key(g, "test.arr_i32");
  ASSERT_GE(i, 0);
  EXPECT_EQ(lf_gguf_kv_type(g, i), LF_GGUF_ARRAY);
  ASSERT_EQ(lf_gguf_arr_info(g, i, &et, &n), LF_OK);
  EXPECT_EQ(et, LF_GGUF_INT32);
  ASSERT_EQ(n, 3u);
  const int64_t want_i[] = {1, -2, 3};
  for (uint64_t j = 0; j < n; j++) {
    ASSERT_EQ(lf_gguf_arr_int(g, i, j, &v), LF_OK);
    EXPECT_EQ(v, want_i[j]);
  }
  EXPECT_EQ(lf_gguf_arr_int(g, i, 3, &v), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_gguf_arr_str(g, i, 0, &s), LF_ERR_FORMAT);
  EXPECT_EQ(lf_gguf_kv_int(g, i, &v), LF_ERR_FORMAT); // an array is not a scalar

  i = lf_gguf_find_key(g, "test.arr_f32");
  ASSERT_EQ(lf_gguf_arr_info(g, i, &et, &n), LF_OK);
  EXPECT_EQ(et, LF_GGUF_FLOAT32);
  ASSERT_EQ(n, 2u);
  ASSERT_EQ(lf_gguf_arr_float(g, i, 1, &d), LF_OK);
  EXPECT_EQ(d, -1.25);
  EXPECT_EQ(lf_gguf_arr_int(g, i, 1, &v), LF_ERR_FORMAT);

  i = lf_gguf_find_key(g, "test.arr_str");
  ASSERT_EQ(lf_gguf_arr_info(g, i, &et, &n), LF_OK);
  EXPECT_EQ(et, LF_GGUF_STRING);
  const char *want_s[] = {"", "a", "<0x0A>", "\xc3\xbcn\xc3\xaf", "with space"};
  ASSERT_EQ(n, 5u);
  for (uint64_t j = 0; j < n; j++) {
    ASSERT_EQ(lf_gguf_arr_str(g, i, j, &s), LF_OK);
    EXPECT_EQ(std::string(s.ptr, s.len), want_s[j]);
  }
  EXPECT_EQ(lf_gguf_arr_str(g, i, 5, &s), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_gguf_arr_float(g, i, 0, &d), LF_ERR_FORMAT);

  i = lf_gguf_find_key(g, "test.arr_bool");
  ASSERT_EQ(lf_gguf_arr_info(g, i, &et, &n), LF_OK);
  EXPECT_EQ(et, LF_GGUF_BOOL);
  ASSERT_EQ(n, 3u);
  for (uint64_t j = 0; j < n; j++) {
    ASSERT_EQ(lf_gguf_arr_bool(g, i, j, &bl), LF_OK);
    EXPECT_EQ(bl, j != 1);
  }
  i = lf_gguf_find_key(g, "test.arr_u8");
  ASSERT_EQ(lf_gguf_arr_info(g, i, &et, &n), LF_OK);
  EXPECT_EQ(et, LF_GGUF_UINT8);
  ASSERT_EQ(lf_gguf_arr_int(g, i, 2, &v), LF_OK);
  EXPECT_EQ(v, 255);
  i = lf_gguf_find_key(g, "test.arr_i64");
  ASSERT_EQ(lf_gguf_arr_int(g, i, 0, &v), LF_OK);
  EXPECT_EQ(v, -(1LL << 40));
  i = lf_gguf_find_key(g, "test.arr_f64");
  ASSERT_EQ(lf_gguf_arr_float(g, i, 1, &d), LF_OK);
  EXPECT_EQ(d, -0.1);
  EXPECT_EQ(lf_gguf_arr_info(g, lf_gguf_find_key(g, "test.str"), &et, &n), LF_ERR_FORMAT);

  // Every key is found by its own name.
  for (int64_t k = 0; k < lf_gguf_kv_count(g); k++) {
    lf_gguf_str key = lf_gguf_kv_key(g, k);
    EXPECT_EQ(lf_gguf_find_key(g, std::string(key.ptr, key.len).c_str()), k);
  }
}

TEST(Gguf, StrCopyRefusesNul) {
  const char raw[] = {'a', '\0', 'b'};
  char buf[8];
  EXPECT_EQ(lf_gguf_str_copy(lf_gguf_str{raw, 3}, buf, sizeof buf), LF_ERR_FORMAT);
  EXPECT_EQ(lf_gguf_str_copy(lf_gguf_str{raw, 1}, buf, sizeof buf), LF_OK);
  EXPECT_STREQ(buf, "a");
  EXPECT_TRUE(lf_gguf_str_eq(lf_gguf_str{raw, 1}, "a"));
  EXPECT_FALSE(lf_gguf_str_eq(lf_gguf_str{raw, 1}, "ab"));
}

TEST(Gguf, TensorSetShapesAndValues) {
  Set set;
  ASSERT_EQ(lf_gguf_tensor_set_load(&set.s, gguf_path("meta.gguf").c_str(), &set.meta), LF_OK)
      << lf_last_error();
  ASSERT_NE(set.meta, nullptr);
  EXPECT_EQ(set.s.n, 5);
  const lf_tensor_src *mat = lf_tensor_set_find(&set.s, "mat");
  ASSERT_NE(mat, nullptr);
  EXPECT_EQ(mat->dtype, LF_DTYPE_F32);
  ASSERT_EQ(mat->ndim, 2);
  EXPECT_EQ(mat->shape[0], 3); // rows = ne[1]
  EXPECT_EQ(mat->shape[1], 4); // cols = ne[0]
  EXPECT_EQ(mat->row_perm_heads, 0);
  float m[12];
  ASSERT_EQ(lf_tensor_read_f32(mat, 0, 3, 0, 4, m), LF_OK);
  for (int i = 0; i < 12; i++)
    EXPECT_EQ(m[i], float(i));
  const lf_tensor_src *cube = lf_tensor_set_find(&set.s, "cube");
  ASSERT_NE(cube, nullptr);
  ASSERT_EQ(cube->ndim, 3);
  EXPECT_EQ(cube->shape[0], 2);
  EXPECT_EQ(cube->shape[1], 3);
  EXPECT_EQ(cube->shape[2], 4);
  const lf_tensor_src *vec = lf_tensor_set_find(&set.s, "vec");
  ASSERT_NE(vec, nullptr);
  ASSERT_EQ(vec->ndim, 1);
  EXPECT_EQ(vec->shape[0], 8);
  float x[8];
  ASSERT_EQ(lf_tensor_read_f32(vec, 0, 1, 2, 3, x), LF_OK);
  EXPECT_EQ(x[0], -1.0f);
  EXPECT_EQ(x[2], -2.0f);
  // The metadata points into the set's mapping.
  lf_gguf_str arch;
  ASSERT_EQ(lf_gguf_get_str(set.meta, "general.architecture", &arch), LF_OK);
  EXPECT_TRUE(lf_gguf_str_eq(arch, "lftest"));
  // A second load of the same names is a duplicate; the set stays as it was.
  EXPECT_EQ(lf_gguf_tensor_set_load(&set.s, gguf_path("meta.gguf").c_str(), nullptr),
            LF_ERR_FORMAT);
  EXPECT_EQ(set.s.n, 5);
  EXPECT_EQ(set.s.n_maps, 1);
}

TEST(Gguf, RotaryPermutedRowsFromConverter) {
  // meta.gguf's perm.* were permuted by the converter's formula (numpy) from plain aranges.
  Set set;
  ASSERT_EQ(lf_gguf_tensor_set_load(&set.s, gguf_path("meta.gguf").c_str(), nullptr), LF_OK)
      << lf_last_error();
  lf_tensor_src w = *lf_tensor_set_find(&set.s, "perm.weight");
  lf_tensor_src b = *lf_tensor_set_find(&set.s, "perm.bias");
  float raw[24];
  ASSERT_EQ(lf_tensor_read_f32(&w, 0, 8, 0, 3, raw), LF_OK);
  EXPECT_NE(raw[3], 3.0f); // stored permuted
  w.row_perm_heads = 2;
  b.row_perm_heads = 2;
  float got[24];
  ASSERT_EQ(lf_tensor_read_f32(&w, 0, 8, 0, 3, got), LF_OK);
  for (int i = 0; i < 24; i++)
    EXPECT_EQ(got[i], float(i));
  ASSERT_EQ(lf_tensor_read_f32(&b, 0, 1, 0, 8, got), LF_OK);
  for (int i = 0; i < 8; i++)
    EXPECT_EQ(got[i], float(i));
  ASSERT_EQ(lf_tensor_read_f32(&b, 0, 1, 3, 4, got), LF_OK);
  for (int i = 0; i < 4; i++)
    EXPECT_EQ(got[i], float(3 + i));
}

// ---- the rotary un-permutation on hand-made tensors -------------------------------------------

// Stored row of Hugging Face row r, heads of hd rows (the converter's permute).
int stored_row(int r, int hd) {
  int h = r / hd, k = r % hd, i = k / (hd / 2), j = k % (hd / 2);
  return h * hd + 2 * j + i;
}

// A [R][C] tensor stored with llama.cpp's Q/K row order, read back in the HF order.
lf_tensor_src permuted_src(const char *name, lf_dtype dt, int R, int C, const void *data,
                           int heads) {
  lf_tensor_src t{};
  std::snprintf(t.name, sizeof t.name, "%s", name);
  t.dtype = dt;
  t.ndim = 2;
  t.shape[0] = R;
  t.shape[1] = C;
  t.data = data;
  t.row_perm_heads = heads;
  return t;
}

TEST(Gguf, RowPermutationF32) {
  const int R = 12, C = 5, heads = 2, hd = R / heads;
  std::vector<float> stored(R * C);
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++)
      stored[size_t(stored_row(r, hd) * C + c)] = float(r * 100 + c); // HF value (r, c)
  const lf_tensor_src t = permuted_src("q", LF_DTYPE_F32, R, C, stored.data(), heads);
  std::vector<float> got(R * C);
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, R, 0, C, got.data()), LF_OK);
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++)
      EXPECT_EQ(got[size_t(r * C + c)], float(r * 100 + c)) << r << "," << c;
  // A slice of rows and columns (a tensor-parallel shard).
  ASSERT_EQ(lf_tensor_read_f32(&t, 5, 4, 1, 3, got.data()), LF_OK);
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 3; c++)
      EXPECT_EQ(got[size_t(r * 3 + c)], float((5 + r) * 100 + 1 + c));

  // 1-D (a bias): the elements are the rows.
  std::vector<float> bias(R);
  for (int r = 0; r < R; r++)
    bias[size_t(stored_row(r, hd))] = float(r);
  lf_tensor_src bt = t;
  bt.ndim = 1;
  bt.shape[0] = R;
  bt.shape[1] = 0;
  bt.data = bias.data();
  ASSERT_EQ(lf_tensor_read_f32(&bt, 0, 1, 0, R, got.data()), LF_OK);
  for (int r = 0; r < R; r++)
    EXPECT_EQ(got[size_t(r)], float(r));
  ASSERT_EQ(lf_tensor_read_f32(&bt, 0, 1, 7, 3, got.data()), LF_OK);
  for (int r = 0; r < 3; r++)
    EXPECT_EQ(got[size_t(r)], float(7 + r));

  // Heads that do not divide the rows, or odd head sizes, are refused.
  lf_tensor_src bad = t;
  bad.row_perm_heads = 5;
  EXPECT_EQ(lf_tensor_read_f32(&bad, 0, 1, 0, C, got.data()), LF_ERR_SHAPE);
  EXPECT_NE(std::string(lf_last_error()).find("heads"), std::string::npos);
  bad.row_perm_heads = 4; // hd = 3
  EXPECT_EQ(lf_tensor_read_f32(&bad, 0, 1, 0, C, got.data()), LF_ERR_SHAPE);
  bad.row_perm_heads = -1;
  EXPECT_EQ(lf_tensor_read_f32(&bad, 0, 1, 0, C, got.data()), LF_ERR_SHAPE);
}

TEST(Gguf, RowPermutationQ8_0) {
  // [8][64] Q8_0 with d = 1 and q = HF row * 3 + column % 7: exact values after dequantization.
  const int R = 8, C = 64, heads = 2, hd = R / heads, bpr = C / 32 * 34;
  std::vector<uint8_t> stored(size_t(R * bpr));
  for (int r = 0; r < R; r++) {
    uint8_t *row = stored.data() + stored_row(r, hd) * bpr;
    for (int b = 0; b < C / 32; b++) {
      row[b * 34] = 0x00;
      row[b * 34 + 1] = 0x3C;
      for (int l = 0; l < 32; l++)
        row[b * 34 + 2 + l] = uint8_t(int8_t(r * 3 + (b * 32 + l) % 7 - 10));
    }
  }
  const lf_tensor_src t = permuted_src("k", LF_DTYPE_Q8_0, R, C, stored.data(), heads);
  std::vector<float> got(R * C);
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, R, 0, C, got.data()), LF_OK);
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++)
      EXPECT_EQ(got[size_t(r * C + c)], float(r * 3 + c % 7 - 10)) << r << "," << c;
  ASSERT_EQ(lf_tensor_read_f32(&t, 3, 2, 30, 5, got.data()), LF_OK);
  for (int r = 0; r < 2; r++)
    for (int c = 0; c < 5; c++)
      EXPECT_EQ(got[size_t(r * 5 + c)], float((3 + r) * 3 + (30 + c) % 7 - 10));
}

// ---- dequantization against gguf.quants ---------------------------------------------------------

struct QuantCase {
  const char *name;
  lf_dtype dtype;
  uint32_t ggml;
};
const QuantCase kQuantCases[] = {
    {"t.F32", LF_DTYPE_F32, LF_GGML_F32},    {"t.F16", LF_DTYPE_F16, LF_GGML_F16},
    {"t.BF16", LF_DTYPE_BF16, LF_GGML_BF16}, {"t.Q4_0", LF_DTYPE_Q4_0, LF_GGML_Q4_0},
    {"t.Q4_1", LF_DTYPE_Q4_1, LF_GGML_Q4_1}, {"t.Q8_0", LF_DTYPE_Q8_0, LF_GGML_Q8_0},
    {"t.Q4_K", LF_DTYPE_Q4_K, LF_GGML_Q4_K}, {"t.Q5_K", LF_DTYPE_Q5_K, LF_GGML_Q5_K},
    {"t.Q6_K", LF_DTYPE_Q6_K, LF_GGML_Q6_K},
};

TEST(Gguf, DequantizeMatchesPythonBitExactly) {
  Set q, e;
  ASSERT_EQ(lf_gguf_tensor_set_load(&q.s, gguf_path("quant.gguf").c_str(), &q.meta), LF_OK)
      << lf_last_error();
  ASSERT_EQ(lf_gguf_tensor_set_load(&e.s, gguf_path("quant_expected.gguf").c_str(), nullptr), LF_OK)
      << lf_last_error();
  for (const QuantCase &qc : kQuantCases) {
    SCOPED_TRACE(qc.name);
    const lf_tensor_src *t = lf_tensor_set_find(&q.s, qc.name);
    const lf_tensor_src *x = lf_tensor_set_find(&e.s, qc.name);
    ASSERT_NE(t, nullptr);
    ASSERT_NE(x, nullptr);
    EXPECT_EQ(t->dtype, qc.dtype);
    EXPECT_STREQ(lf_dtype_str(t->dtype), qc.name + 2);
    ASSERT_EQ(t->ndim, 2);
    ASSERT_EQ(x->dtype, LF_DTYPE_F32);
    const int64_t R = t->shape[0], C = t->shape[1];
    ASSERT_EQ(x->shape[0], R);
    ASSERT_EQ(x->shape[1], C);
    const float *want = static_cast<const float *>(x->data);

    // The whole tensor through the loaders' reader.
    std::vector<float> got(size_t(R * C));
    ASSERT_EQ(lf_tensor_read_f32(t, 0, R, 0, C, got.data()), LF_OK) << lf_last_error();
    EXPECT_EQ(std::memcmp(got.data(), want, got.size() * 4), 0);
    for (int64_t i = 0; i < R * C; i++)
      ASSERT_EQ(got[size_t(i)], want[i]) << "element " << i;

    // Row by row through quant.h, from an unaligned copy of the row.
    const int64_t rb = lf_quant_row_bytes(qc.ggml, C);
    ASSERT_GT(rb, 0);
    EXPECT_EQ(size_t(rb), lf_dtype_row_bytes(qc.dtype, C));
    std::vector<uint8_t> unaligned(size_t(rb) + 1);
    for (int64_t r = 0; r < R; r++) {
      std::memcpy(unaligned.data() + 1, static_cast<const uint8_t *>(t->data) + r * rb, size_t(rb));
      std::vector<float> row(static_cast<size_t>(C));
      ASSERT_EQ(lf_quant_dequant_row(qc.ggml, unaligned.data() + 1, C, row.data()), LF_OK);
      EXPECT_EQ(std::memcmp(row.data(), want + r * C, size_t(C) * 4), 0) << "row " << r;
    }

    // Slices: any rows, any columns (inside and across blocks).
    struct Slice {
      int64_t row0, nrows, col0, ncols;
    };
    for (const Slice &s :
         {Slice{0, 1, 0, C}, Slice{1, 2, 0, 256}, Slice{0, 3, 256, 256}, Slice{2, 1, 5, 300},
          Slice{1, 1, C - 1, 1}, Slice{0, 3, 31, 2}, Slice{1, 2, 100, 412}, Slice{0, 3, 0, 1}}) {
      SCOPED_TRACE(testing::Message()
                   << "rows " << s.row0 << "+" << s.nrows << " cols " << s.col0 << "+" << s.ncols);
      std::vector<float> sl(size_t(s.nrows * s.ncols));
      ASSERT_EQ(lf_tensor_read_f32(t, s.row0, s.nrows, s.col0, s.ncols, sl.data()), LF_OK);
      for (int64_t r = 0; r < s.nrows; r++)
        EXPECT_EQ(std::memcmp(sl.data() + r * s.ncols, want + (s.row0 + r) * C + s.col0,
                              size_t(s.ncols) * 4),
                  0)
            << "row " << r;
    }
    // Out of range slices are still refused.
    EXPECT_EQ(lf_tensor_read_f32(t, 0, 1, C - 1, 2, got.data()), LF_ERR_INVALID_ARG);
    EXPECT_EQ(lf_tensor_read_f32(t, R, 1, 0, 1, got.data()), LF_ERR_INVALID_ARG);
  }
}

TEST(Gguf, DtypeHelpers) {
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_F32), 4u);
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_BF16), 2u);
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_Q4_K), 0u);
  EXPECT_EQ(lf_dtype_block_size(LF_DTYPE_F16), 1);
  EXPECT_EQ(lf_dtype_block_size(LF_DTYPE_Q4_0), 32);
  EXPECT_EQ(lf_dtype_block_size(LF_DTYPE_Q6_K), 256);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_F32, 10), 40u);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_Q4_0, 64), 36u);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_Q4_1, 32), 20u);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_Q8_0, 32), 34u);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_Q4_K, 256), 144u);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_Q5_K, 512), 352u);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_Q6_K, 256), 210u);
  EXPECT_EQ(lf_dtype_row_bytes(LF_DTYPE_Q6_K, 100), 0u);
  EXPECT_STREQ(lf_ggml_type_name(LF_GGML_Q5_K), "Q5_K");
  EXPECT_STREQ(lf_ggml_type_name(11), "Q3_K");
  EXPECT_EQ(lf_ggml_type_name(4), nullptr); // retired Q4_2
  EXPECT_EQ(lf_ggml_type_name(99), nullptr);
  EXPECT_FALSE(lf_quant_can_dequant(11));
  EXPECT_EQ(lf_quant_row_bytes(LF_GGML_Q8_0, 33), -1);
  float out[32];
  uint8_t blk[110] = {};
  EXPECT_EQ(lf_quant_dequant_row(11, blk, 256, out), LF_ERR_UNSUPPORTED);
  EXPECT_EQ(lf_quant_dequant_row(LF_GGML_Q8_0, blk, 31, out), LF_ERR_INVALID_ARG);

  // A block type whose column count is not whole blocks cannot be read.
  lf_tensor_src t{};
  std::snprintf(t.name, sizeof t.name, "odd");
  t.dtype = LF_DTYPE_Q4_K;
  t.ndim = 2;
  t.shape[0] = 1;
  t.shape[1] = 100;
  t.data = blk;
  EXPECT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, 10, out), LF_ERR_SHAPE);
  EXPECT_NE(std::string(lf_last_error()).find("blocks"), std::string::npos) << lf_last_error();
}

} // namespace
