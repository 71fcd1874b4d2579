"""Rewrite a dump: change arrays record by record, drop records, or split one eval into two
chunks (a chunked prefill). The transforms of real dumps that plant one fault each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Eval, Record, record_key
from featdiff.dump.writer import DumpWriter

ArrayFn = Callable[[Record, np.ndarray], np.ndarray | None]  # None drops the record


def rewrite(
    src: Path,
    dst: Path,
    fn: ArrayFn | None = None,
    evals: tuple[Eval, ...] | None = None,
    build: dict | None = None,
    **manifest_fields,
) -> Path:
    """Copy `src` to `dst`, passing every array through `fn`; `manifest_fields` replace the
    manifest's (e.g. `prompt_tokens`, `memory_ops`, `flow_notes`)."""
    with read_dump(src) as dump:
        writer = DumpWriter(Path(dst))
        for r in dump.records():
            a = np.array(dump.array(r))
            a = fn(r, a) if fn else a
            if a is None:
                continue
            a = np.ascontiguousarray(a, dtype=a.dtype)
            writer.add(replace(r, shape=a.shape, ne=tuple(reversed(a.shape)), dtype=str(a.dtype)), a)
        m = dump.manifest
        return writer.close(
            replace(
                m,
                build=build if build is not None else m.build,
                evals=evals if evals is not None else m.evals,
                records=(),
                **manifest_fields,
            )
        )


def split_eval(src: Path, dst: Path, eval_index: int, at: int) -> Path:
    """Split eval `eval_index` into two evals of `at` and the remaining rows (later evals renumbered)."""
    with read_dump(src) as dump:
        m = dump.manifest
        writer = DumpWriter(Path(dst))
        for r in dump.records():
            a = np.array(dump.array(r))
            for rec, part in _split_record(r, a, eval_index, at, m):
                writer.add(rec, part)
        return writer.close(
            Manifest(
                source=m.source,
                models=m.models,
                build=m.build,
                evals=tuple(_split_evals(m.evals, eval_index, at)),
                records=(),
                rounds=m.rounds,
                prompt_tokens=m.prompt_tokens,
            )
        )


def _split_evals(evals: tuple[Eval, ...], eval_index: int, at: int) -> list[Eval]:
    out = []
    for ev in evals:
        if ev.eval < eval_index:
            out.append(ev)
        elif ev.eval > eval_index:
            out.append(replace(ev, eval=ev.eval + 1))
        else:
            for k, (lo, hi) in enumerate(((0, at), (at, ev.n_tokens))):
                out.append(
                    replace(
                        ev,
                        eval=ev.eval + k,
                        n_tokens=hi - lo,
                        positions=ev.positions[lo:hi],
                        token_ids=ev.token_ids[lo:hi],
                        seq_ids=ev.seq_ids[lo:hi],
                    )
                )
    return out


def _split_record(r: Record, a: np.ndarray, eval_index: int, at: int, m: Manifest):
    n_tokens = next(e.n_tokens for e in m.evals if e.eval == r.eval)
    if r.eval < eval_index:
        yield r, a
        return
    if r.eval > eval_index:
        yield _moved(r, r.eval + 1, a), a
        return
    parts = (a[:at], a[at:]) if a.shape[:1] == (n_tokens,) else (a, a)
    for k, part in enumerate(parts):
        part = np.ascontiguousarray(part)
        yield _moved(r, r.eval + k, part), part


def _moved(r: Record, eval_index: int, a: np.ndarray) -> Record:
    return replace(
        r,
        eval=eval_index,
        key=record_key(eval_index, r.role, r.name, r.occurrence),
        shape=a.shape,
        ne=tuple(reversed(a.shape)),
    )
