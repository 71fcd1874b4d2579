#!/usr/bin/env bash
# featdiff check of a llama.cpp fork's drafter wiring, the steps of the CI workflow
# (examples/ci/featdiff-check.yml) runnable on any machine:
#   1. build the fork with shared libraries (when LLAMA_DIR/build has no libllama yet),
#   2. find featdiff (on PATH, else this checkout's .venv, else pip install this checkout),
#   3. the drafter fixture: the fork's own GGUF pair, else featdiff's trained pair,
#   4. featdiff check: capture through the fork's build, reference, compare, accept probe;
#      the JSON, the HTML report and a Markdown summary go to $OUT (the summary is appended to
#      $GITHUB_STEP_SUMMARY when set). The exit code is featdiff check's: 0 wired right, 1 a wiring
#      fault or an accept gap, 2 unusable input, 3 a bug of featdiff's.
#
# Usage: examples/ci/check.sh [LLAMA_DIR]
#   LLAMA_DIR   a llama.cpp checkout (its CMake build goes to LLAMA_DIR/build). Default: featdiff's
#               own patched pinned tree, build/llama.cpp/src (built once by `make tools`).
# Environment (all optional):
#   TARGET, DRAFT     the fork's GGUF pair; default: `featdiff fixture $OUT/fixture --variant $VARIANT`
#   REF_MODEL         the trained checkpoint (HF dir) the export came from (the fixture's draft-hf/)
#   PROMPTS           one prompt per line (the fixture's prompts.txt)
#   VARIANT           featdiff's fixture variant when TARGET is unset (default: trained)
#   MODE              in-process (default) or llama-server (around LLAMA_DIR/build/bin/llama-server)
#   ROUNDS            speculative rounds per prompt, in-process (default 3)
#   MIN_ACCEPT        the least accept rate (accepted / drafted) the run must reach
#   OUT               where the outputs go (default: featdiff-check-out)
#   BUILD             auto (default: build when libllama is missing), always, or never
#   BUILD_JOBS        parallel build jobs (default: the CPU count)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-featdiff-check-out}
MODE=${MODE:-in-process}
ROUNDS=${ROUNDS:-3}
BUILD=${BUILD:-auto}
VARIANT=${VARIANT:-trained}
mkdir -p "$OUT"

step() {  # a foldable group in the GitHub Actions log, a header elsewhere
    if [ -n "${GITHUB_ACTIONS:-}" ]; then echo "::group::$1"; else echo "== $1"; fi
}
end_step() {
    if [ -n "${GITHUB_ACTIONS:-}" ]; then echo "::endgroup::"; fi
}

step "featdiff"
if ! command -v featdiff >/dev/null 2>&1; then
    if [ -x "$REPO/.venv/bin/featdiff" ]; then
        PATH="$REPO/.venv/bin:$PATH"
    else
        python3 -m pip install -e "$REPO"   # editable: the C shim is compiled from $REPO/native
    fi
fi
PY=$(head -1 "$(command -v featdiff)" | sed 's/^#!//')   # the interpreter featdiff is installed in
echo "featdiff: $(command -v featdiff) ($PY)"
end_step

step "llama.cpp build"
if [ $# -ge 1 ]; then
    LLAMA_DIR=$(cd "$1" && pwd)
else
    LLAMA_DIR=$(dirname "$(dirname "$("$PY" -m featdiff.llama.tools)")")   # featdiff's tools: built once, then found
fi
if [ "$BUILD" = always ] || { [ "$BUILD" = auto ] && ! ls "$LLAMA_DIR"/build/bin/libllama.* >/dev/null 2>&1; }; then
    # shared libraries: featdiff loads libllama in-process and preloads into llama-server
    cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/build" -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF
    cmake --build "$LLAMA_DIR/build" --target llama llama-server -j "${BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
fi
echo "llama.cpp: $LLAMA_DIR (libraries in $LLAMA_DIR/build/bin)"
end_step

step "drafter fixture"
if [ -z "${TARGET:-}" ]; then
    featdiff fixture "$OUT/fixture" --variant "$VARIANT" >/dev/null   # a trained variant trains once per machine
    TARGET=$OUT/fixture/target.gguf
    DRAFT=$OUT/fixture/draft.gguf
    REF_MODEL=${REF_MODEL:-$OUT/fixture/draft-hf}
    PROMPTS=${PROMPTS:-$OUT/fixture/prompts.txt}
fi
echo "target $TARGET, drafter ${DRAFT:?set DRAFT with TARGET}, reference ${REF_MODEL:-the same GGUF}"
end_step

step "featdiff check ($MODE)"
args=(--target "$TARGET" --model "$DRAFT" --llama-dir "$LLAMA_DIR"
      --json "$OUT/check.json" --report "$OUT/report.html" --summary-md "$OUT/summary.md")
[ -n "${REF_MODEL:-}" ] && args+=(--ref-model "$REF_MODEL")
[ -n "${PROMPTS:-}" ] && args+=(--prompts "$PROMPTS")
[ -n "${MIN_ACCEPT:-}" ] && args+=(--min-accept "$MIN_ACCEPT")
case "$MODE" in
    in-process) args+=(--rounds "$ROUNDS") ;;
    llama-server) args+=(--exec -- "$LLAMA_DIR/build/bin/llama-server" -m "$TARGET" -md "$DRAFT"
                         --spec-type draft-dflash --spec-draft-n-max 3 -c 256 -t 2 -td 2) ;;
    *) echo "check.sh: MODE=$MODE: expected in-process or llama-server" >&2; exit 2 ;;
esac
code=0
featdiff check "${args[@]}" || code=$?
end_step
echo "featdiff check exit $code; summary $OUT/summary.md, report $OUT/report.html"
exit "$code"
