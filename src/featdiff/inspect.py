"""`featdiff inspect`: a readable listing of a dump (records by eval and phase) or of a GGUF's
DFlash metadata. Reads files, returns text; prints nothing itself.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from safetensors import safe_open

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.names import BACKEND_HOST, ROLES
from featdiff.core.words import plural
from featdiff.dump.manifest import Manifest
from featdiff.dump.model_info import model_info
from featdiff.dump.reader import Dump, read_dump
from featdiff.kinds.eagle3 import (
    FLAG,
    HF_AUX_LAYER_IDS,
    HF_EAGLE_CONFIG,
    HF_LAYER_PREFIXES,
    LAYER_IDS_OUTPUT,
    eagle3_config,
    stated_layer_ids,
    trainer_of,
    unread_keys,
    unread_tensors,
)
from featdiff.llama import ggml_dequant


def describe(path: Path) -> str:
    """The listing for a `.npz` dump or a `.gguf` model."""
    path = Path(path)
    if path.is_dir():
        return describe_eagle3_checkpoint(path)
    if path.suffix == ".gguf":
        return describe_gguf(path)
    if path.suffix == ".npz":
        with read_dump(path) as dump:
            return describe_dump(dump)
    raise InputError(f"{path}: expected a dump (.npz), a model (.gguf) or an EAGLE3 Hugging Face checkpoint directory")


def describe_eagle3_checkpoint(path: Path) -> str:
    """An EAGLE3 HF checkpoint: which trainer wrote it, where its layer ids are and what they name
    (featdiff.kinds.eagle3.TRAINERS), and what the reference would refuse of it."""
    cfg = path / names.HF_CONFIG
    try:
        config = eagle3_config(json.loads(cfg.read_text()))
    except (OSError, ValueError) as e:
        raise InputError(f"{cfg}: unreadable ({e}); pass a Hugging Face checkpoint directory") from None
    if names.HF_DRAFT_VOCAB_SIZE not in config:
        raise InputError(f"{cfg}: no {names.HF_DRAFT_VOCAB_SIZE}: featdiff inspect describes EAGLE3 checkpoints")
    tensors = _tensor_names(path)
    trainer = trainer_of(config, tensors)
    lines = [f"{path}: EAGLE3 checkpoint, {len(tensors)} tensors"]
    if trainer is None:
        lines.append(
            f"  trainer: cannot be told (top-level {HF_AUX_LAYER_IDS} beside {HF_EAGLE_CONFIG}); "
            f"the reference needs {FLAG} input|output"
        )
    else:
        ids = stated_layer_ids(config, trainer)
        lines += [
            f"  trainer: {trainer.name}, {trainer.what}: {trainer.why}",
            f"  layer ids: {ids if ids else 'none stated: the inputs of [2, n // 2, n - 3] (every default)'}"
            + (f" at {trainer.ids_at}, naming layer {trainer.layer_ids_mean}s" if ids else ""),
        ]
        if ids and trainer.layer_ids_mean == LAYER_IDS_OUTPUT:
            lines.append(f"  llama.cpp taps layer inputs: the GGUF must carry {[int(i) + 1 for i in ids]}")
    prefix = next((p for p in HF_LAYER_PREFIXES if any(t.startswith(p) for t in tensors)), HF_LAYER_PREFIXES[0])
    unread = [*unread_keys(config), *unread_tensors(tensors, prefix)]
    lines.append(f"  not read by the reference (refused): {', '.join(unread) if unread else 'nothing'}")
    return "\n".join(lines)


def _tensor_names(path: Path) -> list[str]:
    """The names of every tensor in the directory's safetensors files (headers only)."""
    out: list[str] = []
    for f in sorted(path.glob(names.HF_WEIGHTS_GLOB)):
        with safe_open(str(f), "numpy") as st:
            out += list(st.keys())
    return out


def checkpoint_line(entry: dict[str, Any]) -> str:
    """A reference's `models.draft.checkpoint` (docs/dump.md) in words."""
    ids, mean = entry.get("layer_ids"), entry.get("layer_ids_mean")
    tapped = [int(i) + 1 for i in ids] if mean == LAYER_IDS_OUTPUT and isinstance(ids, list) else ids
    return (
        f"  draft checkpoint: trainer {entry.get('trainer')}, layer ids {ids} name layer {mean}s "
        f"(told by the {entry.get('told_by')}): the reference tapped the inputs of {tapped}"
    )


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
    lines = [
        f"{dump.path}: {m.source} dump, {plural(len(m.evals), 'eval')}, {plural(len(m.records), 'record')}, "
        f"{plural(len(m.rounds), 'round')}"
    ]
    for role, info in sorted(m.models.items()):
        lines.append(f"  {role}: {info.get('path')} ({info.get('architecture')})")
        if isinstance(info.get("checkpoint"), dict):
            lines.append(checkpoint_line(info["checkpoint"]))
    lines += placement_lines(m)
    by_eval: dict[int, list] = {}
    for r in m.records:
        by_eval.setdefault(r.eval, []).append(r)
    for ev in m.evals:
        pos = f"{ev.positions[0]}..{ev.positions[-1]}" if ev.positions else "-"
        refused = f"  REFUSED by llama.cpp (rc {ev.rc})" if ev.rc else ""
        encoder = "  (llama_encode: the inject's encoder step)" if not ev.writes_cache else ""
        lines.append(
            f"eval {ev.eval:3d}  {ev.role:6s} {ev.phase:7s} round {ev.round}  {plural(ev.n_tokens, 'token')} at {pos}"
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
