"""compare/: read two dumps (ref = the trained reference, run = the llama.cpp capture), align
them, measure every pair, find the first divergence and name the wiring fault.

Called by the CLI:
* `compare_dumps(ref, run, name_map) -> Comparison`: the whole stage (InputError when unusable).
* `exit_code(c) -> int`: 0 no error finding, 1 error findings.
* `render_summary(c, verbose)`: verdict line and ranked findings on stdout (rich); `verbose`
  adds the per-record table.
* `write_json(c, dest)`: `{"ok", "findings", "records", "coverage"}` to a file, or stdout for "-"
  (docs/findings.md is the contract).

For report/ (which renders a `Comparison` and computes nothing of its own):
* `Comparison` (result.py): `findings`, `pairs` (one `PairMetrics` per compared record set, in
  eval and graph order, with `row_rel_err` per row and `positions`; `first_bad_position()`),
  `alignments` (parallel to `pairs`: the `Alignment` plan of each: ref/run keys comma-joined when
  a record spans several evals, layout, `rows`/`run_rows`/`positions`), `first_divergence`
  (index into `pairs`), `skipped` (what was not compared, one line each), `coverage`
  (`Coverage`: record sets and rows compared, and each `Skip` with its reason), `types` (what the
  tolerance model used), `layer_match` (sketch.py `LayerMatch`: the first injected features'
  slot x layer matrix; `.similarity` / `.rel_err` are `(n_extract, len(layers))`, `.layers` the
  layer ids of the columns, `.expected_layers` the checkpoint's `target_layers`, `.run_layers`
  the run's, `.closest_layers` the best layer per slot) and `row_shift` (rowshift.py `RowShift`:
  run rows x ref rows of the first divergent record, cosine, `.best_shift()`). The findings JSON
  carries all of it (docs/findings.md).
* `layer_match_matrix(ref, run, name_map=None, eval_index=None) -> LayerMatch | None`: the
  layer-match search alone, from two dump files.
* `row_similarity(ref, run) -> (n_run, n_ref)` cosine of every run row with every ref row (row
  shifts show as an off-diagonal); `row_cosine(ref, run) -> (R,)` the same-row cosine.
* `target_layers(manifest) -> tuple[int, ...]`: the drafter's `target_layers` a manifest states.

Modules: align.py (plan: pairs, name map, layouts, rows, what is left out), batches.py (a side's
eval groups as the flow's batches), kvcache.py (the draft KV cache, followed through the run),
arrays.py (memory-mapped reads), metrics.py, tolerance.py (the tolerance model and its
calibration), sketch.py (layer-match sketches), rowshift.py (the row-shift matrix), partings.py
(where the token histories part), dependence.py (what an unmodelled feature sets aside),
evidence.py (what the detectors see), detectors/ (one pure `detect_<kind>` per hypothesis, one
module per family, each finding's sentence beside its detector), fields.py (one field record
per finding kind), schema.py (the findings schema's finding properties, made from those records),
result.py (the records compare produces), diagnose.py (first divergence, own vs inherited error,
the detector chain, which skips and partings become findings), positions.py (the token and
position checks, in the order the run met them), comparison.py (the stage), render.py
(terminal, JSON, exit code), namemap.py + maps/ (forks).

Each finding kind's fields are its record in fields.py (docs/findings.md, Kinds): `rows` are
token positions (row indices when the record is not row-wise); a field only some producers of a
kind have is left out by the others (`position_offset` of a batch adds `role`, `phase`, `round`,
`eval` to the `offset` of a RoPE'd record; the draft KV cache's `stale` adds `detail`, `round`,
`eval`). What the token ids and positions say comes first (`block_token`, `position_offset` of a
batch, the draft KV cache's `stale` and `duplicate_rows`, `flow_note`), and no wiring record is
left out of the comparison without an `unpaired` finding that says why (`reason`: `prompt`,
`token_history`, `position`, `missing_eval`, `failed_eval`; info for llama.cpp's expected
`no_rows`, `no_draft`, `fewer_drafts`: result.py holds how each reason is judged).

One-sided records: reference-only candidates (`layer_inp-<L>`, `<record>@<h>`, an old dump's
`log_snr_embed`; docs/records.md) and unnamed `node_<n>` never count. A name in the wiring set
(names.WIRING_NAMES) present on one side only is a `missing_tensor`/`unexpected_tensor` error
(missing only when the run's recorded capture filters would have kept it; a run graph with none of
the log-SNR nodes is one `missing_term` instead); any other one-sided name is one info finding.
"""

from featdiff.diff.comparison import compare_dumps, layer_match_matrix
from featdiff.diff.evidence import target_layers
from featdiff.diff.metrics import row_cosine, row_similarity
from featdiff.diff.render import exit_code, render_summary, verdict, write_json
from featdiff.diff.result import Alignment, Comparison, Coverage, Finding, PairMetrics, Skip
from featdiff.diff.rowshift import RowShift
from featdiff.diff.sketch import LayerMatch

__all__ = [
    "Alignment",
    "Comparison",
    "Coverage",
    "Finding",
    "LayerMatch",
    "PairMetrics",
    "RowShift",
    "Skip",
    "compare_dumps",
    "exit_code",
    "layer_match_matrix",
    "render_summary",
    "row_cosine",
    "row_similarity",
    "target_layers",
    "verdict",
    "write_json",
]
