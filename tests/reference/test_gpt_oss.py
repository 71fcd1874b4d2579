"""The gpt-oss family (llama.cpp's openai-moe) through transformers' model code (issue 24): a tiny
GptOss target with attention sinks, a sliding window on its even layers that the tests' prompt
outgrows, gpt-oss-20b's YaRN, biased experts behind the clamped swiglu and a softmax over the
top-k router logits, converted by the pinned converter, with the fixtures' DFlash drafter. Its
converted pair compares clean in-process and around llama-server (also once llama.cpp reuses the
sliding layers' cells), `featdiff check` passes, and a drafter tapping the layers one too high
is named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from featdiff.core import names
from featdiff.factory.hf_families import GATE_UP_GAIN, GPT_OSS_ROPE, SLIDING_WINDOW
from featdiff.factory.hf_targets import write_family_fixture
from featdiff.torchref.hf_target import HfTarget, target_from_transformers
import families
from real_flow import DEFAULT_TOKENS

pytestmark = pytest.mark.slow  # the pair is converted (cached per machine)
PROMPT = tuple(int(t) for t in DEFAULT_TOKENS.split(","))
SWIGLU_LIMIT = 7.0  # llama-graph.cpp LLM_FFN_SWIGLU_OAI_MOE's limit, and GptOssConfig's default
# rel L2 of a layer input, the reference's cached windowed forward vs transformers' eager
# attention over the whole sequence at once (f32 cache): float32 op order only, measured <= 1.3e-7
EAGER_BOUND = 1e-6
# rel L2 at the first sliding layer's output when the reference ignores the window (measured 0.14):
# far above numeric noise, so a window llama.cpp did not apply could not pass as noise
NO_WINDOW_MIN = 1e-2


@pytest.fixture(scope="session")
def gpt_oss(tmp_path_factory):
    """The tiny gpt-oss pair, converted by the pinned tree's converter (made once)."""
    return write_family_fixture(tmp_path_factory.mktemp("fam-gpt-oss"), "gpt-oss")


def test_fixture_runs_what_llama_cpp_must_reproduce(gpt_oss):
    """Sinks, the window (outgrown by the prompt), YaRN, expert biases, gates past the swiglu clamp."""
    from gguf import GGUFReader

    config = json.loads((gpt_oss / "target-hf" / names.HF_CONFIG).read_text())
    assert config["model_type"] == "gpt_oss" and config["sliding_window"] == SLIDING_WINDOW < len(PROMPT)
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]  # llama.cpp's swa pattern 2
    g = GGUFReader(str(gpt_oss / "target.gguf"))
    assert g.fields["general.architecture"].contents() == "gpt-oss"
    assert g.fields["gpt-oss.attention.sliding_window"].contents() == SLIDING_WINDOW
    assert g.fields["gpt-oss.rope.scaling.type"].contents() == "yarn"  # gpt-oss-20b's RoPE
    assert g.fields["gpt-oss.rope.scaling.factor"].contents() == GPT_OSS_ROPE["factor"]
    tensors = {t.name for t in g.tensors}
    assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_exps.bias", "blk.0.ffn_gate_inp.bias"} <= tensors
    hf = target_from_transformers(gpt_oss / "target-hf", torch.float32, torch.device("cpu"))
    assert isinstance(hf, HfTarget) and hf.hparams.arch == "gpt-oss"
    assert (hf.hparams.n_swa, hf.hparams.swa_layers[:2]) == (SLIDING_WINDOW, (True, False))
    gates: list[torch.Tensor] = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, a: gates.append(a[0] @ m.gate_up_proj[0][:, ::2]))
        for layer in hf.model.get_decoder().layers
    ]
    with torch.no_grad():
        hf.model(input_ids=torch.tensor([PROMPT]))
    for h in hooks:
        h.remove()
    assert GATE_UP_GAIN > 1 and max(float(x.max()) for x in gates) > SWIGLU_LIMIT  # the clamp binds


def test_cached_windowed_forward_equals_transformers_eager(gpt_oss):
    """The flow's cache through the ggml attention equals transformers' own eager attention over
    the whole sequence; ignoring the window does not."""
    families.assert_cached_forward_equals_eager(gpt_oss, PROMPT, EAGER_BOUND, NO_WINDOW_MIN)


def test_gpt_oss_pair_compares_clean_with_nothing_skipped(gpt_oss, tmp_path):
    families.assert_clean_in_process(gpt_oss, tmp_path)


# ---------------------------------------------------------------- around llama-server, check, a planted fault


def test_gpt_oss_pair_around_llama_server_compares_clean(gpt_oss, tools, tmp_path):
    families.assert_clean_around_server(gpt_oss, tools, tmp_path)


SWA_CACHE_CELLS = 256
SMALL_SWA_ARGS = ["-c", "512", "-ub", "16", "-b", "16"]


def test_gpt_oss_around_llama_server_reusing_swa_cells_compares_clean(gpt_oss, tools, tmp_path):
    from featdiff.diff import compare_dumps
    from featdiff.programs.exec import capture_exec

    g = torch.Generator().manual_seed(0)
    n_vocab = json.loads((gpt_oss / "target-hf" / names.HF_CONFIG).read_text())["vocab_size"]
    prompt = torch.randint(3, n_vocab - 1, (SWA_CACHE_CELLS + SLIDING_WINDOW,), generator=g)
    server = str(tools.program("llama-server"))
    args = [a for a in families.SERVER_ARGS if a not in ("-c", "256")] + SMALL_SWA_ARGS
    cmd = [server, "-m", str(gpt_oss / "target.gguf"), "-md", str(gpt_oss / "draft.gguf"), *args]
    tokens = ",".join(str(int(t)) for t in prompt)
    run = capture_exec(cmd, tmp_path / "run.npz", filters=["*"], tokens=tokens, timeout_s=families.RUN_TIMEOUT_S)
    comparison = compare_dumps(families.followed(gpt_oss, gpt_oss / "draft.gguf", run, tmp_path / "ref.npz"), run)
    result = comparison.to_json()
    assert comparison.ok and result["first_divergence"] is None, [f.message for f in comparison.findings]
    cov = result["coverage"]
    assert (cov["pairs_skipped"], cov["rows_skipped"], cov["ref_only"]) == (0, 0, 0), cov
    assert all(s["expected"] for s in cov["skipped"]), cov["skipped"]


def test_gpt_oss_check_passes_and_its_accept_agrees(gpt_oss, tmp_path):
    families.assert_check_passes(gpt_oss, tmp_path)


def test_gpt_oss_layers_off_by_one_is_a_layer_offset(gpt_oss, tools, tmp_path):
    families.assert_layer_offset_named(gpt_oss, tools, tmp_path)


def test_gpt_oss_hf_dir_without_its_sinks_exits_2(gpt_oss, tmp_path):
    """A checkpoint missing a tensor the model has (here layer 0's sinks) is refused before any
    reference: transformers alone would fill it with random values and only log it."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from featdiff.cli import app

    hf = shutil.copytree(gpt_oss / "target-hf", tmp_path / "t-hf")
    weights = next(hf.glob("*.safetensors"))
    w = load_file(weights)
    del w["model.layers.0.self_attn.sinks"]
    save_file(w, weights, metadata={"format": "pt"})
    args = ["reference", "--target", str(hf), "--model", str(gpt_oss / "draft.gguf"), "-o", str(tmp_path / "r.npz")]
    result = CliRunner().invoke(app, [*args, "--tokens", "1,2,3"])
    assert result.exit_code == 2, result.output
    assert "model.layers.0.self_attn.sinks" in result.output and str(hf) in result.output


def test_gpt_oss_gguf_as_reference_target_exits_2_asking_for_its_hf_dir(gpt_oss, tmp_path):
    from typer.testing import CliRunner

    from featdiff.cli import app

    args = ["reference", "--target", str(gpt_oss / "target.gguf"), "--model", str(gpt_oss / "draft.gguf")]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "r.npz"), "--tokens", "1,2,3"])
    assert result.exit_code == 2, result.output
    assert "'gpt-oss' runs through transformers" in result.output and "HF checkpoint directory" in result.output
