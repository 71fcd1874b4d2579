"""A tiny *trained* MTP head (fixture variant `trained-mtp`), so that an MTP drafter's accept rate
means something. Consumes a Qwen3.5 checkpoint that carries an MTP head (fixtures_mtp writes one)
and a seed; produces the head's `mtp.*` tensors trained on the target's own greedy text, under the
checkpoint's names and in its convention (zero-centred norms), trained once per machine and cached
beside the trained pairs (training.cache).

The objective is what llama.cpp's qwen35 MTP graph computes (torchref.mtp.decode), run as its
speculative flow runs it (torchref.mtp_flow), on the target's greedy corpus:
* step one, row q: (token q, the target's post-norm hidden of q - 1; zeros at q = 0) at position q,
  causal over the sequence's rows, predicts token q + 1 (a process row, and a round's first draft);
* step k > 1 recycles anchor row q: (token q + k - 1, step k - 1's h_nextn) at position q + k - 1,
  predicting token q + k; it sees step one's rows up to q and its own earlier steps, as a draft
  step sees the head's cache (the process rows, then the round's drafts).
Every row is a `decode` of the reference: step one a sequence at a time, each recycled step an
anchor at a time (no position mask can give each anchor its own cells). The head reads the
target's token_embd and output, which stay as they are.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file
from torch.nn.functional import cross_entropy

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.torchref.attention import empty_cache, truncated
from featdiff.torchref.load import load_target
from featdiff.torchref.mtp.head import MtpHead, MtpPass, decode
from featdiff.torchref.mtp.hf import HF_MTP_PREFIX, hf_head_tensors, mtp_from_hf
from featdiff.torchref.mtp.flow import run_flow, target_hidden
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.target import forward_target
from featdiff.torchref.weights import Target, hf_sha256
from featdiff.factory.training import cache
from featdiff.factory.training.corpus import CPU, Corpus, f32_cache, held_out_prompts, prompts
from featdiff.factory.training.train import _fit, _torch_threads


STREAM_MTP = 7  # rng stream per seed of the batches (corpus.py holds 1, 2; train.py 3 to 5; eagle3.py 6)
DRAFT_MAX = 3  # llama.cpp's --spec-draft-n-max default: drafts a held-out round makes
F32_KV = Numerics(torch.float32, CPU, "f32")  # how accept is measured: training emulates no f16 cache
CACHE_PREFIX = "mtp-"  # its cache entries, beside the trained pairs' (training.cache)
HEAD_FILE = "head.safetensors"


@dataclass(frozen=True)
class MtpConfig:
    """How much corpus and training; the defaults take about a minute on one busy CPU core."""

    n_prompts: int = 512
    n_tokens: int = 48  # per corpus sequence: prompt + greedy continuation
    n_held_out: int = 16  # held-out prompts accept is measured on
    held_out_rounds: int = 8  # rounds of DRAFT_MAX drafts per held-out prompt
    steps: int = 300
    seqs_per_step: int = 8
    anchors_per_seq: int = 2  # rows of a sequence the recycled steps start from (each a decode per step)
    ttt_steps: int = DRAFT_MAX  # step one and the recycled steps: one per draft of a round
    ttt_decay: float = 0.8  # step k's loss weighs ttt_decay^(k-1) (SpecForge's 0.8, as eagle3.py)
    lr: float = 1e-2
    threads: int = 1  # torch intra-op threads: the machine is shared (eagle3.py's reason)


DEFAULT_CONFIG = MtpConfig()


@dataclass(frozen=True)
class TrainedMtp:
    """The trained head's tensors (the checkpoint's `mtp.*` names and convention) and how training went."""

    head: dict[str, np.ndarray]
    meta: dict  # train_seconds (corpus and training), held-out mean accepted drafts per round (trained and
    #             untrained; reference run_flow, f32 KV) and how they were measured


def trained_mtp(hf: Path, seed: int, config: MtpConfig = DEFAULT_CONFIG) -> TrainedMtp:
    """The MTP head of the checkpoint `hf` trained on its target: from the cache, else trained
    (about a minute) and cached."""
    path = cache.trained_once(
        cache_key(hf, seed, config), f"MTP head of seed {seed}", partial(_files, hf, seed, config)
    )
    return TrainedMtp(head=load_file(str(path / HEAD_FILE)), meta=json.loads((path / cache.META_FILE).read_text()))


def cache_key(hf: Path, seed: int, config: MtpConfig) -> str:
    """What the trained head depends on: the code (training.cache's digest), the checkpoint's
    bytes (its target and initial head), seed, settings, torch and transformers."""
    import transformers  # the target runs through its model code

    spec = {
        "code": cache._code_digest(),
        "checkpoint": hf_sha256(Path(hf)),
        "seed": seed,
        "config": asdict(config),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return f"{CACHE_PREFIX}seed{seed}-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def train_mtp(hf: Path, seed: int, config: MtpConfig = DEFAULT_CONFIG) -> TrainedMtp:
    """The checkpoint's target, its greedy corpus, and the checkpoint's head trained on it."""
    start = time.perf_counter()
    with _torch_threads(config.threads):
        target = load_target(Path(hf), torch.float32, CPU)
        base = mtp_from_hf(Path(hf), torch.float32, CPU)
        corpus = make_corpus(target, Path(hf), prompts(seed, config.n_prompts, pairs.TINY), config.n_tokens)
        init = checkpoint_head(Path(hf))
        rng = np.random.default_rng((seed, STREAM_MTP))
        head = train_head(base, corpus, init, config, rng)
        train_seconds = time.perf_counter() - start
        held_out = held_out_prompts(seed, config.n_held_out, pairs.TINY)
        accepted = {
            name: held_out_accepted(target, head_with(base, as_tensors(w)), held_out, config.held_out_rounds)
            for name, w in (("trained", head), ("untrained", init))
        }
    meta = {
        "train_seconds": round(train_seconds, 1),
        "held_out_mean_accepted": accepted["trained"],
        "untrained_held_out_mean_accepted": accepted["untrained"],
        "held_out": {"prompts": config.n_held_out, "rounds": config.held_out_rounds, "draft_max": DRAFT_MAX},
    }
    return TrainedMtp(head=head, meta=meta)


def train_head(
    base: MtpHead, corpus: Corpus, init: dict[str, np.ndarray], config: MtpConfig, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """The head's `mtp.*` tensors trained from `init` on the corpus; `base` gives the rest of the
    head (its sizes and the target's tables)."""
    w = as_tensors(init, trainable=True)
    _fit([(list(w.values()), config.lr)], config.steps, _losses(base, w, corpus, config, rng))
    return {k: t.detach().numpy().copy() for k, t in w.items()}


def checkpoint_head(hf: Path) -> dict[str, np.ndarray]:
    """The checkpoint's `mtp.*` tensors, as it holds them."""
    w: dict[str, np.ndarray] = {}
    for f in sorted(Path(hf).glob(names.HF_WEIGHTS_GLOB)):
        with safe_open(str(f), "np") as st:
            w.update({k: st.get_tensor(k) for k in st.keys() if k.startswith(HF_MTP_PREFIX)})  # noqa: SIM118
    return w


def head_with(base: MtpHead, w: dict[str, torch.Tensor]) -> MtpHead:
    """`base` with its own tensors taken from `w` (the checkpoint's names and convention), every
    norm plus one as mtp_from_hf loads it: autograd reaches `w` through the head."""
    return replace(base, **hf_head_tensors(w.__getitem__))


def as_tensors(w: dict[str, np.ndarray], trainable: bool = False) -> dict[str, torch.Tensor]:
    """float32 torch copies of `w`; with `trainable`, autograd leaves."""
    return {k: torch.tensor(a, dtype=torch.float32, requires_grad=trainable) for k, a in w.items()}


def make_corpus(target: Target, hf: Path, chosen: tuple[tuple[int, ...], ...], n_tokens: int) -> Corpus:
    """Each prompt continued greedily to `n_tokens`, with the target's post-norm hidden of every
    token as `features` `(n_seq, n_tokens, n_embd)`: what the flow hands the head."""
    guesses = greedy_guesses(hf, chosen, n_tokens)
    with torch.no_grad():
        seqs, hidden = zip(*(greedy_sequence(target, g, len(p)) for p, g in zip(chosen, guesses, strict=True)))
    first = torch.tensor([len(p) - 1 for p in chosen])
    return Corpus(tokens=torch.stack(seqs), features=torch.stack(hidden), first_anchor=first)


def greedy_guesses(hf: Path, chosen: tuple[tuple[int, ...], ...], n_tokens: int) -> torch.Tensor:
    """transformers' own greedy continuation of each prompt to `n_tokens` `(n_seq, n_tokens)`,
    the prompts of one length as one batch through its KV and recurrent caches: a first guess.

    The reference's forward (HfTarget) runs one sequence at a time and reruns the recurrent
    history on every eval: decoding the corpus token by token through it takes minutes, checking
    a whole guessed sequence one pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, local_files_only=True).eval()
    lengths = torch.tensor([len(p) for p in chosen])
    out = torch.zeros((len(chosen), n_tokens), dtype=torch.int64)
    with torch.no_grad():
        for n_prompt in sorted(set(lengths.tolist())):
            rows = (lengths == n_prompt).nonzero()[:, 0]
            tokens = [torch.tensor([chosen[int(i)] for i in rows])]  # (n_batch, n_prompt)
            step = model(input_ids=tokens[0], use_cache=True)
            for _ in range(n_tokens - n_prompt):
                tokens.append(step.logits[:, -1:].argmax(-1))  # (n_batch, 1)
                step = model(input_ids=tokens[-1], past_key_values=step.past_key_values, use_cache=True)
            out[rows] = torch.cat(tokens, dim=1)  # (n_batch, n_tokens)
    return out


def greedy_sequence(target: Target, guess: torch.Tensor, n_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference target's greedy continuation of `guess[:n_prompt]` to its length `(n_tokens,)`,
    and the post-norm hidden along it `(n_tokens, n_embd)` (mtp_flow.target_hidden).

    By fixed-point iteration from `guess` (eagle3.greedy_sequence's): each pass sets every
    continuation token to the target's argmax after the tokens before it; a pass that changes
    nothing leaves the greedy continuation, so a right guess takes one pass."""
    n_tokens, seq = guess.shape[0], guess
    for _ in range(n_tokens - n_prompt + 1):
        tp = forward_target(target, seq, torch.arange(n_tokens), f32_cache(target.hparams), has_outputs=True)
        greedy = torch.cat([seq[:n_prompt], tp.logits[n_prompt - 1 : -1].argmax(-1)])  # (n_tokens,)
        if torch.equal(greedy, seq):
            return seq, target_hidden(target, tp, is_prenorm=False).handed  # Qwen3.5: the post-norm hidden
        seq = greedy
    raise ValueError(f"the greedy continuation of {guess[:n_prompt].tolist()} did not settle")


def step_one(head: MtpHead, tokens: torch.Tensor, hidden: torch.Tensor) -> MtpPass:
    """decode over one sequence's rows (token q, hidden q - 1) at positions 0 .. n_tokens-1, as
    process() runs them; tokens `(n_tokens,)`, hidden `(n_tokens, n_embd)`."""
    hp = head.hparams
    first = torch.zeros((1, hp.n_embd), dtype=hidden.dtype)  # no hidden before row 0: mtp_flow's first pending row
    h = torch.cat([first, hidden[:-1]])  # (n_tokens, n_embd): row q is handed hidden q - 1
    cache = empty_cache(1, hp.n_head_kv, hp.n_embd_head, "f32", CPU)
    return decode(head, tokens, h, torch.arange(tokens.shape[0]), cache)


def recycled_steps(head: MtpHead, one: MtpPass, tokens: torch.Tensor, anchor: int, n_steps: int) -> list[torch.Tensor]:
    """Steps 2 .. `n_steps` of anchor row `anchor` (module docstring), each a decode over step
    one's cells up to the anchor and the steps before it; their logits, `(1, n_vocab)` each."""
    cache, h = truncated(one.cache, anchor + 1), one.h_nextn[anchor : anchor + 1]  # (1, n_embd)
    logits = []
    for k in range(1, n_steps):
        pos = anchor + k
        mp = decode(head, tokens[pos : pos + 1], h, torch.tensor([pos]), cache)
        logits.append(mp.logits)
        cache, h = mp.cache, mp.h_nextn  # the chain recycles h_nextn
    return logits


def mtp_loss(
    head: MtpHead, corpus: Corpus, seqs: torch.Tensor, anchors: np.ndarray, n_steps: int, decay: float
) -> torch.Tensor:
    """Cross-entropy of each step's rows against the sequence's next token, over the target's
    greedy tokens only (prompt tokens are random): step one on every row of `seqs`, the recycled
    steps on `anchors` `(n_seq, n_anchors)` (rows that leave every step's label inside the
    sequence); step k weighs decay^(k-1)."""
    n_tokens = corpus.tokens.shape[1]
    per_step: list[list[torch.Tensor]] = [[] for _ in range(n_steps)]
    for s, row_anchors in zip(seqs.tolist(), anchors, strict=True):
        tokens, first = corpus.tokens[s], int(corpus.first_anchor[s])
        one = step_one(head, tokens, corpus.features[s])
        rows = slice(first, n_tokens - 1)  # label token q + 1 is greedy from q = first on
        per_step[0].append(cross_entropy(one.logits[rows], tokens[first + 1 :], reduction="none"))
        for q in row_anchors.tolist():
            for k, logits in enumerate(recycled_steps(head, one, tokens, q, n_steps), start=1):
                per_step[k].append(cross_entropy(logits, tokens[q + k + 1 : q + k + 2], reduction="none"))
    total, weight = torch.zeros(()), 0.0
    for k, ce in enumerate(per_step):
        if ce:  # no anchors: step one alone
            total = total + decay**k * torch.cat(ce).mean()
            weight += decay**k
    return total / weight


def held_out_accepted(
    target: Target, head: MtpHead, chosen: tuple[tuple[int, ...], ...], rounds: int, numerics: Numerics = F32_KV
) -> float:
    """Mean accepted drafts per round of the reference's MTP flow (`run_flow`, greedy, DRAFT_MAX
    drafts a round) over `rounds` rounds of each prompt."""
    with torch.no_grad():
        accepted = [
            r.accepted for p in chosen for r in run_flow(target, head, p, rounds, numerics, draft_max=DRAFT_MAX).rounds
        ]
    return float(np.mean(accepted))


def _losses(
    base: MtpHead, w: dict[str, torch.Tensor], corpus: Corpus, config: MtpConfig, rng: np.random.Generator
) -> Iterator[torch.Tensor]:
    """The loss of each step's batch: `seqs_per_step` random sequences of the corpus, and
    `anchors_per_seq` random anchors of each for the recycled steps."""
    n_tokens = corpus.tokens.shape[1]
    while True:
        seqs = torch.from_numpy(rng.choice(len(corpus.tokens), config.seqs_per_step, replace=False))
        anchors = np.stack(
            [
                rng.choice(
                    np.arange(int(corpus.first_anchor[s]), n_tokens - config.ttt_steps),
                    config.anchors_per_seq,
                    replace=False,
                )
                for s in seqs.tolist()
            ]
        )  # (seqs_per_step, anchors_per_seq): the last step's label q + ttt_steps stays inside the sequence
        yield mtp_loss(head_with(base, w), corpus, seqs, anchors, config.ttt_steps, config.ttt_decay)


def _files(hf: Path, seed: int, config: MtpConfig) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """The trained head as its cache entry holds it (training.cache.store): files and meta."""
    trained = train_mtp(hf, seed, config)
    return {HEAD_FILE: trained.head}, trained.meta
