// CUDA launchers of the beam-search ops (see beam_ops.h), torch-free: raw pointers and a stream.
#pragma once

#include <cuda_runtime_api.h>

#include "beam_ops.h"

namespace fastformer {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Each returns the launch's error (cudaSuccess when the kernels were queued on `stream`).
cudaError_t self_attention_step_cuda(const SelfAttentionArgs& args, DType dtype, cudaStream_t stream);
cudaError_t cross_attention_cuda(const CrossAttentionArgs& args, DType dtype, cudaStream_t stream);
cudaError_t beam_step_cuda(const BeamStepArgs& args, DType dtype, cudaStream_t stream);

}  // namespace fastformer
