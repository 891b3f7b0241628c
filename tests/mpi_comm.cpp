// The MPI communicator against values every rank can compute on its own: each rank draws its
// contribution from a seed shared through rank 0, so the expected sum/gather is known locally.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "engine/tensor.h"
#include "parallel/comm.h"
#include "test_util.h"

namespace {

lf_comm_t g_comm = nullptr;
uint64_t g_seed = 0;

std::vector<float> contribution(int rank, size_t n) {
  std::mt19937_64 gen(g_seed + 7919 * uint64_t(rank));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (auto &x : v) x = nd(gen);
  return v;
}

TEST(MpiComm, AllreduceF32) {
  for (size_t n : {size_t(1), size_t(1000), size_t(1) << 20}) {
    std::vector<float> buf = contribution(g_comm->rank, n);
    ASSERT_EQ(g_comm->allreduce_sum(g_comm, buf.data(), n, LF_COMM_F32, nullptr), LF_OK)
        << lf_last_error();
    std::vector<double> want(n, 0.0);
    for (int r = 0; r < g_comm->size; r++) {
      auto c = contribution(r, n);
      for (size_t i = 0; i < n; i++) want[i] += c[i];
    }
    for (size_t i = 0; i < n; i++) ASSERT_NEAR(buf[i], want[i], 1e-5 * (1 + std::fabs(want[i])));
  }
}

TEST(MpiComm, AllreduceBf16SameOnEveryRank) {
  const size_t n = 4096;
  auto c = contribution(g_comm->rank, n);
  std::vector<uint16_t> buf(n);
  for (size_t i = 0; i < n; i++) buf[i] = lf_f32_to_bf16(c[i]);
  ASSERT_EQ(g_comm->allreduce_sum(g_comm, buf.data(), n, LF_COMM_BF16, nullptr), LF_OK);
  std::vector<double> want(n, 0.0);
  for (int r = 0; r < g_comm->size; r++) {
    auto cr = contribution(r, n);
    for (size_t i = 0; i < n; i++) want[i] += lf_bf16_to_f32(lf_f32_to_bf16(cr[i]));
  }
  for (size_t i = 0; i < n; i++)
    ASSERT_NEAR(lf_bf16_to_f32(buf[i]), want[i], 0.02 * (1 + std::fabs(want[i])));
  // Every rank must hold the same bits.
  std::vector<uint16_t> all(n * g_comm->size);
  ASSERT_EQ(g_comm->allgather(g_comm, buf.data(), all.data(), n, LF_COMM_BF16, nullptr), LF_OK);
  for (int r = 0; r < g_comm->size; r++)
    ASSERT_EQ(std::memcmp(all.data() + n * r, buf.data(), n * 2), 0) << "rank " << r;
}

TEST(MpiComm, AllgatherAndBcast) {
  const size_t n = 333;
  auto mine = contribution(g_comm->rank, n);
  std::vector<float> all(n * g_comm->size);
  ASSERT_EQ(g_comm->allgather(g_comm, mine.data(), all.data(), n, LF_COMM_F32, nullptr), LF_OK);
  for (int r = 0; r < g_comm->size; r++) {
    auto c = contribution(r, n);
    ASSERT_EQ(std::memcmp(all.data() + n * r, c.data(), n * 4), 0) << "rank " << r;
  }
  for (int root = 0; root < g_comm->size; root++) {
    std::vector<float> b = root == g_comm->rank ? contribution(root, n) : std::vector<float>(n, NAN);
    ASSERT_EQ(g_comm->bcast(g_comm, b.data(), n * 4, root, nullptr), LF_OK);
    auto c = contribution(root, n);
    ASSERT_EQ(std::memcmp(b.data(), c.data(), n * 4), 0);
  }
  EXPECT_EQ(g_comm->bcast(g_comm, mine.data(), 4, g_comm->size, nullptr), LF_ERR_INVALID_ARG);
  EXPECT_EQ(g_comm->barrier(g_comm), LF_OK);
}

// The root of a broadcast with a deadline fails within it when a peer does not take the message
// (a stuck follower under tensor parallelism); the peers that take it late still get the bytes.
TEST(MpiComm, BcastRootGivesUpOnAPeerThatStaysAway) {
  lf_comm_t c = nullptr;
  ASSERT_EQ(lf_comm_init_mpi(&c), LF_OK) << lf_last_error();
  ASSERT_EQ(lf_comm_mpi_set_timeout(c, 0.5), LF_OK);
  EXPECT_EQ(lf_comm_mpi_set_timeout(c, -1.0), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_comm_mpi_set_timeout(nullptr, 1.0), LF_ERR_INVALID_ARG);
  // 32 MB: far above any eager limit, so the root's broadcast needs every peer to take part
  const size_t n = size_t(8) << 20;
  std::vector<float> want = contribution(0, n);
  std::vector<float> b = c->rank == 0 ? want : std::vector<float>(n, NAN);
  if (c->rank == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    const lf_status s = c->bcast(c, b.data(), n * 4, 0, nullptr);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(s, LF_ERR_BACKEND);
    EXPECT_NE(std::strstr(lf_last_error(), "gone or stuck"), nullptr) << lf_last_error();
    EXPECT_GE(took, 0.45);
    EXPECT_LT(took, 1.5); // the peers join after 2 s
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    ASSERT_EQ(c->bcast(c, b.data(), n * 4, 0, nullptr), LF_OK) << lf_last_error();
    EXPECT_EQ(std::memcmp(b.data(), want.data(), n * 4), 0);
  }
  // the root's abandoned request completes while it waits here with the others
  MPI_Barrier(MPI_COMM_WORLD);
  lf_comm_free(c);
}

} // namespace

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (lf_comm_init_mpi(&g_comm) != LF_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, lf_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  // One seed for the run, chosen by rank 0.
  g_seed = rank == 0 ? lf_test_seed() : 0;
  MPI_Bcast(&g_seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  if (rank != 0) {
    auto &listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  } else {
    printf("seed %llu, %d ranks\n", (unsigned long long)g_seed, g_comm->size);
  }
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  lf_comm_free(g_comm);
  MPI_Finalize();
  return worst;
}
