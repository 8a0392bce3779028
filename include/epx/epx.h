/* epx C ABI: the same objects as the C++ API, for bindings and C callers.
 * Every call returns EPX_OK or an error code; epx_last_error() then holds a message for this
 * thread. Results are opaque objects holding named tensors; destroy them when done.
 * The structs below grow at their end as features come (epx_buffer_config, epx_dispatch_args):
 * there is no binary compatibility across epx versions yet, so rebuild against the header of the
 * library you link, and fill configs with epx_buffer_config_default first.
 *
 * Collective calls (epx_buffer_create, epx_buffer_create_in_group, epx_dispatch, epx_dispatch_cached,
 * epx_combine, epx_dispatch_backward, epx_combine_backward): every rank makes the same calls in the same order,
 * and every refused argument of a collective call takes part in the call. An unknown dtype,
 * device, layout, wire or mode code, an ndim out of range, a NULL required pointer (tensor, args,
 * cfg, out) or a `dispatched` that is not a result of epx_dispatch makes EVERY rank fail that same
 * call at once: this rank with EPX_ERR_INVALID_ARGUMENT and a message naming the argument, its
 * peers with EPX_ERR_PEER_FAILED naming this rank and the reason, as the library's own checks of
 * shapes, ids and options do. The buffer stays usable for the next call. The one exception is
 * what leaves nothing to take part with: a NULL `buffer` (or, in buffer creation, a NULL `world`
 * or `group`, or a rank outside the world) fails this rank's call only; its peers' call then pairs
 * with this rank's next one, so never let it happen on one rank alone.
 *
 * CUDA (epx_nccl_unique_id and epx_cuda_group_*; in a build without the CUDA backend they return
 * EPX_ERR_UNSUPPORTED). One process per GPU: rank 0 calls epx_nccl_unique_id and hands the id's
 * bytes to the other ranks (by its own means: MPI, a file, a socket); every rank then calls
 * epx_cuda_group_init_rank(id, EPX_NCCL_UNIQUE_ID_BYTES, rank, size, its GPU, &group), which
 * returns once every rank has joined. Or wrap a communicator you already have with
 * epx_cuda_group_from_comm. epx_buffer_create_in_group(group, &cfg, &buffer) then creates the
 * buffer (collective, as epx_buffer_create). Tensors given to a CUDA buffer are device tensors
 * (epx_tensor.device 1, device_index the GPU) and so are its results: calls run on the buffer's
 * stream (epx_buffer_set_stream; default: one the buffer owns) and return before the GPU is done,
 * so call epx_buffer_synchronize (or order your stream after the buffer's) before reading them,
 * and before freeing or overwriting the inputs of those calls (read on that stream too).
 * A group may be destroyed once its buffers are created: they keep what they need. */
#ifndef EPX_EPX_H
#define EPX_EPX_H
#include <stddef.h>
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
  int64_t num_sms; /* CUDA: thread blocks of the data-moving kernels; 0 = the default (24) */
  int32_t check_finite; /* nonzero: dispatch refuses x holding a NaN or an infinity (BufferConfig::check_finite) */
  int64_t send_blocks; /* CUDA: of the num_sms blocks, those that send; 0 = the default split (BufferConfig::send_blocks) */
  int32_t shared_expert; /* nonzero: the fused shared expert (BufferConfig::shared_expert; CPU backend only) */
  int32_t combine_wire; /* what combine's partials cross back as: 0 bf16 (default), 1 fp8, 2 fp8_ue8m0 (BufferConfig::combine_wire) */
  int64_t num_physical_experts; /* redundant experts (EPLB): P physical experts, 0 = off (BufferConfig::num_physical_experts) */
  int64_t max_replicas; /* columns M of expert_replicas, 0 = P - E + 1 (BufferConfig::max_replicas) */
} epx_buffer_config;

typedef struct epx_world epx_world;   /* a host group: ranks are threads */
typedef struct epx_group epx_group;   /* one rank's group (host or CUDA), to create buffers in */
typedef struct epx_buffer epx_buffer;
typedef struct epx_result epx_result; /* named output tensors (+ the handle, for dispatch) */

/* layout: 0 expert_major, 1 rank_major. */
typedef struct {
  epx_tensor x, x_scales, topk_idx, topk_weights, routing_map, probs;
  int32_t layout;
  float nvfp4_global_scale;
  epx_tensor shared_gate; /* [T] f32, optional with shared_expert (DispatchInput::shared_gate) */
  epx_tensor expert_replicas; /* [E, M] i32, required with num_physical_experts > 0 (DispatchInput::expert_replicas) */
} epx_dispatch_args;

const char* epx_last_error(void);
void epx_buffer_config_default(epx_buffer_config* cfg);

epx_status epx_host_world_create(int32_t ranks, epx_world** out);
void epx_host_world_destroy(epx_world* world);

/* Rank `rank`'s group of a host world, for epx_buffer_create_in_group. */
epx_status epx_host_world_group(epx_world* world, int32_t rank, epx_group** out);

/* The size of an NCCL unique id (ncclUniqueId). */
#define EPX_NCCL_UNIQUE_ID_BYTES 128
/* Writes a new NCCL unique id (EPX_NCCL_UNIQUE_ID_BYTES bytes, not a string) to out; size is
 * out's capacity, at least EPX_NCCL_UNIQUE_ID_BYTES. One rank makes it, every rank joins with it. */
epx_status epx_nccl_unique_id(char* out, size_t size);
/* Joins rank `rank` of `size` (one per process, or per thread) on GPU `device` to the group of id
 * (id_size bytes, as epx_nccl_unique_id wrote them). Collective, as ncclCommInitRank: returns once
 * every rank has joined. There is no group yet to take part with, so a refused argument (or no
 * visible GPU: EPX_ERR_UNSUPPORTED) fails this rank only, and its peers wait in NCCL's
 * initialization. */
epx_status epx_cuda_group_init_rank(const char* id, size_t id_size, int32_t rank, int32_t size, int32_t device,
                                    epx_group** out);
/* A group over an existing communicator (an ncclComm_t) whose rank drives GPU `device`. The
 * caller keeps the communicator alive while the group or any buffer in it exists, and destroys it. */
epx_status epx_cuda_group_from_comm(void* nccl_comm, int32_t device, epx_group** out);
void epx_group_destroy(epx_group* group);

/* Collective: every rank's thread calls it with the same config. */
epx_status epx_buffer_create(epx_world* world, int32_t rank, const epx_buffer_config* cfg, epx_buffer** out);
/* Collective: every rank of the group calls it with the same config. */
epx_status epx_buffer_create_in_group(const epx_group* group, const epx_buffer_config* cfg, epx_buffer** out);
void epx_buffer_destroy(epx_buffer* buffer);
/* CUDA buffers: the stream (a cudaStream_t) every later call runs on, NULL = the buffer's own.
 * Outputs are allocated and freed stream-ordered on it, so it must outlive them. Host buffers: no-op. */
epx_status epx_buffer_set_stream(epx_buffer* buffer, void* stream);
/* CUDA buffers: waits until every call made so far on the buffer's stream is done (its outputs are
 * complete). Host buffers: returns at once. */
epx_status epx_buffer_synchronize(epx_buffer* buffer);

/* The buffer's load counters (Buffer::expert_load): [L] i64 rows received per local physical expert
 * since creation or the last reset. *out views the buffer's memory: valid while the buffer lives,
 * and it shows later dispatches' counts. Not collective. */
epx_status epx_buffer_expert_load(const epx_buffer* buffer, epx_tensor* out);
epx_status epx_buffer_reset_expert_load(epx_buffer* buffer);

epx_status epx_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, epx_result** out);
/* Cached dispatch: x (x_scales may be NULL) in the layout of `dispatched`'s dispatch, with no
 * routing and no plan exchange (docs/semantics.md). The result holds recv_x, recv_scales,
 * recv_global_scale, and the handle of `dispatched` (combine and the backward passes take it). */
epx_status epx_dispatch_cached(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* x,
                               const epx_tensor* x_scales, float nvfp4_global_scale, epx_result** out);
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
 * recv_topk_weights expert_offsets tokens_per_expert rank_offsets topk_physical (EPLB); dispatch_cached: recv_x
 * recv_scales recv_global_scale; combine: out;
 * dispatch_backward: grad_x grad_topk_weights grad_shared_gate; combine_backward: grad_y
 * grad_topk_weights grad_shared_gate (the shared_gate ones with shared_expert, as in epx/ops.hpp).
 * A name the result does not hold is EPX_ERR_INVALID_ARGUMENT.
 * Integer names (dispatch): num_rows overflow dropped_slots; (combine): overflow. */
epx_status epx_result_tensor(const epx_result* result, const char* name, epx_tensor* out);
epx_status epx_result_int(const epx_result* result, const char* name, int64_t* out);
void epx_result_destroy(epx_result* result);

#ifdef __cplusplus
}
#endif
#endif
