/* The C ABI from C: a 2-rank dispatch + combine on the host backend (one pthread per rank),
 * checked against the identity combine(dispatch(x)) = x * (experts chosen), and error codes. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "epx/epx.h"

enum { RANKS = 2, T = 8, H = 64, E = 4, K = 2 };

static epx_world* world;
static int failures;

#define CHECK(cond, ...)                        \
  do {                                          \
    if (!(cond)) {                              \
      printf("FAILED %s:%d: ", __FILE__, __LINE__); \
      printf(__VA_ARGS__);                      \
      printf("\n");                             \
      __sync_fetch_and_add(&failures, 1);       \
    }                                           \
  } while (0)

static epx_tensor tensor2(void* data, int dtype, int64_t rows, int64_t cols) {
  epx_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.strides[0] = cols;
  t.strides[1] = 1;
  return t;
}

static uint16_t bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16); /* exact for the small values used here */
}

static void* rank_main(void* arg) {
  const int rank = (int)(long)arg;
  epx_buffer_config cfg;
  epx_buffer_config_default(&cfg);
  cfg.hidden = H;
  cfg.max_tokens_per_rank = T;
  cfg.num_experts = E;
  cfg.topk = K;
  cfg.timeout_ms = 10000;
  epx_buffer* buf = NULL;
  epx_status st = epx_buffer_create(world, rank, &cfg, &buf);
  CHECK(st == EPX_OK, "buffer_create: %s", epx_last_error());
  if (st != EPX_OK) return NULL;

  uint16_t x[T * H];
  int32_t idx[T * K];
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) x[t * H + h] = bf16((float)(1 + (t + h + rank) % 5));
    idx[t * K] = t % E;
    idx[t * K + 1] = (t % 3 == 0) ? -1 : (t + 1) % E;
  }
  epx_dispatch_args args;
  memset(&args, 0, sizeof args);
  args.x = tensor2(x, 0, T, H);
  args.topk_idx = tensor2(idx, 4, T, K);
  epx_result* d = NULL;
  st = epx_dispatch(buf, &args, &d);
  CHECK(st == EPX_OK, "dispatch: %s", epx_last_error());
  if (st != EPX_OK) return NULL;

  epx_tensor recv_x;
  int64_t rows = -1;
  CHECK(epx_result_tensor(d, "recv_x", &recv_x) == EPX_OK, "recv_x missing");
  CHECK(epx_result_int(d, "num_rows", &rows) == EPX_OK && rows == recv_x.shape[0], "num_rows");
  CHECK(epx_result_tensor(d, "no_such", &recv_x) == EPX_ERR_INVALID_ARGUMENT, "unknown name accepted");
  CHECK(strstr(epx_last_error(), "no tensor 'no_such'") != NULL, "message: %s", epx_last_error());
  epx_result_tensor(d, "recv_x", &recv_x);

  epx_result* c = NULL;
  st = epx_combine(buf, d, &recv_x, NULL, 0, &c);
  CHECK(st == EPX_OK, "combine: %s", epx_last_error());
  if (st == EPX_OK) {
    epx_tensor out;
    epx_result_tensor(c, "out", &out);
    const uint16_t* o = (const uint16_t*)out.data;
    for (int t = 0; t < T; ++t) {
      const float n = (t % 3 == 0) ? 1.0f : 2.0f;
      for (int h = 0; h < H; ++h) {
        const float want = n * (float)(1 + (t + h + rank) % 5);
        CHECK(o[t * H + h] == bf16(want), "rank %d out[%d,%d] = 0x%04x, want %g", rank, t, h, o[t * H + h], want);
      }
    }
    epx_result_destroy(c);
  }

  /* A bad expert id on rank 1: both ranks get an error code, nobody hangs. */
  if (rank == 1) idx[3] = 99;
  epx_result* bad = NULL;
  st = epx_dispatch(buf, &args, &bad);
  CHECK(st == (rank == 1 ? EPX_ERR_INVALID_ARGUMENT : EPX_ERR_PEER_FAILED), "rank %d bad dispatch status %d", rank, st);
  CHECK(strstr(epx_last_error(), "topk_idx[1, 1] = 99") != NULL, "rank %d message: %s", rank, epx_last_error());

  epx_result_destroy(d);
  epx_buffer_destroy(buf);
  return NULL;
}

int main(void) {
  if (epx_host_world_create(RANKS, &world) != EPX_OK) {
    printf("world: %s\n", epx_last_error());
    return 1;
  }
  pthread_t th[RANKS];
  for (long r = 0; r < RANKS; ++r) pthread_create(&th[r], NULL, rank_main, (void*)r);
  for (int r = 0; r < RANKS; ++r) pthread_join(th[r], NULL);
  epx_host_world_destroy(world);
  CHECK(epx_host_world_create(0, &world) == EPX_ERR_INVALID_ARGUMENT, "world of 0 ranks accepted");
  printf("%s: %d failures\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
