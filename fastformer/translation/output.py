"""How `fastformer translate` writes translations: text (the best translation of each line) or JSON lines (one object
per hypothesis), each with fairseq's hard alignments when asked."""

from __future__ import annotations

import json

from fastformer.decoding.alignment import hard_alignment
from fastformer.translation.translator import TranslationResult

OUTPUT_FORMATS = ("text", "jsonl")


def format_results(results: list[list[TranslationResult]], first: int, output_format: str,
                   alignment: bool = False) -> list[str]:
    """Per input line its hypotheses, the first being input line `first` (counted from 0) -> the output lines.

    text: one line per input line, its best translation (and with alignment, a tab and its alignment); jsonl: one
    object per hypothesis, {"line", "rank" (0: the best), "text", "score"} (and "alignment")."""
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
    lines = []
    for line, hypotheses in enumerate(results, start=first):
        if output_format == "text":
            best = hypotheses[0]
            lines.append(best.text + ("\t" + alignment_text(best) if alignment else ""))
            continue
        for rank, hypothesis in enumerate(hypotheses):
            record = {"line": line, "rank": rank, "text": hypothesis.text, "score": hypothesis.score}
            if alignment:
                record["alignment"] = alignment_text(hypothesis)
            lines.append(json.dumps(record, ensure_ascii=False))
    return lines


def alignment_text(result: TranslationResult) -> str:
    """fairseq's hard alignment of a result with attention, "i-j ..." (source token i with target token j, both
    counted from 0 over the pieces, EOS aside); "" for a blank line's result, which has none."""
    if result.attention is None:
        return ""
    pairs = hard_alignment(result.attention, result.attention.shape[1] - 1, len(result.tokens))
    return " ".join(f"{source}-{target}" for source, target in pairs)
