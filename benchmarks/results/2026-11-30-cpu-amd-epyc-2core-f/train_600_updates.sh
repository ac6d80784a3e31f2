#!/bin/bash
# $1: source tree; $2: scratch dir
cd "$2" && rm -rf run && PYTHONPATH="$1" exec /work/main/.venv/bin/python -m fastformer train --preset tiny --device cpu --batch-tokens 1500 --update-tokens 1500 --warmup 500 --lr-scale 2 --max-steps 600 --log-every 100 --valid-every 0 --save-every 0 --out-dir run --quiet --prepared-dir "$2/prep"
