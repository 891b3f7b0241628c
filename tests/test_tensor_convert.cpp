// fp16 / bf16 conversions and tensor slices (engine/tensor.c).
#include "tests/loader_util.h"

using namespace loader_test;

namespace {

TEST(Tensor, F16ToF32AllValues) {
  for (uint32_t h = 0; h < 65536; h++) {
    const float got = lf_f16_to_f32(uint16_t(h)), want = ref_f16(uint16_t(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_EQ(f_bits(got), f_bits(want)) << std::hex << "f16 0x" << h;
    }
  }
  EXPECT_EQ(lf_f16_to_f32(0x0001), std::ldexp(1.0f, -24));    // smallest subnormal
  EXPECT_EQ(lf_f16_to_f32(0x03FF), std::ldexp(1023.0f, -24)); // largest subnormal
  EXPECT_EQ(lf_f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(lf_f16_to_f32(0x7C00), INFINITY);
  EXPECT_EQ(lf_f16_to_f32(0xFC00), -INFINITY);
  EXPECT_EQ(f_bits(lf_f16_to_f32(0x8000)), 0x80000000u);
}

// Round-to-nearest-even reference, from the two bf16 neighbours in double.
uint16_t ref_bf16(float f) {
  const uint32_t u = f_bits(f);
  const uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);
  const double dl = std::fabs(double(bits_f(uint32_t(lo) << 16)) - f);
  const double dh = (hi & 0x7F80) == 0x7F80 && (hi & 0x7F) == 0
                        ? std::fabs(std::ldexp(1.0, 128) - std::fabs(double(f)))
                        : std::fabs(double(bits_f(uint32_t(hi) << 16)) - f);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Tensor, Bf16Conversion) {
  for (uint32_t h = 0; h < 65536; h++) {
    const float f = lf_bf16_to_f32(uint16_t(h));
    EXPECT_EQ(f_bits(f), h << 16);
    if (!std::isnan(f))
      ASSERT_EQ(lf_f32_to_bf16(f), h) << std::hex << h;
    else
      ASSERT_TRUE(std::isnan(lf_bf16_to_f32(lf_f32_to_bf16(f))));
  }
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x3F808000u)), 0x3F80) << "tie goes to even (down)";
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x3F818000u)), 0x3F82) << "tie goes to even (up)";
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x3F808001u)), 0x3F81) << "above the tie rounds up";
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x7F7FFFFFu)), 0x7F80) << "FLT_MAX rounds to inf";
  EXPECT_TRUE(std::isnan(lf_bf16_to_f32(lf_f32_to_bf16(bits_f(0x7F800001u)))))
      << "a NaN with only low mantissa bits stays NaN";
  auto rng = make_rng();
  for (int i = 0; i < 200000; i++) {
    uint32_t u = uint32_t(rng());
    if ((u & 0x7F800000u) == 0x7F800000u) continue;
    ASSERT_EQ(lf_f32_to_bf16(bits_f(u)), ref_bf16(bits_f(u))) << std::hex << u;
  }
}

TEST(Tensor, ReadSliceChecksBounds) {
  std::vector<float> m(3 * 5); // [3][5]
  for (size_t i = 0; i < m.size(); i++)
    m[i] = float(i);
  lf_tensor_src t{};
  std::snprintf(t.name, sizeof t.name, "m");
  t.dtype = LF_DTYPE_F32;
  t.ndim = 2;
  t.shape[0] = 3;
  t.shape[1] = 5;
  t.data = m.data();
  EXPECT_EQ(lf_tensor_numel(&t), 15);
  float out[6];
  ASSERT_EQ(lf_tensor_read_f32(&t, 1, 2, 2, 3, out), LF_OK);
  const float want[6] = {7, 8, 9, 12, 13, 14};
  for (int i = 0; i < 6; i++)
    EXPECT_EQ(out[i], want[i]);
  EXPECT_EQ(lf_tensor_read_f32(&t, 2, 2, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 0, 1, 3, 3, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, -1, 1, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, -1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, INT64_MAX, 2, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 1, INT64_MAX, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 3, 0, 0, 5, out), LF_OK) << "empty slices are fine";
  // A vector is one row.
  t.ndim = 1;
  t.shape[0] = 4;
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, 1, 1, 3, out), LF_OK);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[2], 3.0f);
  EXPECT_EQ(lf_tensor_read_f32(&t, 1, 1, 0, 1, out), LF_ERR_INVALID_ARG);
  t.ndim = 3;
  t.shape[2] = 1;
  EXPECT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, 1, out), LF_ERR_SHAPE);
  // Half types convert; data need not be aligned.
  std::vector<uint8_t> raw(1 + 4);
  const uint16_t h[2] = {0x3C00 /* f16 1.0 */, 0xC000 /* f16 -2.0 */};
  std::memcpy(raw.data() + 1, h, 4);
  t.ndim = 1;
  t.shape[0] = 2;
  t.dtype = LF_DTYPE_F16;
  t.data = raw.data() + 1;
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, 2, out), LF_OK);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  t.dtype = LF_DTYPE_BF16;
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, 2, out), LF_OK);
  EXPECT_EQ(out[0], bits_f(0x3C000000u));
}

TEST(Tensor, SetRejectsDuplicates) {
  lf_tensor_set s{};
  lf_tensor_src t{};
  std::snprintf(t.name, sizeof t.name, "a.weight");
  t.ndim = 1;
  t.shape[0] = 1;
  t.file = "f1";
  ASSERT_EQ(lf_tensor_set_add(&s, &t), LF_OK);
  for (int i = 0; i < 200; i++) { // growth
    std::snprintf(t.name, sizeof t.name, "t%d", i);
    ASSERT_EQ(lf_tensor_set_add(&s, &t), LF_OK);
  }
  std::snprintf(t.name, sizeof t.name, "a.weight");
  t.file = "f2";
  EXPECT_TRUE(Fails(lf_tensor_set_add(&s, &t), LF_ERR_FORMAT, {"a.weight", "duplicate", "f2"}));
  EXPECT_EQ(s.n, 201);
  ASSERT_NE(lf_tensor_set_find(&s, "t199"), nullptr);
  EXPECT_EQ(lf_tensor_set_find(&s, "t200"), nullptr);
  lf_tensor_set_free(&s);
  EXPECT_EQ(s.n, 0);
  EXPECT_EQ(lf_tensor_set_map_file(&s, "/nonexistent/x.safetensors", nullptr), LF_ERR_IO);
  lf_tensor_set_free(&s);
}

} // namespace
