"""The trained pair, trained once per machine: a directory per key under $FEATDIFF_CACHE/trained
(else ~/.cache/featdiff/trained) holding one safetensors file per checkpoint and `meta.json`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from featdiff.factory.pairs import BLOCK_SIZE, Sizes
from featdiff.core.cache_dir import cache_root, making
from featdiff.factory.training.train import DEFAULT_CONFIG, TRAINED_SIZES, TrainConfig, TrainedPair, train_pair

log = logging.getLogger(__name__)

# The code the trained weights depend on is part of the cache key: editing it retrains (once).
KEYED_SOURCES = ("factory/training/*.py", "torchref/**/*.py", "factory/pairs.py")
PACKAGE_DIR = Path(__file__).resolve().parents[2]
CACHE_SUBDIR = "trained"
META_FILE = "meta.json"
CHECKPOINTS = ("target", "draft", "draft_log_snr", "draft_dspark")  # TrainedPair fields, one safetensors file each
LAYER_PREFIX = "layers."


def trained_pair(seed: int, sizes: Sizes = TRAINED_SIZES, config: TrainConfig = DEFAULT_CONFIG) -> TrainedPair:
    """The trained pair of `seed`: from the cache, else trained (about 30 s) and cached."""
    path = cache_dir() / cache_key(seed, sizes, config)
    with making(path):  # another process training the same key: wait for its files
        if not (path / META_FILE).is_file():
            log.info("training the tiny DFlash and DSpark drafters of seed %d (once; cached in %s)", seed, path)
            pair = train_pair(seed, sizes, config)
            log.info(
                "trained in %.1f s; held-out mean accepted length, %d drafts a block (reference): %s",
                pair.meta["train_seconds"],
                BLOCK_SIZE - 1,
                pair.meta["held_out_mean_accepted_length"],
            )
            _store(pair, path)
    return _load(path)


def trained_once(key: str, what: str, train: Callable[[], tuple[dict[str, dict[str, np.ndarray]], dict]]) -> Path:
    """The cache entry `key` (a directory): made by `train()` (weight files and META_FILE, as
    `store` takes them) unless another process or an earlier run made it; `what` names the
    model in the log. A drafter's meta states `train_seconds`, `held_out_mean_accepted` and
    `held_out.draft_max`."""
    path = cache_dir() / key
    with making(path):  # another process training the same key: wait for its files
        if not (path / META_FILE).is_file():
            log.info("training the tiny %s (once; cached in %s)", what, path)
            files, meta = train()
            log.info(
                "trained in %.1f s; held-out mean accepted drafts of %d (reference): %s",
                meta["train_seconds"],
                meta["held_out"]["draft_max"],
                meta["held_out_mean_accepted"],
            )
            store(path, files, meta)
    return path


def cache_dir() -> Path:
    """The trained pairs' directory in featdiff's cache (featdiff.core.cache_dir)."""
    return cache_root() / CACHE_SUBDIR


def cache_key(seed: int, sizes: Sizes, config: TrainConfig) -> str:
    """What the trained weights depend on: the code, seed, sizes, settings and torch."""
    spec = {
        "code": _code_digest(),
        "seed": seed,
        "sizes": asdict(sizes),
        "config": asdict(config),
        "torch": torch.__version__,
    }  # float results may move with torch; a retrain is cheap
    return f"seed{seed}-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _code_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(p for pattern in KEYED_SOURCES for p in PACKAGE_DIR.glob(pattern)):
        h.update(f.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _store(pair: TrainedPair, path: Path) -> None:
    store(path, {f"{name}.safetensors": _flat(getattr(pair, name)) for name in CHECKPOINTS}, pair.meta)


def store(path: Path, files: dict[str, dict[str, np.ndarray]], meta: dict) -> None:
    """A trained model's weight files (file name -> its tensors) and META_FILE at `path`: written
    into a private directory, then renamed into place; a concurrent writer may win."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, tensors in files.items():
        save_file(tensors, str(tmp / name))
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    try:
        tmp.rename(path)
    except OSError:  # the same key was stored meanwhile: keep that one (same seed, same weights)
        shutil.rmtree(tmp)


def _load(path: Path) -> TrainedPair:
    parts = {name: _nested(load_file(str(path / f"{name}.safetensors"))) for name in CHECKPOINTS}
    return TrainedPair(**parts, meta=json.loads((path / META_FILE).read_text()))


def _flat(w: dict) -> dict[str, np.ndarray]:
    """A fixtures weight dict under flat safetensors names: `fc`, `layers.<il>.<name>`."""
    flat = {k: np.ascontiguousarray(a) for k, a in w.items() if k != "layers"}
    flat.update(
        {
            f"{LAYER_PREFIX}{il}.{k}": np.ascontiguousarray(a)
            for il, layer in enumerate(w["layers"])
            for k, a in layer.items()
        }
    )
    return flat


def _nested(flat: dict[str, np.ndarray]) -> dict:
    """The inverse of `_flat`."""
    w: dict = {k: a for k, a in flat.items() if not k.startswith(LAYER_PREFIX)}
    per_layer = [k.removeprefix(LAYER_PREFIX).split(".", 1) for k in flat if k.startswith(LAYER_PREFIX)]
    w["layers"] = [{} for _ in range(1 + max(int(il) for il, _ in per_layer))]
    for il, name in per_layer:
        w["layers"][int(il)][name] = flat[f"{LAYER_PREFIX}{il}.{name}"]
    return w
