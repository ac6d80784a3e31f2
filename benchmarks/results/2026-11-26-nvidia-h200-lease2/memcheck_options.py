"""translate's options and score on CUDA, for compute-sanitizer memcheck."""
import torch, fastformer
torch.manual_seed(0)
model = fastformer.Transformer(fastformer.TransformerConfig.tiny(1000, dropout=0.0)).cuda().eval()
src = torch.randint(3, 1000, (6, 12), device="cuda"); src[:, -1] = 2; src[3, 4] = 2; src[3, 5:] = 0
prefix = [[5, 6], None, [7], None, [8, 9, 10], None]
for shrink in ("buckets", "every_step"):
    print(model.translate(src, beam_size=1, n_best=3, sampling_topk=10, sampling_topp=0.9, sampling_temperature=0.8,
                          seed=3, max_len_b=10, shrink=shrink)[0][0].tokens)
    print(model.translate(src, beam_size=4, n_best=2, target_prefix=prefix, no_repeat_ngram_size=2,
                          repetition_penalty=1.3, return_attention=True, max_len_b=10, shrink=shrink)[4][0].tokens)
print([s.shape for s in model.score(src, [[5, 6, 7], [8], [9, 10, 11, 12], [13], [14, 15], [16] * 9])])
print(model.half().translate(src, beam_size=4, target_prefix=prefix, no_repeat_ngram_size=3, max_len_b=10)[0][0].tokens)
print([s.dtype for s in model.score(src, [[5, 6, 7], [8], [9, 10, 11, 12], [13], [14, 15], [16] * 9])])
