"""A tiny *trained* EAGLE3 drafter of the trained pair's target (fixture variant `trained-eagle3`),
so that EAGLE3's accept rate means something. Consumes a seed and `pairs.Sizes`; produces the
drafter in the SpecForge checkpoint layout (`LlamaForCausalLMEagle3`'s HF names, what
fixtures_eagle3 writes as `draft-hf/`), trained once per machine and cached beside the trained pairs.

The objective is what llama.cpp's EAGLE3 decoder computes (torchref.eagle3, eagle3_flow), as
SpecForge trains it with test-time training (TTT), on the target's greedy corpus:
* step one, row t: (token t+1, g_t = fc(the target's inputs of EAGLE3_LAYERS at t)) at position t,
  causal over the sequence's rows, predicts token t+2 (a process row, and a round's seed step);
* step k > 1 recycles row t: (token t+k, step k-1's eagle3_prenorm at t) at position t+k-1,
  predicting token t+k+1; it sees step one's rows up to t and row t of every step since, as a
  draft step sees the draft cache (process rows, the seed row, the steps before it).
`forward_steps` runs every step of every row in one batched pass; the tests prove each step equal
to `torchref.eagle3.decode` on the same weights. The drafter borrows the target's token_embd,
has its own lm_head over the whole vocabulary (d2t the identity) and no encoder norm.
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
from safetensors.numpy import load_file
from torch.nn.functional import cross_entropy

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.pairs import Sizes
from featdiff.torchref.attention import attend
from featdiff.torchref.eagle3.graph import Eagle3Draft, encode
from featdiff.torchref.eagle3.flow import run_flow
from featdiff.torchref.numerics import Numerics, ffn, linear, rms_norm, rope
from featdiff.torchref.target import forward_target
from featdiff.torchref.weights import Layer, Source, Target
from featdiff.factory.training import cache
from featdiff.factory.training.corpus import CPU, Corpus, f32_cache, held_out_prompts, prompts
from featdiff.factory.training.records import _array, _hparams, _tensor, target_record
from featdiff.factory.training.target import lookback_target
from featdiff.factory.training.train import TRAINED_SIZES, _fit, _torch_threads


STREAM_EAGLE3 = 6  # rng stream per seed of the drafter's init (corpus.py holds 1, 2; train.py 3 to 5)
DRAFT_MAX = 3  # llama.cpp's --spec-draft-n-max default: drafts a held-out round makes
F32_KV = Numerics(torch.float32, CPU, "f32")  # how accept is measured: training emulates no f16 cache
CACHE_PREFIX = "eagle3-"  # its cache entries, beside the trained pairs' (training.cache)
DRAFT_FILE = "draft.safetensors"

# The checkpoint's names (fixtures_eagle3.GGUF_FROM_HF's keys): decoder layer field -> HF tensor
LAYER_HF = {
    "attn_norm": "midlayer.input_layernorm.weight",  # on the token embeddings
    "wq": "midlayer.self_attn.q_proj.weight",
    "wk": "midlayer.self_attn.k_proj.weight",
    "wv": "midlayer.self_attn.v_proj.weight",
    "wo": "midlayer.self_attn.o_proj.weight",
    "ffn_norm": "midlayer.post_attention_layernorm.weight",
    "ffn_gate": "midlayer.mlp.gate_proj.weight",
    "ffn_up": "midlayer.mlp.up_proj.weight",
    "ffn_down": "midlayer.mlp.down_proj.weight",
}
FC, G_NORM, OUTPUT_NORM, LM_HEAD = "fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight"
D2T, T2D = "d2t", "t2d"  # HF offsets (target id = d2t[i] + i), and the target ids' mask


@dataclass(frozen=True)
class Eagle3Config:
    """How much corpus and training; the defaults take about 45 s on one busy CPU core."""

    n_prompts: int = 384  # fewer, and it learns the corpus by heart (seed 0, held-out accept: 128 0.35, 256 2.6)
    n_tokens: int = 48  # per corpus sequence: prompt + greedy continuation
    n_held_out: int = 16  # held-out prompts accept is measured on
    held_out_rounds: int = 8  # rounds of DRAFT_MAX drafts per held-out prompt
    steps: int = 400
    seqs_per_step: int = 8
    ttt_steps: int = DRAFT_MAX  # step one and the recycled steps: one per draft of a round
    ttt_decay: float = 0.8  # step k's loss weighs ttt_decay^(k-1) (SpecForge's 0.8)
    lr: float = 1e-2
    threads: int = 1  # torch intra-op threads: the machine is shared, and two threads of ops this small
    #                   spin far more than they compute when it is busy (15x slower at a load of 5 on 2 cores)


DEFAULT_CONFIG = Eagle3Config()


@dataclass(frozen=True)
class TrainedEagle3:
    """The trained pair's target (fixtures layout), its EAGLE3 drafter (HF checkpoint layout),
    and how training went."""

    target: dict
    draft: dict[str, np.ndarray]
    meta: dict  # train_seconds (corpus and training), the target layers, held-out mean accepted drafts per round
    #             (trained and untrained; reference run_flow, f32 KV) and how they were measured


@dataclass(frozen=True)
class Step:
    """One step of every row of a batch: its logits and eagle3_prenorm rows."""

    logits: torch.Tensor  # (n_seq * n_rows, n_vocab)
    prenorm: torch.Tensor  # (n_seq * n_rows, n_embd): the next step's g


def eagle3_layers(sizes: Sizes) -> tuple[int, int, int]:
    """The three target layers the drafter reads, layer-input (GGUF) ids: low, middle, last."""
    n = sizes.target.n_layer
    return (1, n // 2, n - 1)


def target_weights(seed: int, sizes: Sizes = TRAINED_SIZES) -> dict:
    """The trained pair's target of `seed` (what `training.train_pair` builds; fixtures layout)."""
    return lookback_target(np.random.default_rng(seed), sizes)


def trained_eagle3(seed: int, sizes: Sizes = TRAINED_SIZES, config: Eagle3Config = DEFAULT_CONFIG) -> TrainedEagle3:
    """The trained EAGLE3 drafter of `seed`: from the cache, else trained (about 45 s) and cached."""
    path = cache.trained_once(
        cache_key(seed, sizes, config), f"EAGLE3 drafter of seed {seed}", partial(_files, seed, sizes, config)
    )
    meta = json.loads((path / cache.META_FILE).read_text())
    return TrainedEagle3(target=target_weights(seed, sizes), draft=load_file(str(path / DRAFT_FILE)), meta=meta)


def cache_key(seed: int, sizes: Sizes, config: Eagle3Config) -> str:
    """What the trained drafter depends on: the code (training.cache's digest), seed, sizes,
    settings and torch."""
    spec = {"code": cache._code_digest(), "sizes": asdict(sizes), "config": asdict(config), "torch": torch.__version__}
    return f"{CACHE_PREFIX}seed{seed}-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def train_eagle3(seed: int, sizes: Sizes = TRAINED_SIZES, config: Eagle3Config = DEFAULT_CONFIG) -> TrainedEagle3:
    """The target of `seed`, its corpus, and the EAGLE3 drafter trained on it."""
    start = time.perf_counter()
    layers = eagle3_layers(sizes)
    with _torch_threads(config.threads):
        target_w = target_weights(seed, sizes)
        target = target_record(target_w, sizes, seed)
        corpus = make_corpus(target, prompts(seed, config.n_prompts, sizes), config.n_tokens, layers)
        init = init_weights(seed, sizes)
        rng = np.random.default_rng((seed, STREAM_EAGLE3, 1))  # the batches' draws, apart from init's
        draft = train_drafter(target, corpus, init, sizes, config, rng)
        train_seconds = time.perf_counter() - start
        held_out = held_out_prompts(seed, config.n_held_out, sizes)
        accepted = {
            name: held_out_accepted(target, draft_record(w, sizes, layers), held_out, config.held_out_rounds)
            for name, w in (("trained", draft), ("untrained", init))
        }
    meta = {
        "train_seconds": round(train_seconds, 1),
        "target_layers": list(layers),
        "held_out_mean_accepted": accepted["trained"],
        "untrained_held_out_mean_accepted": accepted["untrained"],
        "held_out": {"prompts": config.n_held_out, "rounds": config.held_out_rounds, "draft_max": DRAFT_MAX},
    }
    return TrainedEagle3(target=target_w, draft=draft, meta=meta)


def train_drafter(
    target: Target,
    corpus: Corpus,
    init: dict[str, np.ndarray],
    sizes: Sizes,
    config: Eagle3Config,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """An EAGLE3 drafter trained from `init` (HF layout) on the corpus (of `eagle3_layers`'
    features); its weights, same layout."""
    draft = draft_record(init, sizes, eagle3_layers(sizes), trainable=True)
    _fit([(parameters(draft), config.lr)], config.steps, _losses(draft, target, corpus, config, rng))
    return weights_of(draft)


def init_weights(seed: int, sizes: Sizes) -> dict[str, np.ndarray]:
    """The drafter's initial weights (HF layout, as fixtures_eagle3.eagle3_weights draws a random one)."""
    s, n_features = replace(sizes.draft, n_layer=1), 3 * sizes.target.n_embd
    rng = np.random.default_rng((seed, STREAM_EAGLE3))
    shapes = {
        FC: (s.n_embd, n_features),
        LAYER_HF["wq"]: (s.n_head * s.n_embd_head, 2 * s.n_embd),  # attention reads [norm(embd), norm(g)]
        LAYER_HF["wk"]: (s.n_head_kv * s.n_embd_head, 2 * s.n_embd),
        LAYER_HF["wv"]: (s.n_head_kv * s.n_embd_head, 2 * s.n_embd),
        LAYER_HF["wo"]: (s.n_embd, s.n_head * s.n_embd_head),
        LAYER_HF["ffn_gate"]: (s.n_ff, s.n_embd),
        LAYER_HF["ffn_up"]: (s.n_ff, s.n_embd),
        LAYER_HF["ffn_down"]: (s.n_embd, s.n_ff),
        LM_HEAD: (sizes.n_vocab, s.n_embd),
    }
    w = {name: pairs._linear(rng, n_out, n_in) for name, (n_out, n_in) in shapes.items()}
    for name in (LAYER_HF["attn_norm"], G_NORM, LAYER_HF["ffn_norm"], OUTPUT_NORM):
        w[name] = pairs._norm(rng, s.n_embd)
    return _with_vocabulary(w, sizes.n_vocab)


def draft_record(
    w: dict[str, np.ndarray], sizes: Sizes, layers: tuple[int, int, int], trainable: bool = False
) -> Eagle3Draft:
    """The reference's `Eagle3Draft` of HF-layout weights (NeoX RoPE: q/k rows as HF holds them;
    the full vocabulary, so no d2t); with `trainable`, its tensors are autograd leaves."""
    s = replace(sizes.draft, n_layer=1)
    return Eagle3Draft(
        source=Source(Path("<trained eagle3 drafter>"), is_gguf=False),
        hparams=_hparams(s, names.ARCH_EAGLE3, sizes.n_vocab),
        target_layers=layers,
        n_embd_tgt=sizes.target.n_embd,
        norm_before_fc=False,
        norm_before_residual=False,
        fc=_tensor(w[FC], trainable),
        enc_norm=None,
        layer=Layer(**{k: _tensor(w[name], trainable) for k, name in LAYER_HF.items()}, q_norm=None, k_norm=None),
        attn_norm_2=_tensor(w[G_NORM], trainable),
        output_norm=_tensor(w[OUTPUT_NORM], trainable),
        output=_tensor(w[LM_HEAD], trainable),
        token_embd=None,
    )


def weights_of(draft: Eagle3Draft) -> dict[str, np.ndarray]:
    """A drafter record back in the HF layout, with its (identity) d2t and t2d."""
    w = {name: _array(getattr(draft.layer, k)) for k, name in LAYER_HF.items()}
    w.update({FC: _array(draft.fc), G_NORM: _array(draft.attn_norm_2), OUTPUT_NORM: _array(draft.output_norm)})
    w[LM_HEAD] = _array(draft.output)
    return _with_vocabulary(w, draft.hparams.n_vocab)


def parameters(draft: Eagle3Draft) -> list[torch.Tensor]:
    """Every tensor of the drafter (the trainable ones of a trainable record)."""
    head = [draft.fc, draft.attn_norm_2, draft.output_norm, draft.output]
    return [t for t in head if t is not None] + [getattr(draft.layer, k) for k in LAYER_HF]


def make_corpus(target: Target, chosen: tuple[tuple[int, ...], ...], n_tokens: int, layers: tuple[int, ...]) -> Corpus:
    """Each prompt continued greedily to `n_tokens`, with the rows of the target's inputs of
    `layers`, token-major as the flow's `features` lays them out."""
    with torch.no_grad():
        seqs, feats = zip(*(greedy_sequence(target, p, n_tokens, layers) for p in chosen))
    first = torch.tensor([len(p) - 1 for p in chosen])
    return Corpus(tokens=torch.stack(seqs), features=torch.stack(feats), first_anchor=first)


def greedy_sequence(
    target: Target, prompt: tuple[int, ...], n_tokens: int, layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompt` continued greedily to `n_tokens` (corpus.greedy_continuation's tokens) `(n_tokens,)`,
    and the rows of the target's inputs of `layers` along it `(n_tokens, 3 * n_embd_tgt)`.

    By fixed-point iteration: each pass reads the whole sequence and sets every continuation
    token to the target's argmax after the tokens before it; a pass that changes nothing leaves
    the greedy continuation (pass i fixes token i at least). The lookback target fixes about
    LOOKBACK tokens a pass: ~10 passes over the sequence replace ~40 one-token evals.
    """
    n_prompt = len(prompt)
    seq = torch.tensor(prompt + (0,) * (n_tokens - n_prompt))
    for _ in range(n_tokens - n_prompt + 1):
        tp = forward_target(target, seq, torch.arange(n_tokens), f32_cache(target.hparams), has_outputs=True)
        greedy = torch.cat([seq[:n_prompt], tp.logits[n_prompt - 1 : -1].argmax(-1)])  # (n_tokens,)
        if torch.equal(greedy, seq):
            return seq, torch.cat([tp.layer_inputs[il] for il in layers], dim=1)
        seq = greedy
    raise ValueError(f"the greedy continuation of {prompt} did not settle in {n_tokens - n_prompt + 1} passes")


def forward_steps(
    draft: Eagle3Draft, target: Target, tokens: torch.Tensor, features: torch.Tensor, n_steps: int
) -> tuple[Step, ...]:
    """Steps 1 .. `n_steps` (module docstring) of rows t = 0 .. n_rows-1 of each sequence,
    n_rows = n_tokens - 1 - n_steps (every step's label inside the sequence), rows sequence-major;
    tokens `(n_seq, n_tokens)`, features `(n_seq, n_tokens, 3 * n_embd_tgt)`."""
    if draft.norm_before_residual or draft.d2t is not None:
        raise ValueError("forward_steps runs a drafter of the whole vocabulary (no d2t), residual on the raw g")
    n_seq, n_tokens = tokens.shape
    n_rows = n_tokens - 1 - n_steps
    g, _ = encode(draft, features[:, :n_rows].reshape(n_seq * n_rows, -1))  # (n_seq * n_rows, n_embd)
    row = torch.arange(n_rows)
    step_one = row[None, :] <= row[:, None]  # (n_rows, n_rows): a row sees step one's rows up to its own
    own = torch.eye(n_rows, dtype=torch.bool)  # (n_rows, n_rows): and its own row of each later step
    ks: list[torch.Tensor] = []  # per step: (n_seq, n_rows, n_head_kv, n_embd_head)
    vs: list[torch.Tensor] = []
    steps: list[Step] = []
    for k in range(n_steps):
        step_tokens = tokens[:, k + 1 : k + 1 + n_rows].reshape(-1)  # (n_seq * n_rows,): token t+k+1 (k from 0)
        q, key, value = _qkv(draft, target, step_tokens, g, (row + k).repeat(n_seq))
        q = q.reshape(n_seq, n_rows, *q.shape[1:])  # (n_seq, n_rows, n_head, n_embd_head)
        ks.append(key.reshape(n_seq, n_rows, *key.shape[1:]))
        vs.append(value.reshape(n_seq, n_rows, *value.shape[1:]))
        k_all, v_all = torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # (n_seq, (k+1) * n_rows, n_head_kv, n_embd_head)
        cells = torch.cat([row + j for j in range(k + 1)])  # ((k+1) * n_rows,): unused beside `visible`
        visible = torch.cat([step_one] + [own] * k, dim=1)  # (n_rows, (k+1) * n_rows)
        kqv = torch.cat(
            [attend(q[i], row + k, k_all[i], v_all[i], cells, causal=True, visible=visible) for i in range(n_seq)]
        )  # (n_seq * n_rows, n_head * n_embd_head): one sequence at a time, each over its own cells
        steps.append(_after_attention(draft, target, kqv, g))
        g = steps[-1].prenorm
    return tuple(steps)


def _qkv(
    draft: Eagle3Draft, target: Target, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decode's attention inputs: q, k (RoPE at `positions`) and v of the rows (token, g),
    `(n, n_head or n_head_kv, n_embd_head)`."""
    hp, layer = draft.hparams, draft.layer
    table = draft.token_embd if draft.token_embd is not None else target.token_embd
    embd_norm = rms_norm(table[tokens], layer.attn_norm, hp.rms_eps)
    concat = torch.cat([embd_norm, rms_norm(g, draft.attn_norm_2, hp.rms_eps)], dim=1)  # (n, 2 * n_embd)
    n = concat.shape[0]
    q = rope(linear(concat, layer.wq).reshape(n, hp.n_head, hp.n_embd_head), positions, hp)
    k = rope(linear(concat, layer.wk).reshape(n, hp.n_head_kv, hp.n_embd_head), positions, hp)
    return q, k, linear(concat, layer.wv).reshape(n, hp.n_head_kv, hp.n_embd_head)


def _after_attention(draft: Eagle3Draft, target: Target, kqv: torch.Tensor, g: torch.Tensor) -> Step:
    """decode after attention: the residual on g, the FFN, eagle3_prenorm and the logits."""
    hp, layer = draft.hparams, draft.layer
    ffn_inp = linear(kqv, layer.wo) + g  # (n, n_embd)
    prenorm = ffn(rms_norm(ffn_inp, layer.ffn_norm, hp.rms_eps), layer) + ffn_inp
    head = draft.output if draft.output is not None else target.output
    return Step(logits=linear(rms_norm(prenorm, draft.output_norm, hp.rms_eps), head), prenorm=prenorm)


def eagle3_loss(
    draft: Eagle3Draft, target: Target, corpus: Corpus, seqs: torch.Tensor, n_steps: int, decay: float
) -> torch.Tensor:
    """Cross-entropy of each step's rows against the sequence's token there (step k of row t:
    token t+k+1), over the target's greedy tokens only (prompt tokens are random); step k weighs
    decay^(k-1)."""
    tokens, first = corpus.tokens[seqs], corpus.first_anchor[seqs]  # (n_seq, n_tokens), (n_seq,)
    n_rows = tokens.shape[1] - 1 - n_steps
    total, weight = torch.zeros(()), 0.0
    for k, step in enumerate(forward_steps(draft, target, tokens, corpus.features[seqs], n_steps)):
        label_pos = torch.arange(n_rows) + k + 2  # (n_rows,)
        labels = tokens[:, k + 2 : k + 2 + n_rows].reshape(-1)  # (n,)
        is_greedy = (label_pos[None, :] > first[:, None]).reshape(-1).float()  # (n,)
        ce = cross_entropy(step.logits, labels, reduction="none")
        total = total + decay**k * (ce * is_greedy).sum() / is_greedy.sum()
        weight += decay**k
    return total / weight


def held_out_accepted(
    target: Target, draft: Eagle3Draft, chosen: tuple[tuple[int, ...], ...], rounds: int, numerics: Numerics = F32_KV
) -> float:
    """Mean accepted drafts per round of the reference's EAGLE3 flow (`run_flow`, greedy,
    DRAFT_MAX drafts a round) over `rounds` rounds of each prompt."""
    with torch.no_grad():
        accepted = [
            r.accepted for p in chosen for r in run_flow(target, draft, p, rounds, numerics, draft_max=DRAFT_MAX).rounds
        ]
    return float(np.mean(accepted))


def _losses(
    draft: Eagle3Draft, target: Target, corpus: Corpus, config: Eagle3Config, rng: np.random.Generator
) -> Iterator[torch.Tensor]:
    """The loss of each step's batch: `seqs_per_step` random sequences of the corpus."""
    while True:
        seqs = torch.from_numpy(rng.choice(len(corpus.tokens), config.seqs_per_step, replace=False))
        yield eagle3_loss(draft, target, corpus, seqs, config.ttt_steps, config.ttt_decay)


def _with_vocabulary(w: dict[str, np.ndarray], n_vocab: int) -> dict[str, np.ndarray]:
    """`w` with the whole vocabulary as the draft vocabulary: d2t offsets 0, t2d all set."""
    return {**w, D2T: np.zeros(n_vocab, dtype=np.int64), T2D: np.ones(n_vocab, dtype=np.bool_)}


def _files(seed: int, sizes: Sizes, config: Eagle3Config) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """The trained drafter as its cache entry holds it (training.cache.store): files and meta."""
    trained = train_eagle3(seed, sizes, config)
    return {DRAFT_FILE: trained.draft}, trained.meta
