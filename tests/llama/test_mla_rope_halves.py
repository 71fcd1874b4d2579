"""DeepSeek-V3's MTP head reading MLA's halves in the other order (0017-mla-rope-halves.patch, issue
44 item 3), captured from the patched build with `FEATDIFF_FAULT` set, in-process and around
`llama-speculative-simple` against the reference that follows the run: each head's query and the
compressed KV row read as [rope, nope] where the checkpoint lays them out [nope, rope]. The head
still runs and drafts, badly; compare names it a wrong_source `rope_first` at the head's attention
residual, in the graph (the GGUF holds what the reference read), with the graph's fix."""

from __future__ import annotations

import pytest
from test_step_faults_3 import planted

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)

FAULT = "mtp-deepseek2-rope-halves"


@pytest.mark.parametrize("where", ["in-process", "around the program"])
def test_a_deepseek_head_reading_the_rope_half_first_is_a_wrong_source_rope_first_in_the_graph(
    tools, mtp_pairs, tmp_path, monkeypatch, where
):
    errors = planted(where, tools, "mtp", mtp_pairs("mtp-deepseek2"), FAULT, tmp_path, monkeypatch)
    assert errors, "the halves read the other way were not named"
    first = errors[0]
    assert (first.kind, first.fields["source"]) == ("wrong_source", "rope_first"), [f.message for f in errors]
    assert first.tensor.startswith("mtp_ffn_inp-"), first.tensor
    assert first.fields["candidate"] == f"{first.tensor}@halves=rope_first"
    assert first.fields["where"] == "graph", first.fields["where_reason"]
    assert "view q_nope and the latent from the front of each row" in first.message, first.message
    assert "re-convert" not in first.message  # never the export's fix for a GGUF that is right
