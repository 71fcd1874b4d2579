"""`featdiff pack`: turn the spool a capture left (killed, crashed, set aside) into a dump.

Consumes a spool prefix of either kind: an in-process capture's (its index opens with a `header`,
featdiff.llama.spool) or a `capture --exec` run's (the preload's lines, featdiff.programs.pack);
produces the dump and a `spool.Packed` saying what was kept and dropped. The dispatch lives here
so that spool.py never imports exec_pack.py (exec_pack imports spool).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output, output_lock
from featdiff.llama import spool
from featdiff.programs.pack import pack_exec, saved_build


def pack_spool(prefix: Path, output: Path) -> spool.Packed:
    """Pack the spool at `prefix` into `output`, holding `output`'s lock and, for a spool beside
    another output (`<x>.spool`), that output's too: a capture still writing it refuses."""
    prefix = Path(prefix)
    index, data = spool.require_spool(prefix)
    output = check_output(Path(output), (index, data), "-o")
    with ExitStack() as locks:
        locks.enter_context(output_lock(output))
        owner = spool.owner_output(prefix)
        if owner is not None and owner.resolve() != output.resolve():
            locks.enter_context(output_lock(owner))
        return _pack_kind(prefix, index, output)


def _pack_kind(prefix: Path, index: Path, output: Path) -> spool.Packed:
    """Pack with the packer of the spool's kind: the first line of its index tells."""
    kind = spool.first_kind(index)
    if kind == spool.HEADER:
        return spool.pack(prefix, output)
    if kind is None:
        raise InputError(
            f"{index}: the spool holds no complete line, so nothing was captured; "
            "there is nothing to pack (run the capture again)"
        )
    return pack_exec(prefix, output, saved_build(prefix))
