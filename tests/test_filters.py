"""The capture filter model (featdiff.core.filters): one parser of `--filter`, one record, and the
forms it is written in (the manifest, the shim, the preload's environment)."""

from __future__ import annotations

import pytest

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.filters import (
    KEEP_ALL,
    MAX_GLOBS,
    ROLE_IDS,
    FilterSet,
    RoleFilter,
    capture_filters,
    default_specs,
    parse_filters,
)
from featdiff.dump.manifest import Build


def test_role_prefix_limits_a_glob_and_a_bang_excludes():
    fs = parse_filters(["l_out-*", "!l_out-0", "draft:Qcur-*", "!target:embd", "blk.0:x"])
    assert fs.draft == RoleFilter(include=("l_out-*", "Qcur-*", "blk.0:x"), exclude=("l_out-0",))
    assert fs.target == RoleFilter(include=("l_out-*", "blk.0:x"), exclude=("l_out-0", "embd"))
    assert fs.keeps("draft", "l_out-1") and not fs.keeps("draft", "l_out-0") and not fs.keeps("target", "Qcur-0")


@pytest.mark.parametrize("spec", ["drafter:*", "!targets:l_out-*", "Draft:Qcur-*"])
def test_a_prefix_spelled_like_a_role_but_no_role_is_refused(spec):
    """A typo of a role would be a glob on both roles that matches nothing: an empty capture."""
    head = spec.removeprefix("!").split(":")[0]
    with pytest.raises(InputError) as e:
        parse_filters(["l_out-*", spec])
    assert str(e.value) == (
        f"--filter {spec!r}: unknown role {head!r}; roles are target, draft (or drop the prefix for both)"
    )


def test_a_prefix_that_is_no_word_stays_part_of_the_glob():
    fs = parse_filters(["*:x", "l_out-0:*"])
    assert fs.target == fs.draft == RoleFilter(include=("*:x", "l_out-0:*"))


def test_manifest_form_keeps_the_exclusions_and_reads_back():
    fs = capture_filters(["l_out-*", "!l_out-0"])
    written = fs.to_json()
    assert written["draft"] == ["l_out-*", "!l_out-0", names.EXCLUDE_DERIVED]
    assert FilterSet.from_json(written) == fs
    assert Build.from_json({"filters": written}).filters == fs


def test_old_manifest_filters_still_read():
    old = FilterSet.from_json({"draft": ["inp_noise_embd"], "target": ["*"]})  # before exclusions were kept
    assert old.keeps("draft", "inp_noise_embd") and not old.keeps("draft", "l_out-0") and old.keeps("target", "x")
    first = FilterSet.from_json(["l_out-*"])  # the first form: one list for both roles
    assert first.keeps("target", "l_out-3") and first.keeps("draft", "l_out-0") and not first.keeps("draft", "embd")
    assert FilterSet.from_json(None) == KEEP_ALL == Build.from_json({}).filters


def test_shim_and_preload_forms_are_the_c_side_format():
    fs = capture_filters(["draft:Qcur-*", "!Qcur-1"])
    assert fs.shim_globs() == {
        ROLE_IDS["target"]: ["!Qcur-1", names.EXCLUDE_DERIVED],
        ROLE_IDS["draft"]: ["Qcur-*", "!Qcur-1", names.EXCLUDE_DERIVED],
    }
    lines = fs.env_lines().splitlines()  # native/featdiff_preload.c: "<role id>\t<glob>"
    assert "1\tQcur-*" in lines and "0\t!Qcur-1" in lines and all(line.split("\t")[0] in ("0", "1") for line in lines)


def test_derived_names_are_excluded_unless_a_glob_names_them():
    assert not capture_filters(None).keeps("draft", "l_out-0 (view)")
    assert capture_filters(["* (view)"]).keeps("draft", "l_out-0 (view)")


def test_default_keeps_the_tapped_layers_and_the_drafter_wiring():
    fs = capture_filters(None, (2, 4))
    assert fs.keeps("target", "l_out-1") and fs.keeps("target", "l_out-3") and not fs.keeps("target", "l_out-2")
    assert all(fs.keeps("draft", n) for n in (names.INP_TARGET_FEATURES, "Kcur_injected-0", names.RESULT_OUTPUT))
    assert capture_filters(None).keeps("target", names.INP_POS) and names.INP_POS in default_specs()[-1]


def test_too_many_globs_for_the_shim_is_an_input_error():
    with pytest.raises(InputError, match=f"at most {MAX_GLOBS}"):
        parse_filters([f"x{i}" for i in range(MAX_GLOBS + 1)])
