#!/usr/bin/env bash
# The main job end to end on tiny seeded models: capture what the real llama.cpp build feeds
# the drafter, compute the reference from the trained checkpoint, compare, and write the triage
# reports: once for a correct pair, once for a drafter whose dflash.target_layers are off by one.
# Run by `make demo` (featdiff on PATH).
set -euo pipefail
OUT=${DEMO_OUT:-demo-out}
TOKENS=7,21,3,99,140,5,260,33,18,402,77,9
ROUNDS=3
mkdir -p "$OUT"

run_pair() {  # $1 = fixture variant; prints the verdict, returns compare's exit code
    local v=$1 d=$OUT/$1
    featdiff fixture "$d" --variant "$v" >/dev/null
    featdiff capture --target "$d/target.gguf" --model "$d/draft.gguf" \
        --tokens "$TOKENS" --rounds "$ROUNDS" -o "$d/run.npz" >/dev/null
    featdiff reference --target "$d/target.gguf" --model "$d/draft-hf" \
        --tokens "$TOKENS" --rounds "$ROUNDS" -o "$d/ref.npz" >/dev/null
    featdiff compare "$d/ref.npz" "$d/run.npz" --json "$d/findings.json" --report "$d/report.html"
}

echo "== 1. a correct pair: $OUT/clean"
run_pair clean || { echo "demo: the correct pair should compare clean"; exit 1; }
featdiff inspect "$OUT/clean/run.npz" | head -12

echo
echo "== 2. the same drafter exported with dflash.target_layers one too high: $OUT/layers-plus1"
if run_pair layers-plus1; then
    echo "demo: the off-by-one pair should give an error finding"; exit 1
fi
featdiff inspect "$OUT/layers-plus1/draft.gguf"

echo
echo "reports (open in a browser):"
echo "  correct pair: $OUT/clean/report.html"
echo "  off by one:   $OUT/layers-plus1/report.html"
