"""EAGLE3 export faults named on the real library: each is planted by rewriting the pinned
converter's correct `draft.gguf` (the run loads the faulty GGUF, the reference the correct one),
captured by featdiff's EAGLE3 driver and compared. The reference's EAGLE3 candidates
(`fc_out@slots=<perm>`, `fc_out@norm=...`, `inp_embd@table=target`, `<logits>@d2t=offsets`) name
each fault, and leave a correct pair clean."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from featdiff.core import names
from featdiff.diff import compare_dumps
from featdiff.diff.comparison import UNEXPLAINING
from featdiff.diff.result import Finding
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import DROP, rewrite_gguf

from eagle3_real import run_and_ref

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


def _errors(d: Path, model: Path, tmp: Path) -> list[Finding]:
    """The error findings of the run of `model` against the reference of the correct GGUF; every
    one placed in the export (the run's GGUF differs from the reference's, docs/findings.md `where`)."""
    run, ref = run_and_ref(d, model, tmp)
    errors = [f for f in compare_dumps(ref, run).findings if f.severity == "error"]
    assert all(f.fields["where"] == "export" for f in errors), [(f.kind, f.fields["where_reason"]) for f in errors]
    return errors


def _cause(errors: list[Finding]) -> Finding:
    """The first error that says why the run differs (not which records one side lacks)."""
    return next(f for f in errors if f.kind not in UNEXPLAINING)


def _tensor(path: Path, name: str) -> np.ndarray:
    from gguf import GGUFReader

    return np.array(next(t for t in GGUFReader(str(path)).tensors if t.name == name).data)


def _fc_with_blocks(draft: Path, order: list[int]) -> np.ndarray:
    """fc.weight `(n_embd, 3 * n_embd_tgt)` whose column block k holds the checkpoint's block order[k]."""
    fc = _tensor(draft, names.T_FC).astype(np.float32)  # (n_embd, 3 * n_embd_tgt)
    blocks = fc.reshape(fc.shape[0], 3, -1)  # (n_embd, 3, n_embd_tgt)
    return blocks[:, order].reshape(fc.shape)  # (n_embd, 3 * n_embd_tgt)


def _with_d2t(src: Path, dst: Path, d2t: np.ndarray) -> Path:
    """`src` copied to `dst` with `d2t` replaced by these int64 ids, stored I64 as llama.cpp reads
    it (gguf_rewrite writes replaced tensors as float32)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    wr = GGUFWriter(str(dst), str(reader.fields[names.KEY_ARCH].contents()))
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != names.KEY_ARCH:
            wr.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name == names.T_D2T:
            wr.add_tensor(t.name, np.asarray(d2t, dtype=np.int64))  # numpy int64: GGUFWriter stores I64
        else:
            wr.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return dst


# --- the correct pairs: the candidates are recorded and explain nothing -----------------------


@pytest.mark.parametrize("variant", ["eagle3", "eagle3-norm-before-fc", "eagle3-own-embd"])
def test_a_correct_pair_compares_clean_beside_its_candidates(eagle3_pairs, variant, tmp_path):
    d = eagle3_pairs(variant)
    run, ref = run_and_ref(d, d / "draft.gguf", tmp_path)
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not c.skipped
    with read_dump(ref) as dump:
        recorded = {r.name for r in dump.manifest.records}
    norm = names.HYP_NORM_NONE if variant == "eagle3-norm-before-fc" else names.HYP_NORM_UNIT
    expected = {
        *(names.candidate_name(names.EAGLE3_FC_OUT, h) for h in ("slots=1,0,2", "slots=2,1,0", norm)),
        names.candidate_name(names.RESULT_OUTPUT, names.HYP_D2T_OFFSETS),
        names.candidate_name(names.DRAFT_LOGITS, names.HYP_D2T_OFFSETS),
    }
    assert expected <= recorded
    own = names.candidate_name(names.INP_EMBD, names.HYP_TABLE_TARGET)
    assert (own in recorded) == (variant == "eagle3-own-embd")


# --- 1. the slots: target layer ids reordered, fc column blocks permuted ---------------------


@pytest.mark.parametrize("variant", ["eagle3", "eagle3-norm-before-fc"])
def test_reordered_target_layers_are_a_slot_permutation_of_the_features(eagle3_pairs, variant, tmp_path):
    d = eagle3_pairs(variant)
    bad = rewrite_gguf(d / "draft.gguf", tmp_path / "draft-531.gguf", keys={names.KEY_EAGLE3_TARGET_LAYERS: [5, 3, 1]})
    errors = _errors(d, bad, tmp_path)
    first = errors[0]
    assert (first.kind, first.tensor) == ("slot_permutation", names.INP_EMBD), first.message  # the encoder's input
    assert first.fields["permutation"] == [2, 1, 0]
    assert [f.kind for f in errors] == ["slot_permutation"]  # fc_out and the rest inherit it


@pytest.mark.parametrize(
    ("variant", "order", "permutation"),
    [("eagle3", [1, 0, 2], [1, 0, 2]), ("eagle3-norm-before-fc", [1, 2, 0], [2, 0, 1])],
    ids=["swap", "cycle-after-the-norm"],
)
def test_permuted_fc_column_blocks_are_a_slot_permutation_at_fc_out(
    eagle3_pairs, variant, order, permutation, tmp_path
):
    d = eagle3_pairs(variant)
    fc = _fc_with_blocks(d / "draft.gguf", order)
    bad = rewrite_gguf(d / "draft.gguf", tmp_path / "draft-fc.gguf", tensors={names.T_FC: fc})
    errors = _errors(d, bad, tmp_path)
    first = errors[0]
    assert (first.kind, first.tensor) == ("slot_permutation", names.EAGLE3_FC_OUT), first.message
    assert first.fields["permutation"] == permutation
    assert names.T_FC in first.message and "fc_out@slots=" + ",".join(map(str, permutation)) in first.message
    # block permutation[k] of the GGUF holds the checkpoint's block k
    assert all(order[p] == k for k, p in enumerate(permutation))
    assert [f.kind for f in errors] == ["slot_permutation"]


# --- 2. the encoder norm: dropped, or added ----------------------------------------------------


def test_a_dropped_encoder_norm_is_named_at_fc_out(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3-norm-before-fc")
    bad = rewrite_gguf(
        d / "draft.gguf", tmp_path / "draft-no-norm.gguf",
        keys={names.KEY_EAGLE3_NORM_BEFORE_FC: False}, tensors={names.T_ENC_NORM: DROP},
    )  # fmt: skip
    errors = _errors(d, bad, tmp_path)
    # the graph has no enc_input_norm node (said first, with the records either side lacks); fc_out says why
    assert [(f.kind, f.tensor) for f in errors] == [
        ("missing_tensor", names.EAGLE3_ENC_INPUT_NORM),
        ("wrong_source", names.EAGLE3_FC_OUT),
    ]
    cause = _cause(errors)
    assert (cause.fields["source"], cause.fields["candidate"]) == ("none", "fc_out@norm=none")
    assert "raw target features" in cause.message
    assert names.KEY_EAGLE3_NORM_BEFORE_FC in cause.message and names.T_ENC_NORM in cause.message


def test_an_added_encoder_norm_is_named_at_fc_out(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3")
    width = _tensor(d / "draft.gguf", names.T_FC).shape[1]  # 3 * n_embd_tgt
    bad = rewrite_gguf(
        d / "draft.gguf", tmp_path / "draft-norm.gguf",
        keys={names.KEY_EAGLE3_NORM_BEFORE_FC: True}, tensors={names.T_ENC_NORM: np.ones(width, np.float32)},
    )  # fmt: skip
    errors = _errors(d, bad, tmp_path)
    assert [(f.kind, f.tensor) for f in errors] == [
        ("unexpected_tensor", names.EAGLE3_ENC_INPUT_NORM),
        ("wrong_source", names.EAGLE3_FC_OUT),
    ]
    cause = _cause(errors)
    assert (cause.fields["source"], cause.fields["candidate"]) == ("unit", "fc_out@norm=unit")
    assert names.KEY_EAGLE3_NORM_BEFORE_FC in cause.message and "raw features" in cause.message


# --- 3. d2t written as the checkpoint's offsets ----------------------------------------------


def test_d2t_written_as_offsets_is_a_wrong_source_of_result_output(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3")
    ids = _tensor(d / "draft.gguf", names.T_D2T).reshape(-1)  # (n_vocab_draft,) absolute, as converted
    offsets = ids - np.arange(ids.size)  # the checkpoint's d2t: sorted ids, so in 0 .. n_vocab - 1
    assert np.unique(offsets).size < offsets.size  # consecutive ids share an offset: several rows race for it
    bad = _with_d2t(d / "draft.gguf", tmp_path / "draft-offsets.gguf", offsets)
    errors = _errors(d, bad, tmp_path)
    first = errors[0]
    assert (first.kind, first.tensor) == ("wrong_source", names.RESULT_OUTPUT), first.message
    assert (first.fields["source"], first.fields["candidate"]) == ("offsets", "result_output@d2t=offsets")
    assert "absolute target ids" in first.message and "offset + row index" in first.message
    assert [f.kind for f in errors] == ["wrong_source"]  # every later batch's logits: the same fault


# --- 4. own embeddings dropped -----------------------------------------------------------------


def test_dropped_own_embeddings_read_the_targets_table(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3-own-embd")
    bad = rewrite_gguf(d / "draft.gguf", tmp_path / "draft-no-embd.gguf", tensors={names.T_TOKEN_EMBD: DROP})
    errors = _errors(d, bad, tmp_path)
    first = errors[0]
    assert (first.kind, first.tensor) == ("wrong_source", names.INP_EMBD), first.message
    assert (first.fields["source"], first.fields["candidate"]) == ("target", "inp_embd@table=target")
    assert [f.kind for f in errors] == ["wrong_source"]
