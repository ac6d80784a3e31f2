"""compute-sanitizer memcheck of the CUDA search's cross-attention after its stride arguments (56675c0): translate
in both shrink modes, fp32 and fp16, a wide beam, sampling and alignments, and scoring."""

import torch

import fastformer

torch.manual_seed(0)
model = fastformer.Transformer(fastformer.TransformerConfig.tiny(1000, dropout=0.0)).cuda().eval()
src = torch.randint(3, 1000, (6, 12), device="cuda")
src[:, -1] = 2
src[3, 4] = 2
src[3, 5:] = 0
print(model.translate(src, beam_size=4, n_best=2, max_len_b=10, shrink="buckets")[0])
print(model.translate(src, beam_size=4, n_best=2, max_len_b=10, shrink="every_step", return_attention=True)[0])
print(model.translate(src, beam_size=32, max_len_b=6)[0])
print(model.translate(src, beam_size=1, sampling_topk=10, seed=3, max_len_b=8)[0])
print(model.score(src, [[5, 6, 7]] * 6)[0])
print(model.half().translate(src, beam_size=8, max_len_b=10)[0])
