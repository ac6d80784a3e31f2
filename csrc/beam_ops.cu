// CUDA kernels of the beam-search ops (see beam_ops.h): fp32/fp16/bf16 storage, fp32 math.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "beam_ops_cuda.h"

namespace fastformer {
namespace {

constexpr int kAttentionThreads = kMaxCudaHeadDim;  // one thread per channel
constexpr int kBeamStepThreads = 256;
constexpr int kWarp = 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Block-wide sum (is_max = false) or max of x; every thread gets the result. `scratch`: kWarp floats.
__device__ float block_reduce(float x, bool is_max, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = (blockDim.x + kWarp - 1) / kWarp;
  x = is_max ? warp_max(x) : warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < n_warps ? scratch[lane] : (is_max ? -INFINITY : 0.0f);
  return is_max ? warp_max(x) : warp_sum(x);
}

// out[0:head_dim] = softmax(q . k_p / sqrt(head_dim)) @ v over positions p < length, for one (row, head) per block;
// offset_of(p) is the element offset of position p's [head_dim] key/value vectors.
template <typename T, typename OffsetOf>
__device__ void attend_one(const T* q, const T* k, const T* v, int head_dim, int length, OffsetOf offset_of, T* out) {
  extern __shared__ float shared[];
  float* q_scaled = shared;                                  // [head_dim]
  float* partial = q_scaled + head_dim;                      // [kAttentionThreads]
  float* weights = partial + kAttentionThreads;              // [length]
  __shared__ float scratch[kWarp];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, n_warps = blockDim.x / kWarp;
  const float scale = rsqrtf(static_cast<float>(head_dim));
  for (int d = tid; d < head_dim; d += blockDim.x) q_scaled[d] = to_float(q[d]) * scale;
  __syncthreads();
  for (int p = warp; p < length; p += n_warps) {
    const T* key = k + offset_of(p);
    float dot = 0.0f;
    for (int d = lane; d < head_dim; d += kWarp) dot += q_scaled[d] * to_float(key[d]);
    dot = warp_sum(dot);
    if (lane == 0) weights[p] = dot;
  }
  __syncthreads();
  float local_max = -INFINITY;
  for (int p = tid; p < length; p += blockDim.x) local_max = fmaxf(local_max, weights[p]);
  const float max_score = block_reduce(local_max, true, scratch);
  float local_sum = 0.0f;
  for (int p = tid; p < length; p += blockDim.x) {
    weights[p] = __expf(weights[p] - max_score);
    local_sum += weights[p];
  }
  const float total = block_reduce(local_sum, false, scratch);  // its barriers also publish weights[]
  // Thread groups of head_dim threads split the positions; group g sums positions g, g + n_groups, ...
  const int n_groups = blockDim.x / head_dim;
  if (tid < n_groups * head_dim) {
    const int d = tid % head_dim, group = tid / head_dim;
    float acc = 0.0f;
    for (int p = group; p < length; p += n_groups) acc += weights[p] * to_float(v[offset_of(p) + d]);
    partial[tid] = acc;
  }
  __syncthreads();
  if (tid < head_dim) {
    float acc = 0.0f;
    for (int group = 0; group < n_groups; ++group) acc += partial[group * head_dim + tid];
    out[tid] = from_float<T>(acc / total);
  }
}

template <typename T>
__global__ void self_attention_step_kernel(SelfAttentionArgs a) {
  const int row = blockIdx.x, h = blockIdx.y, d_model = a.heads * a.head_dim, step = *a.step;
  if (step < 0 || step >= a.cache_len) return;  // the host checks an eager call; a replayed graph cannot
  const int64_t slot = a.row_slots[row];
  const int64_t first_slot_of_sentence = slot - slot % a.beam_size;
  const int32_t* indirection = a.indirection + slot * a.cache_len;
  const T* q = static_cast<const T*>(a.qkv) + static_cast<int64_t>(row) * 3 * d_model + h * a.head_dim;
  T* k_cache = static_cast<T*>(a.k_cache);
  T* v_cache = static_cast<T*>(a.v_cache);
  auto offset_of = [&](int p) -> int64_t {
    const int64_t cache_slot = p == step ? slot : first_slot_of_sentence + indirection[p];
    return ((cache_slot * a.heads + h) * a.cache_len + p) * a.head_dim;
  };
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    k_cache[offset_of(step) + d] = q[d_model + d];
    v_cache[offset_of(step) + d] = q[2 * d_model + d];
  }
  __syncthreads();  // the block reads its own appended key/value back
  attend_one(q, k_cache, v_cache, a.head_dim, step + 1, offset_of,
             static_cast<T*>(a.out) + static_cast<int64_t>(row) * d_model + h * a.head_dim);
}

template <typename T>
__global__ void cross_attention_kernel(CrossAttentionArgs a) {
  const int row = blockIdx.x, h = blockIdx.y, d_model = a.heads * a.head_dim;
  const int64_t sentence = a.row_slots[row] / a.beam_size;
  const int64_t head_offset = sentence * a.kv_sentence_stride + h * a.kv_head_stride;
  auto offset_of = [&](int p) -> int64_t { return head_offset + p * a.kv_position_stride; };
  attend_one(static_cast<const T*>(a.q) + row * a.q_row_stride + h * a.head_dim,
             static_cast<const T*>(a.k), static_cast<const T*>(a.v), a.head_dim, a.src_lengths[sentence], offset_of,
             static_cast<T*>(a.out) + static_cast<int64_t>(row) * d_model + h * a.head_dim);
}

// Block-wide best candidate (ranks_before order); every thread gets it. `scratch`: kWarp candidates.
__device__ Candidate block_best(Candidate c, Candidate* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  auto warp_best = [](Candidate x) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const Candidate other{__shfl_xor_sync(0xffffffffu, x.score, offset), __shfl_xor_sync(0xffffffffu, x.id, offset)};
      if (ranks_before(other, x)) x = other;
    }
    return x;
  };
  c = warp_best(c);
  __syncthreads();
  if (lane == 0) scratch[warp] = c;
  __syncthreads();
  return warp_best(lane < n_warps ? scratch[lane] : Candidate{-INFINITY, INT_MAX});
}

// One block per row (beam j of an active sentence): log-softmax, running sum, masks, and the row's best 2k
// candidates, best first, into the workspace. kListSize >= 2k is each thread's sorted candidate list.
template <typename T, int kListSize>
__global__ void row_candidates_kernel(BeamStepArgs a) {
  __shared__ float scratch[kWarp];
  __shared__ Candidate best_scratch[kWarp];
  const int row = blockIdx.x, k = a.beam_size, j = row % k;
  const int sentence = a.active[row / k], step = *a.step;
  if (a.done[sentence]) return;  // select_beams_kernel skips it too, before reading these candidates
  const T* logits = static_cast<const T*>(a.logits) + static_cast<int64_t>(row) * a.vocab;
  const float running = a.sums[static_cast<int64_t>(sentence) * k + j];
  const int max_len = a.max_lens[sentence];

  float local_max = -INFINITY;
  for (int t = threadIdx.x; t < a.vocab; t += blockDim.x) local_max = fmaxf(local_max, to_float(logits[t]));
  const float max_logit = block_reduce(local_max, true, scratch);
  float local_sum = 0.0f;
  for (int t = threadIdx.x; t < a.vocab; t += blockDim.x) local_sum += __expf(to_float(logits[t]) - max_logit);
  const float log_total = logf(block_reduce(local_sum, false, scratch));

  Candidate list[kListSize];
#pragma unroll
  for (int i = 0; i < kListSize; ++i) list[i] = Candidate{-INFINITY, INT_MAX};
  for (int t = threadIdx.x; t < a.vocab; t += blockDim.x) {
    if (!token_allowed(a, step, sentence, t, max_len)) continue;
    const Candidate c{running + ((to_float(logits[t]) - max_logit) - log_total), j * a.vocab + t};
    if (!(c.score > -INFINITY) || !ranks_before(c, list[kListSize - 1])) continue;
    list[kListSize - 1] = c;
#pragma unroll
    for (int i = kListSize - 1; i > 0; --i) {
      if (ranks_before(list[i], list[i - 1])) {
        const Candidate swap = list[i];
        list[i] = list[i - 1];
        list[i - 1] = swap;
      }
    }
  }
  int head = 0;
  for (int rank = 0; rank < 2 * k; ++rank) {
    const Candidate mine = head < kListSize ? list[head] : Candidate{-INFINITY, INT_MAX};
    const Candidate best = block_best(mine, best_scratch);
    if (mine.id == best.id && best.score > -INFINITY) ++head;
    if (threadIdx.x == 0) {
      a.candidate_scores[static_cast<int64_t>(row) * 2 * k + rank] = best.score;
      a.candidate_ids[static_cast<int64_t>(row) * 2 * k + rank] = best.id;
    }
  }
}

// One block per active sentence: merges its beams' sorted candidate lists into the best 2k, then writes the next
// beams (the indirection copy shared by the block's threads).
__global__ void select_beams_kernel(BeamStepArgs a) {
  __shared__ Candidate ranked[2 * kMaxCudaBeamSize];
  __shared__ int heads[kMaxCudaBeamSize];
  __shared__ int next_parents[kMaxCudaBeamSize], next_tokens[kMaxCudaBeamSize];
  __shared__ float next_sums[kMaxCudaBeamSize];
  __shared__ int n_alive;
  const int k = a.beam_size, block = blockIdx.x, sentence = a.active[block], step = *a.step;
  // Read by every thread before thread 0 may set it below (the barrier), so that the whole block agrees.
  const bool already_done = a.done[sentence];
  __syncthreads();
  if (already_done) return;
  if (threadIdx.x == 0) {
    for (int j = 0; j < k; ++j) heads[j] = 0;
    for (int rank = 0; rank < 2 * k; ++rank) {
      Candidate best{-INFINITY, INT_MAX};
      int best_beam = 0;
      for (int j = 0; j < k; ++j) {
        if (heads[j] == 2 * k) continue;
        const int64_t at = (static_cast<int64_t>(block) * k + j) * 2 * k + heads[j];
        const Candidate c{a.candidate_scores[at], a.candidate_ids[at]};
        if (ranks_before(c, best)) {
          best = c;
          best_beam = j;
        }
      }
      ranked[rank] = best;
      if (best.score > -INFINITY) ++heads[best_beam];
    }
    n_alive = select_next_beams(a, step, sentence, ranked, next_parents, next_tokens, next_sums);
  }
  __syncthreads();
  for (int j = 0; j < k; ++j) {
    write_next_beam(a, step, sentence, j, n_alive, next_parents, next_tokens, next_sums, threadIdx.x, blockDim.x);
  }
}

size_t attention_shared_bytes(int head_dim, int length) {
  return sizeof(float) * (head_dim + kAttentionThreads + length);
}

template <typename T>
cudaError_t launch_self_attention(const SelfAttentionArgs& a, cudaStream_t stream) {
  const dim3 grid(a.n_rows, a.heads);
  // Room for every position: the step is read on the device, so the same launch serves every step of a graph.
  self_attention_step_kernel<T><<<grid, kAttentionThreads, attention_shared_bytes(a.head_dim, a.cache_len),
                                  stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_cross_attention(const CrossAttentionArgs& a, cudaStream_t stream) {
  const dim3 grid(a.n_rows, a.heads);
  cross_attention_kernel<T><<<grid, kAttentionThreads, attention_shared_bytes(a.head_dim, a.src_len), stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int kListSize>
cudaError_t launch_beam_step_sized(const BeamStepArgs& a, cudaStream_t stream) {
  row_candidates_kernel<T, kListSize><<<a.n_active * a.beam_size, kBeamStepThreads, 0, stream>>>(a);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  select_beams_kernel<<<a.n_active, kBeamStepThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_beam_step(const BeamStepArgs& a, cudaStream_t stream) {
  const int n_candidates = 2 * a.beam_size;
  if (n_candidates <= 2) return launch_beam_step_sized<T, 2>(a, stream);
  if (n_candidates <= 4) return launch_beam_step_sized<T, 4>(a, stream);
  if (n_candidates <= 8) return launch_beam_step_sized<T, 8>(a, stream);
  if (n_candidates <= 16) return launch_beam_step_sized<T, 16>(a, stream);
  if (n_candidates <= 32) return launch_beam_step_sized<T, 32>(a, stream);
  return launch_beam_step_sized<T, 2 * kMaxCudaBeamSize>(a, stream);
}

bool valid_attention_shape(int head_dim, int length) {
  return head_dim >= 1 && head_dim <= kAttentionThreads && length >= 1 && length <= kMaxCudaKeyLength;
}

}  // namespace

cudaError_t self_attention_step_cuda(const SelfAttentionArgs& args, DType dtype, cudaStream_t stream) {
  if (args.n_rows == 0) return cudaSuccess;
  if (!valid_attention_shape(args.head_dim, args.cache_len)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_self_attention<float>(args, stream);
    case DType::kFloat16: return launch_self_attention<__half>(args, stream);
    case DType::kBFloat16: return launch_self_attention<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t cross_attention_cuda(const CrossAttentionArgs& args, DType dtype, cudaStream_t stream) {
  if (args.n_rows == 0) return cudaSuccess;
  if (!valid_attention_shape(args.head_dim, args.src_len)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_cross_attention<float>(args, stream);
    case DType::kFloat16: return launch_cross_attention<__half>(args, stream);
    case DType::kBFloat16: return launch_cross_attention<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t beam_step_cuda(const BeamStepArgs& args, DType dtype, cudaStream_t stream) {
  if (args.n_active == 0) return cudaSuccess;
  if (args.beam_size < 1 || args.beam_size > kMaxCudaBeamSize) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_beam_step<float>(args, stream);
    case DType::kFloat16: return launch_beam_step<__half>(args, stream);
    case DType::kBFloat16: return launch_beam_step<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastformer
