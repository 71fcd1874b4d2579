"""The Qwen3.5 family (llama.cpp's qwen35, a hybrid recurrent target) through transformers' model
code (issue 24): a tiny Qwen3.5 text model with gated delta-net layers and a full-attention layer
every third, partial interleaved M-RoPE, converted by the pinned converter, with the fixtures'
DFlash drafter, whose taps (layers 2 and 4) read one layer of each kind.

A rejected draft must leave nothing in the recurrent state: llama.cpp rolls it back through the
per-token snapshots its target context keeps (n_rs_seq, which the in-process flow sets as
upstream's common.cpp does), the reference by replaying the accepted rows' history only. The
pair compares clean in-process and around llama-server, `featdiff check` passes, and a drafter
tapping a linear-attention layer's input for a full-attention one is named a layer offset."""

from __future__ import annotations

import json

import pytest
import torch

import featdiff
from featdiff.core import names
from featdiff.factory.hf_families import QWEN35_ROPE, qwen35_layer_types
from featdiff.factory.hf_targets import write_family_fixture
from featdiff.torchref.hf_target import (
    HfTarget,
    kept_rejected_candidates,
    kept_rejected_state,
    target_from_transformers,
)
import families
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS, reference_of

pytestmark = pytest.mark.slow  # the pair is converted (cached per machine)
PROMPT = tuple(int(t) for t in DEFAULT_TOKENS.split(","))
QWEN35_EMBD = "model.input_embed"  # qwen35.cpp's name for the target's embeddings (embd elsewhere)
FULL, LINEAR = "full_attention", "linear_attention"
# rel L2 of a layer input, the reference's cached forward (prefill, a rejected block rolled back,
# the accepted rows) vs transformers' eager forward over the whole sequence at once: float32 op
# order only (chunked delta rule over the history vs over the whole), measured <= 5.0e-7 on one
# machine and 1.15e-6 on a Xeon with AVX-512 and AMX (torch's CPU kernels differ); as Nemotron-H's,
# 1e-5 leaves that noise 8x and still sits 10^4 below a state that kept the rejected rows (0.64)
EAGER_BOUND = 1e-5
# rel L2 at layer 1's input when the rejected block's recurrent state is kept (measured 0.64):
# far above numeric noise, so a state that kept rejected rows could not pass as noise
KEPT_STATE_MIN = 1e-1


@pytest.fixture(scope="session")
def qwen35(tmp_path_factory):
    """The tiny Qwen3.5 pair, converted by the pinned tree's converter (made once)."""
    return write_family_fixture(tmp_path_factory.mktemp("fam-qwen35"), "qwen35")


def test_fixture_is_hybrid_and_the_drafter_taps_both_kinds(qwen35):
    from gguf import GGUFReader

    config = json.loads((qwen35 / "target-hf" / names.HF_CONFIG).read_text())
    kinds = config["layer_types"]
    assert config["model_type"] == "qwen3_5_text" and kinds == qwen35_layer_types(config["num_hidden_layers"])
    g = GGUFReader(str(qwen35 / "target.gguf"))
    assert g.fields["general.architecture"].contents() == "qwen35"
    assert g.fields["qwen35.full_attention_interval"].contents() == kinds.index(FULL) + 1
    assert g.fields["qwen35.rope.dimension_sections"].contents()[:3] == QWEN35_ROPE["mrope_section"]
    tensors = {t.name for t in g.tensors}
    assert {"blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.2.attn_q.weight"} <= tensors
    assert "blk.2.ssm_a" not in tensors  # layer 2 is full attention
    # the drafter, converted against this M-RoPE target, gets its degenerate sections: every
    # rotary pair of its 16-wide heads in the first
    d = GGUFReader(str(qwen35 / "draft.gguf"))
    assert list(d.fields["dflash.rope.dimension_sections"].contents()) == [8, 0, 0, 0]
    layers = families.draft_layers(qwen35 / "draft.gguf")
    assert [kinds[L] for L in layers] == [FULL, LINEAR]  # the planted offset reads the other kind
    assert kinds[layers[0] + 1] == LINEAR
    hf = target_from_transformers(qwen35 / "target-hf", torch.float32, torch.device("cpu"))
    assert isinstance(hf, HfTarget) and hf.hparams.arch == "qwen35"


def test_rolled_back_recurrent_state_equals_transformers_eager(qwen35):
    """The flow's cache (prefill, a rejected block rolled back, the accepted rows) through the
    reference equals transformers' eager forward over the whole sequence; keeping the rejected
    block's state does not."""
    from featdiff.torchref.attention import truncated
    from featdiff.torchref.hf_target import forward_hf

    rb = families.rolled_back_passes(qwen35, PROMPT)
    hf, tokens, n, cache, rejected, got = rb.hf, rb.tokens, rb.n, rb.prefill, rb.rejected, rb.got
    rejected_block, want, hp = torch.tensor(families.REJECTED_BLOCK), rb.want.hidden_states, rb.hf.hparams
    with torch.no_grad():
        # the rejected rows' recurrent history kept, the attention cells dropped (a memory that
        # rolled back its attention and position only: the `@recurrent=kept_rejected` candidates)
        kept_state = kept_rejected_state(hf, rejected.cache, n)
        assert kept_state is not None and kept_rejected_state(hf, got.cache, len(tokens)) is None  # nothing rejected
        kept = forward_hf(hf, tokens[n:], torch.arange(n, len(tokens)), kept_state, True)
        candidates = kept_rejected_candidates(hf, tokens[n:], torch.arange(n, len(tokens)), kept_state)
        # a block of which the first two rows are accepted: the state rolls back to mid-block
        partial_block = torch.cat([tokens[n : n + 2], rejected_block[:2]])
        partial = forward_hf(hf, partial_block, torch.arange(n, n + 4), cache, True)
        rest = forward_hf(hf, tokens[n + 2 :], torch.arange(n + 2, len(tokens)), truncated(partial.cache, n + 2), True)
    for il in range(hp.n_layer):  # hidden_states[n_layer] is after the final norm
        assert families.rel(want[il][0, n:], got.layer_inputs[il]) <= EAGER_BOUND, il
        assert families.rel(want[il][0, n + 2 :], rest.layer_inputs[il]) <= EAGER_BOUND, il
    assert families.rel(want[1][0, n:], kept.layer_inputs[1]) > KEPT_STATE_MIN  # layer 0 is recurrent
    # a candidate for every layer from the first recurrent one (layer 0) on, each that layer's output
    assert [c.name for c in candidates] == [f"l_out-{il}@{names.HYP_RECURRENT_KEPT}" for il in range(hp.n_layer)]
    assert torch.equal(candidates[0].array, kept.layer_inputs[1])


def test_qwen35_recurrent_state_that_kept_the_rejected_drafts_is_named(qwen35, tmp_path, monkeypatch):
    f = families.assert_recurrent_kept_rejected_named(qwen35, tmp_path, monkeypatch)
    assert f["tensor"].startswith(names.L_OUT + "-")


def test_qwen35_pair_compares_clean_with_nothing_skipped(qwen35, tmp_path):
    from featdiff.dump.reader import read_dump

    result = families.assert_clean_in_process(qwen35, tmp_path, embd=QWEN35_EMBD)
    with read_dump(result["run"]) as dump:
        rounds = dump.manifest.rounds
    # rows were rejected: the target's recurrent state was rolled back within a verify block
    assert any(r.accepted < len(r.drafts) for r in rounds), rounds


def test_qwen35_one_draft_blocks_roll_back_one_row_and_compare_clean(qwen35, tmp_path):
    """With one draft per block llama.cpp keeps one state snapshot (n_rs_seq 1) and each rejected
    draft rolls back through it: the shallowest rollback, where the 3-draft flow above takes the
    deepest (the tiny drafter's drafts are all rejected)."""
    from featdiff.dump.reader import read_dump

    run = featdiff.capture(
        qwen35 / "target.gguf",
        qwen35 / "draft.gguf",
        tmp_path / "run.npz",
        tokens=DEFAULT_TOKENS,
        rounds=DEFAULT_ROUNDS,
        draft_max=1,
        filters=["*"],
    )
    rounds = read_dump(run).manifest.rounds
    assert all(len(r.drafts) == 1 for r in rounds) and any(r.accepted == 0 for r in rounds), rounds
    ref = reference_of(qwen35 / "target-hf", qwen35 / "draft.gguf", tmp_path / "ref.npz", follow=run)
    result = featdiff.compare(ref, run).to_json()
    assert result["ok"] and result["first_divergence"] is None, result["findings"]
    cov = result["coverage"]
    assert (cov["pairs_skipped"], cov["rows_skipped"], cov["ref_only"]) == (0, 0, 0), cov


# ---------------------------------------------------------------- around llama-server, check, a planted fault


def test_qwen35_pair_around_llama_server_compares_clean(qwen35, tools, tmp_path):
    families.assert_clean_around_server(qwen35, tools, tmp_path)


def test_qwen35_check_passes_and_its_accept_agrees(qwen35, tmp_path):
    families.assert_check_passes(qwen35, tmp_path)


def test_qwen35_linear_layer_tapped_for_a_full_attention_one_is_a_layer_offset(qwen35, tools, tmp_path):
    """The drafter's slot 0 reads the full-attention layer 2's input; planted one higher, it
    reads the gated delta-net layer 3's: named as the offset it is."""
    kinds = json.loads((qwen35 / "target-hf" / names.HF_CONFIG).read_text())["layer_types"]
    f = families.assert_layer_offset_named(qwen35, tools, tmp_path)
    assert (kinds[f["expected_layer"]], kinds[f["observed_layer"]]) == ("full_attention", "linear_attention")


def test_qwen35_slots_reversed_is_a_slot_permutation(qwen35, tools, tmp_path):
    """Slot 0 reading the gated delta-net layer's input and slot 1 the full-attention one's."""
    families.assert_slots_reversed_named(qwen35, tools, tmp_path)


def test_qwen35_target_that_cannot_roll_back_is_refused_by_name(qwen35, tmp_path, monkeypatch):
    """A target context without recurrent-state snapshots (n_rs_seq 0: a build whose
    llama_context_params lacks the field) refuses the partial seq_rm of the rejected rows
    (llama-memory-recurrent.cpp); the flow stops with exit 2 naming that, never verifying on the
    rejected rows' state."""
    from typer.testing import CliRunner

    from featdiff.cli import app
    from featdiff.llama import runtime

    new = runtime.Context.new
    monkeypatch.setattr(runtime.Context, "new", staticmethod(lambda *a, **k: new(*a, **{**k, "n_rs_seq": 0})))
    args = ["capture", "--target", str(qwen35 / "target.gguf"), "--model", str(qwen35 / "draft.gguf")]
    args += ["-o", str(tmp_path / "run.npz"), "--tokens", DEFAULT_TOKENS, "--rounds", str(DEFAULT_ROUNDS)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "could not roll the target's recurrent state back" in result.output, result.output
    assert str(qwen35 / "target.gguf") in result.output


def test_published_qwen35_layout_runs_the_same_text_model(qwen35, tmp_path):
    """Qwen3.5 is published image-text-to-text (model_type qwen3_5: the text model under
    `model.language_model.`, an MTP head beside it): the reference runs its text model, the very
    one the text-only directory holds."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config

    from featdiff.torchref.attention import empty_cache
    from featdiff.torchref.hf_target import forward_hf

    text = json.loads((qwen35 / "target-hf" / names.HF_CONFIG).read_text())
    published = tmp_path / "published"
    Qwen3_5Config(text_config=text).save_pretrained(published)
    weights = load_file(next((qwen35 / "target-hf").glob("*.safetensors")))
    renamed = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in weights.items()
    }
    renamed["mtp.fc.weight"] = torch.zeros(text["hidden_size"], 2 * text["hidden_size"])  # transformers skips mtp.*
    save_file(renamed, published / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((published / names.HF_CONFIG).read_text())["model_type"] == "qwen3_5"
    got, want = (
        target_from_transformers(p, torch.float32, torch.device("cpu")) for p in (published, qwen35 / "target-hf")
    )
    assert got.hparams == want.hparams and got.hparams.arch == "qwen35"
    hp = want.hparams
    with torch.no_grad():
        a, b = (
            forward_hf(
                t,
                torch.tensor(PROMPT),
                torch.arange(len(PROMPT)),
                empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, "f16", torch.device("cpu")),
                True,
            )
            for t in (got, want)
        )
    assert all(torch.equal(x, y) for x, y in zip(a.layer_inputs, b.layer_inputs, strict=True))
