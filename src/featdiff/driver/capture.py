"""In-process capture: run the DFlash flow through the real llama.cpp build with the shim's
eval callback on both contexts, spool what the filters select, then pack the spool into a dump.

The spool sits beside the output (`<output>.spool.index/.data`) while the capture runs, under
the output's lock (featdiff.core.outputs.output_lock); if the process dies, `featdiff pack` still turns
it into a dump of the complete records. An interrupted capture packs what it has, beside a dump
already at the output (featdiff.core.outputs.failed_output), never over it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from featdiff.core import names, progress
from featdiff.core.blocks import DEFAULT_DRAFT_MAX, flow_positions
from featdiff.core.errors import InputError, Interrupted, NoRoomError
from featdiff.core.filters import ROLE_IDS, FilterSet, capture_filters
from featdiff.core.gguf_reader import read_gguf
from featdiff.core.outputs import check_output, failed_output, is_no_room, no_room_error, output_lock
from featdiff.core.tokens import check_prompt, parse_tokens, require_one
from featdiff.driver import dflash as driver
from featdiff.dump.model_info import model_info
from featdiff.dump.records import Eval, Round
from featdiff.kinds import registry as kinds
from featdiff.kinds.preflight import preflight
from featdiff.llama import ggml_dequant, spool
from featdiff.llama.options import RunOptions, run_threads
from featdiff.llama.runtime import Context, Model, Runtime, Spool

log = logging.getLogger(__name__)

DEFAULT_OPTIONS = RunOptions()  # llama.cpp's defaults
DEFAULT_N_UBATCH = 512  # -ub: common/common.h common_params.n_ubatch (llama_context_default_params agrees)

CTX_MIN = 256
CTX_SLACK = 16


@dataclass
class SpoolRecorder:
    """Writes each eval and round into the spool, and points the shim at the current eval."""

    spool: Spool

    def begin_eval(self, ev: Eval) -> None:
        self.spool.note("eval", ev.to_json())
        self.spool.begin_eval(ev.eval)

    def end_round(self, rnd: Round) -> None:
        self.spool.note("round", rnd.to_json())

    def readback(self, name: str, rows) -> None:
        self.spool.add_rows(ROLE_IDS["draft"], name, rows)


def prompt_ids(model: Model, prompt: str | None, tokens: str | None) -> list[int]:
    """The prompt as token ids, from `--tokens` or tokenized by llama.cpp's own vocabulary."""
    require_one(prompt, tokens)
    ids = list(parse_tokens(tokens)) if tokens is not None else model.tokenize(prompt or "")
    check_prompt(ids, model.n_vocab, model.path)
    return ids


def flow_config(draft: Model, draft_max: int = DEFAULT_DRAFT_MAX, p_min: float = 0.0) -> driver.FlowConfig:
    """The settings upstream's driver of the drafter's kind (featdiff.kinds) reads from it, with
    `draft_max` drafts per round (`--spec-draft-n-max`) and `p_min` (`--spec-draft-p-min`)."""
    arch = draft.meta(names.KEY_ARCH) or ""  # the kinds of one arch share its driver (featdiff.kinds)
    return kinds.kind_of(arch, (), str(draft.path)).driver_module().flow_config(draft, draft_max, p_min)


def driver_of(cfg) -> ModuleType:
    """The driver module of the kind a flow config belongs to."""
    return kinds.by_name(cfg.kind).driver_module()


def capture(
    target: Path | None,
    model: Path | None,
    output: Path,
    *,
    prompt: str | None = None,
    tokens: str | None = None,
    rounds: int = 2,
    filters: list[str] | None = None,
    llama_dir: Path | None = None,
    draft_max: int | None = None,
    p_min: float | None = None,
    options: RunOptions = DEFAULT_OPTIONS,
) -> Path:
    """Run the flow on the real build and write the dump; return its path. Draft blocks hold
    `draft_max` drafts (default: llama.cpp's `--spec-draft-n-max` default; featdiff.core.blocks);
    `options` are llama.cpp's run options (KV types, flash attention, offload, threads, context)."""
    if target is None or model is None:
        raise InputError("capture needs --target T.gguf and --model D.gguf (or --exec -- <command>)")
    output = check_output(Path(output), (Path(target), Path(model)), "-o")
    with output_lock(output):
        preflight(
            Path(model),
            Path(target),
            rounds=rounds,
            draft_max=DEFAULT_DRAFT_MAX if draft_max is None else draft_max,
            ggml=ggml_dequant.load,
        )
        rt = Runtime.load(llama_dir)
        models = load_models(rt, Path(target), Path(model), options)
        try:
            ids = prompt_ids(models[0], prompt, tokens)  # speculative-simple tokenizes with the target
            cfg = flow_config(models[1], DEFAULT_DRAFT_MAX if draft_max is None else draft_max, p_min or 0.0)
            kind = kinds.by_name(cfg.kind)
            wiring = kind.wiring_of(models[1].meta(names.KEY_ARCH))  # Gemma 4's assistant's graph is its own
            kept = capture_filters(filters, cfg.target_layers, wiring, kind.target_wiring)
            packed = _spooled(rt, models, ids, cfg, rounds, kept, output, options)
        finally:
            free_models(models)
    if filters:
        spool.warn_unmatched_filters(kept, packed)
    return packed.path


def load_models(rt: Runtime, target: Path, model: Path, options: RunOptions) -> tuple[Model, Model]:
    """The target and the drafter, as upstream loads them for the drafter's kind: an MTP head
    inside the target's GGUF runs on the target's own model (one load, its MTP layers included:
    common_speculative_init_result), a separate one loads with its MTP layers."""
    shares = kinds.kind_of(read_gguf(model, ggml_dequant.load).arch, (), str(model)).shares_target_model
    if shares and target.resolve() == model.resolve():
        both = Model.load(rt, target, n_gpu_layers=options.n_gpu_layers, load_mtp=True)
        return both, both
    tgt = Model.load(rt, target, n_gpu_layers=options.n_gpu_layers)
    try:
        return tgt, Model.load(rt, model, n_gpu_layers=options.n_gpu_layers_draft, load_mtp=shares)
    except BaseException:
        tgt.free()
        raise


def free_models(models: tuple[Model, Model]) -> None:
    """Free each model once (an MTP head inside the target shares its model)."""
    models[0].free()
    if models[1] is not models[0]:
        models[1].free()


def _spooled(
    rt: Runtime,
    models: tuple[Model, Model],
    ids: list[int],
    cfg: driver.FlowConfig,
    rounds: int,
    filters: FilterSet,
    output: Path,
    options: RunOptions,
) -> spool.Packed:
    """Run the flow into a spool beside `output`, then pack it; keep what a crash leaves."""
    prefix = spool.prefix_for(output)
    spool.set_aside(prefix, output)
    sp = Spool.open(rt, prefix, filters.shim_globs())
    try:
        sp.note(spool.HEADER, _header(rt, models, ids, filters, cfg, options))
        _run(rt, sp, models, ids, cfg, rounds, options)
        failed = sp.close()
        if failed is not None:
            raise failed
        packed = spool.pack(prefix, output)
    except KeyboardInterrupt as stop:
        sp.close()
        packed = spool.pack(prefix, failed_output(output))
        spool.remove_spool(prefix)
        raise Interrupted.of(stop, packed.summary()) from None
    except BaseException as e:
        sp.close()
        _leave_spool(prefix, output, e)
        raise
    spool.remove_spool(prefix)
    spool.warn_dropped(packed)
    return packed


def _leave_spool(prefix: Path, output: Path, stopped: BaseException) -> None:
    """What a capture that `stopped` leaves of its spool: nothing when it ran out of room (raises
    the one-line error: the spool's room is what a rerun needs) or stopped before a record; else
    its complete records, and how to pack them."""
    if isinstance(stopped, OSError) and is_no_room(stopped):
        spool.remove_spool(prefix)
        raise no_room_error(output, stopped, f"its spool {stopped.filename}") from None
    data = spool.spool_files(prefix)[1]
    if isinstance(stopped, NoRoomError) or (data.is_file() and data.stat().st_size == 0):
        spool.remove_spool(prefix)  # the dump ran out of room, or nothing to recover
        return
    log.error(
        "capture stopped; its complete records stay in %s.*: `featdiff pack %s -o %s`",
        prefix,
        prefix,
        failed_output(output),
    )


def new_contexts(
    rt: Runtime,
    models: tuple[Model, Model],
    n_prompt: int,
    rounds: int,
    cfg: driver.FlowConfig,
    tags: tuple = (None, None),
    options: RunOptions = DEFAULT_OPTIONS,
) -> tuple[Context, Context]:
    """The target and draft contexts of one flow, sized for it (at least `options.n_ctx`), with
    DFlash switched on and the run's KV types, flash attention and threads; `tags` are the shim's
    callback tags (None: no callback)."""
    n_ctx = max(CTX_MIN, flow_positions(n_prompt, rounds, cfg.block_rows) + CTX_SLACK, options.n_ctx or 0)
    threads = run_threads(options, os.environ)
    ub, fa = n_ubatch(options), options.flash_attn
    check_ubatch(ub, cfg.noncausal_rows)
    # n_rs_seq: common.cpp common_context_params_to_llama sets the target's to the draft length
    # (common_params_speculative::need_n_rs_seq), so a hybrid target's recurrent state rolls back
    # the rejected rows; llama.cpp clamps it to 0 where the arch has no recurrent state
    kv, rs = options.kv["target"], cfg.draft_max
    tgt = Context.new(rt, models[0], n_ctx, threads, tag=tags[0], kv=kv, flash_attn=fa, n_ubatch=ub, n_rs_seq=rs)
    dft = Context.new(
        rt,
        models[1],
        n_ctx,
        threads,
        tag=tags[1],
        ctx_other=tgt,
        kv=options.kv["draft"],
        flash_attn=fa,
        n_ubatch=ub,
        mtp=kinds.by_name(cfg.kind).shares_target_model,
    )
    driver_of(cfg).enable(tgt, dft, cfg)
    return tgt, dft


def n_ubatch(options: RunOptions) -> int:
    """The micro-batch both contexts compute a decode in: `-ub`, else llama.cpp's default (the
    draft context inherits the target's, common/speculative.cpp)."""
    return options.n_ubatch or DEFAULT_N_UBATCH


def check_ubatch(size: int, block_rows: int) -> None:
    """A draft block is decoded non-causally, so it must fit one ubatch: llama.cpp aborts
    otherwise (src/llama-context.cpp: "non-causal attention requires n_ubatch >= n_tokens")."""
    if size < block_rows:
        raise InputError(
            f"-ub {size}: a draft block of {block_rows} rows must fit one ubatch (llama.cpp aborts on a "
            f"non-causal batch larger than n_ubatch); pass -ub {block_rows} or more, or a smaller --draft-max"
        )


def _run(
    rt: Runtime,
    sp: Spool,
    models: tuple[Model, Model],
    ids: list[int],
    cfg: driver.FlowConfig,
    rounds: int,
    options: RunOptions,
) -> None:
    tgt, dft = new_contexts(rt, models, len(ids), rounds, cfg, (sp.tag(0), sp.tag(1)), options)
    try:
        with progress.steps(rounds, "rounds") as on_round:
            driver_of(cfg).run_flow(tgt, dft, ids, rounds, cfg, SpoolRecorder(sp), on_round=on_round)
    finally:
        dft.free()
        tgt.free()


def _header(
    rt: Runtime,
    models: tuple[Model, Model],
    ids: list[int],
    filters: FilterSet,
    cfg: driver.FlowConfig,
    options: RunOptions,
) -> dict:
    return {
        "models": {
            role: model_info(m.path, ggml=ggml_dequant.load).to_json() for role, m in zip(("target", "draft"), models)
        },
        "build": {
            "library": str(rt.build.libllama),
            "kind": rt.build.kind,
            "root": str(rt.build.root),
            "system_info": rt.system_info(),
            "commit": _commit(rt),
            "filters": filters.to_json(),
            "draft_max": cfg.draft_max,
            "p_min": cfg.p_min,
            "n_ubatch": n_ubatch(options),
            "placement": placement_json(rt, options),
            **options.build_json(),
        },
        "prompt_tokens": ids,
    }


def placement_json(rt: Runtime, options: RunOptions) -> dict:
    """`build.placement` (docs/dump.md): the devices ggml reports and, per model, the layers it
    was told to offload (-ngl / -ngld, else llama.cpp's default; negative: all) and the devices
    that can take them (every device but the CPU; none when no layer is offloaded)."""
    devices = rt.devices()
    offload = [d.name for d in devices if d.kind != "cpu"]
    given = {"target": options.n_gpu_layers, "draft": options.n_gpu_layers_draft}
    per_role = {}
    for role, n in given.items():
        layers = rt.default_gpu_layers() if n is None else n
        per_role[role] = {"n_gpu_layers": layers, "devices": offload if layers != 0 else []}
    return {"devices": [d.to_json() for d in devices], **per_role}


def _commit(rt: Runtime) -> str:
    """The llama.cpp version of the build, where it says (pinned wheel: the package version; the
    project's build: the sdist it was built from, and the patches)."""
    if rt.build.kind == "pinned":
        from importlib.metadata import version

        return f"llama-cpp-python=={version('llama-cpp-python')}"
    if rt.build.kind == "project":
        from featdiff.llama.patches import patch_files
        from featdiff.llama.tools import PINNED_SDIST

        return f"{PINNED_SDIST} + featdiff patches {', '.join(p.stem for p in patch_files())}"
    head = rt.build.root / ".git" / "HEAD"
    return head.read_text().strip() if head.is_file() else "unknown"
