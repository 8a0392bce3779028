/* epx C ABI: the same objects as the C++ API, for bindings and C callers.
 * Every call returns EPX_OK or an error code; epx_last_error() then holds a message for this
 * thread. Results are opaque objects holding named tensors; destroy them when done. */
#ifndef EPX_EPX_H
#define EPX_EPX_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  EPX_OK = 0,
  EPX_ERR_INVALID_ARGUMENT = 1,
  EPX_ERR_CONFIG_MISMATCH = 2,
  EPX_ERR_PEER_FAILED = 3,
  EPX_ERR_TIMEOUT = 4,
  EPX_ERR_UNSUPPORTED = 5,
  EPX_ERR_INTERNAL = 6
} epx_status;

/* dtype: 0 bf16, 1 f32, 2 fp8_e4m3, 3 e2m1x2, 4 i32, 5 i64, 6 bool (epx::DType).
 * device: 0 host, 1 cuda. ndim 0 = "not given". Strides in elements. */
typedef struct {
  void* data;
  int32_t dtype;
  int32_t ndim;
  int64_t shape[4];
  int64_t strides[4];
  int32_t device;
  int32_t device_index;
} epx_tensor;

/* wire: 0 bf16, 1 fp8, 2 fp8_ue8m0, 3 nvfp4. mode: 0 blocking, 1 capacity. */
typedef struct {
  int64_t hidden;
  int64_t max_tokens_per_rank;
  int64_t num_experts;
  int64_t topk;
  int32_t wire;
  int64_t expert_alignment;
  int32_t mode;
  int64_t capacity_rows;
  double capacity_factor;
  int64_t timeout_ms;
} epx_buffer_config;

typedef struct epx_world epx_world;   /* a host group: ranks are threads */
typedef struct epx_buffer epx_buffer;
typedef struct epx_result epx_result; /* named output tensors (+ the handle, for dispatch) */

/* layout: 0 expert_major, 1 rank_major. */
typedef struct {
  epx_tensor x, x_scales, topk_idx, topk_weights, routing_map, probs;
  int32_t layout;
  float nvfp4_global_scale;
} epx_dispatch_args;

const char* epx_last_error(void);
void epx_buffer_config_default(epx_buffer_config* cfg);

epx_status epx_host_world_create(int32_t ranks, epx_world** out);
void epx_host_world_destroy(epx_world* world);

/* Collective: every rank's thread calls it with the same config. */
epx_status epx_buffer_create(epx_world* world, int32_t rank, const epx_buffer_config* cfg, epx_buffer** out);
void epx_buffer_destroy(epx_buffer* buffer);

epx_status epx_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, epx_result** out);
/* shared_out may be NULL. */
epx_status epx_combine(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* y,
                       const epx_tensor* shared_out, int32_t weighted, epx_result** out);
/* grad_recv_weights may be NULL. */
epx_status epx_dispatch_backward(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* grad_recv_x,
                                 const epx_tensor* grad_recv_weights, epx_result** out);
/* y may be NULL when weighted is 0. */
epx_status epx_combine_backward(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* grad_out,
                                const epx_tensor* y, int32_t weighted, epx_result** out);

/* Tensor names: dispatch: recv_x recv_scales recv_global_scale recv_src recv_weights recv_topk_idx
 * recv_topk_weights expert_offsets tokens_per_expert rank_offsets; combine: out;
 * dispatch_backward: grad_x grad_topk_weights; combine_backward: grad_y grad_topk_weights.
 * A name the result does not hold is EPX_ERR_INVALID_ARGUMENT.
 * Integer names (dispatch): num_rows overflow dropped_slots; (combine): overflow. */
epx_status epx_result_tensor(const epx_result* result, const char* name, epx_tensor* out);
epx_status epx_result_int(const epx_result* result, const char* name, int64_t* out);
void epx_result_destroy(epx_result* result);

#ifdef __cplusplus
}
#endif
#endif
