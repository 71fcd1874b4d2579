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

Modules: align.py (plan: pairs, name map, layouts, rows, what is left out), flow.py (token ids
and positions against the flow and the reference), arrays.py (memory-mapped reads),
metrics.py, tolerance.py (the tolerance model and its calibration), sketch.py (layer-match
sketches), rowshift.py (the row-shift matrix), evidence.py (what the detectors see),
detectors.py + wiring.py (one `detect_<kind>` per finding kind), diagnose.py (first divergence,
own vs inherited error, the detector chain),
comparison.py (the stage), render.py (terminal, JSON, exit code), namemap.py + maps/ (forks).

Findings fields beyond the first findings table (docs/findings.md): `rows` (zeros, nonfinite, stale) are token positions
(row indices when the record is not row-wise); `stale` adds `source_eval`; `layer_offset` adds
`observed_layers`/`expected_layers` (all slots); `wrong_source` adds `candidate` (the reference
record it matched); `missing_term` adds `expected_in` (the sum the run's graph lacks, when it
lacks one); an info `unexpected_tensor` lists `names` outside the wiring set.

Findings of flow.py and the plan (docs/findings.md): `block_token`, `position_offset` of a whole
batch (`phase`, `round`, `eval`), the draft KV cache's `stale` and `duplicate_rows` (from the run's
`memory_ops`), `flow_note` (the run's `flow_notes`), and `unpaired` (`reason`: `prompt`,
`token_history`, `position`, `missing_eval`; info for llama.cpp's expected `no_rows`, `no_draft`,
`fewer_drafts`):
no wiring record is left out of the comparison without a finding that says why.

One-sided records: reference-only candidates (`layer_inp-<L>`, `<record>@<h>`, an old dump's
`log_snr_embed`; docs/records.md) and unnamed `node_<n>` never count. A name in the wiring set
(names.WIRING_NAMES) present on one side only is a `missing_tensor`/`unexpected_tensor` error
(missing only when the run's recorded capture filters would have kept it; a run graph with none of
the log-SNR nodes is one `missing_term` instead); any other one-sided name is one info finding.
"""

from featdiff.compare.comparison import compare_dumps, layer_match_matrix
from featdiff.compare.evidence import target_layers
from featdiff.compare.metrics import row_cosine, row_similarity
from featdiff.compare.render import exit_code, render_summary, verdict, write_json
from featdiff.compare.result import Alignment, Comparison, Coverage, Finding, PairMetrics, Skip
from featdiff.compare.rowshift import RowShift
from featdiff.compare.sketch import LayerMatch

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
