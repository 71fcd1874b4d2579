"""The tools build applies featdiff's patches of the pinned llama.cpp: the patched tree is the
pristine one plus the patches, only the files a patch change touches are rewritten (so the build
stays incremental), and a patch that does not apply is refused naming the file."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from featdiff.core.errors import InputError
from featdiff.llama.patches import PATCH_DIR, apply_patches, patch_files, patched_paths
from featdiff.llama.tools import BUILD_LOCK, _build_lock

PATCH = """a header line patch(1) ignores
--- a/src/a.c
+++ b/src/a.c
@@ -1,2 +1,2 @@
 int a;
-int b;
+int b = 1;
"""


def _trees(tmp_path):
    pristine, tree = tmp_path / "pristine", tmp_path / "tree"
    for root in (pristine, tree):
        (root / "src").mkdir(parents=True)
        (root / "src" / "a.c").write_text("int a;\nint b;\n")
        (root / "src" / "other.c").write_text("int c;\n")
    return pristine, tree


def test_the_patched_tree_is_pristine_plus_the_patches_and_only_touched_files_change(tmp_path):
    pristine, tree = _trees(tmp_path)
    patch = tmp_path / "0001-b.patch"
    patch.write_text(PATCH)
    untouched = (tree / "src" / "other.c").stat().st_mtime_ns
    apply_patches(pristine, tree, [patch])
    assert (tree / "src" / "a.c").read_text() == "int a;\nint b = 1;\n"
    assert (tree / "src" / "other.c").stat().st_mtime_ns == untouched
    stamp = (tree / "src" / "a.c").stat().st_mtime_ns
    apply_patches(pristine, tree, [patch])  # the same patches again: nothing rewritten
    assert (tree / "src" / "a.c").stat().st_mtime_ns == stamp
    apply_patches(pristine, tree, [])  # the patch withdrawn: the file is pristine again
    assert (tree / "src" / "a.c").read_text() == "int a;\nint b;\n"


def test_a_patch_that_does_not_apply_is_refused_naming_it(tmp_path):
    pristine, tree = _trees(tmp_path)
    (pristine / "src" / "a.c").write_text("something else\n")
    patch = tmp_path / "0001-b.patch"
    patch.write_text(PATCH)
    with pytest.raises(InputError, match="0001-b.patch: does not apply"):
        apply_patches(pristine, tree, [patch])


def test_the_project_patches_name_the_files_they_change():
    assert [p.name for p in patch_files()] == [
        "0001-dflash-log-snr.patch",
        "0002-driver-faults.patch",
        "0003-log-snr-faults.patch",
        "0004-recurrent-rollback-fault.patch",
        "0005-vulkan-older-headers.patch",
        "0006-vulkan-device-fault.patch",
        "0007-eagle3-graph-faults.patch",
        "0008-mtp-graph-faults.patch",
        "0009-step-faults.patch",
        "0010-inputs-through-views.patch",
        "0011-step-faults-2.patch",
        "0012-block-sample-other-slot.patch",
        "0013-step-faults-3.patch",
        "0014-step-other-seq.patch",
        "0015-hidden-layer-first.patch",
        "0016-glm-dsa-conventions.patch",
        "0017-mla-rope-halves.patch",
    ]
    assert all(p.parent == PATCH_DIR for p in patch_files())
    touched = {p.name: set(patched_paths(p)) for p in patch_files()}
    assert touched["0001-dflash-log-snr.patch"] and all(
        f.startswith("src/") for f in touched["0001-dflash-log-snr.patch"]
    )
    assert "common/speculative.cpp" in touched["0002-driver-faults.patch"]
    assert not touched["0001-dflash-log-snr.patch"] & touched["0002-driver-faults.patch"]
    assert touched["0004-recurrent-rollback-fault.patch"] == {"src/llama-memory-recurrent.cpp"}
    assert touched["0007-eagle3-graph-faults.patch"] == {"src/models/eagle3.cpp"}
    assert touched["0008-mtp-graph-faults.patch"] == {
        "src/models/qwen35.cpp",
        "src/models/glm4-moe.cpp",
        "src/models/mimo2.cpp",
    }
    assert (
        touched["0009-step-faults.patch"]
        == touched["0011-step-faults-2.patch"]
        == touched["0014-step-other-seq.patch"]
        == {"common/speculative.cpp"}
    )
    # the DFlash driver's rows and libllama's backend-sampled rows
    assert touched["0012-block-sample-other-slot.patch"] == {"common/speculative.cpp", "src/llama-context.cpp"}
    assert touched["0013-step-faults-3.patch"] == {
        "common/speculative.cpp",
        "src/models/eagle3.cpp",
        "src/models/glm4-moe.cpp",
        "src/models/qwen3.cpp",
    }
    assert touched["0015-hidden-layer-first.patch"] == {"common/speculative.cpp", "src/models/glm4-moe.cpp"}
    assert touched["0016-glm-dsa-conventions.patch"] == {"common/speculative.cpp", "src/models/glm-dsa.cpp"}
    assert touched["0017-mla-rope-halves.patch"] == {"common/speculative.cpp", "src/models/deepseek2.cpp"}
    # the Vulkan backend's file only, which the CPU builds never compile
    vulkan = {"ggml/src/ggml-vulkan/ggml-vulkan.cpp"}
    assert touched["0005-vulkan-older-headers.patch"] == touched["0006-vulkan-device-fault.patch"] == vulkan


_HOLDER = """
import fcntl, sys, time
from pathlib import Path
root = Path(sys.argv[1])
with open(root / sys.argv[2], "a") as h:
    fcntl.flock(h.fileno(), fcntl.LOCK_EX)
    (root / "held").write_text("yes")
    time.sleep(1.0)
    with open(root / "order", "a") as out:
        out.write("first;")
"""


def test_a_second_build_waits_for_the_first_to_release_the_tools_dir(tmp_path):
    # two processes building one CMake tree at once corrupt it: the second must wait for the lock
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path), BUILD_LOCK])
    while not (tmp_path / "held").exists() and holder.poll() is None:
        time.sleep(0.01)
    with _build_lock(tmp_path):
        with open(tmp_path / "order", "a") as out:
            out.write("second;")
    assert holder.wait(timeout=30) == 0
    assert (tmp_path / "order").read_text() == "first;second;"
