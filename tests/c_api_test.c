/* The C ABI from C, on the host backend (one pthread per rank):
 * - a 2-rank dispatch + combine (and both backward passes) checked against the identity
 *   combine(dispatch(x)) = x * (experts chosen);
 * - every refused argument of a collective call takes part in the call: a bad argument on rank 1
 *   makes both ranks fail that same call at once (rank 1 with the reason, rank 0 with peer_failed
 *   naming rank 1 and the reason), and the next good calls on both ranks still work; buffer
 *   creation likewise;
 * - redundant experts (EPLB): the replica table, topk_physical, the load counters;
 * - groups (epx_host_world_group, epx_buffer_create_in_group), and the CUDA functions' status in
 *   any build (EPX_ERR_UNSUPPORTED without the CUDA backend). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "epx/epx.h"

enum { RANKS = 2, T = 8, H = 64, E = 4, K = 2 };

static epx_world* world;
static pthread_barrier_t together;
static int failures;

#define CHECK(cond, ...)                            \
  do {                                              \
    if (!(cond)) {                                  \
      printf("FAILED %s:%d: ", __FILE__, __LINE__); \
      printf(__VA_ARGS__);                          \
      printf("\n");                                 \
      __sync_fetch_and_add(&failures, 1);           \
    }                                               \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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

static epx_buffer_config config(void) {
  epx_buffer_config cfg;
  epx_buffer_config_default(&cfg);
  cfg.hidden = H;
  cfg.max_tokens_per_rank = T;
  cfg.num_experts = E;
  cfg.topk = K;
  cfg.timeout_ms = 20000; /* a call paired with the wrong one would take this long to fail */
  return cfg;
}

typedef struct {
  int rank;
  epx_buffer* buf;
  uint16_t x[T * H];
  int32_t idx[T * K];
  epx_dispatch_args args;
} rank_state;

static void make_inputs(rank_state* s) {
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) s->x[t * H + h] = bf16((float)(1 + (t + h + s->rank) % 5));
    s->idx[t * K] = t % E;
    s->idx[t * K + 1] = (t % 3 == 0) ? -1 : (t + 1) % E;
  }
  memset(&s->args, 0, sizeof s->args);
  s->args.x = tensor2(s->x, 0, T, H);
  s->args.topk_idx = tensor2(s->idx, 4, T, K);
}

/* `name` of result r (a combine's out or a dispatch backward's grad_x) is x * (experts chosen). */
static void check_sum(const rank_state* s, const epx_result* r, const char* name, const char* when) {
  epx_tensor out;
  const epx_status st = epx_result_tensor(r, name, &out);
  CHECK(st == EPX_OK && out.ndim == 2 && out.shape[0] == T && out.shape[1] == H, "rank %d %s (%s): no [T, H] tensor",
        s->rank, name, when);
  if (st != EPX_OK) return;
  const uint16_t* o = (const uint16_t*)out.data;
  int wrong = 0, first = -1;
  for (int t = 0; t < T; ++t) {
    const float n = (t % 3 == 0) ? 1.0f : 2.0f;
    for (int h = 0; h < H; ++h)
      if (o[t * H + h] != bf16(n * (float)(1 + (t + h + s->rank) % 5)) && wrong++ == 0) first = t * H + h;
  }
  CHECK(wrong == 0, "rank %d %s (%s): %d values wrong, the first at [%d, %d]", s->rank, name, when, wrong,
        first / H, first % H);
}

/* A good dispatch + combine on this rank. */
static void check_round_trip(rank_state* s, const char* when) {
  epx_result* d = NULL;
  epx_result* c = NULL;
  epx_status st = epx_dispatch(s->buf, &s->args, &d);
  CHECK(st == EPX_OK, "rank %d dispatch after %s: %s", s->rank, when, epx_last_error());
  if (st != EPX_OK) return;
  epx_tensor recv_x;
  epx_result_tensor(d, "recv_x", &recv_x);
  st = epx_combine(s->buf, d, &recv_x, NULL, 0, &c);
  CHECK(st == EPX_OK, "rank %d combine after %s: %s", s->rank, when, epx_last_error());
  if (st == EPX_OK) check_sum(s, c, "out", when);
  epx_result_destroy(c);
  c = NULL;
  /* The same rows again by a cached dispatch, and its result as the combine's handle. */
  epx_result* cached = NULL;
  st = epx_dispatch_cached(s->buf, d, &s->args.x, NULL, 0.0f, &cached);
  CHECK(st == EPX_OK, "rank %d cached dispatch after %s: %s", s->rank, when, epx_last_error());
  if (st == EPX_OK) {
    epx_tensor again;
    epx_result_tensor(cached, "recv_x", &again);
    CHECK(again.shape[0] == recv_x.shape[0] &&
              memcmp(again.data, recv_x.data, (size_t)(recv_x.shape[0] * recv_x.shape[1]) * 2) == 0,
          "rank %d cached dispatch after %s: recv_x differs from the dispatch's", s->rank, when);
    st = epx_combine(s->buf, cached, &again, NULL, 0, &c);
    CHECK(st == EPX_OK, "rank %d combine of the cached dispatch after %s: %s", s->rank, when, epx_last_error());
    if (st == EPX_OK) check_sum(s, c, "out", when);
  }
  epx_result_destroy(c);
  epx_result_destroy(cached);
  epx_result_destroy(d);
}

/* Both ranks just made the same call, rank 1 with a bad argument, taking `seconds`: both failed
 * it at once, rank 1 with the reason, rank 0 with peer_failed naming rank 1 and the reason. */
static void check_refused(int rank, epx_status st, double seconds, const char* reason) {
  const char* msg = epx_last_error();
  if (rank == 1) {
    CHECK(st == EPX_ERR_INVALID_ARGUMENT, "rank 1 (%s): status %d, want %d: %s", reason, st,
          EPX_ERR_INVALID_ARGUMENT, msg);
    CHECK(strstr(msg, reason) != NULL, "rank 1: the message '%s' does not say '%s'", msg, reason);
  } else {
    CHECK(st == EPX_ERR_PEER_FAILED, "rank 0 (rank 1: %s): status %d, want %d: %s", reason, st, EPX_ERR_PEER_FAILED,
          msg);
    CHECK(strstr(msg, "rank 1 ") != NULL && strstr(msg, reason) != NULL,
          "rank 0: the message '%s' does not name rank 1 and '%s'", msg, reason);
  }
  CHECK(seconds < 1.0, "rank %d (%s): the failing call took %.2f s", rank, reason, seconds);
}

/* Rank 1 creates its buffer (in `group`, or world's rank) with bad_cfg (null_out: a NULL out), rank 0
 * with good arguments. */
static void creation_refused(int rank, const epx_group* group, const epx_buffer_config* bad_cfg, int null_out,
                             const char* reason) {
  const epx_buffer_config good = config();
  const epx_buffer_config* cfg = rank == 1 ? bad_cfg : &good;
  epx_buffer* buf = NULL;
  epx_buffer** out = rank == 1 && null_out ? NULL : &buf;
  pthread_barrier_wait(&together);
  const double t0 = now_s();
  const epx_status st = group ? epx_buffer_create_in_group(group, cfg, out) : epx_buffer_create(world, rank, cfg, out);
  check_refused(rank, st, now_s() - t0, reason);
  epx_buffer_destroy(buf);
}

/* Rank 1 dispatches `bad` (NULL: args NULL; null_out: out NULL), rank 0 its good args; then a good
 * dispatch + combine on both. */
static void dispatch_refused(rank_state* s, const epx_dispatch_args* bad, int null_out, const char* reason) {
  epx_result* d = NULL;
  pthread_barrier_wait(&together);
  const double t0 = now_s();
  const epx_status st =
      s->rank == 1 ? epx_dispatch(s->buf, bad, null_out ? NULL : &d) : epx_dispatch(s->buf, &s->args, &d);
  check_refused(s->rank, st, now_s() - t0, reason);
  epx_result_destroy(d);
  check_round_trip(s, reason);
}

/* Redundant experts (EPLB): P = 8 physical experts, logical e served by e (rank 0) and 4 + e (rank
 * 1), so every rank keeps its tokens home; topk_physical says so, combine(dispatch(x)) is still
 * x * (experts chosen), the load counts this rank's used slots and resets; a table with an id out of
 * range on rank 1 fails both ranks' dispatch. */
static void check_eplb(rank_state* s) {
  epx_buffer_config cfg = config();
  cfg.num_physical_experts = 2 * E;
  cfg.max_replicas = 2;
  epx_buffer* buf = NULL;
  epx_status st = epx_buffer_create(world, s->rank, &cfg, &buf);
  CHECK(st == EPX_OK, "rank %d EPLB buffer_create: %s", s->rank, epx_last_error());
  if (st != EPX_OK) return;
  int32_t table[E * 2], bad_table[E * 2];
  for (int e = 0; e < E; ++e) {
    table[2 * e] = bad_table[2 * e] = e;
    table[2 * e + 1] = bad_table[2 * e + 1] = E + e;
  }
  bad_table[3] = 2 * E; /* expert_replicas[1][1] out of [0, P) */
  epx_buffer* plain = s->buf;
  s->buf = buf;
  s->args.expert_replicas = tensor2(table, 4, E, 2);
  epx_result* d = NULL;
  st = epx_dispatch(buf, &s->args, &d);
  CHECK(st == EPX_OK, "rank %d EPLB dispatch: %s", s->rank, epx_last_error());
  epx_tensor chosen, load;
  if (st == EPX_OK && epx_result_tensor(d, "topk_physical", &chosen) == EPX_OK) {
    const int32_t* p = (const int32_t*)chosen.data;
    int wrong = 0;
    for (int i = 0; i < T * K; ++i) wrong += p[i] != (s->idx[i] < 0 ? -1 : s->idx[i] + E * s->rank);
    CHECK(wrong == 0, "rank %d topk_physical: %d slots not on their own rank's replica", s->rank, wrong);
  } else {
    CHECK(0, "rank %d EPLB dispatch: no topk_physical", s->rank);
  }
  st = epx_buffer_expert_load(buf, &load);
  int64_t counted = 0, used = 0;
  for (int i = 0; st == EPX_OK && i < load.shape[0]; ++i) counted += ((const int64_t*)load.data)[i];
  for (int i = 0; i < T * K; ++i) used += s->idx[i] >= 0;
  CHECK(st == EPX_OK && load.ndim == 1 && load.shape[0] == E && counted == used, "rank %d expert_load: %lld, want %lld",
        s->rank, (long long)counted, (long long)used);
  CHECK(epx_buffer_reset_expert_load(buf) == EPX_OK && ((const int64_t*)load.data)[0] == 0,
        "rank %d reset_expert_load: %s", s->rank, epx_last_error());
  epx_result_destroy(d);
  check_round_trip(s, "an EPLB dispatch");

  epx_result* bad_result = NULL;
  if (s->rank == 1) s->args.expert_replicas = tensor2(bad_table, 4, E, 2);
  st = epx_dispatch(buf, &s->args, &bad_result);
  CHECK(st == (s->rank == 1 ? EPX_ERR_INVALID_ARGUMENT : EPX_ERR_PEER_FAILED), "rank %d bad table status %d", s->rank,
        st);
  CHECK(strstr(epx_last_error(), "expert_replicas[1][1] = 8 is out of range") != NULL, "rank %d message: %s",
        s->rank, epx_last_error());
  s->args.expert_replicas = tensor2(table, 4, E, 2);
  check_round_trip(s, "a bad replica table");
  memset(&s->args.expert_replicas, 0, sizeof s->args.expert_replicas);
  s->buf = plain;
  epx_buffer_destroy(buf);
}

static void* rank_main(void* arg) {
  rank_state state;
  rank_state* s = &state;
  memset(s, 0, sizeof *s);
  s->rank = (int)(long)arg;
  const int rank = s->rank;
  make_inputs(s);

  /* Buffer creation: a config or out that rank 1 alone gets wrong fails both ranks' creation. */
  epx_buffer_config bad = config();
  bad.wire = 9;
  creation_refused(rank, NULL, &bad, 0, "wire: unknown wire format code 9");
  bad = config();
  bad.mode = 5;
  creation_refused(rank, NULL, &bad, 0, "mode: unknown capacity mode code 5");
  bad = config();
  bad.combine_wire = 3; /* nvfp4 */
  creation_refused(rank, NULL, &bad, 0, "combine_wire nvfp4 is not supported");
  bad = config();
  creation_refused(rank, NULL, &bad, 1, "epx_buffer_create: out must not be NULL");
  creation_refused(rank, NULL, NULL, 0, "epx_buffer_create: cfg must not be NULL");

  epx_buffer_config cfg = config();
  epx_status st = epx_buffer_create(world, rank, &cfg, &s->buf);
  CHECK(st == EPX_OK, "buffer_create: %s", epx_last_error());
  if (st != EPX_OK) return NULL;
  /* Host buffers: no stream, nothing to wait for. */
  CHECK(epx_buffer_set_stream(s->buf, NULL) == EPX_OK, "set_stream on a host buffer: %s", epx_last_error());
  CHECK(epx_buffer_synchronize(s->buf) == EPX_OK, "synchronize on a host buffer: %s", epx_last_error());

  epx_result* d = NULL;
  st = epx_dispatch(s->buf, &s->args, &d);
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
  st = epx_combine(s->buf, d, &recv_x, NULL, 0, &c);
  CHECK(st == EPX_OK, "combine: %s", epx_last_error());
  if (st != EPX_OK) return NULL;
  check_sum(s, c, "out", "the first combine");

  /* Dispatch: each refused argument of rank 1 fails both ranks' dispatch at once. */
  epx_dispatch_args a = s->args;
  a.x.dtype = 9;
  dispatch_refused(s, &a, 0, "epx_dispatch: args->x: unknown dtype code 9");
  a = s->args;
  a.topk_idx.ndim = 5;
  dispatch_refused(s, &a, 0, "epx_dispatch: args->topk_idx: ndim must be in [0, 4], got 5");
  a = s->args;
  a.x.device = 7;
  dispatch_refused(s, &a, 0, "epx_dispatch: args->x: unknown device code 7");
  a = s->args;
  a.layout = 7;
  dispatch_refused(s, &a, 0, "epx_dispatch: args->layout: unknown layout code 7");
  dispatch_refused(s, &s->args, 1, "epx_dispatch: out must not be NULL");
  dispatch_refused(s, NULL, 0, "epx_dispatch: args must not be NULL");

  /* Combine, with the first dispatch's result d: rank 1's bad y or dispatched fails both ranks'
   * combine at once, then a good combine of d works. c, a combine's result, holds no handle. */
  epx_tensor bad_y = recv_x;
  bad_y.dtype = 9;
  const struct {
    const epx_result* dispatched;
    const epx_tensor* y;
    int null_out;
    const char* reason;
  } combines[] = {
      {d, NULL, 0, "epx_combine: y must not be NULL"},
      {d, &bad_y, 0, "epx_combine: y: unknown dtype code 9"},
      {NULL, &recv_x, 0, "epx_combine: dispatched must not be NULL"},
      {c, &recv_x, 0, "epx_combine: dispatched is not a result of epx_dispatch"},
      {d, &recv_x, 1, "epx_combine: out must not be NULL"},
  };
  for (size_t i = 0; i < sizeof combines / sizeof combines[0]; ++i) {
    epx_result* c2 = NULL;
    pthread_barrier_wait(&together);
    const double t0 = now_s();
    if (rank == 1)
      st = epx_combine(s->buf, combines[i].dispatched, combines[i].y, NULL, 0, combines[i].null_out ? NULL : &c2);
    else
      st = epx_combine(s->buf, d, &recv_x, NULL, 0, &c2);
    check_refused(rank, st, now_s() - t0, combines[i].reason);
    epx_result_destroy(c2);
    c2 = NULL;
    st = epx_combine(s->buf, d, &recv_x, NULL, 0, &c2);
    CHECK(st == EPX_OK, "rank %d combine after %s: %s", rank, combines[i].reason, epx_last_error());
    if (st == EPX_OK) check_sum(s, c2, "out", combines[i].reason);
    epx_result_destroy(c2);
  }

  /* The backward passes likewise; then good ones: dispatch_backward(recv_x) is the unweighted
   * combine of recv_x, and combine_backward(x) returns x to every row (= recv_x). */
  epx_result* b = NULL;
  pthread_barrier_wait(&together);
  double t0 = now_s();
  st = epx_dispatch_backward(s->buf, d, rank == 1 ? NULL : &recv_x, NULL, &b);
  check_refused(rank, st, now_s() - t0, "epx_dispatch_backward: grad_recv_x must not be NULL");
  epx_result_destroy(b);
  b = NULL;
  st = epx_dispatch_backward(s->buf, d, &recv_x, NULL, &b);
  CHECK(st == EPX_OK, "rank %d dispatch_backward: %s", rank, epx_last_error());
  if (st == EPX_OK) check_sum(s, b, "grad_x", "dispatch_backward");
  epx_result_destroy(b);
  b = NULL;

  pthread_barrier_wait(&together);
  t0 = now_s();
  st = epx_combine_backward(s->buf, d, rank == 1 ? NULL : &s->args.x, NULL, 0, &b);
  check_refused(rank, st, now_s() - t0, "epx_combine_backward: grad_out must not be NULL");
  epx_result_destroy(b);
  b = NULL;
  st = epx_combine_backward(s->buf, d, &s->args.x, NULL, 0, &b);
  CHECK(st == EPX_OK, "rank %d combine_backward: %s", rank, epx_last_error());
  if (st == EPX_OK) {
    epx_tensor gy;
    CHECK(epx_result_tensor(b, "grad_y", &gy) == EPX_OK && gy.shape[0] == recv_x.shape[0] && gy.shape[1] == H,
          "rank %d grad_y: not [N, H]", rank);
    CHECK(memcmp(gy.data, recv_x.data, (size_t)(recv_x.shape[0] * H * 2)) == 0, "rank %d grad_y != recv_x", rank);
  }
  epx_result_destroy(b);

  /* A bad expert id on rank 1 (found by the library's own checks): both ranks get an error code. */
  if (rank == 1) s->idx[3] = 99;
  epx_result* bad_result = NULL;
  st = epx_dispatch(s->buf, &s->args, &bad_result);
  CHECK(st == (rank == 1 ? EPX_ERR_INVALID_ARGUMENT : EPX_ERR_PEER_FAILED), "rank %d bad dispatch status %d", rank, st);
  CHECK(strstr(epx_last_error(), "topk_idx[1, 1] = 99") != NULL, "rank %d message: %s", rank, epx_last_error());
  make_inputs(s);
  check_round_trip(s, "a bad expert id");
  check_eplb(s);

  epx_result_destroy(c);
  epx_result_destroy(d);
  epx_buffer_destroy(s->buf);

  /* A buffer in a group: creation refused alike, then a good one works. */
  epx_group* group = NULL;
  st = epx_host_world_group(world, rank, &group);
  CHECK(st == EPX_OK, "rank %d host_world_group: %s", rank, epx_last_error());
  if (st != EPX_OK) return NULL;
  bad = config();
  bad.wire = -1;
  creation_refused(rank, group, &bad, 0, "wire: unknown wire format code -1");
  creation_refused(rank, group, &bad, 1, "epx_buffer_create_in_group: out must not be NULL");
  s->buf = NULL;
  st = epx_buffer_create_in_group(group, &cfg, &s->buf);
  CHECK(st == EPX_OK, "rank %d buffer_create_in_group: %s", rank, epx_last_error());
  epx_group_destroy(group); /* the buffer keeps what it needs */
  if (st != EPX_OK) return NULL;
  check_round_trip(s, "creating the buffer in a group");
  epx_buffer_destroy(s->buf);
  return NULL;
}

/* The CUDA functions: EPX_ERR_UNSUPPORTED without the CUDA backend; with it, a status (never a
 * crash) whether or not a GPU is visible. */
static void check_cuda_functions(void) {
  char id[EPX_NCCL_UNIQUE_ID_BYTES];
  memset(id, 0, sizeof id);
  epx_group* group = NULL;
  epx_status st = epx_nccl_unique_id(id, sizeof id);
#ifndef EPX_HAS_CUDA
  CHECK(st == EPX_ERR_UNSUPPORTED && strstr(epx_last_error(), "no CUDA backend") != NULL,
        "nccl_unique_id without CUDA: status %d: %s", st, epx_last_error());
  st = epx_cuda_group_init_rank(id, sizeof id, 0, 1, 0, &group);
  CHECK(st == EPX_ERR_UNSUPPORTED &&
            strstr(epx_last_error(), "epx_cuda_group_init_rank: this build of epx has no CUDA backend") != NULL,
        "cuda_group_init_rank without CUDA: status %d: %s", st, epx_last_error());
  st = epx_cuda_group_from_comm(id, 0, &group);
  CHECK(st == EPX_ERR_UNSUPPORTED && strstr(epx_last_error(), "no CUDA backend") != NULL,
        "cuda_group_from_comm without CUDA: status %d: %s", st, epx_last_error());
  CHECK(group == NULL, "a group without CUDA");
#else
  CHECK(epx_nccl_unique_id(id, 3) == EPX_ERR_INVALID_ARGUMENT, "an id buffer of 3 bytes accepted");
  CHECK(epx_cuda_group_init_rank(id, 3, 0, 1, 0, &group) == EPX_ERR_INVALID_ARGUMENT &&
            strstr(epx_last_error(), "id_size") != NULL,
        "an id of 3 bytes: %s", epx_last_error());
  CHECK(epx_cuda_group_init_rank(id, sizeof id, 2, 2, 0, &group) == EPX_ERR_INVALID_ARGUMENT,
        "rank 2 of 2 accepted: %s", epx_last_error());
  CHECK(epx_cuda_group_from_comm(NULL, 0, &group) == EPX_ERR_INVALID_ARGUMENT, "a NULL communicator accepted");
  if (st == EPX_OK) { /* a one-rank group on GPU 0: joins where a GPU is visible, else unsupported */
    st = epx_cuda_group_init_rank(id, sizeof id, 0, 1, 0, &group);
    CHECK(st == EPX_OK || (st == EPX_ERR_UNSUPPORTED && strstr(epx_last_error(), "GPU") != NULL),
          "cuda_group_init_rank: status %d: %s", st, epx_last_error());
    if (st == EPX_OK) epx_group_destroy(group);
  } else {
    CHECK(epx_last_error()[0] != '\0', "nccl_unique_id failed without a message");
  }
#endif
}

int main(void) {
  if (epx_host_world_create(RANKS, &world) != EPX_OK) {
    printf("world: %s\n", epx_last_error());
    return 1;
  }
  pthread_barrier_init(&together, NULL, RANKS);
  pthread_t th[RANKS];
  for (long r = 0; r < RANKS; ++r) pthread_create(&th[r], NULL, rank_main, (void*)r);
  for (int r = 0; r < RANKS; ++r) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&together);

  /* No buffer (or group) to take part with: a local error. */
  epx_result* r = NULL;
  CHECK(epx_dispatch(NULL, NULL, &r) == EPX_ERR_INVALID_ARGUMENT &&
            strstr(epx_last_error(), "epx_dispatch: buffer must not be NULL") != NULL,
        "dispatch without a buffer: %s", epx_last_error());
  CHECK(epx_combine(NULL, NULL, NULL, NULL, 0, &r) == EPX_ERR_INVALID_ARGUMENT, "combine without a buffer");
  CHECK(epx_buffer_synchronize(NULL) == EPX_ERR_INVALID_ARGUMENT, "synchronize without a buffer");
  epx_buffer_config cfg = config();
  epx_buffer* buf = NULL;
  CHECK(epx_buffer_create_in_group(NULL, &cfg, &buf) == EPX_ERR_INVALID_ARGUMENT &&
            strstr(epx_last_error(), "group must not be NULL") != NULL,
        "create_in_group without a group: %s", epx_last_error());
  epx_group* group = NULL;
  CHECK(epx_host_world_group(world, 2, &group) == EPX_ERR_INVALID_ARGUMENT, "rank 2 of a 2-rank world accepted");
  check_cuda_functions();

  epx_host_world_destroy(world);
  CHECK(epx_host_world_create(0, &world) == EPX_ERR_INVALID_ARGUMENT, "world of 0 ranks accepted");
  printf("%s: %d failures\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
