"""`featdiff reference` of an MTP head (featdiff.kinds), through the one-token-per-step reference
command (step_run.py) with the MTP flow (mtp_flow.py), and the accept probe's side of the kind.

`--model` is where the head is: the target's own GGUF (heads inside), a separate `mtp-*.gguf`,
or the checkpoint directory that holds it (the target's `target-hf/`: a Qwen3.5 checkpoint's
`mtp.*` tensors, a GLM-4.5 one's extra decoder layer, a MiMo-V2 one's first `model.mtp.layers`
head; torchref/mtp/hf.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from featdiff.dump.records import Round
from featdiff.dump.model_info import model_info
from featdiff.dump.manifest_fields import ModelInfo
from featdiff.torchref.mtp import chain
from featdiff.torchref.mtp.chain import MtpChain
from featdiff.torchref.mtp import gemma4_assistant as assistant
from featdiff.torchref.mtp.gemma4_assistant import Assistant
from featdiff.torchref.mtp.head import MtpHead, check_mtp_pair, mtp_from_gguf
from featdiff.torchref.mtp.hf import mtp_from_hf
from featdiff.torchref.mtp.flow import run_flow
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.step_run import StepKind, step_reference
from featdiff.torchref.weights import Target, hf_sha256


def reference(target: Path, model: Path, output: Path, **options: Any) -> Path:
    """Compute the MTP reference dump; return its path (torchref.run.reference's contract)."""
    return step_reference(MTP, target, model, output, **options)


def load_head(
    model: Path, target: Target, numerics: Numerics, llama_dir: Path | None = None
) -> MtpHead | MtpChain | Assistant:
    """The MTP head at `model` (a GGUF carrying one, or a Qwen3.5, GLM-4.5 or MiMo-V2 checkpoint
    directory), or its chained heads where it carries several (torchref/mtp/chain.py), or Gemma 4's
    assistant (torchref/mtp/gemma4_assistant.py)."""
    if assistant.is_assistant_gguf(Path(model)):
        return assistant.load_assistant(Path(model), numerics.dtype, numerics.device, llama_dir)
    n_heads = chain.n_heads(Path(model))
    if n_heads > 1:
        return chain.load_chain(Path(model), n_heads, numerics.dtype, numerics.device, llama_dir)
    if Path(model).is_dir():
        return mtp_from_hf(Path(model), numerics.dtype, numerics.device)
    return mtp_from_gguf(Path(model), numerics.dtype, numerics.device, llama_dir)


def run_any_flow(
    target: Target,
    draft: MtpHead | MtpChain | Assistant,
    prompt: tuple[int, ...],
    rounds: int,
    numerics: Numerics,
    **options: Any,
):
    """The single head's flow, the chain's, or Gemma 4's assistant's."""
    if isinstance(draft, Assistant):
        return assistant.run_flow(target, draft, prompt, rounds, numerics, **options)
    if isinstance(draft, MtpChain):  # its heads take no batch_last candidate
        options.pop("target_batches", None)
        return chain.run_chain_flow(target, draft, prompt, rounds, numerics, **options)
    return run_flow(target, draft, prompt, rounds, numerics, **options)


def mtp_models_entry(draft: MtpHead | MtpChain | Assistant) -> dict[str, Any]:
    """The manifest's `models` entry of the head's model, as capture describes it (`ModelInfo`)."""
    if isinstance(draft, Assistant):
        return assistant.assistant_entry(draft)
    head = draft.first if isinstance(draft, MtpChain) else draft
    n_heads = len(draft.heads) if isinstance(draft, MtpChain) else 1
    if head.source.is_gguf:
        return replace(model_info(head.source.path), dequantized_by=head.source.dequantized_by).to_json()
    hp = head.hparams
    return ModelInfo(
        path=str(head.source.path),
        sha256=hf_sha256(Path(head.source.path)),
        architecture=hp.arch,
        n_layer=head.il + n_heads,
        n_embd=hp.n_embd,
        n_vocab=hp.n_vocab,
        weight_types=(),
        rope_freq_base=hp.rope_base,
    ).to_json()


# --- the accept probe's side of the MTP kind (featdiff.verdict.probe, through featdiff.kinds) -----------


def load_pair_draft(target: Target, model: Path, numerics: Numerics) -> MtpHead | MtpChain | Assistant:
    """The head at `model`, its chained heads, or Gemma 4's assistant (load_head); a single head
    checked against `target` here, a chain and an assistant by their own flows."""
    draft = load_head(Path(model), target, numerics)
    if isinstance(draft, MtpHead):
        check_mtp_pair(target, draft)
    return draft


def probe_round(
    target: Target, draft: MtpHead | MtpChain | Assistant, prompt: tuple[int, ...], numerics: Numerics, block_rows: int
) -> Round:
    """The reference's one round after `prompt`: up to `block_rows` - 1 drafts, verified (a chain
    caps them at its head count, as the driver does)."""
    return run_any_flow(target, draft, prompt, 1, numerics, draft_max=block_rows - 1).rounds[0]


MTP = StepKind("MTP", load_head, run_any_flow, mtp_models_entry, reads_run_batches=True)
