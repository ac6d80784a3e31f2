"""CPU beam-search decoding throughput: fastformer's compiled decoder against CTranslate2 on the same random weights.

One process measures one system at one shape, so that two builds (or the two systems) can be timed in turn:

    OMP_NUM_THREADS=2 python benchmarks/cpu_decoding.py --shape b --system fastformer

Shapes: "a" is the tiny preset (d_model 64, 2 + 2 layers, vocab 1k), "b" the paper's base model (d_model 512,
6 + 6 layers, d_ff 2048, 8 heads) with an 8k vocabulary. The batch is 64 sentences of 20 source tokens plus EOS,
beam 4, and every hypothesis is decoded to exactly 31 target tokens (EOS barred until then in fastformer, the
decoding length fixed in CTranslate2), so both systems do the same work. It prints the median tokens/s of the
timed passes and a checksum of the best hypotheses, for comparing two builds of one system. The systems' checksums
differ by construction: fastformer's last token is the forced EOS, scored, and CTranslate2's is a 31st real token,
so the best hypotheses are ranked on different scores. That both return the same best hypothesis under the same
rules is tested in tests/test_export.py. "ctranslate2-int8" runs CTranslate2 with int8 weights (a different model,
for reference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from baselines import placeholder_vocabulary
from fastformer import Transformer, TransformerConfig
from fastformer.export import to_ctranslate2

N_SENTENCES, SOURCE_TOKENS, TARGET_TOKENS, BEAM_SIZE, LENGTH_PENALTY = 64, 20, 31, 4, 0.6


def shape_config(shape: str) -> TransformerConfig:
    if shape == "a":
        return TransformerConfig.tiny(1000, dropout=0.0)
    return TransformerConfig.base(8000, dropout=0.0)


def sources(config: TransformerConfig, seed: int) -> torch.Tensor:
    """[N_SENTENCES, SOURCE_TOKENS + 1] random ids, each row ending in EOS."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, config.vocab_size, (N_SENTENCES, SOURCE_TOKENS + 1), generator=generator)
    src[:, -1] = config.eos_id
    return src


def fastformer_translate(model: Transformer, src: torch.Tensor) -> list[list[int]]:
    # max_len_b so that EOS is forced at step TARGET_TOKENS - 1, after which the hypotheses have TARGET_TOKENS tokens.
    results = model.translate(src, beam_size=BEAM_SIZE, length_penalty=LENGTH_PENALTY, max_len_a=1.0,
                              max_len_b=TARGET_TOKENS - 1 - src.shape[1], min_len=model.config.max_positions)
    return [sentence[0].tokens + [model.config.eos_id] for sentence in results]


def ctranslate2_translator(model: Transformer, threads: int, quantization: str):
    import ctranslate2

    vocabulary = placeholder_vocabulary(model.config)
    out_dir = Path(tempfile.mkdtemp(prefix="fastformer-ct2-"))
    to_ctranslate2(model, vocabulary, out_dir, quantization=quantization)
    engine = ctranslate2.Translator(str(out_dir), device="cpu", inter_threads=1, intra_threads=threads)
    index = {token: i for i, token in enumerate(vocabulary)}

    def translate(src: torch.Tensor) -> list[list[int]]:
        pieces = [[vocabulary[i] for i in row[:-1]] for row in src.tolist()]
        results = engine.translate_batch(pieces, beam_size=BEAM_SIZE, length_penalty=LENGTH_PENALTY,
                                         min_decoding_length=TARGET_TOKENS, max_decoding_length=TARGET_TOKENS,
                                         max_batch_size=0)
        return [[index[p] for p in result.hypotheses[0]] for result in results]

    return translate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("a", "b"), required=True)
    parser.add_argument("--system", choices=("fastformer", "ctranslate2", "ctranslate2-int8"), required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = shape_config(args.shape)
    model = Transformer(config).eval()
    src = sources(config, args.seed)
    if args.system == "fastformer":
        translate = lambda batch: fastformer_translate(model, batch)  # noqa: E731
    else:
        quantization = "int8" if args.system == "ctranslate2-int8" else "float32"
        translate = ctranslate2_translator(model, torch.get_num_threads(), quantization)
    outputs = translate(src)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = translate(src)
        times.append(time.perf_counter() - start)
    n_tokens = sum(len(tokens) for tokens in outputs)
    if n_tokens != N_SENTENCES * TARGET_TOKENS:
        sys.exit(f"decoded {n_tokens} tokens, expected {N_SENTENCES * TARGET_TOKENS}")
    checksum = zlib.crc32(str(outputs).encode())
    print(f"shape={args.shape} system={args.system} threads={torch.get_num_threads()} "
          f"tok/s={n_tokens / statistics.median(times):.0f} "
          f"(min {n_tokens / max(times):.0f}, max {n_tokens / min(times):.0f}) checksum={checksum:08x}")


if __name__ == "__main__":
    main()
