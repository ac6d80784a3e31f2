"""Which of the compiled search's float32 linears (fused shapes included) give a row another result alone than in a
batch on this CPU? Prints each (out, in, packed rows, threads) whose rows move, with the first row count that moves."""
import torch

import fastformer
from fastformer.decoding.compiled import DECODER_ROWS, ENCODER_ROWS, extension

config = fastformer.TransformerConfig.tiny(1000, dropout=0.0)
d, ff, vocab = config.d_model, config.d_ff, config.vocab_size
print("loops", extension().cpu_isa(), "d_model", d, "d_ff", ff)
generator = torch.Generator().manual_seed(0)
moved = 0
for threads in (1, 2):
    torch.set_num_threads(threads)
    for out_features, in_features, packed in [(3 * d, d, DECODER_ROWS), (d, d, DECODER_ROWS), (2 * d, d, 8 * DECODER_ROWS),
                                              (ff, d, DECODER_ROWS), (d, ff, DECODER_ROWS), (vocab, d, DECODER_ROWS),
                                              (3 * d, d, ENCODER_ROWS), (d, d, ENCODER_ROWS), (ff, d, ENCODER_ROWS),
                                              (d, ff, ENCODER_ROWS)]:
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        rows = torch.randn(160, in_features, generator=generator)
        linear = extension().PackedLinear(weight, bias, packed, "float32")
        batch = linear(rows)
        bad = [m for m in range(1, len(rows) + 1) if not torch.equal(linear(rows[:m]), batch[:m])]
        alone = [r for r in range(len(rows)) if not torch.equal(linear(rows[r:r + 1]), batch[r:r + 1])]
        if bad or alone:
            moved += 1
            print(f"threads {threads} ({out_features}, {in_features}) packed {packed}: leading runs that move "
                  f"{bad[:6]} ({len(bad)}), rows alone that move {alone[:6]} ({len(alone)})")
print("moved:", moved)
