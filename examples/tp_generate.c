/* tp_generate: tensor-parallel generation through include/lfserve.h under mpirun.
 *
 *   mpirun -np 2 tp_generate MODEL [PROMPT] [--max-tokens N] [--gpu]
 *
 * Every rank loads its shard of the model (the ranks must divide the model's KV heads, or be a
 * multiple of them that divides the query heads). Rank 0 tokenizes the prompt, submits it, steps
 * the engine and streams the text; every other rank calls lf_engine_follow, which runs what rank
 * 0's steps broadcast and returns when rank 0 frees its engine. CPU ranks talk over MPI
 * (lf_comm_init_mpi); with --gpu each rank takes a GPU and the ranks talk over NCCL
 * (lf_comm_init_nccl_mpi, in a build with CUDA and NCCL). The program, not the library, starts
 * and ends MPI.
 *
 * Build: see examples/CMakeLists.txt, or
 *   mpicc tp_generate.c $(pkg-config --cflags --libs lfserve) -o tp_generate
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lfserve.h>

static int fail(int rank, const char *what, lf_status s) {
  fprintf(stderr, "tp_generate: rank %d: %s: %s: %s\n", rank, what, lf_status_str(s),
          lf_last_error());
  return 1;
}

/* Rank 0: one request, its text streamed to stdout. */
static int lead(lf_engine_t e, const char *model, const char *prompt, int max_tokens) {
  lf_tokenizer *tok = NULL;
  lf_detokenizer *detok = NULL;
  int32_t *ids = NULL;
  int n = 0, rc = 0;
  uint64_t id = 0;
  lf_status s = lf_tokenizer_open(model, &tok);
  if (s == LF_OK) s = lf_tokenize(tok, prompt, 1, &ids, &n);
  if (s == LF_OK && n == 0) {
    fprintf(stderr, "tp_generate: the prompt is empty\n");
    rc = 1;
  }
  lf_request rq = {0};
  rq.prompt = ids;
  rq.n_prompt = n;
  rq.max_tokens = max_tokens; /* greedy */
  if (s == LF_OK && rc == 0) s = lf_engine_submit(e, &rq, &id);
  lf_free(ids);
  if (s == LF_OK && rc == 0) s = lf_detokenizer_init(tok, &detok);
  if (s != LF_OK) rc = fail(0, "prompt", s);
  if (rc == 0) printf("%s", prompt);
  lf_event ev[16];
  while (rc == 0 && lf_engine_busy(e)) {
    int got = 0;
    if ((s = lf_engine_step(e, ev, 16, &got)) != LF_OK) {
      rc = fail(0, "step", s);
      break;
    }
    for (int i = 0; i < got; i++) {
      const char *piece = "";
      size_t len = 0;
      if (ev[i].type == LF_EVENT_TOKEN) {
        if (lf_detokenizer_put(detok, ev[i].token, &piece, &len) == LF_OK)
          fwrite(piece, 1, len, stdout);
      } else {
        if (lf_detokenizer_flush(detok, &piece, &len) == LF_OK) fwrite(piece, 1, len, stdout);
        lf_request_stats st;
        lf_engine_request_stats(e, id, &st);
        printf("\n[finished: %s, %d prompt + %d generated tokens]\n",
               lf_finish_reason_str(ev[i].reason), st.prompt_tokens, st.generated_tokens);
        if (ev[i].reason == LF_FINISH_ERROR) rc = fail(0, "generation", ev[i].status);
      }
      fflush(stdout);
    }
  }
  lf_detokenizer_free(detok);
  lf_tokenizer_free(tok);
  return rc;
}

int main(int argc, char **argv) {
  const char *model = NULL, *prompt = "Once upon a time";
  int max_tokens = 48, gpu = 0, have_prompt = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--max-tokens") && i + 1 < argc)
      max_tokens = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--gpu"))
      gpu = 1;
    else if (!model)
      model = argv[i];
    else if (!have_prompt)
      prompt = argv[i], have_prompt = 1;
    else {
      fprintf(stderr, "tp_generate: unexpected argument '%s'\n", argv[i]);
      return 2;
    }
  }
  if (!model || max_tokens < 1) {
    fprintf(stderr, "usage: mpirun -np N tp_generate MODEL [PROMPT] [--max-tokens N] [--gpu]\n");
    return 2;
  }
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) return 1;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  lf_comm_t comm = NULL;
  lf_status s = gpu ? lf_comm_init_nccl_mpi(0.0, NULL, &comm) : lf_comm_init_mpi(&comm);
  if (s != LF_OK) {
    fail(rank, "communicator", s);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = model;
  cfg.backend = gpu ? LF_BACKEND_CUDA : LF_BACKEND_CPU;
  cfg.n_pools = 1;
  lf_engine_t e = NULL;
  s = lf_engine_init(&cfg, comm, &e); /* collective: every rank agrees on success */
  int rc = 0;
  if (s != LF_OK) {
    rc = fail(rank, "engine", s);
  } else if (rank == 0) {
    fprintf(stderr, "tp_generate: lfserve %s, tensor parallel over %d ranks\n", lf_version(),
            lf_comm_size(comm));
    rc = lead(e, model, prompt, max_tokens);
    lf_engine_free(e); /* releases the followers */
  } else {
    s = lf_engine_follow(e); /* until rank 0 frees its engine */
    if (s != LF_OK) rc = fail(rank, "follow", s);
    lf_engine_free(e);
  }
  /* A failed rank leaves without MPI_Finalize: the launcher then ends the whole job rather than
   * leaving the other ranks waiting in a collective. */
  if (rc != 0) MPI_Abort(MPI_COMM_WORLD, rc);
  lf_comm_free(comm);
  MPI_Finalize();
  return 0;
}
