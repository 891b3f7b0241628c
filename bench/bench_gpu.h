/* What lfbench's GPU subcommands (kernel, step, prefill, attn) share: the device they run on and
 * its measured copy bandwidth, the floor every figure is held to (the peer-row lookup they share
 * is bench_util's bench_peer_value). */
#ifndef LF_BENCH_GPU_H
#define LF_BENCH_GPU_H

#include <stddef.h>

typedef struct bench_gpu {
  char name[256]; /* the device's name, safe inside a JSON string (bench_json_safe) */
  int n_sm;
  size_t l2_bytes;
  double copy_gbs; /* 2 GiB device-to-device copies, read + write, median of 20; 0 if not asked */
} bench_gpu;

/* The current CUDA device into *g, and its copy bandwidth when copy_bw: 0, or 1 after
 * "<prog>: ..." on stderr (no device, or the 2 x 2 GiB of the copy test do not fit). A build
 * without CUDA always returns 1. */
int bench_gpu_open(const char *prog, int copy_bw, bench_gpu *g);

#endif
