"""In-process capture: run the DFlash flow through the real llama.cpp build with the shim's
eval callback on both contexts, spool what the filters select, then pack the spool into a dump.

The spool sits beside the output (`<output>.spool.index/.data`) while the capture runs; if the
process dies, `featdiff.llama.spool.pack` still turns it into a dump of the complete records.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from featdiff import names
from featdiff.dump import Eval, Round
from featdiff.errors import InputError
from featdiff.gguf_meta import model_info
from featdiff.llama import driver, spool
from featdiff.llama.runtime import Context, Model, Runtime, Spool
from featdiff.outputs import check_output
from featdiff.blocks import DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT_MAX, clamped_draft_max
from featdiff.tokens import check_prompt, parse_tokens, require_one

log = logging.getLogger(__name__)

ROLE_IDS = {"target": 0, "draft": 1}
CTX_MIN = 256
CTX_SLACK = 16
MAX_THREADS = 8


@dataclass
class SpoolRecorder:
    """Writes each eval and round into the spool, and points the shim at the current eval."""

    spool: Spool

    def begin_eval(self, ev: Eval) -> None:
        self.spool.note("eval", ev.to_json())
        self.spool.begin_eval(ev.eval)

    def end_round(self, rnd: Round) -> None:
        self.spool.note("round", rnd.to_json())


def role_filters(filters: list[str] | None, tapped: tuple[int, ...] | None = None) -> dict[int, list[str]]:
    """Globs per role; `draft:GLOB` or `target:GLOB` limits one to a role, `!GLOB` excludes.

    Without filters: the drafter's wiring tensors, and on the target the inputs of the `tapped`
    layers and the logits. When the layers are unknown (around a program): every target layer,
    and the positions as the graphs saw them. ggml's derived names ("x (view)", "x (permuted)")
    are excluded unless a glob names "(".
    """
    if filters:
        chosen = list(filters)
    elif tapped:
        target = [names.tapped_layer_name(L) for L in tapped] + list(names.TARGET_WIRING)
        chosen = [f"draft:{g}" for g in names.DRAFT_WIRING] + [f"target:{g}" for g in target]
    else:
        chosen = [f"draft:{g}" for g in names.DRAFT_WIRING] + [f"target:{g}" for g in names.TARGET_ALL_LAYERS] + [names.INP_POS]
    if not any("(" in f for f in chosen):
        chosen.append(names.EXCLUDE_DERIVED)
    out: dict[int, list[str]] = {0: [], 1: []}
    for f in chosen:
        bang = "!" if f.startswith("!") else ""
        role, sep, glob = f.removeprefix("!").partition(":")
        for i in ([ROLE_IDS[role]] if sep and role in ROLE_IDS else [0, 1]):
            out[i].append(bang + (glob if sep and role in ROLE_IDS else f.removeprefix("!")))
    return out


def prompt_ids(model: Model, prompt: str | None, tokens: str | None) -> list[int]:
    """The prompt as token ids, from `--tokens` or tokenized by llama.cpp's own vocabulary."""
    require_one(prompt, tokens)
    ids = list(parse_tokens(tokens)) if tokens is not None else model.tokenize(prompt or "")
    check_prompt(ids, model.n_vocab, model.path)
    return ids


def flow_config(target: Model, draft: Model, draft_max: int = DEFAULT_DRAFT_MAX) -> driver.FlowConfig:
    """The DFlash settings the upstream driver reads from the drafter, with `draft_max` drafts
    per block (`--spec-draft-n-max`)."""
    layers = tuple(draft.target_layer_ids())
    n_layer = int(target.rt.lib.llama_model_n_layer(target.ptr))
    if not layers or max(layers) >= n_layer:
        raise InputError(f"{draft.path}: dflash.target_layers = {list(layers)} but the target has {n_layer} layers; ids must be < n_layer (see `featdiff lint`)")
    block_size = int(draft.meta(names.KEY_BLOCK_SIZE) or DEFAULT_BLOCK_SIZE)
    return driver.FlowConfig(layers, _draft_max(draft.path, draft_max, block_size),
                             int(draft.rt.lib.llama_vocab_mask(draft.vocab)))


def _draft_max(path: Path, draft_max: int, block_size: int) -> int:
    """`--draft-max` clamped to `block_size - 1` with a warning, as common_speculative_impl_draft_dflash
    clamps n_max."""
    if draft_max < 1:
        raise InputError(f"--draft-max {draft_max}: expected >= 1 draft per block (llama.cpp's "
                         f"--spec-draft-n-max, default {DEFAULT_DRAFT_MAX})")
    clamped = clamped_draft_max(draft_max, block_size)
    if clamped != draft_max:
        log.warning("%s: --draft-max %d exceeds the trained block size (%s = %d); clamping to %d, as llama.cpp does",
                    path, draft_max, names.KEY_BLOCK_SIZE, block_size, clamped)
    return clamped


def capture(target: Path | None, model: Path | None, output: Path, *, prompt: str | None = None,
            tokens: str | None = None, rounds: int = 2, filters: list[str] | None = None,
            llama_dir: Path | None = None, draft_max: int | None = None) -> Path:
    """Run the flow on the real build and write the dump; return its path. Draft blocks are
    `draft_max + 1` rows (default: llama.cpp's `--spec-draft-n-max` default)."""
    if target is None or model is None:
        raise InputError("capture needs --target T.gguf and --model D.gguf (or --exec -- <command>)")
    output = check_output(Path(output), (Path(target), Path(model)), "-o")
    rt = Runtime.load(llama_dir)
    models = (Model.load(rt, Path(target)), Model.load(rt, Path(model)))
    try:
        ids = prompt_ids(models[0], prompt, tokens)  # speculative-simple tokenizes with the target
        cfg = flow_config(*models, DEFAULT_DRAFT_MAX if draft_max is None else draft_max)
        return _spooled(rt, models, ids, cfg, rounds, role_filters(filters, cfg.target_layers), output)
    finally:
        for m in models:
            m.free()


def _spooled(rt: Runtime, models: tuple[Model, Model], ids: list[int], cfg: driver.FlowConfig,
             rounds: int, globs: dict[int, list[str]], output: Path) -> Path:
    """Run the flow into a spool beside `output`, then pack it; keep what a crash leaves."""
    prefix = spool.prefix_for(output)
    sp = Spool.open(rt, prefix, globs)
    try:
        sp.note("header", _header(rt, models, ids, globs, cfg))
        _run(rt, sp, models, ids, cfg, rounds)
    except KeyboardInterrupt:
        sp.close()
        log.warning("interrupted: packing the complete records into %s", spool.pack(prefix, output))
        spool.remove_spool(prefix)
        raise
    except BaseException:
        sp.close()
        log.error("capture stopped; its complete records stay in %s.*: `featdiff pack %s -o %s`", prefix, prefix, output)
        raise
    err = sp.close()
    if err:
        raise OSError(f"{prefix}.data: the shim failed to write the spool (error {err})")
    path = spool.pack(prefix, output)
    spool.remove_spool(prefix)
    return path


def new_contexts(rt: Runtime, models: tuple[Model, Model], n_prompt: int, rounds: int,
                 cfg: driver.FlowConfig, tags: tuple = (None, None)) -> tuple[Context, Context]:
    """The target and draft contexts of one flow, sized for it, with DFlash switched on; `tags`
    are the shim's callback tags (None: no callback)."""
    n_ctx = max(CTX_MIN, n_prompt + (rounds + 1) * cfg.block_rows + CTX_SLACK)
    threads = min(os.cpu_count() or 1, MAX_THREADS)
    tgt = Context.new(rt, models[0], n_ctx, threads, tag=tags[0])
    dft = Context.new(rt, models[1], n_ctx, threads, tag=tags[1], ctx_other=tgt)
    enable_dflash(tgt, dft, cfg)
    return tgt, dft


def _run(rt: Runtime, sp: Spool, models: tuple[Model, Model], ids: list[int], cfg: driver.FlowConfig,
         rounds: int) -> None:
    tgt, dft = new_contexts(rt, models, len(ids), rounds, cfg, (sp.tag(0), sp.tag(1)))
    try:
        driver.run_flow(tgt, dft, ids, rounds, cfg, SpoolRecorder(sp), on_round=_progress(rounds))
    finally:
        dft.free()
        tgt.free()


def enable_dflash(tgt: Context, dft: Context, cfg: driver.FlowConfig) -> None:
    """What common_speculative_impl_draft_dflash's constructor switches on."""
    lib = tgt.rt.lib
    for layer in cfg.target_layers:
        lib.fd_set_embeddings_layer_inp(tgt.ptr, layer, True)
    lib.fd_set_embeddings_nextn(dft.ptr, True, True)
    lib.llama_set_causal_attn(dft.ptr, False)


def kept_globs(filters: dict[int, list[str]]) -> dict[str, list[str]]:
    """The globs a capture keeps per role, as a manifest's build records them (compare reads them)."""
    return {role: sorted(g for g in filters[i] if not g.startswith("!")) for role, i in ROLE_IDS.items()}


def _header(rt: Runtime, models: tuple[Model, Model], ids: list[int], filters: dict[int, list[str]],
            cfg: driver.FlowConfig) -> dict:
    kept = kept_globs(filters)
    return {
        "models": {"target": model_info(models[0].path).to_json(), "draft": model_info(models[1].path).to_json()},
        "build": {"library": str(rt.build.libllama), "kind": rt.build.kind, "root": str(rt.build.root),
                  "system_info": rt.system_info(), "commit": _commit(rt), "filters": kept,
                  "draft_max": cfg.draft_max},
        "prompt_tokens": ids,
    }


def _commit(rt: Runtime) -> str:
    """The llama.cpp version of the build, where it says (pinned wheel: the package version)."""
    if rt.build.kind == "pinned":
        from importlib.metadata import version

        return f"llama-cpp-python=={version('llama-cpp-python')}"
    head = rt.build.root / ".git" / "HEAD"
    return head.read_text().strip() if head.is_file() else "unknown"


def _progress(rounds: int):
    """A tqdm bar over rounds on long captures (stderr), else None."""
    if rounds < 8:
        return None
    from tqdm import tqdm

    bar = tqdm(total=rounds, desc="rounds", unit="round", leave=False)
    return lambda: bar.update(1)


def capture_exec(command: list[str], output: Path, filters: list[str] | None,
                 llama_dir: Path | None, prompt: str | None = None, tokens: str | None = None,
                 draft_max: int | None = None) -> Path:
    """Capture around an unmodified llama.cpp program (featdiff.llama.exec); llama-server gets
    one greedy completion request for `prompt` / `tokens`. The program's own command line sets
    its block length, so `draft_max` is refused."""
    from featdiff.llama.exec import capture_exec as run_exec

    if draft_max is not None:
        raise InputError(f"--draft-max {draft_max} drives the in-process flow; with --exec pass "
                         "--spec-draft-n-max in the program's command line instead")

    return run_exec(command, output, filters, llama_dir, prompt=prompt, tokens=tokens)
