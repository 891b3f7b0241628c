// safetensors files: every dtype and shape, and malformed files.
#include "tests/loader_util.h"

using namespace loader_test;

namespace {

TEST(Safetensors, LoadsEveryDtypeAndShape) {
  auto rng = make_rng();
  TempDir d;
  std::vector<StTensor> ts;
  std::map<std::string, std::vector<float>> expect;
  const struct {
    const char *name, *dtype;
    std::vector<int64_t> shape;
  } specs[] = {{"a", "F32", {3, 5}},  {"b.weight", "F16", {7}},  {"c", "BF16", {2, 3, 4}},
               {"scalar", "F32", {}}, {"empty", "BF16", {0, 4}}, {"d", "F16", {1, 1, 1, 3}}};
  for (const auto &sp : specs) {
    StTensor t{sp.name, sp.dtype, sp.shape, {}};
    size_t n = 1;
    for (auto v : sp.shape)
      n *= size_t(v);
    random_values(rng, sp.dtype, n, t.bytes, expect[sp.name]);
    ts.push_back(t);
  }
  for (size_t pad : {1, 8}) { // unpadded headers leave the data unaligned
    const std::string path = d / ("m" + std::to_string(pad) + ".safetensors");
    write_file(path, st_file(ts, pad));
    lf_tensor_set s{};
    ASSERT_EQ(lf_safetensors_load(&s, path.c_str()), LF_OK) << lf_last_error();
    EXPECT_EQ(s.n, int(ts.size()));
    EXPECT_EQ(s.n_maps, 1);
    for (const auto &sp : specs) {
      const lf_tensor_src *t = lf_tensor_set_find(&s, sp.name);
      ASSERT_NE(t, nullptr) << sp.name;
      EXPECT_STREQ(lf_dtype_str(t->dtype), sp.dtype);
      ASSERT_EQ(t->ndim, int(sp.shape.size()));
      for (int k = 0; k < t->ndim; k++)
        EXPECT_EQ(t->shape[k], sp.shape[size_t(k)]);
      EXPECT_EQ(std::string(t->file), path);
      if (t->ndim == 1 || t->ndim == 2) {
        const int64_t rows = t->ndim == 2 ? t->shape[0] : 1, cols = t->shape[t->ndim - 1];
        std::vector<float> got(size_t(rows * cols) + 1);
        ASSERT_EQ(lf_tensor_read_f32(t, 0, rows, 0, cols, got.data()), LF_OK);
        got.pop_back();
        if (rows * cols > 0) expect_values(got.data(), expect[sp.name], sp.name);
      }
    }
    EXPECT_EQ(lf_tensor_set_find(&s, "__metadata__"), nullptr);
    lf_tensor_set_free(&s);
  }
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_F32), 4u);
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_BF16), 2u);
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_F16), 2u);
}

struct StCase {
  const char *what;
  std::vector<uint8_t> bytes;
  lf_status want;
  std::vector<std::string> subs;
};

TEST(Safetensors, RejectsMalformedFiles) {
  auto rng = make_rng();
  std::vector<uint8_t> data32;
  std::vector<float> ignore;
  random_values(rng, "F32", 6, data32, ignore); // 24 bytes
  const std::string good = R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  std::vector<StCase> cases;
  cases.push_back({"empty file", {}, LF_ERR_FORMAT, {"too short"}});
  cases.push_back({"shorter than the length", {1, 2, 3, 4, 5}, LF_ERR_FORMAT, {"too short"}});
  {
    auto b = st_raw(good, data32);
    b.resize(8 + good.size() / 2);
    cases.push_back({"header length past EOF", b, LF_ERR_FORMAT, {"past the end"}});
  }
  {
    auto b = st_raw(good, data32);
    for (int i = 0; i < 8; i++)
      b[size_t(i)] = 0xFF;
    cases.push_back({"absurd header length", b, LF_ERR_FORMAT, {"past the end"}});
  }
  {
    auto b = st_raw(good, data32);
    b.resize(b.size() - 3);
    cases.push_back(
        {"truncated data", b, LF_ERR_FORMAT, {"tensor w", "data_offsets", "truncated"}});
  }
  cases.push_back({"malformed JSON",
                   st_raw(R"({"w":{"dtype":"F32",)", data32),
                   LF_ERR_FORMAT,
                   {"JSON", "at byte"}});
  cases.push_back(
      {"header not an object", st_raw("[1,2]", data32), LF_ERR_FORMAT, {"not an object"}});
  cases.push_back({"entry not an object", st_raw(R"({"w":[1]})", data32), LF_ERR_FORMAT, {"w"}});
  cases.push_back({"offsets inconsistent with shape",
                   st_raw(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "data_offsets", "need 16"}});
  cases.push_back({"offsets inconsistent with dtype",
                   st_raw(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "need 12"}});
  cases.push_back({"offsets reversed",
                   st_raw(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w"}});
  cases.push_back({"offsets past the data",
                   st_raw(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[4,28]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "outside the data section"}});
  cases.push_back(
      {"huge shape",
       st_raw(
           R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,24]}})",
           data32),
       LF_ERR_FORMAT,
       {"tensor w"}});
  cases.push_back({"unsupported dtype",
                   st_raw(R"({"w":{"dtype":"I8","shape":[24],"data_offsets":[0,24]}})", data32),
                   LF_ERR_UNSUPPORTED,
                   {"tensor w", "I8"}});
  cases.push_back(
      {"rank 5",
       st_raw(R"({"w":{"dtype":"F32","shape":[1,1,2,1,3],"data_offsets":[0,24]}})", data32),
       LF_ERR_UNSUPPORTED,
       {"tensor w", "rank 5"}});
  cases.push_back({"negative dim",
                   st_raw(R"({"w":{"dtype":"F32","shape":[-2,-3],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "shape"}});
  cases.push_back({"fractional dim",
                   st_raw(R"({"w":{"dtype":"F32","shape":[2.5,3],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "shape"}});
  cases.push_back({"missing dtype",
                   st_raw(R"({"w":{"shape":[6],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "dtype"}});
  cases.push_back({"missing offsets",
                   st_raw(R"({"w":{"dtype":"F32","shape":[6]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "data_offsets"}});
  cases.push_back({"duplicate name",
                   st_raw(R"({"w":{"dtype":"F32","shape":[6],"data_offsets":[0,24]},)"
                          R"("w":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})",
                          data32),
                   LF_ERR_FORMAT,
                   {"duplicate", "w"}});
  cases.push_back({"name too long",
                   st_raw("{\"" + std::string(300, 'n') +
                              R"(":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})",
                          data32),
                   LF_ERR_FORMAT,
                   {"longer than"}});
  TempDir d;
  for (const auto &c : cases) {
    const std::string path = d / "bad.safetensors";
    write_file(path, c.bytes);
    lf_tensor_set s{};
    // A tensor from an earlier good file must survive the failed load untouched.
    const std::string ok_path = d / "ok.safetensors";
    write_file(ok_path,
               st_raw(R"({"ok":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})", data32));
    ASSERT_EQ(lf_safetensors_load(&s, ok_path.c_str()), LF_OK) << lf_last_error();
    EXPECT_TRUE(Fails(lf_safetensors_load(&s, path.c_str()), c.want, {path})) << "case: " << c.what;
    for (const auto &sub : c.subs) {
      EXPECT_NE(std::string(lf_last_error()).find(sub), std::string::npos)
          << "case: " << c.what << ": \"" << lf_last_error() << "\" lacks \"" << sub << "\"";
    }
    EXPECT_EQ(s.n, 1) << c.what;
    EXPECT_EQ(s.n_maps, 1) << c.what;
    lf_tensor_set_free(&s);
  }
  lf_tensor_set s{};
  EXPECT_TRUE(Fails(lf_safetensors_load(&s, (d / "absent.safetensors").c_str()), LF_ERR_IO,
                    {"absent.safetensors"}));
  lf_tensor_set_free(&s);
}

} // namespace
