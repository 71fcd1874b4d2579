"""The MTP kind's pure facts: the records of an MTP head's graph and what it reads of its target."""

from __future__ import annotations

from featdiff.core import names

# An MTP head's graph (upstream src/models/qwen35.cpp, qwen35moe.cpp, glm4-moe.cpp, mimo2.cpp graph_mtp): its
# token rows, its norms and their concat, eh_proj, the decoder layer's residuals, the head norm and the logits. Not
# mtp_h_input, the hidden rows it is handed: only a norm reads them (the shim reads inputs through
# consumers that cannot overwrite them); mtp_hnorm-<il> carries them, and the in-process driver
# records the rows it stages under that name (a read-back)
MTP_WIRING: tuple[str, ...] = (
    "mtp_tok_embd-*",
    "mtp_hnorm-*",
    "mtp_enorm-*",
    "mtp_concat-*",
    "mtp_eh_proj-*",
    "mtp_attn_residual-*",
    "mtp_ffn_inp-*",  # glm4-moe.cpp's and mimo2.cpp's name of mtp_attn_residual
    "mtp_post_ffn-*",
    names.H_NEXTN,
    names.RESULT_OUTPUT,
    names.DRAFT_LOGITS,
    names.MTP_H_INPUT,  # a read-back in-process (above)
)
# what an MTP head reads of its target: the post-final-norm hidden of every row (mimo2's: before the final norm; llama.cpp's
# llama_set_embeddings_nextn, unmasked), and the verify logits
MTP_TARGET_WIRING: tuple[str, ...] = (names.H_NEXTN, names.RESULT_OUTPUT)

MTP = "mtp"  # the MTP kind's name: its drafter runs in an MTP context (LLAMA_CONTEXT_TYPE_MTP)
