"""What the reference does not model in a drafter GGUF, asked of each kind's table (kinds/dflash/modelled.py,
kinds/eagle3.py)."""

from __future__ import annotations

from featdiff.core import names
from featdiff.core.gguf_reader import GgufModel
from featdiff.kinds.dflash.modelled import unmodelled_in
from featdiff.kinds.eagle3 import unmodelled_eagle3


def gguf_unmodelled(model: GgufModel) -> tuple[str, ...]:
    """The drafter GGUF's keys and tensors the reference does not model: an EAGLE3 drafter's
    (featdiff.kinds.eagle3), else its `dflash.*` ones (featdiff.kinds.dflash.modelled)."""
    if model.arch == names.ARCH_EAGLE3:
        return unmodelled_eagle3(model.reader.fields, model.tensors)
    fields = model.reader.fields
    keys = {k: f.contents() for k, f in fields.items() if k.startswith(f"{names.ARCH_DFLASH}.")}
    return unmodelled_in(keys, model.tensors)
