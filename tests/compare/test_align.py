"""Alignment: pairing by role, phase, round, name and occurrence; name maps; layouts; rows by
position and token history; what counts as a one-sided record."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from featdiff.core.errors import InputError
from featdiff.core.phases import Phase
from featdiff.diff import compare_dumps
from featdiff.diff.align import plan_pairs, row_contexts
from featdiff.diff.namemap import NameMap, builtin_map, read_name_map
from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Eval, record_key
from featdiff.dump.writer import DumpWriter, record_from_array

import synth
from transform import rewrite, split_eval


def kinds(c) -> list[str]:
    return [f.kind for f in c.findings if f.severity == "error"]


def test_identical_synthetic_pair_is_clean(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(), None)
    assert c.ok and not kinds(c) and c.first_divergence is None
    assert {p.name for p in c.pairs} >= {"inp_target_features", "inp_g_embeddings", "l_out-0", "inp_noise_embd"}


def test_reference_only_records_are_neither_paired_nor_missing(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(), None)
    assert not any("@" in p.name or p.name.startswith("layer_inp") for p in c.pairs)
    assert not any(f.kind == "missing_tensor" for f in c.findings)


def test_chunked_prefill_lines_up_with_one_batch(synth_ref, synth_run, tmp_path):
    run = split_eval(synth_run(), tmp_path / "chunked.npz", eval_index=0, at=3)
    c = compare_dumps(synth_ref, run, None)
    assert c.ok and not c.skipped
    l_out = next(a for p, a in zip(c.pairs, c.alignments) if p.name == "l_out-2" and p.phase == "prefill")
    assert l_out.positions == tuple(range(7)) and "," in l_out.run_key  # two run records, one pair


def test_differently_split_inject_lines_up(synth_ref, synth_run, tmp_path):
    run = split_eval(synth_run(), tmp_path / "split.npz", eval_index=1, at=5)
    assert compare_dumps(synth_ref, run, None).ok


def test_head_layout_is_normalized(synth_ref, synth_run, tmp_path):
    def flat(r, a):
        return a.reshape(a.shape[0], -1) if r.name.startswith("Kcur_injected") else a  # (T, n_head_kv * head_dim)

    c = compare_dumps(synth_ref, rewrite(synth_run(), tmp_path / "flat.npz", flat), None)
    layout = next(a.layout for p, a in zip(c.pairs, c.alignments) if p.name == "Kcur_injected-0")
    assert c.ok and layout == "(T, 16) -> (T, 2, 8)"


def test_rows_with_a_different_history_are_left_out(synth_ref, tmp_path):
    spec = synth.Spec()
    evals, _ = synth.flow(spec)
    verify = evals[3][0]
    changed = replace(verify, token_ids=(verify.token_ids[0], 77, 78, 79))
    run = synth.write(tmp_path / "run.npz", side="run")
    with read_dump(run) as d:
        new_evals = tuple(changed if e.eval == verify.eval else e for e in d.manifest.evals)
    run2 = rewrite(run, tmp_path / "run2.npz", evals=new_evals)
    c = compare_dumps(synth_ref, run2, None)
    verify_pair = next(a for p, a in zip(c.pairs, c.alignments) if p.eval == verify.eval and p.name == "l_out-0")
    assert verify_pair.positions == (verify.positions[0],) and "different token history" in verify_pair.note
    assert verify_pair.history_rows == verify.positions[1:]
    # left out, never silently: the coverage lists the rows and an error finding says why
    skip = next(s for s in c.coverage.skips if s.name == "l_out-0" and s.round == 1)
    assert (skip.reason, skip.whole, skip.rows) == ("token_history", False, verify.positions[1:])
    assert not c.ok and any(f.kind == "unpaired" and f.severity == "error" for f in c.findings)


def test_rows_at_positions_the_other_side_lacks_are_counted(synth_ref, tmp_path):
    run = synth.write(tmp_path / "run.npz", side="run")
    with read_dump(run) as d:
        evals = tuple(
            replace(e, positions=tuple(p + 1 for p in e.positions)) if e.eval == 1 else e for e in d.manifest.evals
        )
    c = compare_dumps(synth_ref, rewrite(run, tmp_path / "late.npz", evals=evals), None)
    feats = next(a for p, a in zip(c.pairs, c.alignments) if p.eval == 1 and p.name == "inp_target_features")
    assert feats.unmatched_rows == (0, 7) and feats.positions == tuple(range(1, 7))
    skip = next(s for s in c.coverage.skips if s.name == "inp_target_features" and s.round == 0)
    assert (skip.reason, skip.rows, skip.whole) == ("position", (0, 7), False)


def test_row_contexts_follow_the_token_history():
    evals, _ = synth.flow(synth.Spec())
    ctx = row_contexts(Manifest("reference", {}, {}, tuple(e for e, _, _ in evals), ()))
    assert ctx[1] == ctx[0]  # the inject rows carry the prefill rows
    assert ctx[4] == ctx[3]  # and the verify rows
    assert len(set(ctx[2])) == len(ctx[2])  # a draft block: one context per row


def _one_token_steps(earlier_verify: tuple[int, ...]) -> Manifest:
    """A prefill of 4 tokens, a round whose verify decoded `earlier_verify` at positions 4.., then
    a round of two one-token draft steps (EAGLE3's, MTP's) at positions 6 and 7, tokens 21, 22."""
    ev = [
        Eval(0, "target", Phase.PREFILL, 4, (0, 1, 2, 3), (1, 2, 3, 4), (0,)),
        Eval(1, "draft", Phase.DRAFT, 1, (4,), (9,), (0,), round=1),
        Eval(
            2,
            "target",
            Phase.VERIFY,
            len(earlier_verify),
            tuple(range(4, 4 + len(earlier_verify))),
            earlier_verify,
            (0,),
            round=1,
        ),
        Eval(3, "draft", Phase.DRAFT, 1, (6,), (21,), (0,), round=2),
        Eval(4, "draft", Phase.DRAFT, 1, (7,), (22,), (0,), round=2),
    ]
    return Manifest("reference", {}, {}, tuple(ev), ())


def test_a_draft_step_continues_its_rounds_history_not_an_earlier_rounds_rejected_row():
    """Step 2 at position 7 was drafted from the tokens 0..5, step 1's 21 and its own 22: whether an
    earlier verify decoded a (rejected) row at 6 must not change its history (issue 42, item 3)."""
    short, long = row_contexts(_one_token_steps((9, 5))), row_contexts(_one_token_steps((9, 5, 30)))
    assert short[3] == long[3] and short[4] == long[4]
    other = row_contexts(_one_token_steps((9, 6)))  # another accepted token at 5: another history
    assert other[3] != short[3] and other[4] != short[4]


def test_missing_wiring_tensor_is_an_error(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(drop=lambda ev, name: name == "inp_g_embeddings"), None)
    f = next(f for f in c.findings if f.kind == "missing_tensor")
    assert f.tensor == "inp_g_embeddings" and f.severity == "error"


def test_missing_tensor_not_reported_when_the_capture_filter_left_it_out(synth_ref, synth_run):
    run = synth_run(drop=lambda ev, name: name == "inp_g_embeddings", build={"filters": ["l_out-*", "inp_*_features"]})
    assert not any(f.kind == "missing_tensor" for f in compare_dumps(synth_ref, run, None).findings)


def test_missing_tensor_not_reported_for_a_name_the_capture_excluded(synth_ref, synth_run):
    """An exclusion (`--filter '!inp_g_embeddings'`) is recorded in the manifest and read by compare."""
    run = synth_run(
        drop=lambda ev, name: name == "inp_g_embeddings",
        build={"filters": {"draft": ["*", "!inp_g_embeddings"], "target": ["*"]}},
    )
    assert not any(f.kind == "missing_tensor" for f in compare_dumps(synth_ref, run, None).findings)


def test_extra_run_names_outside_the_wiring_set_are_one_info_and_nodes_are_ignored(synth_ref, synth_run, tmp_path):
    run = synth_run()
    with read_dump(run) as d:
        base = d.manifest
    w = DumpWriter(tmp_path / "wide.npz")
    with read_dump(run) as d:
        for r in d.records():
            w.add(r, np.array(d.array(r)))
        for il in range(2):
            rec, arr = record_from_array(
                record_key(0, "target", f"Qcur-{il}", 0),
                "target",
                "prefill",
                0,
                f"Qcur-{il}",
                0,
                np.ones((7, 4), np.float32),
            )
            w.add(rec, arr)
        rec, arr = record_from_array(
            record_key(0, "target", "node_12", 0), "target", "prefill", 0, "node_12", 0, np.ones((7, 4), np.float32)
        )
        w.add(rec, arr)
    wide = w.close(base)
    c = compare_dumps(synth_ref, wide, None)
    assert c.ok
    info = [f for f in c.findings if f.kind == "unexpected_tensor"]
    assert len(info) == 1 and info[0].severity == "info" and info[0].fields["names"] == ["Qcur-0", "Qcur-1"]
    assert not any(p.name.startswith("node_") for p in c.pairs)


def test_unexpected_wiring_tensor_is_an_error(synth_ref, synth_run, tmp_path):
    run = synth_run()
    w = DumpWriter(tmp_path / "extra.npz")
    with read_dump(run) as d:
        base = d.manifest
        for r in d.records():
            w.add(r, np.array(d.array(r)))
    rec, arr = record_from_array(
        record_key(1, "draft", "inp_g_embeddings", 1),
        "draft",
        "inject",
        1,
        "inp_g_embeddings",
        1,
        np.ones((7, 16), np.float32),
    )
    w.add(rec, arr)
    c = compare_dumps(synth_ref, w.close(base), None)
    f = next(f for f in c.findings if f.kind == "unexpected_tensor")
    assert f.severity == "error" and f.tensor == "inp_g_embeddings"


def test_not_conditioned_when_the_run_has_no_inject_eval(synth_ref, tmp_path):
    run = synth.write(tmp_path / "run.npz", side="run")
    with read_dump(run) as d:
        evals = tuple(e for e in d.manifest.evals if e.phase != "inject")
    bare = rewrite(run, tmp_path / "bare.npz", lambda r, a: None if r.phase == "inject" else a, evals=evals)
    c = compare_dumps(synth_ref, bare, None)
    f = next(f for f in c.findings if f.kind == "not_conditioned")
    assert f.severity == "error" and f.fields["detail"] == "no inject eval"


def test_dumps_sharing_nothing_are_unusable_input(synth_ref, tmp_path):
    run = synth.write(tmp_path / "run.npz", side="run")
    nothing = rewrite(run, tmp_path / "nothing.npz", lambda r, a: None)
    with pytest.raises(InputError, match="no record pairs"):
        compare_dumps(synth_ref, nothing, None)


# --- name maps ---------------------------------------------------------------------------------


def test_dspark_map_translates_the_fork_names():
    m = read_name_map(builtin_map("dspark"))
    assert m.fork == "dspark"
    assert m.ref_name("dspark_ctx_feat") == "inp_target_features"
    assert m.ref_name("dspark_hidden_norm") == "inp_g_embeddings"
    assert m.ref_name("dspark_draft_embd") == "inp_noise_embd"
    assert m.ref_name("l_out-3") == "l_out-3"
    assert m.pairing_name("dspark_attn_in-7") is None


def test_layer_placeholder_carries_the_index(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('[names]\n"fork_kv-<il>" = "Kcur_injected-<il>"\n')
    assert read_name_map(p).ref_name("fork_kv-12") == "Kcur_injected-12"
    assert read_name_map(p).ref_name("fork_kv-x") == "fork_kv-x"


@pytest.mark.parametrize("text", ["[names\n", "[names]\na = 3\n", '[fork_only]\nnames = "x"\n'])
def test_bad_name_maps_are_unusable_input_naming_the_file(tmp_path, text):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(InputError, match="bad.toml"):
        read_name_map(p)


def test_a_fork_dump_pairs_through_the_map(synth_ref, synth_run, tmp_path):
    fork = {
        "inp_target_features": "dspark_ctx_feat",
        "inp_g_embeddings": "dspark_hidden_norm",
        "inp_noise_embd": "dspark_draft_embd",
    }
    run = synth_run()
    w = DumpWriter(tmp_path / "fork.npz")
    with read_dump(run) as d:
        base = d.manifest
        for r in d.records():
            name = fork.get(r.name, r.name)
            w.add(replace(r, name=name, key=r.key.replace(r.name, name)), np.array(d.array(r)))
    fork_dump = w.close(base)
    without = compare_dumps(synth_ref, fork_dump, None)
    assert any(f.kind == "missing_tensor" for f in without.findings)
    c = compare_dumps(synth_ref, fork_dump, builtin_map("dspark"))
    assert c.ok
    feats = next(a for p, a in zip(c.pairs, c.alignments) if p.name == "inp_target_features")
    assert feats.name_map == "dspark_ctx_feat -> inp_target_features"


def test_plan_is_in_eval_then_graph_order(synth_ref, synth_run):
    with read_dump(synth_ref) as ref, read_dump(synth_run()) as run:
        plan = plan_pairs(ref.manifest, run.manifest, NameMap())
    orders = [p.order for p in plan.pairs]
    assert orders == sorted(orders)


def test_positions_the_graph_used_are_checked_against_the_batch(synth_ref, tmp_path):
    run = synth.write(tmp_path / "run.npz", side="run")
    w = DumpWriter(tmp_path / "pos.npz")
    with read_dump(run) as d:
        base = d.manifest
        for r in d.records():
            w.add(r, np.array(d.array(r)))
        for ev in base.evals:
            shift = 1 if ev.phase == "inject" and ev.round == 1 else 0
            rec, arr = record_from_array(
                record_key(ev.eval, ev.role, "inp_pos", 0),
                ev.role,
                ev.phase,
                ev.eval,
                "inp_pos",
                0,
                np.asarray(ev.positions, np.int32) + shift,
            )
            w.add(rec, arr)
    c = compare_dumps(synth_ref, w.close(base), None)
    f = next(f for f in c.findings if f.severity == "error")
    assert (f.kind, f.tensor, f.fields["offset"]) == ("position_offset", "inp_pos", 1)
    assert not any(f.kind == "unexpected_tensor" for f in c.findings)


def test_not_conditioned_when_the_injected_features_are_empty(synth_ref, tmp_path):
    run = synth.write(tmp_path / "run.npz", side="run")
    empty = rewrite(
        run, tmp_path / "empty.npz", lambda r, a: a[:, :0] if r.name == "inp_target_features" else a
    )  # (n_tokens, 0)
    f = next(f for f in compare_dumps(synth_ref, empty, None).findings if f.kind == "not_conditioned")
    assert f.fields["detail"] == "empty injected features"
