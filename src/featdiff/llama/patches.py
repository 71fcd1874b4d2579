"""The project's patches of the pinned llama.cpp (`patches/llama.cpp/*.patch`): which there are, which
files each touches, and how they are applied to the tools' tree (featdiff.llama.tools.source_tree),
rewriting only the files whose content changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from featdiff.core.errors import InputError

REPO_ROOT = Path(__file__).resolve().parents[3]
PATCH_DIR = REPO_ROOT / "patches" / "llama.cpp"  # applied in name order with `patch -p1`
PATCHED_NOTE = ".featdiff-patched.json"  # in the patched tree: the patches applied and the files they touch


def patch_files() -> list[Path]:
    """The project's patches of the pinned llama.cpp, in the order they apply."""
    return sorted(PATCH_DIR.glob("*.patch"))


def patched_paths(patch: Path) -> list[str]:
    """The files a unified diff changes, relative to the tree root (`+++ b/<path>` lines)."""
    out = []
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("+++ ") and not line.startswith("+++ /dev/null"):
            out.append(line[4:].split("\t")[0].strip().split("/", 1)[1])
    return out


def apply_patches(pristine: Path, tree: Path, patches: list[Path]) -> None:
    """Make `tree` = `pristine` + `patches`, rewriting only the files whose content changes, so
    an incremental build recompiles only what a patch edit touched."""
    note = tree / PATCHED_NOTE
    before = json.loads(note.read_text()) if note.is_file() else {"patches": {}, "files": []}
    wanted = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in patches}
    if before.get("patches") == wanted:
        return
    touched = sorted({f for p in patches for f in patched_paths(p)})
    with tempfile.TemporaryDirectory(prefix="featdiff-patch-") as tmp:
        scratch = Path(tmp)
        for rel in touched:
            if (pristine / rel).is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(pristine / rel, scratch / rel)
        for patch in patches:
            done = subprocess.run(
                ["patch", "-p1", "--forward", "--batch", "-s", "-d", str(scratch), "-i", str(patch)],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                why = (done.stdout + done.stderr).strip().splitlines()[:1] or ["no output"]
                raise InputError(
                    f"{patch}: does not apply to the pinned llama.cpp in {pristine} ({why[0]}); "
                    "regenerate it against that tree"
                )
        for rel in sorted(set(touched) | set(before.get("files", []))):
            _sync_file(scratch / rel if rel in touched else pristine / rel, tree / rel)
    note.write_text(json.dumps({"patches": wanted, "files": touched}, indent=1))


def _sync_file(want: Path, have: Path) -> None:
    """Copy `want` over `have` when their bytes differ (remove `have` when `want` is absent)."""
    if not want.is_file():
        have.unlink(missing_ok=True)
    elif not have.is_file() or have.read_bytes() != want.read_bytes():
        have.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(want, have)
        os.utime(have)  # newer than the build's objects, whatever the pristine file's date
