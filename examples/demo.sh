#!/usr/bin/env bash
# The main job end to end on tiny seeded models: make the models, capture what the real
# llama.cpp build feeds the drafter, and list it. Run by `make demo` (featdiff on PATH).
set -euo pipefail
OUT=${DEMO_OUT:-demo-out}
TOKENS=7,21,3,99,140,5,260,33,18,402,77,9
mkdir -p "$OUT"

echo "== 1. tiny models: a correct pair and one with dflash.target_layers off by one"
featdiff fixture "$OUT/clean"
featdiff fixture "$OUT/layers-plus1" --variant layers-plus1

echo "== 2. capture from the real llama.cpp library (pinned build)"
featdiff capture --target "$OUT/clean/target.gguf" --model "$OUT/clean/draft.gguf" \
    --tokens "$TOKENS" --rounds 3 -o "$OUT/clean/run.npz"
featdiff inspect "$OUT/clean/draft.gguf"
featdiff inspect "$OUT/clean/run.npz"

echo
echo "capture: $OUT/clean/run.npz"
