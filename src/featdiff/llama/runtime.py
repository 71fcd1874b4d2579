"""Thin, typed handles on the llama.cpp C API through the cffi binding: models, contexts,
batches and the shim's capture spool. No DFlash logic here; driver.py holds the flow.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from featdiff.core.errors import InputError
from featdiff.core.outputs import is_no_room
from featdiff.dump.manifest import CacheTypes
from featdiff.llama import binding

ENV_VERBOSE = "FEATDIFF_LLAMA_LOG"
META_BUF = 256
# llama.cpp's -fa choices -> its llama_flash_attn_type values (read from the build's header)
FLASH_ATTN_TYPES = {
    "auto": "LLAMA_FLASH_ATTN_TYPE_AUTO",
    "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED",
    "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED",
}
N_POS_ARR = 4  # llama_batch_ext_set_pos reads up to 4 positions (M-RoPE); upstream passes {p,p,p,0}


@dataclass
class Runtime:
    """The loaded binding: `ffi`, `lib` and the build they came from."""

    ffi: Any
    lib: Any
    build: binding.LlamaBuild

    @staticmethod
    def load(llama_dir: Path | None = None) -> "Runtime":
        module, build = binding.load(llama_dir)
        rt = Runtime(module.ffi, module.lib, build)
        if not os.environ.get(ENV_VERBOSE):
            rt.lib.llama_log_set(
                rt.ffi.cast("ggml_log_callback", rt.ffi.addressof(rt.lib, "fd_log_errors_only")), rt.ffi.NULL
            )
        rt.lib.llama_backend_init()
        rt.load_backends()
        return rt

    def load_backends(self) -> None:
        """A build made with GGML_BACKEND_DL=ON registers no backend until its backend libraries
        (libggml-cpu*.so, libggml-cuda.so, ...) are loaded, as llama.cpp's programs do at start;
        load those beside the build's libraries. Builds with backends linked in have them already."""
        if self.lib.ggml_backend_reg_count() > 0:
            return
        for d in self.build.backend_dirs:
            if d.is_dir():
                self.lib.ggml_backend_load_all_from_path(str(d).encode())
        if self.lib.ggml_backend_reg_count() == 0:
            dirs = ", ".join(str(d) for d in self.build.backend_dirs)
            raise InputError(
                f"{self.build.libllama}: this build registers no ggml backend and none loads from {dirs} "
                "(a GGML_BACKEND_DL build keeps libggml-cpu*.so there); rebuild it or pass its install prefix"
            )

    def system_info(self) -> str:
        return self.ffi.string(self.lib.llama_print_system_info()).decode()

    def devices(self) -> tuple[Device, ...]:
        """The devices ggml reports, in its order (the CPU's among them)."""
        lib, ffi = self.lib, self.ffi
        kinds = {int(lib.GGML_BACKEND_DEVICE_TYPE_CPU): "cpu", int(lib.GGML_BACKEND_DEVICE_TYPE_GPU): "gpu"}
        found = []
        for i in range(int(lib.ggml_backend_dev_count())):
            dev = lib.ggml_backend_dev_get(i)
            found.append(
                Device(
                    name=ffi.string(lib.ggml_backend_dev_name(dev)).decode(errors="replace"),
                    description=ffi.string(lib.ggml_backend_dev_description(dev)).decode(errors="replace"),
                    kind=kinds.get(int(lib.ggml_backend_dev_type(dev)), "other"),
                )
            )
        return tuple(found)

    def default_gpu_layers(self) -> int:
        """llama.cpp's n_gpu_layers when -ngl is not given (-1 in the pinned tree: every layer)."""
        return int(self.lib.llama_model_default_params().n_gpu_layers)


@dataclass(frozen=True)
class Device:
    """A ggml device: its name (`Vulkan0`, `CUDA0`, `CPU`), ggml's description of it, and its
    kind: `cpu`, `gpu`, or `other` (an integrated GPU, an accelerator)."""

    name: str
    description: str
    kind: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "description": self.description, "kind": self.kind}


@dataclass
class Model:
    rt: Runtime
    ptr: Any
    path: Path

    @staticmethod
    def load(
        rt: Runtime, path: Path, vocab_only: bool = False, n_gpu_layers: int | None = None, load_mtp: bool = False
    ) -> "Model":
        """Load a GGUF; `n_gpu_layers` as llama.cpp's -ngl (None: the library's default); `load_mtp`:
        its MTP (nextn) layers too, which llama.cpp skips unless a run drafts with them
        (common.cpp sets it for `--spec-type draft-mtp`)."""
        params = rt.lib.llama_model_default_params()
        params.vocab_only = vocab_only
        if n_gpu_layers is not None:
            params.n_gpu_layers = n_gpu_layers
        if load_mtp:
            if not rt.build.has_mtp:
                raise InputError(
                    f"{rt.build.root}: this llama.cpp build has no MTP contexts (llama_context_type); "
                    "build a tree with `--spec-type draft-mtp` to run an MTP drafter"
                )
            params.load_mtp = True
        ptr = rt.lib.llama_model_load_from_file(str(path).encode(), params)
        if ptr == rt.ffi.NULL:
            raise InputError(
                f"{path}: llama.cpp refused to load this model (set {ENV_VERBOSE}=1 to see why); check it with `featdiff lint`"
            )
        return Model(rt, ptr, path)

    def meta(self, key: str) -> str | None:
        buf = self.rt.ffi.new("char[]", META_BUF)
        n = self.rt.lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, META_BUF)
        return None if n < 0 else self.rt.ffi.string(buf).decode()

    @property
    def vocab(self) -> Any:
        return self.rt.lib.llama_model_get_vocab(self.ptr)

    @property
    def n_embd(self) -> int:
        return int(self.rt.lib.llama_model_n_embd(self.ptr))

    @property
    def n_vocab(self) -> int:
        return int(self.rt.lib.llama_vocab_n_tokens(self.vocab))

    def target_layer_ids(self) -> list[int]:
        n = self.rt.lib.fd_model_target_layer_ids_n(self.ptr)
        ids = self.rt.lib.fd_model_target_layer_ids(self.ptr)
        return [int(ids[i]) for i in range(n)]

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        n_max = len(raw) + 8
        out = self.rt.ffi.new("llama_token[]", n_max)
        n = self.rt.lib.llama_tokenize(self.vocab, raw, len(raw), out, n_max, True, False)
        if n < 0:  # llama_tokenize answers -(tokens needed) when the buffer is short (a byte-level vocabulary)
            n_max = -n
            out = self.rt.ffi.new("llama_token[]", n_max)
            n = self.rt.lib.llama_tokenize(self.vocab, raw, len(raw), out, n_max, True, False)
        if n < 0:
            raise InputError(f"{self.path}: llama.cpp could not tokenize the prompt (it asked for {-n} tokens twice)")
        return [int(out[i]) for i in range(n)]

    def free(self) -> None:
        self.rt.lib.llama_model_free(self.ptr)


@dataclass
class Context:
    """A llama_context with its reusable batch and, when capturing, its callback tag."""

    rt: Runtime
    ptr: Any
    model: Model
    batch: Any
    tag: Any = None
    n_ubatch: int = 0  # rows llama.cpp computes in one graph (a longer decode: several graphs)
    _keep: list[Any] = field(default_factory=list)

    @staticmethod
    def new(
        rt: Runtime,
        model: Model,
        n_ctx: int,
        n_threads: int,
        tag: Any = None,
        ctx_other: "Context | None" = None,
        kv: CacheTypes | None = None,
        flash_attn: str = "auto",
        n_ubatch: int | None = None,
        n_rs_seq: int = 0,
        mtp: bool = False,
    ) -> "Context":
        """A context with llama.cpp's defaults but for the size, threads, callback, `kv` cache
        types (default f16), `flash_attn` (on / off / auto) and `n_ubatch` (None: one graph per
        decode; else a decode of more rows is computed as several graphs, as llama.cpp's -ub)."""
        p = rt.lib.llama_context_default_params()
        if kv is not None:
            p.type_k, p.type_v = ggml_type(rt, kv.k), ggml_type(rt, kv.v)
        p.flash_attn_type = getattr(rt.lib, FLASH_ATTN_TYPES[flash_attn])
        p.n_ctx = p.n_batch = n_ctx  # a decode of any length fits one batch
        p.n_ubatch = min(n_ubatch or n_ctx, n_ctx)  # llama.cpp clamps n_ubatch to n_batch too
        p.n_seq_max = 1
        if n_rs_seq and rt.build.has_rs_seq:  # recurrent-state snapshots: a hybrid target's rollback
            p.n_rs_seq = n_rs_seq  # llama.cpp clamps it to 0 for an arch that cannot use it
        p.n_threads = p.n_threads_batch = n_threads
        if tag is not None:
            p.cb_eval = rt.ffi.addressof(rt.lib, "fd_eval_callback")
            p.cb_eval_user_data = tag
        if ctx_other is not None:
            p.ctx_other = ctx_other.ptr
        if mtp:  # the MTP graph of the model's nextn layers (LLAMA_CONTEXT_TYPE_MTP), as common_speculative makes it
            p.ctx_type = rt.lib.LLAMA_CONTEXT_TYPE_MTP
        ptr = rt.lib.llama_init_from_model(model.ptr, p)
        if ptr == rt.ffi.NULL:
            told = (
                f" with K/V cache types {kv.k}/{kv.v} and -fa {flash_attn}"
                if kv is not None and kv != CacheTypes()
                else ""
            )
            raise InputError(
                f"{model.path}: llama_init_from_model failed{told}; a quantized K/V type needs head sizes "
                "that are a multiple of its block (32 for q8_0) and a quantized V needs -fa on; "
                f"set {ENV_VERBOSE}=1 to see llama.cpp's reason"
            )
        batch = rt.lib.llama_batch_ext_init(ptr) if rt.build.batch_api == binding.BATCH_EXT else None
        return Context(rt, ptr, model, batch, tag, n_ubatch=int(p.n_ubatch))

    @property
    def legacy(self) -> bool:
        """The build has the older batch API (llama_batch + llama_decode / llama_encode)."""
        return self.batch is None

    @property
    def inject_encodes_first(self) -> bool:
        """DFlash injection in two steps, as that generation's speculative.cpp does it:
        llama_encode the target features (fc, enc norm), then llama_decode the rows it made. The
        ext generation fuses both into one decode of the features."""
        return self.legacy

    def decode_tokens(self, tokens: list[int], positions: list[int], outputs: bool) -> None:
        lib, ffi = self.rt.lib, self.rt.ffi
        if self.legacy:
            self._decode_legacy(positions, tokens=tokens, outputs=outputs)
            return
        lib.llama_batch_ext_clear(self.batch)
        for tok, pos in zip(tokens, positions):
            idx = lib.llama_batch_ext_add_token(self.batch, 0, tok)
            lib.llama_batch_ext_set_pos(self.batch, idx, ffi.new("llama_pos[]", [pos] * 3 + [0]))
            lib.llama_batch_ext_set_output_logits(self.batch, idx, outputs)
        self._process(len(tokens))

    def decode_embd(self, rows: np.ndarray, positions: list[int]) -> None:
        """Decode an embd batch: `rows` is (n_tokens, n_embd_inp), one row per position."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)  # (n_tokens, n_embd_inp)
        if self.legacy:
            self._decode_legacy(positions, rows=rows)
            return
        self._embd_batch(rows, positions, outputs=False)
        self._process(len(positions), keep=rows)

    def _embd_batch(self, rows: np.ndarray, positions: list[int], outputs: bool) -> None:
        """The context's llama_batch_ext filled with one embedding row per position (`rows`
        contiguous float32, kept alive by the caller until the batch is processed)."""
        lib, ffi = self.rt.lib, self.rt.ffi
        base = ffi.from_buffer("float[]", rows)
        lib.llama_batch_ext_clear(self.batch)
        for i, pos in enumerate(positions):
            idx = lib.llama_batch_ext_add_embd(self.batch, 0, self._embd(base, i, rows.shape[1])[0])
            lib.llama_batch_ext_set_pos(self.batch, idx, ffi.new("llama_pos[]", [pos] * 3 + [0]))
            if outputs:
                lib.llama_batch_ext_set_output_logits(self.batch, idx, True)

    def _embd(self, base: Any, i: int, width: int) -> Any:
        """A `struct llama_embd *` viewing row `i` of the rows at `base`, `width` floats each."""
        return self.rt.ffi.new("struct llama_embd *", {"data": base + i * width, "n_rows": 1, "n_embd": width})

    def decode_tokens_embd(
        self, tokens: list[int], rows: np.ndarray, positions: list[int], outputs: bool, last_only: bool = False
    ) -> None:
        """Decode entries that carry both a token id and an embedding row (EAGLE3's decoder: token
        t+1 with the encoder's row of t; `rows` is (n_tokens, n_embd)), as common_batch::set_embd
        makes them (llama_batch_ext_set_embd_token after add_token); `last_only`: the last entry
        the only output (a chained MTP step)."""
        lib, ffi = self.rt.lib, self.rt.ffi
        if self.legacy:
            raise InputError(f"{self.model.path}: a batch of token ids with embeddings needs the llama_batch_ext API")
        rows = np.ascontiguousarray(rows, dtype=np.float32)  # (n_tokens, n_embd)
        base = ffi.from_buffer("float[]", rows)
        lib.llama_batch_ext_clear(self.batch)
        for i, (tok, pos) in enumerate(zip(tokens, positions)):
            idx = lib.llama_batch_ext_add_token(self.batch, 0, tok)
            lib.llama_batch_ext_set_pos(self.batch, idx, ffi.new("llama_pos[]", [pos] * 3 + [0]))
            if not lib.llama_batch_ext_set_embd_token(self.batch, idx, self._embd(base, i, rows.shape[1])[0]):
                raise RuntimeError(f"{self.model.path.name}: llama_batch_ext_set_embd_token refused entry {i}")
            lib.llama_batch_ext_set_output_logits(self.batch, idx, outputs and (not last_only or i == len(tokens) - 1))
        self._process(len(tokens), keep=rows)

    def process_encode(self, rows: np.ndarray, positions: list[int]) -> np.ndarray:
        """llama_process(ENCODE) of an embd batch (EAGLE3's encoder: one row per token, every row an
        output); return the rows the encoder made, read from the nextn embeddings: (n_tokens, n_embd)."""
        lib = self.rt.lib
        rows = np.ascontiguousarray(rows, dtype=np.float32)  # (n_tokens, n_embd_inp)
        self._embd_batch(rows, positions, outputs=True)
        rc = lib.llama_process(self.ptr, lib.LLAMA_PROCESS_TYPE_ENCODE, self.batch)
        if rc != 0:
            raise RuntimeError(
                f"llama_process(ENCODE) on {self.model.path.name} failed: rc={rc}, n_tokens={len(positions)}"
            )
        return self.nextn_rows(len(positions))

    def nextn_rows(self, n_rows: int) -> np.ndarray:
        """Every output row's nextn embedding of the last batch: (n_rows, n_embd)."""
        ptr = self.rt.lib.fd_get_embeddings_nextn(self.ptr)
        if ptr == self.rt.ffi.NULL:
            raise RuntimeError(f"{self.model.path.name}: the last batch made no nextn embeddings")
        flat = np.frombuffer(self.rt.ffi.buffer(ptr, 4 * n_rows * self.model.n_embd), dtype=np.float32)
        return flat.reshape(n_rows, self.model.n_embd).copy()  # (n_rows, n_embd)

    def encode_embd(self, rows: np.ndarray) -> np.ndarray:
        """llama_encode an embd batch (the older generation's DFlash encoder: no positions, no
        sequence ids, as upstream passes it); return the rows it made: (n_tokens, n_embd)."""
        lib, ffi = self.rt.lib, self.rt.ffi
        rows = np.ascontiguousarray(rows, dtype=np.float32)  # (n_tokens, n_embd_inp)
        batch = ffi.new("struct llama_batch *")
        batch.n_tokens = rows.shape[0]
        batch.embd = ffi.from_buffer("float[]", rows)
        rc = lib.llama_encode(self.ptr, batch[0])
        if rc != 0:
            raise RuntimeError(f"llama_encode on {self.model.path.name} failed: rc={rc}, n_tokens={rows.shape[0]}")
        ptr = lib.fd_get_embeddings_nextn(self.ptr)
        if ptr == ffi.NULL:
            raise RuntimeError(f"{self.model.path.name}: llama_encode made no nextn embeddings")
        n_embd = self.model.n_embd
        flat = np.frombuffer(ffi.buffer(ptr, 4 * rows.shape[0] * n_embd), dtype=np.float32)
        return flat.reshape(rows.shape[0], n_embd).copy()  # (n_tokens, n_embd)

    def _decode_legacy(
        self,
        positions: list[int],
        tokens: list[int] | None = None,
        rows: np.ndarray | None = None,
        outputs: bool = False,
    ) -> None:
        """One llama_decode of a llama_batch the library allocates: token ids, or embedding rows."""
        lib, ffi = self.rt.lib, self.rt.ffi
        n = len(positions)
        batch = lib.llama_batch_init(n, 0 if rows is None else rows.shape[1], 1)
        try:
            if rows is not None:
                ffi.memmove(batch.embd, ffi.from_buffer("float[]", rows), rows.nbytes)
            for i, pos in enumerate(positions):
                if tokens is not None:
                    batch.token[i] = tokens[i]
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = outputs
            batch.n_tokens = n
            rc = lib.llama_decode(self.ptr, batch)
        finally:
            lib.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode on {self.model.path.name} failed: rc={rc}, n_tokens={n}")

    def _process(self, n_tokens: int, keep: Any = None) -> None:
        rc = self.rt.lib.llama_process(self.ptr, self.rt.lib.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_process on {self.model.path.name} failed: rc={rc}, n_tokens={n_tokens}")

    def logits(self, i: int) -> np.ndarray:
        ptr = self.rt.lib.llama_get_logits_ith(self.ptr, i)
        return np.frombuffer(self.rt.ffi.buffer(ptr, 4 * self.model.n_vocab), dtype=np.float32).copy()

    def nextn_value(self, i: int) -> float:
        """Column 0 of output row `i`'s nextn embedding: DSpark's confidence of that row."""
        ptr = self.rt.lib.fd_get_embeddings_nextn_ith(self.ptr, i)
        if ptr == self.rt.ffi.NULL:
            raise RuntimeError(f"{self.model.path.name}: no nextn output at row {i}")
        return float(ptr[0])

    def nextn_row(self, i: int, width: int | None = None) -> np.ndarray:
        """Output row `i`'s nextn embedding, n_embd floats (`width`, where the model's is another:
        Gemma 4's assistant hands back the target's width): a DFlash2 drafter's lattice row."""
        ptr = self.rt.lib.fd_get_embeddings_nextn_ith(self.ptr, i)
        if ptr == self.rt.ffi.NULL:
            raise RuntimeError(f"{self.model.path.name}: no nextn output at row {i}")
        n = self.model.n_embd if width is None else width
        return np.frombuffer(self.rt.ffi.buffer(ptr, 4 * n), dtype=np.float32).copy()

    def layer_input(self, layer: int, n_tokens: int) -> np.ndarray:
        """The tapped input of target layer `layer` for the last batch: (n_tokens, n_embd)."""
        ptr = self.rt.lib.fd_get_embeddings_layer_inp(self.ptr, layer)
        if ptr == self.rt.ffi.NULL:
            raise RuntimeError(f"layer {layer} input was not extracted")
        n_embd = self.model.n_embd
        flat = np.frombuffer(self.rt.ffi.buffer(ptr, 4 * n_tokens * n_embd), dtype=np.float32)
        return flat.reshape(n_tokens, n_embd).copy()  # (n_tokens, n_embd)

    def set_nextn_layer_offset(self, k: int) -> None:
        """The MTP head the next decodes run: layer n_layer + k (llama_set_nextn_layer_offset)."""
        self.rt.lib.fd_set_nextn_layer_offset(self.ptr, k)

    def seq_rm(self, p0: int) -> bool:
        """Drop the cells at positions >= p0; False where the memory refused (a recurrent state
        rolls back only as far as its n_rs_seq snapshots reach, llama-memory-recurrent.cpp seq_rm)."""
        return bool(self.rt.lib.llama_memory_seq_rm(self.rt.lib.llama_get_memory(self.ptr), 0, p0, -1))

    def pos_max(self) -> int:
        """The last position the sequence holds in memory (-1: none)."""
        return int(self.rt.lib.llama_memory_seq_pos_max(self.rt.lib.llama_get_memory(self.ptr), 0))

    def free(self) -> None:
        if not self.legacy:
            self.rt.lib.llama_batch_ext_free(self.batch)
        self.rt.lib.llama_free(self.ptr)


@dataclass
class Spool:
    """The shim's capture state: filters per role, the current eval, the spool files."""

    rt: Runtime
    ptr: Any
    prefix: Path

    @staticmethod
    def open(rt: Runtime, prefix: Path, filters: dict[int, list[str]]) -> "Spool":
        ptr = rt.lib.fd_capture_open(str(prefix).encode())
        if ptr == rt.ffi.NULL:
            failed = OSError(rt.ffi.errno, os.strerror(rt.ffi.errno), f"{prefix}.*")  # open(2)'s errno
            for suffix in (".data", ".index"):  # it may have created one of the two
                Path(f"{prefix}{suffix}").unlink(missing_ok=True)
            if is_no_room(failed):
                raise failed
            raise InputError(f"{prefix}.index: cannot create the capture spool; check the output directory is writable")
        for role, globs in filters.items():
            for g in globs:
                if rt.lib.fd_capture_add_filter(ptr, role, g.encode()) != 0:
                    raise InputError(f"--filter {g!r}: too many filters (at most 64 per role)")
        return Spool(rt, ptr, prefix)

    def tag(self, role: int) -> Any:
        return self.rt.lib.fd_tag_new(self.ptr, role)

    def begin_eval(self, eval_index: int) -> None:
        self.rt.lib.fd_capture_begin_eval(self.ptr, eval_index)

    def note(self, kind: str, payload: dict[str, Any]) -> None:
        line = json.dumps({"kind": kind, **payload}, sort_keys=True)
        if self.rt.lib.fd_capture_note(self.ptr, line.encode()) != 0:
            raise self.write_error()

    def add_rows(self, role: int, name: str, rows: np.ndarray) -> None:
        """Record `rows` `(n_rows, n_cols)`, read back through the API, under `name` in the current eval."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)  # (n_rows, n_cols)
        data = self.rt.ffi.from_buffer("float[]", rows)
        if self.rt.lib.fd_capture_add_rows(self.ptr, role, name.encode(), data, rows.shape[1], rows.shape[0]) != 0:
            raise self.write_error()

    def write_error(self) -> OSError:
        """The spool write that failed, with the shim's errno when a write(2) failed: ENOSPC,
        EDQUOT and EFBIG are a spool out of room (featdiff.core.outputs.is_no_room), not a bug."""
        code = self.rt.lib.fd_capture_errno(self.ptr)
        if code:
            return OSError(code, os.strerror(code), f"{self.prefix}.*")
        return OSError(f"{self.prefix}.*: the shim failed to write the spool (error {self.error()})")

    def error(self) -> int:
        """The shim's first error (an FD_E* code), 0 if none: its callback cannot raise one."""
        return int(self.rt.lib.fd_capture_error(self.ptr))

    def close(self) -> OSError | None:
        """Close the spool files (once; again is a no-op). The write the shim's callback could not
        make (it cannot raise), None when every write succeeded."""
        if self.ptr == self.rt.ffi.NULL:
            return None
        failed = self.write_error() if self.error() else None
        ptr, self.ptr = self.ptr, self.rt.ffi.NULL
        rc = self.rt.lib.fd_capture_close(ptr)
        return failed or (OSError(f"{self.prefix}.*: closing the spool failed (error {rc})") if rc else None)


def ggml_type(rt: Runtime, name: str) -> int:
    """The build's ggml_type value of a KV cache type name (`q8_0`: GGML_TYPE_Q8_0)."""
    value = getattr(rt.lib, f"GGML_TYPE_{name.upper()}", None)
    if value is None:
        raise InputError(
            f"KV cache type {name!r}: the binding knows no GGML_TYPE_{name.upper()}; use one of "
            "f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"
        )
    return int(value)
