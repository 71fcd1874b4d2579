"""DFlash2 end to end: the tiny DFlash2 checkpoint (featdiff.factory.dflash2), converted by the
pinned converter, loads in the pinned llama.cpp; the reference computes its convs and candidate
lattice as dflash.cpp does, its drafts are the lattice walk of common/speculative.cpp; captures
in-process, around llama-speculative-simple and around llama-server compare clean against the
reference built from the GGUF and from the HF directory; the probe and `check` agree, and a
layer-id fault fails `check` by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from featdiff.kinds.dflash import modelled
from featdiff.core import names
from featdiff.diff.comparison import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.factory.converter import DRAFT_GGUF, TARGET_GGUF, WRITER_PREFIX, write_converted_dflash2_fixture
from featdiff.factory.dflash2 import SELECTOR_TOP_K
from featdiff.dump.model_info import model_info
from featdiff.kinds.dflash.dflash2 import lattice_drafts
from featdiff.torchref.dflash import dflash2
from featdiff.torchref.load_gguf import draft_from_gguf
from featdiff.torchref.load_hf import draft_from_hf
from real_flow import reference_of

N_PREDICT = 8  # llama-speculative-simple -n: a few rounds of 3 drafts
RUN_TIMEOUT_S = 120


pytestmark = pytest.mark.slow  # the pair is converted (cached per machine)


@pytest.fixture(scope="module")
def d2_dir(tmp_path_factory) -> Path:
    """The DFlash2 pair as the pinned converter writes it from the HF directories (featdiff's
    writer's GGUFs beside it as writer-*.gguf)."""
    return write_converted_dflash2_fixture(tmp_path_factory.mktemp("dflash2"))


@pytest.fixture(scope="module")
def spec_run(d2_dir, tools, tmp_path_factory) -> Path:
    """A capture of every callback around llama-speculative-simple (the real DFlash2 driver)."""
    from featdiff.programs import exec as exec_capture

    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(d2_dir / "target.gguf")]
    cmd += ["-md", str(d2_dir / "draft.gguf"), "--spec-type", "draft-dflash", "--spec-draft-n-max", "3"]
    cmd += ["-c", "256", "-t", "1", "-td", "1", "-p", "hello world", "-n", str(N_PREDICT), "--temp", "0"]
    out = tmp_path_factory.mktemp("dflash2-run") / "run.npz"
    return exec_capture.capture_exec(cmd, out, filters=["*"], timeout_s=RUN_TIMEOUT_S)


def test_dflash2_keys_and_tensors_are_modelled(d2_dir):
    assert model_info(d2_dir / "draft.gguf", with_hash=False).unmodelled == ()
    for name in (*dflash2.KEYS[:4], dflash2.T_SELECTOR_HIDDEN, "blk.0.attn_conv_base", "blk.1.ffn_conv_proj.weight"):
        assert modelled.entry(name).modelled, name


def test_gguf_and_hf_drafters_load_the_same_dflash2(d2_dir):
    g = draft_from_gguf(d2_dir / "draft.gguf", torch.float32, torch.device("cpu")).dflash2
    h = draft_from_hf(d2_dir / "draft-hf", torch.float32, torch.device("cpu")).dflash2
    assert g is not None and h is not None and g.top_k == h.top_k == SELECTOR_TOP_K
    assert torch.equal(g.selector_prev, h.selector_prev) and torch.equal(g.ffn_conv[1].proj, h.ffn_conv[1].proj)


def test_conv_reads_only_earlier_rows_of_the_block(d2_dir):
    dfl = draft_from_gguf(d2_dir / "draft.gguf", torch.float32, torch.device("cpu")).dflash2
    assert dfl is not None
    hidden = torch.randn(4, 64)
    dynamic = torch.randn(4, 2 * dfl.kernel_size * 64 // dfl.group_size)
    later = hidden.clone()
    later[3] += 1.0  # a change in the last row leaves the rows before it alone
    a = dflash2.conv(dfl, hidden, dynamic, dfl.attn_conv[0].base, dflash2.SIDE_IN)
    b = dflash2.conv(dfl, later, dynamic, dfl.attn_conv[0].base, dflash2.SIDE_IN)
    assert torch.equal(a[:3], b[:3]) and not torch.equal(a[3], b[3])


def test_lattice_walk_follows_the_best_successor_of_the_last_pick():
    k = 2
    row1 = [10.0, 11.0] + [0.0, 5.0] * 2  # best successor 1: token 11
    row2 = [20.0, 21.0] + [9.0, 0.0] + [0.0, 9.0]  # after pick 1 the second block of scores: token 21
    assert lattice_drafts([[0.0] * 6, row1, row2], k, 3, 0.0) == [11, 21]
    assert lattice_drafts([[0.0] * 6, row1, row2], k, 3, 0.999) == []  # softmax at the pick below p_min


def test_the_driver_drafts_are_the_walk_of_its_lattice(spec_run):
    with read_dump(spec_run) as dump:
        rounds = {r.round: r for r in dump.manifest.rounds}
        evals = {e.eval: e for e in dump.manifest.evals}
        walked = 0
        for rec in dump.records():
            ev = evals[rec.eval]
            if rec.name != dflash2.LATTICE or ev.phase != "draft" or ev.round not in rounds:
                continue
            lat = np.asarray(dump.array(rec))  # (block rows, n_embd)
            drafts = rounds[ev.round].drafts
            assert lattice_drafts(lat.tolist(), SELECTOR_TOP_K, lat.shape[0], 0.0)[: len(drafts)] == list(drafts)
            walked += 1
    assert walked >= 2


@pytest.mark.parametrize("model", ["draft.gguf", "draft-hf"])
def test_dflash2_run_compares_clean_with_nothing_skipped(d2_dir, spec_run, tmp_path, model):
    with read_dump(spec_run) as dump:
        tokens = ",".join(map(str, dump.manifest.prompt_tokens))
        rounds = len(dump.manifest.rounds)
    ref = reference_of(d2_dir / "target-hf", d2_dir / model, tmp_path / "ref.npz", tokens=tokens, rounds=rounds)
    comparison = compare_dumps(ref, spec_run)
    assert comparison.ok, [f.message for f in comparison.findings if f.severity == "error"]
    assert comparison.coverage.pairs_skipped == 0 and comparison.coverage.rows_skipped == 0
    with read_dump(ref) as dump:
        names = {r.name for r in dump.records()}
    assert {dflash2.LATTICE, "attn_conv_in-0", "ffn_conv_out-1"} <= names and "draft_logits" not in names


def test_in_process_dflash2_capture_walks_the_lattice_and_compares_clean(d2_dir, tmp_path):
    """featdiff's own driver drafts a DFlash2 block as upstream's does (the lattice walk, not the
    argmax of logits), with the default wiring filter keeping the convs and the lattice."""
    from featdiff.driver.capture import capture

    tokens = "7,21,3,99,140,5,260,33,18,402,77,9"
    run = capture(d2_dir / "target.gguf", d2_dir / "draft.gguf", tmp_path / "run.npz", tokens=tokens, rounds=4)
    with read_dump(run) as dump:
        kept = {r.name for r in dump.records()}
    assert {dflash2.LATTICE, "attn_conv_in-0", "ffn_conv_out-1"} <= kept
    ref = reference_of(d2_dir / "target-hf", d2_dir / "draft-hf", tmp_path / "ref.npz", tokens=tokens, rounds=4)
    comparison = compare_dumps(ref, run)
    assert comparison.ok, [f.message for f in comparison.findings if f.severity == "error"]
    assert comparison.coverage.pairs_skipped == 0 and comparison.coverage.rows_skipped == 0


def test_dflash2_around_llama_server_compares_clean(d2_dir, tools, tmp_path):
    """The server's DFlash2 drafts (its own loop, its lattice walk) against the reference that
    replays the run: clean, nothing skipped, with the default wiring filter."""
    from featdiff.programs import exec as exec_capture

    cmd = [str(tools.program("llama-server")), "-m", str(d2_dir / "target.gguf"), "-md", str(d2_dir / "draft.gguf")]
    cmd += ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", tokens="7,21,3,99,140,5,260,33", timeout_s=RUN_TIMEOUT_S)
    with read_dump(run) as dump:
        kept = {r.name for r in dump.records()}
        assert any(r.drafts for r in dump.manifest.rounds)
    assert dflash2.LATTICE in kept
    ref = reference_of(d2_dir / "target-hf", d2_dir / "draft-hf", tmp_path / "ref.npz", follow=run)
    comparison = compare_dumps(ref, run)
    assert comparison.ok, [f.message for f in comparison.findings if f.severity == "error"]
    assert comparison.coverage.pairs_skipped == 0 and comparison.coverage.rows_skipped == 0


def test_the_converters_dflash2_gguf_is_featdiffs_writers(d2_dir):
    """The converter writes DFlash2's keys, convs and codebooks as featdiff's writer does."""
    from test_converter import WRITER_CONVENTIONS, _differences

    for role, arch in ((TARGET_GGUF, "qwen3"), (DRAFT_GGUF, modelled.DFLASH_PREFIX.rstrip("."))):
        assert _differences(d2_dir / f"{WRITER_PREFIX}{role}", d2_dir / role) <= WRITER_CONVENTIONS[arch], role


def test_dflash2_probe_drafts_the_runs_blocks_and_check_passes(d2_dir):
    """The probe's reference walks the lattice as the driver does: every round's drafts are the
    run's own (the untrained drafter accepts little, but equally), and `check` passes."""
    import featdiff
    from featdiff.verdict.probe import probe

    p = probe(d2_dir / TARGET_GGUF, d2_dir / DRAFT_GGUF)
    rounds = [r for pp in p.prompts for r in pp.rounds if r.run_drafts]
    assert len(rounds) >= 8 and all(r.run_drafts == r.ref_drafts for r in rounds) and not p.has_gap
    result = featdiff.check(d2_dir / TARGET_GGUF, d2_dir / DRAFT_GGUF)
    assert result.verdict == "pass" and result.reasons == (), result.reasons


def test_dflash2_layer_offset_fails_check_by_name(d2_dir, tmp_path):
    """The converter's GGUF with dflash.target_layers one too high (the +1 written twice)."""
    import featdiff
    from gguf import GGUFReader

    from featdiff.factory.gguf_rewrite import rewrite_gguf

    key = names.KEY_TARGET_LAYERS
    ids = [int(i) for i in GGUFReader(str(d2_dir / DRAFT_GGUF)).fields[key].contents()]
    bad = rewrite_gguf(d2_dir / DRAFT_GGUF, tmp_path / "draft.gguf", {key: [i + 1 for i in ids]}, {})
    result = featdiff.check(d2_dir / TARGET_GGUF, bad, ref_model=d2_dir / "draft-hf")
    assert result.verdict == "fail"
    first = next(f for f in result.comparison.findings if f.severity == "error")
    assert (first.kind, first.tensor) == ("layer_offset", names.INP_TARGET_FEATURES), first.message
