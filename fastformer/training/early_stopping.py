"""The best validation score of a run (`--best-metric`), which picks checkpoint_best.pt, and the validations since it
without a better one, which `--patience` counts. Both are part of every checkpoint, so a resumed run goes on
counting where the stopped one was."""

from __future__ import annotations

from fastformer.checkpoint import BestScore

# The validation result each metric reads, and whether a higher score is better.
METRIC_KEYS = {"bleu": "valid_bleu", "loss": "valid_nll"}
HIGHER_IS_BETTER = {"bleu": True, "loss": False}


class BestTracker:
    """`state` is the best score so far (None before the first validation) as a checkpoint holds it."""

    def __init__(self, metric: str, saved: BestScore | None = None) -> None:
        self.metric = metric
        self.state: BestScore | None = None if saved is None else BestScore(**saved)

    def observe(self, valid: dict[str, float], step: int) -> bool:
        """Takes a validation's results -> whether its score is better than every one before (the first always is);
        an equal score is not better."""
        score = valid[METRIC_KEYS[self.metric]]
        if self.state is None or (score > self.state["score"] if HIGHER_IS_BETTER[self.metric]
                                  else score < self.state["score"]):
            self.state = BestScore(metric=self.metric, score=score, step=step, stale=0)
            return True
        self.state["stale"] += 1
        return False

    def exhausted(self, patience: int) -> bool:
        """Whether `patience` validations in a row were no better than the best (never, for patience 0)."""
        return patience > 0 and self.state is not None and self.state["stale"] >= patience
