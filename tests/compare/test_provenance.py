"""compare checks first that its two dumps are a reference and a run of the same models and
prompt (featdiff.diff.provenance), on crafted manifests: the arguments swapped, another target or
drafter (told by what a conversion keeps, not by path or sha256 alone), a reference that followed
another run, one that replayed another prompt; and what it must let through: a HF checkpoint
against its own GGUF, a quantized target, a reference guided by the run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from featdiff.diff.provenance import provenance_problem
from featdiff.dump.manifest import Manifest
from featdiff.dump.manifest_fields import ModelInfo
from featdiff.dump.records import Round

REF, RUN = Path("ref.npz"), Path("run.npz")
PROMPT = (1, 5, 9, 4)
TARGET = ModelInfo("/m/target.gguf", "a" * 64, "qwen3", 4, 64, 256, ("f32",))
TARGET_HF = replace(TARGET, path="/m/target-hf", sha256="b" * 64)
DRAFT = ModelInfo("/m/draft.gguf", "c" * 64, "dflash-draft", 1, 64, 256, ("f32",), (2, 3), 4, 255)
DRAFT_HF = replace(DRAFT, path="/m/draft-hf", sha256="d" * 64, architecture="")
ROUNDS = (Round(1, 3, 4, (7, 8), 1, (7, 2)), Round(2, 5, 2, (6, 6), 0, (3,)))


def _manifest(source: str, target: ModelInfo = TARGET, draft: ModelInfo = DRAFT, **changes) -> Manifest:
    m = Manifest(
        source=source,
        models={"target": target.to_json(), "draft": draft.to_json()},
        build={},
        evals=(),
        records=(),
        rounds=ROUNDS,
        prompt_tokens=PROMPT,
    )
    return replace(m, **changes)


def _run(**changes) -> Manifest:
    return _manifest("llama.cpp", **changes)


def _ref(**changes) -> Manifest:
    return _manifest("reference", **changes)


def test_a_reference_of_the_runs_own_files_and_prompt_passes():
    assert provenance_problem(REF, RUN, _ref(), _run()) is None


def test_a_checkpoint_against_its_own_ggufs_passes_though_their_sha256_differ():
    assert provenance_problem(REF, RUN, _ref(target=TARGET_HF, draft=DRAFT_HF), _run()) is None


def test_a_quantized_target_or_a_drafter_exported_with_other_keys_passes():
    quantized = replace(TARGET, path="/m/target-q8.gguf", sha256="e" * 64, weight_types=("q8_0",))
    faulty = replace(DRAFT, path="/m/layers-minus1.gguf", sha256="f" * 64, target_layers=(1, 2))
    assert provenance_problem(REF, RUN, _ref(), _run(target=quantized, draft=faulty)) is None


def test_swapped_arguments_are_named_with_the_command_in_the_right_order():
    said = provenance_problem(RUN, REF, _run(), _ref())
    assert said is not None and "the reference comes first" in said
    assert said.endswith(f"`featdiff compare {REF} {RUN}`")


def test_another_target_gguf_is_named_by_what_differs_and_sha256():
    other = replace(TARGET, path="/x/target.gguf", sha256="9" * 64, architecture="llama", n_layer=6)
    said = provenance_problem(REF, RUN, _ref(target=other), _run())
    assert said is not None and "different models (architecture llama vs qwen3)" in said
    assert "sha256 999999999999" in said and "sha256 aaaaaaaaaaaa" in said
    assert f"`featdiff reference --target {TARGET.path} --model {DRAFT.path} --follow {RUN} -o {REF}`" in said


def test_an_mtp_targets_checkpoint_counts_no_nextn_layer_and_passes():
    """A GGUF's block_count counts the MTP head's layer; the HF config's num_hidden_layers does not."""
    assert provenance_problem(REF, RUN, _ref(target=replace(TARGET_HF, n_layer=3)), _run()) is None


def test_a_target_of_another_width_is_another_model():
    said = provenance_problem(REF, RUN, _ref(target=replace(TARGET_HF, n_embd=128)), _run())
    assert said is not None and "different models (n_embd 128 vs 64)" in said


def test_the_same_file_under_another_path_is_the_same_model():
    moved = replace(TARGET, path="/elsewhere/t.gguf", architecture="llama")  # same sha256: same bytes
    assert provenance_problem(REF, RUN, _ref(target=moved), _run()) is None


def test_a_checkpoint_of_another_width_is_another_drafter():
    other = replace(DRAFT_HF, n_embd=128)
    said = provenance_problem(REF, RUN, _ref(draft=other), _run())
    assert said is not None and "different models (n_embd 128 vs 64)" in said and "--model /m/draft.gguf" in said


def test_a_reference_that_followed_another_run_is_named():
    said = provenance_problem(REF, RUN, _ref(build={"follow": "other.npz"}, prompt_tokens=(1, 5, 8)), _run())
    assert said is not None and "followed another run (other.npz)" in said
    assert "3 vs 4 prompt tokens, first different at position 2" in said
    assert f"--follow {RUN} -o {REF}`" in said


def test_a_followed_run_of_the_same_prompt_but_other_rounds_is_named():
    other = (Round(1, 3, 4, (7, 8), 2, (7, 8, 1)), Round(2, 6, 1, (2, 2), 0, (5,)))
    said = provenance_problem(REF, RUN, _ref(build={"follow": "other.npz"}, rounds=other), _run())
    assert said is not None and "the same 4 prompt tokens, other rounds" in said


def test_a_reference_that_followed_this_run_passes():
    assert provenance_problem(REF, RUN, _ref(build={"follow": str(RUN)}, rounds=ROUNDS[:1]), _run()) is None


def test_another_prompt_around_a_program_suggests_follow_first():
    run = _run(build={"command": ["llama-server", "-m", "t.gguf"]}, prompt_tokens=(0,) + PROMPT)
    said = provenance_problem(REF, RUN, _ref(), run)
    assert (
        said is not None
        and "replayed another prompt than" in said
        and "3 vs 4 tokens before the first draft, first different at position 0" in said
    )
    assert said.endswith(f"--follow {RUN} -o {REF}`")


def test_another_prompt_in_process_is_left_to_the_unpaired_finding():
    assert provenance_problem(REF, RUN, _ref(prompt_tokens=(1, 5)), _run()) is None


def test_a_first_anchor_a_driver_fault_changed_is_not_another_prompt():
    run = _run(build={"command": ["llama-speculative-simple"]}, prompt_tokens=PROMPT[:-1] + (175,))
    assert provenance_problem(REF, RUN, _ref(), run) is None


def test_a_run_that_drafted_early_under_a_fault_is_not_another_prompt():
    run = _run(build={"command": ["llama-speculative-simple"]}, prompt_tokens=PROMPT[:-1])  # inject-twice
    assert provenance_problem(REF, RUN, _ref(), run) is None


def test_a_run_that_decoded_one_token_more_than_the_reference_suggests_follow():
    run = _run(build={"command": ["llama-server"]}, prompt_tokens=PROMPT + (7,))  # the first sampled token
    said = provenance_problem(REF, RUN, _ref(), run)
    assert said is not None and f"--follow {RUN}" in said


def test_a_prompt_with_cached_positions_is_not_judged():
    run = _run(build={"command": ["llama-server"]}, prompt_tokens=(-1, 5, 9, 4))
    assert provenance_problem(REF, RUN, _ref(), run) is None


# ---------------------------------------------------------------- end to end, on real dumps

OTHER_TOKENS = "7,21,3,99,140,5,260,33,18,402,77,10"  # real_flow.DEFAULT_TOKENS with another last but one


def _compare(ref: Path, run: Path):
    from typer.testing import CliRunner

    from featdiff.cli import app

    return CliRunner().invoke(app, ["compare", str(ref), str(run)])


def _one_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


def test_a_checkpoints_reference_of_the_run_is_compared_not_refused(captured, referenced):
    result = _compare(referenced("clean"), captured("clean"))
    assert result.exit_code == 0, result.output


def test_swapped_dumps_exit_2_naming_the_right_order(captured, referenced):
    ref, run = referenced("clean"), captured("clean")
    line = _one_line(_compare(run, ref))
    assert "the reference comes first" in line and f"featdiff compare {ref} {run}" in line


def test_a_reference_of_another_target_exits_2_naming_the_runs_target(captured, referenced, fixture_models):
    run = captured("clean")
    line = _one_line(_compare(referenced("llama"), run))
    assert "architecture llama vs qwen3" in line
    assert f"--target {fixture_models('clean') / 'target.gguf'}" in line and f"--follow {run}" in line


def test_a_reference_that_followed_another_run_exits_2_and_its_command_works(captured, tmp_path, fixture_models):
    from featdiff.torchref.dflash.run import reference

    d = fixture_models("clean")
    options = dict(prompt=None, tokens=None, rounds=1, dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None)
    other = reference(d / "target.gguf", d / "draft-hf", tmp_path / "other.npz", follow=captured("clean"), **options)
    run = captured("clean", tokens=OTHER_TOKENS)
    line = _one_line(_compare(other, run))
    assert "followed another run" in line and f"--follow {run}" in line
    fixed = reference(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run, **options)
    assert _compare(fixed, run).exit_code == 0  # the command it names makes a reference that compares


def test_a_program_stopped_before_its_first_draft_is_the_same_prompt():
    """llama-server answering 500 at its first inject (inject-pos): no round, the same prompt."""
    run = _run(build={"command": ["llama-server"]}, rounds=())
    assert provenance_problem(REF, RUN, _ref(), run) is None
