"""`featdiff inspect`: a readable listing of a dump (records by eval and phase) or of a GGUF's
DFlash metadata. Reads files, returns text; prints nothing itself.
"""

from __future__ import annotations

from pathlib import Path

from featdiff.dump import Dump, read_dump
from featdiff.errors import InputError
from featdiff.gguf_reader import model_info
from featdiff.llama import ggml_dequant


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
            lines.append(f"    {r.name + occ:32s} {r.op:10s} {r.ggml_type:5s} {str(r.shape):18s} {r.dtype}")
    for rnd in m.rounds:
        lines.append(
            f"round {rnd.round}: pos0 {rnd.pos0}, anchor {rnd.anchor}, drafts {list(rnd.drafts)}, accepted {rnd.accepted}"
        )
    if m.memory_ops:
        lines.append(f"{len(m.memory_ops)} KV-cache removals recorded (memory_ops)")
    lines += [f"flow note: {note}" for note in m.flow_notes]
    return "\n".join(lines)
