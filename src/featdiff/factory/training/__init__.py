"""Tiny *trained* DFlash drafters, so that accept rate means something (fixture variants
`trained*`). Consumes a seed and `pairs.Sizes`; produces the trained pair's weights in the
fixtures' layout (HF orientation), which the fixtures' writers save as GGUF and HF directories.

* `target`: a seeded qwen3 target whose greedy continuation a tiny drafter can learn, and only
  from the right target layers;
* `corpus`: its greedy continuations of random prompts, and held-out prompts;
* `objective`: packed `[anchor, mask ...]` blocks through the reference's own drafter forward,
  the DFlash loss and the accepted length;
* `train`: the training loop of the drafters (plain, GIDD log-SNR conditioned, and DSpark);
* `dspark`: the anchor-first DSpark objective (Markov and confidence heads) and its held-out drafts;
* `cache`: trained once per machine under $FEATDIFF_CACHE/trained (~/.cache/featdiff/trained).
"""

from featdiff.factory.training.cache import trained_pair
from featdiff.factory.training.corpus import held_out_prompts, write_prompts
from featdiff.factory.training.train import TRAINED_SIZES, TrainConfig, TrainedPair, train_pair

__all__ = [
    "TRAINED_SIZES",
    "TrainConfig",
    "TrainedPair",
    "held_out_prompts",
    "train_pair",
    "trained_pair",
    "write_prompts",
]
