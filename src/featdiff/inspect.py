"""`featdiff inspect`: a readable listing of a dump (records by eval and phase) or of a GGUF's
DFlash metadata. Reads files, returns text; prints nothing itself.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from featdiff.dump import Dump, Manifest, read_dump
from featdiff.errors import InputError
from featdiff.gguf_reader import model_info
from featdiff.llama import ggml_dequant
from featdiff.names import BACKEND_HOST, ROLES


def describe(path: Path) -> str:
    """The listing for a `.npz` dump or a `.gguf` model."""
    path = Path(path)
    if path.suffix == ".gguf":
        return describe_gguf(path)
    if path.suffix == ".npz":
        with read_dump(path) as dump:
            return describe_dump(dump)
    raise InputError(f"{path}: expected a dump (.npz) or a model (.gguf)")


def describe_gguf(path: Path) -> str:
    info = model_info(path, with_hash=False, ggml=ggml_dequant.load)
    lines = [
        f"{path}: {info.architecture}, {info.n_layer} layers, n_embd {info.n_embd}, vocab {info.n_vocab}",
        f"  weight types: {', '.join(info.weight_types) or '-'}",
    ]
    if info.architecture == "dflash":
        lines += [
            f"  dflash.target_layers = {list(info.target_layers)} (inputs of these target layers; HF ids = these - 1)",
            f"  dflash.block_size = {info.block_size}, mask token id = {info.mask_token_id}",
            f"  own token_embd/output: {'yes' if info.has_own_embeddings else 'no (borrows the target through ctx_other)'}",
            f"  log-SNR conditioning: {_log_snr_text(info.log_snr, info.has_log_snr_tensors)}",
        ]
    return "\n".join(lines)


def placement_lines(m: Manifest) -> list[str]:
    """Where a capture computed (`build.placement`: the devices, each model's offloaded layers)
    and, per model, how many records each backend's memory held (`records[].backend`); nothing
    for a dump that says neither (a reference, a capture before issue 31). `build` is the
    producer's own (docs/dump.md): what is not of the documented shape is left out."""
    placement = m.build.get("placement")
    placement = placement if isinstance(placement, dict) else {}
    devices = [d for d in _listed(placement.get("devices")) if isinstance(d, dict)]
    lines = ["  devices: " + ", ".join(f"{d.get('name')} ({d.get('description')})" for d in devices)] if devices else []
    for role in ROLES:
        counts = Counter(r.backend for r in m.records if r.role == role and r.backend)
        told = placement.get(role)
        told = told if isinstance(told, dict) else {}
        if not counts and not told:
            continue
        on = ", ".join(str(d) for d in _listed(told.get("devices"))) or BACKEND_HOST
        layers = f"-ngl {told.get('n_gpu_layers')} -> {on}; " if told else ""
        read = ", ".join(f"{n} from {b}" for b, n in sorted(counts.items()))
        lines.append(f"  {role} placement: {layers}records: {read or 'none read from a buffer'}")
    return lines


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _log_snr_text(log_snr: dict | None, has_tensors: bool) -> str:
    enabled = bool(log_snr and log_snr.get("enabled"))
    if not enabled:
        return "tensors without the flag" if has_tensors else "off"
    assert log_snr is not None  # enabled
    return f"on, log-SNR {log_snr['min']} .. {log_snr['max']}, tensors {'present' if has_tensors else 'MISSING'}"


def describe_dump(dump: Dump) -> str:
    m = dump.manifest
    lines = [f"{dump.path}: {m.source} dump, {len(m.evals)} evals, {len(m.records)} records, {len(m.rounds)} rounds"]
    for role, info in sorted(m.models.items()):
        lines.append(f"  {role}: {info.get('path')} ({info.get('architecture')})")
    lines += placement_lines(m)
    by_eval: dict[int, list] = {}
    for r in m.records:
        by_eval.setdefault(r.eval, []).append(r)
    for ev in m.evals:
        pos = f"{ev.positions[0]}..{ev.positions[-1]}" if ev.positions else "-"
        refused = f"  REFUSED by llama.cpp (rc {ev.rc})" if ev.rc else ""
        encoder = "  (llama_encode: the inject's encoder step)" if not ev.writes_cache else ""
        lines.append(
            f"eval {ev.eval:3d}  {ev.role:6s} {ev.phase:7s} round {ev.round}  {ev.n_tokens} tokens at {pos}"
            f"{refused}{encoder}"
        )
        for r in by_eval.get(ev.eval, []):
            occ = f"#{r.occurrence}" if r.occurrence else ""
            where = f" {r.backend}" if r.backend else ""
            lines.append(f"    {r.name + occ:32s} {r.op:10s} {r.ggml_type:5s} {str(r.shape):18s} {r.dtype}{where}")
    for rnd in m.rounds:
        lines.append(
            f"round {rnd.round}: pos0 {rnd.pos0}, anchor {rnd.anchor}, drafts {list(rnd.drafts)}, accepted {rnd.accepted}"
        )
    if m.memory_ops:
        lines.append(f"{len(m.memory_ops)} KV-cache removals recorded (memory_ops)")
    lines += [f"flow note: {note}" for note in m.flow_notes]
    return "\n".join(lines)
