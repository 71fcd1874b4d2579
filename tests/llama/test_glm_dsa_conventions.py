"""GLM-5's MTP head run under DeepSeek's conventions (0016-glm-dsa-conventions.patch, issue 44 item
3), each captured from the patched build with `FEATDIFF_FAULT` set, in-process and around
`llama-speculative-simple` against the reference that follows the run, and named with its kind,
tensor and `where` (docs/faults.md): the next draft step handed the raw block output where GLM-5
hands on the shared-head-normed state (vLLM PR 46075 met it on GLM-5: acceptance after the first
draft collapsed with no error), and the head's experts routed by softmax, deepseek2.cpp's reading of
a file without expert_gating_func, where glm-dsa.cpp routes by sigmoid."""

from __future__ import annotations

import pytest
from test_step_faults_3 import planted

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)

WHERE = ["in-process", "around the program"]


@pytest.mark.parametrize("where", WHERE)
def test_a_glm5_head_handing_on_its_raw_state_is_a_wrong_source_chain_prenorm_in_the_graph(
    tools, mtp_pairs, tmp_path, monkeypatch, where
):
    errors = planted(where, tools, "mtp", mtp_pairs("mtp-glm-dsa"), "mtp-glm-dsa-raw-state", tmp_path, monkeypatch)
    assert errors, "the raw state handed on was not named"
    first = errors[0]
    assert (first.kind, first.tensor, first.fields["source"]) == ("wrong_source", "mtp_h_input", "chain_prenorm"), [
        f.message for f in errors
    ]
    assert "the previous step's state before the head norm" in first.message, first.message
    assert first.fields["where"] == "graph", first.fields["where_reason"]


@pytest.mark.parametrize("where", WHERE)
def test_a_glm5_head_routed_by_softmax_is_a_wrong_source_naming_the_gating_in_the_graph(
    tools, mtp_pairs, tmp_path, monkeypatch, where
):
    fault = "mtp-glm-dsa-softmax-routing"
    errors = planted(where, tools, "mtp", mtp_pairs("mtp-glm-dsa"), fault, tmp_path, monkeypatch)
    assert errors, "the softmax routing was not named"
    first = errors[0]
    assert (first.kind, first.tensor, first.fields["source"]) == ("wrong_source", "mtp_post_ffn-6", "softmax"), [
        f.message for f in errors
    ]
    assert first.fields["candidate"] == "mtp_post_ffn-6@routing=softmax"
    assert "the graph routes the head's experts by softmax" in first.message, first.message
    assert first.fields["where"] == "graph", first.fields["where_reason"]
    assert "expert_gating_func =" not in first.message  # never the export's fix for a GGUF that is right
