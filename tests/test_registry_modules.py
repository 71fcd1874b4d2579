"""Every drafter kind's lazily imported modules resolve (issue 43): the registry names its stage
modules by dotted path (`DrafterKind.driver`, `.reference`), which tests/test_layout.py cannot see, so a
moved or renamed module would otherwise fail only when a run of that kind reaches it."""

from __future__ import annotations

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
