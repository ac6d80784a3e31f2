"""Training runs: the options (options.py), the trainer (trainer.py), the run's prepared corpus across ranks
(run_corpus.py), signals, locks and divergence (run_control.py), bf16 with fp32 master weights (mixed_precision.py)
and the CUDA-graph training step (captured_step.py). Used by the CLI; uses the model, the data and translation's
evaluation (validation BLEU)."""
