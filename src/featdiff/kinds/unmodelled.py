"""What the reference does not model in a drafter GGUF, asked of its kind (featdiff.kinds.registry:
`DrafterKind.unmodelled`, each kind's table: kinds/dflash/modelled.py, kinds/eagle3.py), and the
lint check that lists it."""

from __future__ import annotations

from featdiff.core.gguf_reader import GgufModel
from featdiff.kinds import registry as kinds


def gguf_unmodelled(model: GgufModel) -> tuple[str, ...]:
    """The drafter GGUF's keys and tensors the reference does not model: its kind's `<arch>.*` keys
    and its tensors, as the kind's table says (the DFlash graph's for an architecture no kind has);
    () for a kind with no table here (MTP)."""
    kind = kinds.of_arch(model.arch)
    if kind.unmodelled is None:
        return ()
    prefix = f"{kind.arch}."
    keys = {k: f.contents() for k, f in model.reader.fields.items() if k.startswith(prefix)}
    return kind.unmodelled(keys, model.tensors)


def unmodelled_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """The drafter's keys and tensors llama.cpp computes and the reference does not model."""
    return [
        f"{name} is computed by llama.cpp but not modelled by featdiff's reference, which refuses this "
        "drafter (docs/modelled.md); a capture runs and records it"
        for name in gguf_unmodelled(d)
    ]
