"""A sampled choice judged as a sample (issue 45): where the run sampled its target's tokens, a
token that is not the reference's argmax is no divergence when the sampler's chain (top-k, top-p,
min-p, as llama.cpp's common_sampler_init orders them) could draw it from the reference's logits,
within the noise bound on a margin; one it could not draw stays a divergence naming the sampler.
The sampler record itself round-trips through a dump's manifest, and a dump without it is greedy."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_near_tie import _with_logits

from featdiff.core.names import RESULT_OUTPUT
from featdiff.diff import compare_dumps, exit_code
from featdiff.diff.detectors import detect_divergence_by_margin
from featdiff.diff.diagnose import parting_findings
from featdiff.diff.partings import Parting, sampled_parting
from featdiff.dump.manifest import Manifest, flow_view
from featdiff.dump.reader import read_dump
from featdiff.dump.sampling import (
    DEFAULT_TEMPERATURE,
    Sampler,
    chain_probs,
    could_draw,
    expected_accepted,
    sampler_from_command,
)
from featdiff.dump.writer import DumpWriter
from featdiff.programs.sampler import flow_samplers, launched_requests

N_VOCAB = 64
DEFAULT = Sampler(flow=0, source="request")  # llama.cpp's defaults: temp 0.8, top-k 40, top-p 0.95, min-p 0.05


def _row(*top: float) -> np.ndarray:
    """Logits (N_VOCAB,): tokens 0.. carry `top`, the rest far below (-30)."""
    row = np.full(N_VOCAB, -30.0)
    row[: len(top)] = top
    return row


def test_a_token_the_chain_keeps_can_be_drawn_and_one_it_cuts_cannot():
    row = _row(5.0, 4.5, 4.0, 0.0)  # token 3: p/p_max = e^-5 < min-p 0.05
    assert could_draw(row, 1, DEFAULT, 0.0) and could_draw(row, 2, DEFAULT, 0.0)
    assert not could_draw(row, 3, DEFAULT, 0.0)
    assert could_draw(row, 3, replace(DEFAULT, min_p=0.0, top_p=1.0), 0.0)  # no cut but top-k 40
    assert not could_draw(row, 3, replace(DEFAULT, min_p=0.0), 0.0)  # top-p 0.95: 0.997 of the mass above it


def test_top_k_cuts_by_rank_and_the_slack_lifts_a_token_near_the_cut():
    row = _row(5.0, 4.9, 4.8, 4.7)
    top2 = replace(DEFAULT, top_k=2, top_p=1.0, min_p=0.0)
    assert could_draw(row, 1, top2, 0.0) and not could_draw(row, 2, top2, 0.0)
    assert could_draw(row, 2, top2, 0.15)  # within the noise bound of the second token


def test_top_p_keeps_tokens_while_the_mass_above_them_is_below_p():
    row = _row(math.log(0.6), math.log(0.3), math.log(0.1))  # probabilities 0.6, 0.3, 0.1
    top_p = replace(DEFAULT, top_k=0, min_p=0.0, top_p=0.8)
    assert could_draw(row, 1, top_p, 0.0)  # 0.6 above it
    assert not could_draw(row, 2, top_p, 0.0)  # 0.9 above it


def test_a_greedy_sampler_draws_the_argmax_alone():
    greedy = replace(DEFAULT, temperature=0.0)
    row = _row(5.0, 4.0)
    assert greedy.is_greedy and could_draw(row, 0, greedy, 0.0) and not could_draw(row, 1, greedy, 0.0)


def _parting(observed: int, margin: float, bound: float = 0.05) -> Parting:
    return Parting("verify", 3, 0, 40, 9, RESULT_OUTPUT, expected=0, observed=observed, margin=margin, bound=bound)


def test_a_sampled_token_in_the_support_is_no_parting_and_one_outside_is_a_divergence_naming_the_sampler():
    row = _row(5.0, 4.0, 0.0)
    assert sampled_parting(_parting(1, 1.0), row, DEFAULT) is None
    p = sampled_parting(_parting(2, 5.0), row, DEFAULT)
    assert p is not None and p.sampler == "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05"
    f = detect_divergence_by_margin(p)
    assert f is not None and f.severity == "error" and f.fields["observed"] == 2
    assert "its sampler (temperature 0.8, top-k 40" in f.message and "greedily" not in f.message


def test_a_chain_with_a_stage_featdiff_does_not_compute_does_not_judge_the_choice_and_says_so():
    row = _row(5.0, 4.0, 0.0)
    penalised = replace(DEFAULT, repeat_penalty=1.1)
    assert penalised.unmodelled == ("penalties",)
    p = sampled_parting(_parting(2, 5.0), row, penalised)
    assert p is not None and p.unmodelled == ("penalties",)
    (f,) = parting_findings((p,), explained=False)  # never the divergence a greedy reading gives
    assert (f.kind, f.severity, f.fields["names"], f.fields["role"]) == ("unmodelled", "info", ["penalties"], "target")
    assert "not judged" in f.message and "penalties not modelled" in f.message
    assert sampled_parting(_parting(1, 1.0), row, penalised) is not None  # even one the cuts keep: unjudged


def test_the_flags_set_the_sampler_and_the_defaults_are_llama_cpps():
    s = sampler_from_command(
        ["llama-server", "--temp", "0.5", "--top-k=20", "-s", "7", "--no-spec-draft-backend-sampling"]
    )
    assert (s.temperature, s.top_k, s.seed, s.draft_backend_sampling, s.source) == (0.5, 20, 7, False, "command_line")
    d = sampler_from_command(["llama-speculative-simple"])
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.draft_backend_sampling) == (
        DEFAULT_TEMPERATURE,
        40,
        0.95,
        0.05,
        True,
    )


def _launch(slot: int, chain: str, params: str, previous: str = "") -> str:
    """llama-server's trace log of one launch on `slot` (server-context.cpp launch_slot_with_task)."""
    head = f"0.01.254.504 D slot launch_slot_: id  {slot} | task -1 | "
    params_json = f',"params":{{{previous}}}' if previous else ""
    before = f'{{"id":{slot},"n_ctx":256{params_json}}}'
    return (
        f"{head}launching slot : {before}\n{head}sampler chain: logits -> {chain} -> dist \n{head}sampler params: \n"
        "\trepeat_last_n = 64, repeat_penalty = 1.000, frequency_penalty = 0.000, presence_penalty = 0.000\n"
        f"\t{params}\n\tmirostat = 0, mirostat_lr = 0.100, mirostat_ent = 5.000\n"
        "0.01.254.569 I slot launch_slot_: id  1 | task 0 | processing task, is_child = 0\n"
    )


_ACTIVE = "?penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> min-p -> ?xtc -> temp-ext"
SERVER_LOG = (
    _launch(1, _ACTIVE, "top_k = 40, top_p = 0.900, min_p = 0.100, typical_p = 1.000, temp = 0.800")
    + _launch(0, "top-k -> temp-ext", "top_k = 40, top_p = 1.000, min_p = 0.000, temp = 0.000")
    + _launch(1, _ACTIVE, "top_k = 40, top_p = 0.950, min_p = 0.050, temp = 0.700", previous='"seed":42')
    + "slot launch_slot_: id  1 | task 2 | launching slot : not json\n"
)


def test_each_flow_takes_the_request_llama_server_launched_on_its_slot_in_order():
    """The chain and parameters each launch logs are that request's; the seed, in the JSON a
    slot's next launch logs, the previous request's."""
    assert sorted(launched_requests(SERVER_LOG)) == [0, 1]
    found = flow_samplers(["llama-server", "--temp", "0.3"], {0: 1, 1: 0, 2: 1, 3: 1}, SERVER_LOG)
    assert [(s.flow, s.source, s.temperature) for s in found] == [
        (0, "request", 0.8),
        (1, "request", 0.0),
        (2, "request", 0.7),
        (3, "command_line", 0.3),  # no launch logged for a third request on slot 1: the server's flags
    ]
    assert (found[0].top_p, found[0].min_p, found[0].seed) == (0.9, 0.1, 42)
    assert found[2].seed == 4294967295  # the last request on its slot: no later launch wrote its seed
    assert found[0].samplers == ("top_k", "top_p", "min_p", "temperature")  # the active stages, in order
    assert [s.temperature for s in flow_samplers(["llama-speculative-simple"], {0: 0}, None)] == [DEFAULT_TEMPERATURE]
    assert flow_samplers(["llama-simple", "--temp", "0.8"], {0: 0}, None) == ()  # its own greedy chain


def _manifest(samplers: tuple[Sampler, ...]) -> Manifest:
    return Manifest(source="llama.cpp", models={}, build={}, evals=(), records=(), samplers=samplers)


def test_the_samplers_round_trip_and_a_dump_without_them_chose_greedily():
    m = _manifest((replace(DEFAULT, flow=0, top_p=0.9), replace(DEFAULT, flow=1, temperature=0.0)))
    back = Manifest.from_json(m.to_json())
    assert back.samplers == m.samplers
    assert back.sampler(0) == m.samplers[0] and back.sampler(1) is None  # temperature 0: greedy
    assert _manifest(()).sampler(0) is None and "samplers" not in _manifest(()).to_json()
    assert flow_view(back, 0).samplers == (m.samplers[0],)


@pytest.mark.parametrize("bad", [{"flow": 0, "source": "request", "top_k": "many"}, {"flow": 0, "source": "guess"}])
def test_a_bad_sampler_field_is_refused_by_path(bad):
    from featdiff.dump.manifest_fields import ManifestError

    with pytest.raises(ManifestError, match="samplers"):
        Manifest.from_json({**_manifest(()).to_json(), "samplers": [bad]})


def test_the_chain_draws_from_what_its_cuts_keep_at_its_temperature():
    row = _row(2.0, 1.0, -10.0)
    probs = chain_probs(row, replace(DEFAULT, temperature=0.5))
    assert probs[2] == 0.0 and probs[3:].sum() == 0.0  # cut by min-p
    assert probs[0] == pytest.approx(1 / (1 + math.exp(-2.0)))  # (2 - 1) / 0.5 apart
    assert chain_probs(row, replace(DEFAULT, temperature=0.0))[0] == 1.0


def test_the_expected_accepted_length_sums_the_chances_that_every_draft_so_far_agrees():
    assert expected_accepted([1.0, 1.0, 0.0]) == 2.0
    assert expected_accepted([0.5, 0.5]) == pytest.approx(0.5 + 0.25)
    assert expected_accepted([]) == 0.0


# --- compare of a synthetic pair whose verify token is a sample --------------------------------------

SAMPLED_ROUND = 2
LEADER = 117  # the reference's argmax at the sampled row (never a synth token: those are 10..59)


def _sampled_pair(src: Path, dst: Path, margin: float, samplers: tuple[Sampler, ...]) -> Path:
    """`src` with logits (test_near_tie._with_logits, no parting) where, at row 0 of round
    SAMPLED_ROUND's verify, LEADER leads the run's token by `margin` on both sides (so the run's
    token is a sample, not the argmax), and the manifest's `samplers`."""
    plain = _with_logits(src, dst.with_suffix(".plain.npz"), None)
    with read_dump(plain) as dump:
        m = dump.manifest
        verify = next(e.eval for e in m.evals if e.phase == "verify" and e.round == SAMPLED_ROUND)
        writer = DumpWriter(dst)
        for r in dump.records():
            a = np.array(dump.array(r))
            if (r.eval, r.name) == (verify, RESULT_OUTPUT):
                a[0, LEADER] = a[0].max() + margin  # (n_tokens, N_VOCAB)
            writer.add(r, a)
        return writer.close(replace(m, records=(), samplers=samplers))


@pytest.mark.parametrize(
    ("sampler", "is_error"),
    [(None, True), (DEFAULT, False), (replace(DEFAULT, top_k=1), True)],
    ids=["greedy", "sampled", "sampled-top-k-1"],
)
def test_compare_judges_a_sampled_verify_token_as_a_sample(synth_ref, synth_run, tmp_path, sampler, is_error):
    samplers = () if sampler is None else (sampler,)
    ref = _sampled_pair(synth_ref, tmp_path / "ref.npz", 1.0, ())
    run = _sampled_pair(synth_run(), tmp_path / "run.npz", 1.0, samplers)
    c = compare_dumps(ref, run)
    errors = [f for f in c.findings if f.severity == "error"]
    assert exit_code(c) == int(is_error), [f.message for f in c.findings]
    if is_error:
        (f,) = errors
        assert f.kind == "divergence" and f.fields["round"] == SAMPLED_ROUND and f.fields["expected"] == LEADER
        assert ("its sampler (" in f.message) == (sampler is not None)
