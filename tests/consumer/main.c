/* An installed epx from C, through the C ABI: a host world of 2 ranks (one pthread each), one
 * buffer per rank, one weighted dispatch + combine with y = recv_x, so out[t] = x[t] * (sum of
 * t's weights). Exits non-zero on any mismatch or error. */
#include <epx/epx.h>

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { RANKS = 2, TOKENS = 6, HIDDEN = 64, EXPERTS = 4, TOPK = 2 };
enum { DT_BF16 = 0, DT_F32 = 1, DT_I32 = 4 };

static epx_world* world;
static int failures;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void fail(int rank, const char* what, const char* detail) {
  pthread_mutex_lock(&lock);
  printf("rank %d: %s%s%s\n", rank, what, detail ? ": " : "", detail ? detail : "");
  ++failures;
  pthread_mutex_unlock(&lock);
}

/* bf16 of a float whose low 16 bits are zero (every value used here). */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)(u >> 16);
}

static float x_value(int rank, int t, int h) { return (float)(1 + (3 * t + h + rank) % 7); }
static int second_used(int t) { return t % 3 != 0; }

static epx_tensor matrix(void* data, int32_t dtype, int64_t rows, int64_t cols) {
  epx_tensor v;
  memset(&v, 0, sizeof v);
  v.data = data;
  v.dtype = dtype;
  v.ndim = 2;
  v.shape[0] = rows;
  v.shape[1] = cols;
  v.strides[0] = cols;
  v.strides[1] = 1;
  return v;
}

static void* run_rank(void* arg) {
  const int rank = (int)(intptr_t)arg;
  uint16_t x[TOKENS * HIDDEN];
  int32_t idx[TOKENS * TOPK];
  float w[TOKENS * TOPK];
  epx_buffer_config cfg;
  epx_buffer* buffer = NULL;
  epx_dispatch_args args;
  epx_result* dispatched = NULL;
  epx_result* combined = NULL;
  epx_tensor recv_x, out;
  int64_t rows = -1;

  epx_buffer_config_default(&cfg);
  cfg.hidden = HIDDEN;
  cfg.max_tokens_per_rank = TOKENS;
  cfg.num_experts = EXPERTS;
  cfg.topk = TOPK;
  cfg.timeout_ms = 20000;
  if (epx_buffer_create(world, rank, &cfg, &buffer) != EPX_OK) {
    fail(rank, "epx_buffer_create", epx_last_error());
    return NULL;
  }
  for (int t = 0; t < TOKENS; ++t) {
    for (int h = 0; h < HIDDEN; ++h) x[t * HIDDEN + h] = to_bf16(x_value(rank, t, h));
    idx[t * TOPK] = (t + rank) % EXPERTS;
    idx[t * TOPK + 1] = second_used(t) ? (t + rank + 1) % EXPERTS : -1;
    w[t * TOPK] = 0.5f;
    w[t * TOPK + 1] = 0.25f;
  }
  memset(&args, 0, sizeof args);
  args.x = matrix(x, DT_BF16, TOKENS, HIDDEN);
  args.topk_idx = matrix(idx, DT_I32, TOKENS, TOPK);
  args.topk_weights = matrix(w, DT_F32, TOKENS, TOPK);
  if (epx_dispatch(buffer, &args, &dispatched) != EPX_OK) {
    fail(rank, "epx_dispatch", epx_last_error());
    epx_buffer_destroy(buffer);
    return NULL;
  }
  if (epx_result_tensor(dispatched, "recv_x", &recv_x) != EPX_OK) fail(rank, "recv_x", epx_last_error());
  if (epx_result_int(dispatched, "num_rows", &rows) != EPX_OK || rows != recv_x.shape[0])
    fail(rank, "num_rows differs from recv_x's rows", NULL);

  if (epx_combine(buffer, dispatched, &recv_x, NULL, 1, &combined) != EPX_OK) {
    fail(rank, "epx_combine", epx_last_error());
  } else if (epx_result_tensor(combined, "out", &out) != EPX_OK || out.ndim != 2 || out.shape[0] != TOKENS ||
             out.shape[1] != HIDDEN || out.dtype != DT_BF16) {
    fail(rank, "combine's out is missing or has the wrong shape", NULL);
  } else {
    const uint16_t* o = (const uint16_t*)out.data;
    for (int t = 0; t < TOKENS; ++t) {
      const float weight = second_used(t) ? 0.75f : 0.5f;
      for (int h = 0; h < HIDDEN; ++h) {
        if (o[t * HIDDEN + h] != to_bf16(weight * x_value(rank, t, h))) {
          char detail[96];
          snprintf(detail, sizeof detail, "out[%d, %d] = 0x%04x, want %g", t, h, o[t * HIDDEN + h],
                   weight * x_value(rank, t, h));
          fail(rank, "combine", detail);
          t = TOKENS;
          break;
        }
      }
    }
  }
  epx_result_destroy(combined);
  epx_result_destroy(dispatched);
  epx_buffer_destroy(buffer);
  return NULL;
}

int main(void) {
  pthread_t threads[RANKS];
  if (epx_host_world_create(RANKS, &world) != EPX_OK) {
    printf("epx_host_world_create: %s\n", epx_last_error());
    return 1;
  }
  for (intptr_t r = 0; r < RANKS; ++r) pthread_create(&threads[r], NULL, run_rank, (void*)r);
  for (int r = 0; r < RANKS; ++r) pthread_join(threads[r], NULL);
  epx_host_world_destroy(world);
  printf("epx consumer (C): %s\n", failures ? "FAIL" : "OK");
  return failures ? 1 : 0;
}
