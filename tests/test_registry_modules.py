"""Every drafter kind's lazily imported modules resolve (issue 43): the registry names its stage
modules by dotted path (`DrafterKind.driver`, `.reference`), which tests/test_layout.py cannot see, so a
moved or renamed module would otherwise fail only when a run of that kind reaches it."""

from __future__ import annotations

import importlib

import pytest

from featdiff.kinds import KINDS

# what each stage calls on a kind's module (the registry's docstring)
DRIVER_API = ("flow_config", "enable", "run_flow")
REFERENCE_API = ("reference", "load_pair_draft", "probe_round")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_driver_module_resolves(kind):
    module = kind.driver_module()
    assert module.__name__.startswith("featdiff.driver.")
    assert [f for f in DRIVER_API if not callable(getattr(module, f, None))] == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_reference_module_resolves(kind):
    module = kind.reference_module()
    assert module.__name__.startswith("featdiff.torchref.")
    assert [f for f in REFERENCE_API if not callable(getattr(module, f, None))] == []


def test_every_kind_has_its_own_entry():
    assert len({k.name for k in KINDS}) == len(KINDS)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_checks_resolve_to_a_table_of_checks_and_severities(kind):
    table = kind.check_table()
    assert table, kind.checks
    assert all(callable(check) and severity in ("fatal", "advisory", "unmodelled") for check, severity in table)


def test_each_mtp_checkpoint_family_has_its_head_and_its_layers_key():
    """kinds/mtp.py tells a checkpoint with a head by model_type; torchref/mtp/hf.py says where its
    head is: one family list, one layers key each."""
    from featdiff.kinds.mtp import MTP_LAYERS_KEY
    from featdiff.torchref.mtp.hf import HF_HEADS

    assert {t: h.layers_key for t, h in HF_HEADS.items()} == MTP_LAYERS_KEY


def test_a_checkpoint_is_told_by_the_kind_that_claims_it():
    from featdiff.kinds import of_checkpoint

    assert of_checkpoint({"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1}).name == "mtp"
    assert of_checkpoint({"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 0}).name == "dflash"
    assert of_checkpoint({"draft_vocab_size": 64, "num_hidden_layers": 1}).name == "eagle3"
    assert of_checkpoint({"draft_vocab_size": 64, "num_hidden_layers": 2}).name == "dflash"


@pytest.mark.parametrize("kind", [k for k in KINDS if k.unread is not None], ids=lambda k: k.name)
def test_unread_resolves_to_a_function_of_the_kinds_reference(kind):
    module, _, attr = kind.unread.partition(":")
    function = getattr(importlib.import_module(f"featdiff.torchref.{module}"), attr, None)
    assert callable(function), kind.unread
    assert module.split(".")[0] == kind.reference.split(".")[0]  # the kind's own reference package
