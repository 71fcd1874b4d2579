"""How a run chose its tokens: the sampler a dump records per flow (the manifest's `samplers`,
docs/dump.md), read from llama.cpp's command-line flags or the server's own account of a request,
and which tokens llama.cpp's sampler chain can draw from one row of logits (common/sampling.cpp).
A dump without the record, or a sampler at temperature <= 0, chose greedily.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from featdiff.dump.manifest_fields import Fields, as_bool, as_count, as_int, as_number, as_str, as_strs

# common/common.h `common_params_sampling`: the defaults of every llama.cpp program and of
# llama-server's requests that leave a field out (its own flags change them)
DEFAULT_TEMPERATURE = 0.80
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed per sampler
DEFAULT_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
# common/speculative.cpp: every drafter's own sampler is top-k 10 and drafts its first candidate
# (greedy), on the backend unless --no-spec-draft-backend-sampling
DRAFT_TOP_K = 10
SOURCES = ("request", "command_line")

# llama.cpp's flags (common/arg.cpp) -> Sampler field; the value is parsed as the field's type
FLAGS: dict[str, str] = {
    "--temp": "temperature",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--min-p": "min_p",
    "--typical": "typical_p",
    "--repeat-last-n": "repeat_last_n",
    "--repeat-penalty": "repeat_penalty",
    "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty",
    "--dry-multiplier": "dry_multiplier",
    "--top-nsigma": "top_n_sigma",
    "--xtc-probability": "xtc_probability",
    "--mirostat": "mirostat",
    "-s": "seed",
    "--seed": "seed",
}
NO_DRAFT_BACKEND_FLAG = "--no-spec-draft-backend-sampling"
# llama-server's account of a request (tools/server/server-task.cpp task_params::to_json) -> field
REQUEST_KEYS = {f: f for f in FLAGS.values()}


@dataclass(frozen=True)
class Sampler:
    """The target's sampler chain of one flow, as llama.cpp built it (`common_sampler_init`), and
    where the drafter's sampler ran. Names and defaults are llama.cpp's."""

    flow: int
    source: str  # "request": the server's account of the request; "command_line": the program's flags
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    mirostat: int = 0
    seed: int = DEFAULT_SEED
    samplers: tuple[str, ...] = DEFAULT_CHAIN
    draft_backend_sampling: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def unmodelled(self) -> tuple[str, ...]:
        """The active stages of the chain whose cut `could_draw` does not compute: they depend on
        the history (penalties, DRY), or on a random draw (XTC), or replace the chain (mirostat)."""
        active = {
            "penalties": self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0,
            "dry": self.dry_multiplier > 0.0,
            "top_n_sigma": self.top_n_sigma > 0.0,
            "typ_p": self.typical_p < 1.0,
            "xtc": self.xtc_probability > 0.0,
        }
        found = [s for s in self.samplers if active.get(s, False)]
        return (*found, "mirostat") if self.mirostat else tuple(found)

    def describe(self) -> str:
        """One phrase: 'temperature 0.8, top-k 40, top-p 0.95, min-p 0.05'."""
        if self.is_greedy:
            return "greedy (temperature <= 0)"
        return f"temperature {self.temperature:g}, top-k {self.top_k}, top-p {self.top_p:g}, min-p {self.min_p:g}" + (
            f" ({', '.join(self.unmodelled)} not modelled)" if self.unmodelled else ""
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["samplers"] = list(self.samplers)
        return dict(sorted(out.items()))

    @staticmethod
    def from_json(d: Any, at: str = "sampler") -> Sampler:
        f = Fields.of(d, at)
        kw: dict[str, Any] = {}
        for field in fields(Sampler):
            if field.name in ("flow", "source"):
                continue
            default = getattr(_DEFAULT, field.name)
            reader = _READERS[type(default)]
            kw[field.name] = f.get(field.name, reader, default=default)
        return Sampler(flow=f.get("flow", as_count), source=f.get("source", as_str, SOURCES), **kw)


_DEFAULT = Sampler(flow=0, source="command_line")
_READERS: dict[type, Any] = {float: as_number, int: as_int, bool: as_bool, tuple: as_strs}


def sampler_from_command(command: list[str], flow: int = 0) -> Sampler:
    """The sampler a llama.cpp program's flags set (llama.cpp's defaults for those it leaves out):
    a program's, or llama-server's defaults for a request that sends no sampling fields."""
    kw: dict[str, Any] = {}
    for i, arg in enumerate(command[1:], 1):
        name, eq, value = arg.partition("=")
        field = FLAGS.get(name)
        if field is not None:
            raw = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            kw[field] = _parsed(field, raw)
        elif arg == NO_DRAFT_BACKEND_FLAG:
            kw["draft_backend_sampling"] = False
        elif name == "--samplers" and (eq or i + 1 < len(command)):
            kw["samplers"] = tuple(s for s in (value if eq else command[i + 1]).split(";") if s)
    return replace(_DEFAULT, flow=flow, **{k: v for k, v in kw.items() if v is not None})


def sampler_from_request(params: dict[str, Any], flow: int, defaults: Sampler) -> Sampler:
    """The sampler of one request, from llama-server's account of it (`params` of a slot's JSON),
    the server's `defaults` for what it does not say."""
    kw: dict[str, Any] = {}
    for key, field in REQUEST_KEYS.items():
        if key in params:
            kw[field] = _parsed(field, params[key])
    if isinstance(params.get("samplers"), list):
        kw["samplers"] = tuple(str(s) for s in params["samplers"])
    return replace(defaults, flow=flow, source="request", **{k: v for k, v in kw.items() if v is not None})


def _parsed(field: str, raw: Any) -> Any:
    """`raw` as the field's type; None when it is not a number (llama.cpp would refuse it)."""
    kind = type(getattr(_DEFAULT, field))
    try:
        return kind(float(raw)) if kind is int else kind(raw)
    except (TypeError, ValueError):
        return None


def could_draw(logits: np.ndarray, token: int, s: Sampler, slack: float) -> bool:
    """Whether the chain's cuts (top-k, top-p, min-p, in the sampler's order) keep `token` of one
    row of logits (n_vocab,) when its logit is raised by `slack` (the noise bound on a margin):
    a token the sampler could have drawn from those logits, within the numerics. Temperature > 0
    changes the probabilities, not the support; temperature <= 0 keeps the argmax alone."""
    row = np.array(logits, dtype=np.float64)  # (n_vocab,)
    row[token] += slack
    return bool(kept_tokens(row, s)[token])


def kept_tokens(row: np.ndarray, s: Sampler) -> np.ndarray:
    """The tokens of one row of logits (n_vocab,) the chain's cuts keep, as a mask (n_vocab,)."""
    if s.is_greedy:
        return row >= row.max()
    kept = np.isfinite(row)  # (n_vocab,)
    for stage in s.samplers:
        if stage == "top_k" and s.top_k > 0:
            kept &= row >= _kth_largest(row[kept], s.top_k)
        elif stage == "top_p" and s.top_p < 1.0:
            kept &= _top_p(row, kept, s.top_p)
        elif stage == "min_p" and s.min_p > 0.0:
            kept &= row >= row[kept].max() + math.log(s.min_p)
    return kept


def chain_probs(logits: np.ndarray, s: Sampler) -> np.ndarray:
    """The probabilities (n_vocab,) the chain draws the token from: the softmax at the sampler's
    temperature of the tokens its cuts keep (greedy: the argmax, certain)."""
    row = np.asarray(logits, dtype=np.float64)  # (n_vocab,)
    kept = kept_tokens(row, s)
    if s.is_greedy:
        return (np.arange(len(row)) == int(np.argmax(row))).astype(np.float64)
    scaled = np.where(kept, (row - row[kept].max()) / s.temperature, -np.inf)  # (n_vocab,)
    probs = np.exp(scaled)
    return probs / probs.sum()


def expected_accepted(p_draft: list[float]) -> float:
    """llama.cpp's expected accepted drafts when the target's sample at row j equals draft j with
    probability p_draft[j] and drafts are kept while they agree (common_sampler_sample_and_accept_n):
    sum over k of prod_{j <= k} p_draft[j]."""
    out, run = 0.0, 1.0
    for p in p_draft:
        run *= p
        out += run
    return out


def _kth_largest(values: np.ndarray, k: int) -> float:
    return float(np.partition(values, -k)[-k]) if k < len(values) else float(values.min())


def _top_p(row: np.ndarray, kept: np.ndarray, p: float) -> np.ndarray:
    """llama.cpp's top-p on the kept tokens: in descending order, a token stays while the
    probability of those above it is below p (llama-sampler.cpp llama_sampler_top_p_apply)."""
    logits = row[kept]  # (n_kept,)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-logits, kind="stable")
    above = np.concatenate(([0.0], np.cumsum(probs[order])[:-1]))  # (n_kept,) mass before each, in order
    stays = np.zeros(len(logits), dtype=bool)
    stays[order] = above < p
    out = np.zeros(len(row), dtype=bool)
    out[np.flatnonzero(kept)] = stays
    return out
