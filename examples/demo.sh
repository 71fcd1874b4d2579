#!/usr/bin/env bash
# The main job end to end on a tiny drafter trained on its target: its accept rate through the
# real llama.cpp spec loop next to the reference's, a capture of what the drafter receives, the
# reference dump from the trained checkpoint, compare, and the triage report. Once for the
# correct export, once for an export whose dflash.target_layers lack the converter's +1; then a
# GIDD log-SNR drafter exported without its conditioning, captured in-process on featdiff's
# patched library. Everything so far needs only the library (`make setup`), so the first verdict
# comes before the programs are built; then the tools (llama-server and friends, built once) and
# the log-SNR drafters' accept rate through the patched llama-server. Run by `make demo`
# (featdiff on PATH).
set -euo pipefail
OUT=${DEMO_OUT:-demo-out}
ROUNDS=3
mkdir -p "$OUT"

triage() {  # $1 = fixture variant, $2 = label; returns compare's exit code
    local d=$OUT/$2
    featdiff fixture "$d" --variant "$1" >/dev/null   # trains once per machine, then cached
    local tokens
    tokens=$(sed -n '1s/^tokens: //p' "$d/prompts.txt")
    echo "-- accept rate, real llama.cpp loop vs the reference drafter (held-out prompts)"
    featdiff probe --target "$d/target.gguf" --model "$d/draft.gguf" --ref-model "$d/draft-hf" \
        --prompts "$d/prompts.txt" > "$d/probe.txt" || true   # exit 1 on a gap: shown below
    head -1 "$d/probe.txt"
    tail -2 "$d/probe.txt"
    echo "-- capture, reference, compare"
    featdiff capture --target "$d/target.gguf" --model "$d/draft.gguf" \
        --tokens "$tokens" --rounds "$ROUNDS" -o "$d/run.npz" >/dev/null
    featdiff reference --target "$d/target.gguf" --model "$d/draft-hf" \
        --tokens "$tokens" --rounds "$ROUNDS" -o "$d/ref.npz" >/dev/null
    featdiff compare "$d/ref.npz" "$d/run.npz" --json "$d/findings.json" --report "$d/report.html"
}

echo "== 1. the trained drafter, exported correctly: $OUT/correct"
triage trained correct || { echo "demo: the correct export should compare clean"; exit 1; }

echo
echo "== 2. the same drafter, dflash.target_layers without the +1: $OUT/off-by-one"
featdiff inspect "$OUT/correct/draft.gguf" | grep target_layers
if triage trained-layers-minus1 off-by-one; then
    echo "demo: the off-by-one export should give an error finding"; exit 1
fi
featdiff inspect "$OUT/off-by-one/draft.gguf" | grep target_layers

echo
echo "== 3. a GIDD log-SNR drafter exported without its conditioning (featdiff's patched library): $OUT/log-snr"
SRC=$(python -m featdiff.llama.tools --library)   # the patched tree the library was built in (make setup)
for v in trained-log-snr trained-no-log-snr; do
    featdiff fixture "$OUT/log-snr/$v" --variant "$v" >/dev/null
done
d=$OUT/log-snr/trained-no-log-snr
tokens=$(sed -n '1s/^tokens: //p' "$d/prompts.txt")
echo "-- capture (in-process), reference, compare"
featdiff capture --llama-dir "$SRC" --target "$d/target.gguf" --model "$d/draft.gguf" \
    --tokens "$tokens" --rounds "$ROUNDS" -o "$d/run.npz" >/dev/null
featdiff reference --target "$d/target.gguf" --model "$d/draft-hf" \
    --tokens "$tokens" --rounds "$ROUNDS" -o "$d/ref.npz" >/dev/null
if featdiff compare "$d/ref.npz" "$d/run.npz" --report "$d/report.html"; then
    echo "demo: the export without its log-SNR conditioning should give an error finding"; exit 1
fi

echo
echo "== 4. the same log-SNR drafters through the patched llama-server (its tools: built once, the first time here)"
BIN=$(python -m featdiff.llama.tools)   # llama-server and friends, added to the library's build (make tools)
for v in trained-log-snr trained-no-log-snr; do
    d=$OUT/log-snr/$v
    echo "-- $v: accept rate through the patched llama-server vs the trained checkpoint"
    featdiff probe --target "$d/target.gguf" --model "$d/draft.gguf" --ref-model "$d/draft-hf" \
        --prompts "$d/prompts.txt" --exec -- "$BIN/llama-server" -m "$d/target.gguf" -md "$d/draft.gguf" \
        --spec-type draft-dflash --spec-draft-n-max 3 -c 256 -t 2 -td 2 > "$d/probe.txt" || true
    tail -2 "$d/probe.txt"
done

echo
echo "== what the capture holds (first evals of $OUT/correct/run.npz)"
featdiff inspect "$OUT/correct/run.npz" | head -24

echo
echo "reports (open in a browser):"
echo "  correct export: $OUT/correct/report.html"
echo "  off by one:     $OUT/off-by-one/report.html"
echo "  log-SNR lost:   $OUT/log-snr/trained-no-log-snr/report.html"
