"""The chained MTP fixtures (factory/mtp_chain.py) without the converter: `fixture --list` names
each variant, and reorder_heads moves whole head blocks of a GGUF (the export faults' rewrite),
leaving the trunk's blocks and the keys as they were."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.factory.mtp_chain import CHAIN_VARIANTS, reorder_heads

N_LAYER, N_HEADS = 2, 3


def _tiny_chain(path):
    """A mimo2-keyed GGUF of N_LAYER trunk blocks and N_HEADS head blocks, block b's tensors all b."""
    from gguf import GGUFWriter

    wr = GGUFWriter(str(path), names.ARCH_MIMO2)
    wr.add_uint32(names.KEY_BLOCK_COUNT.format(arch=names.ARCH_MIMO2), N_LAYER + N_HEADS)
    wr.add_uint32(names.KEY_NEXTN_LAYERS.format(arch=names.ARCH_MIMO2), N_HEADS)
    for b in range(N_LAYER + N_HEADS):
        wr.add_tensor(f"blk.{b}.attn_norm.weight", np.full(4, b, dtype=np.float32))
        if b >= N_LAYER:
            wr.add_tensor(f"blk.{b}.nextn.eh_proj.weight", np.full((4, 8), b, dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def _blocks(path) -> dict[str, float]:
    from gguf import GGUFReader

    return {t.name: float(np.asarray(t.data).flat[0]) for t in GGUFReader(str(path)).tensors}


def test_fixture_list_names_every_chain_variant():
    result = CliRunner().invoke(app, ["fixture", "--list"])
    assert result.exit_code == 0 and all(f"\n{name} " in result.output for name in CHAIN_VARIANTS)


def test_reorder_heads_moves_whole_head_blocks_and_nothing_else(tmp_path):
    gguf = _tiny_chain(tmp_path / "t.gguf")
    reorder_heads(gguf, (2, 1, 0))
    held = _blocks(gguf)
    assert [held[f"blk.{b}.attn_norm.weight"] for b in range(N_LAYER + N_HEADS)] == [0, 1, 4, 3, 2]
    assert [held[f"blk.{N_LAYER + k}.nextn.eh_proj.weight"] for k in range(N_HEADS)] == [4, 3, 2]
    reorder_heads(gguf, (0, 0, 0))
    assert [_blocks(gguf)[f"blk.{N_LAYER + k}.nextn.eh_proj.weight"] for k in range(N_HEADS)] == [4, 4, 4]
