"""Every foreign name featdiff relies on, spelled once: GGUF keys, llama.cpp callback names,
ggml type ids and record roles. (The flow's phases and their rules live in featdiff.core.phases.)

GGUF keys follow the upstream DFlash converter; callback names follow upstream
`src/models/dflash.cpp` and the qwen3/llama target graphs.
"""

from typing import Literal

# --- roles of the DFlash flow (upstream common/speculative.cpp; its phases: featdiff.core.phases) ----
Role = Literal["target", "draft"]  # the model whose context ran an eval ("draft": the drafter)
ROLE_TARGET: Role = "target"
ROLE_DRAFT: Role = "draft"
ROLES: tuple[Role, ...] = (ROLE_TARGET, ROLE_DRAFT)
# how an eval ran: a decode (llama_decode / llama_process), or llama_encode, the older batch API
# generation's inject encoder step (docs/flow.md)
CALL_DECODE, CALL_ENCODE = "decode", "encode"
CALLS = (CALL_DECODE, CALL_ENCODE)
# where a captured record's data was (records[].backend, native/featdiff_shim.c memory_device):
# host memory, else a ggml device by its name, e.g. "Vulkan0", "CUDA0"
BACKEND_HOST = "CPU"

# --- GGUF metadata keys ------------------------------------------------------------------------
ARCH_DFLASH = "dflash"
KEY_ARCH = "general.architecture"
KEY_TARGET_LAYERS = "dflash.target_layers"
KEY_BLOCK_SIZE = "dflash.block_size"
KEY_SAMPLE_FROM_ANCHOR = "dflash.sample_from_anchor"
KEY_CAUSAL = "dflash.attention.causal"
KEY_HAS_CONFIDENCE_HEAD = "dflash.has_confidence_head"
KEY_LOG_SNR = "dflash.log_snr_conditioning"
KEY_MIN_LOG_SNR = "dflash.min_log_snr"
KEY_MAX_LOG_SNR = "dflash.max_log_snr"
KEY_MASK_TOKEN = "tokenizer.ggml.mask_token_id"
# EAGLE3 (upstream src/models/eagle3.cpp, llama_model_eagle3::load_arch_hparams)
ARCH_EAGLE3 = "eagle3"
KEY_EAGLE3_TARGET_LAYERS = "eagle3.target_layers"  # exactly 3 layer-input ids, unshifted (the converter)
KEY_EAGLE3_TARGET_HIDDEN = "eagle3.target_hidden_size"
KEY_EAGLE3_NORM_BEFORE_RESIDUAL = "eagle3.norm_before_residual"
KEY_EAGLE3_NORM_BEFORE_FC = "eagle3.norm_before_fc"
# MTP heads (upstream src/models/qwen35.cpp graph_mtp, common/speculative.cpp draft-mtp): the
# target's own next-token-prediction blocks, stored after its trunk as blk.<n_layer + i>, or alone
# in an `mtp-*.gguf` (convert_hf_to_gguf.py --mtp); block_count counts them
ARCH_QWEN35 = "qwen35"
ARCH_QWEN35MOE = "qwen35moe"  # the same head with a MoE FFN (qwen35moe.cpp graph_mtp)
ARCH_GLM4MOE = "glm4moe"  # GLM-4.5's head: biased attention, sigmoid-routed MoE (glm4-moe.cpp graph_mtp)
ARCH_MIMO2 = "mimo2"  # MiMo-V2's head: handed the pre-norm hidden, recycles its pre-norm state (mimo2.cpp graph_mtp)
ARCH_QWEN3NEXT = "qwen3next"  # Qwen3-Next's head: qwen35moe's, output rows taken before its residual (qwen3next.cpp)
ARCH_DEEPSEEK2 = "deepseek2"  # DeepSeek-V3's head: MLA attention, sigmoid-routed MoE (deepseek2.cpp graph_mtp)
ARCH_DEEPSEEK32 = "deepseek32"  # DeepSeek-V3.2's head: deepseek2's MLA head; its trunk adds the DSA indexer
ARCH_NEMOTRON_H_MOE = "nemotron_h_moe"  # Nemotron-H's head: NoPE attention + relu^2 MoE, LayerNorm head norm
ARCH_STEP35 = "step35"  # Step-3.5's chained heads: gated attention, sigmoid MoE, pre-norm state (step35.cpp)
ARCH_GLM_DSA = "glm-dsa"  # GLM-5's head: deepseek32's, sigmoid routing where the file says none (glm-dsa.cpp)
ARCH_HY_V3 = "hy_v3"  # Hy3's head: q/k-normed attention, sigmoid MoE + shared expert, its own final norm (hy-v3.cpp)
ARCH_COHERE2MOE = "cohere2moe"  # Cohere2-MoE's head: a parallel block (attention and MoE on one norm), scaled logits
ARCH_BAILINGMOE3 = "bailingmoe3"  # Ling 3.0's head: MLA with a head-wise gate, sigmoid MoE + shared expert
ARCH_DEEPSEEK4 = "deepseek4"  # DeepSeek-V4's head: hyper-connections, sink attention; refused (kinds/mtp.py)
ARCH_DOTS3NOTE = "dots3note"  # dots3-note: nextn blocks loaded as skipped, no graph_mtp; refused (kinds/mtp.py)
ARCH_GEMMA4_ASSISTANT = "gemma4-assistant"  # Gemma 4's assistant: queries over the target's KV; refused (kinds/mtp.py)
KEY_NEXTN_LAYERS = "{arch}.nextn_predict_layers"
# Architectures whose memory keeps a recurrent state beside (or instead of) a KV cache
# (llama-arch.cpp llm_arch_is_recurrent and llm_arch_is_hybrid): a row's hidden state depends on
# every row before it through that state, and llama.cpp scans it in its own order
RECURRENT_ARCHS = frozenset(
    {
        "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",  # recurrent
        "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
        "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
        "deepseek4", "minimax-01",  # hybrid
    }
)  # fmt: skip
T_NEXTN = "blk.{il}.nextn.{name}.weight"  # eh_proj, enorm, hnorm, embed_tokens, shared_head_head, shared_head_norm
NEXTN_EH_PROJ = "eh_proj"  # what makes a block an MTP head (common_speculative_types_from_gguf)
# llama.cpp's RoPE base when `{arch}.rope.freq_base` is absent (HF: `rope_theta` absent)
ROPE_FREQ_BASE_DEFAULT = 10000.0

# --- GGUF tensor names -------------------------------------------------------------------------
T_TOKEN_EMBD = "token_embd.weight"
T_OUTPUT = "output.weight"
T_OUTPUT_NORM = "output_norm.weight"
T_FC = "fc.weight"
T_ENC_NORM = "enc.output_norm.weight"
T_LOG_SNR_FC1_W = "log_snr_fc1.weight"
T_LOG_SNR_FC1_B = "log_snr_fc1.bias"
T_LOG_SNR_FC2_W = "log_snr_fc2.weight"
T_LOG_SNR_FC2_B = "log_snr_fc2.bias"
# DSpark heads (upstream src/models/dflash.cpp): a GGUF with markov_w1 is run as draft-dspark
T_MARKOV_W1 = "markov_w1.weight"  # numpy (n_vocab, rank): one row per previous (target) token
T_MARKOV_W2 = "markov_w2.weight"  # numpy (n_vocab_draft, rank)
T_MARKOV_W2_SCALE = "markov_w2.scale"  # numpy (1,), optional: multiplies markov_w2's product
T_CONF_PROJ_W = "conf_proj.weight"  # numpy (1, n_embd + rank), optional confidence head
T_CONF_PROJ_B = "conf_proj.bias"  # numpy (1,), optional
T_D2T = "d2t"  # int64 (n_vocab_draft,): absolute target id of each draft row
DSPARK_TENSORS = (T_MARKOV_W1, T_MARKOV_W2)  # what makes a drafter DSpark
LOG_SNR_TENSORS = (T_LOG_SNR_FC1_W, T_LOG_SNR_FC1_B, T_LOG_SNR_FC2_W, T_LOG_SNR_FC2_B)

# --- llama.cpp graph callback names ------------------------------------------------------------
INP_TARGET_FEATURES = "inp_target_features"  # a leaf: seen as src[] of the fc MUL_MAT
INP_G_EMBEDDINGS = "inp_g_embeddings"
# the older generation's inject (llama_encode, then llama_decode; docs/flow.md): its encoder graph
# names the same feature rows "inp_embd" (a leaf, seen as src[] of fc's MUL_MAT)
ENC_INP_EMBD = "inp_embd"
KCUR_INJECTED = "Kcur_injected"
VCUR_INJECTED = "Vcur_injected"
INP_NOISE_EMBD = "inp_noise_embd"  # the noise block's token-embedding rows, before any conditioning term
INP_POS = "inp_pos"  # a leaf: seen as the position src[] of ROPE
L_OUT = "l_out"
RESULT_NORM = "result_norm"
RESULT_OUTPUT = "result_output"
INP_EMBD = "inp_embd"  # the DFlash encoder graph's input
# EAGLE3's graphs: the encoder (inp_embd -> enc_input_norm -> fc_out, the rows the decoder reads as
# inp_g_embeddings), the decoder's one layer and the pre-norm state recycled as the next step's g
EAGLE3_ENC_INPUT_NORM = "enc_input_norm"
EAGLE3_FC_OUT = "fc_out"
EAGLE3_EMBD_NORM = "embd_norm"
EAGLE3_G_NORM = "g_norm"
EAGLE3_CONCAT = "concat_embd"
EAGLE3_PRENORM = "eagle3_prenorm"
TARGET_EMBD = "embd"  # the target's token embeddings: the input of layer 0
# An MTP head's graph (qwen35.cpp graph_mtp; <il> is the head's block index): the hidden rows it
# is handed (`mtp_h_input`, a leaf), its token rows, both norms, their concat [e, h] and eh_proj,
# one decoder layer, the head norm (`h_nextn`: also the next step's recycled hidden) and the logits.
# The target's graph names its post-final-norm hidden `h_nextn` too: what the head is handed.
MTP_H_INPUT = "mtp_h_input"
MTP_TOK_EMBD = "mtp_tok_embd"
MTP_HNORM = "mtp_hnorm"
MTP_ENORM = "mtp_enorm"
MTP_CONCAT = "mtp_concat"
MTP_EH_PROJ = "mtp_eh_proj"
MTP_ATTN_RESIDUAL = "mtp_attn_residual"
MTP_FFN_INP = "mtp_ffn_inp"  # glm4-moe.cpp's name of the same sum (attention's output + its input)
MTP_POST_FFN = "mtp_post_ffn"
MTP_ATTN_OUT = "mtp_attn_out"  # cohere2moe.cpp's attention output alone (its parallel block has no attention residual)
H_NEXTN = "h_nextn"
MTP_SHARED_HEAD_NORM = "mtp_shared_head_norm"

# Records no graph callback names (docs/records.md, "featdiff names"): read back through the API
API_OP = "API"  # their `op` (native/featdiff_shim.c): one row per output row of the whole call
DRAFT_LOGITS = "draft_logits"  # each draft row's logits as the sampler reads them (llama_get_logits_ith)
DSPARK_CONF = "dspark_conf"  # DSpark confidence per draft row (llama_get_embeddings_nextn, column 0), (n, 1)
DSPARK_MARKOV_BIAS = "dspark_markov_bias"  # reference-only: the Markov head's bias on each row's logits
# reference-only records
LAYER_INP = "layer_inp"  # layer_inp-<L>: the input of target layer L (= l_out-(L-1))
LOG_SNR_EMBED = "log_snr_embed"  # the old name of dspark_log_snr_fc2: OLD_RECORD_NAMES

# GIDD log-SNR conditioning on the `dflash` graph, as the fork that implements it names its
# nodes (docs/records.md). Only a log-SNR conditioned drafter has them.
DSPARK_LOG_SNR_FEAT = "dspark_log_snr_feat"  # a leaf (host-filled sin/cos features): src[] of fc1's MUL_MAT
DSPARK_LOG_SNR_FC1 = "dspark_log_snr_fc1"  # silu(fc1 feat + b1)
DSPARK_LOG_SNR_FC2 = "dspark_log_snr_fc2"  # fc2 fc1out + b2: the term added to the noise embeddings
DSPARK_DRAFT_EMBD_SNR = "dspark_draft_embd_snr"  # inp_noise_embd + the term: what the first layer reads
LOG_SNR_RECORDS = (DSPARK_LOG_SNR_FEAT, DSPARK_LOG_SNR_FC1, DSPARK_LOG_SNR_FC2, DSPARK_DRAFT_EMBD_SNR)
# what dspark_draft_embd_snr is computed from: every other draft record is computed from it
LOG_SNR_SUM_INPUTS = (INP_NOISE_EMBD, DSPARK_LOG_SNR_FEAT, DSPARK_LOG_SNR_FC1, DSPARK_LOG_SNR_FC2)
# Records the checkpoint adds into another record (the sum): the candidates of missing_term / extra_term.
TERM_RECORDS = (DSPARK_LOG_SNR_FC2, DSPARK_MARKOV_BIAS)
# Record names older dumps used, and the name each has now: compare reads old reference dumps
# through this table (docs/records.md, "Renamed records"). In those dumps `inp_noise_embd` also
# holds the sum (rows + term), as `dspark_draft_embd_snr` does now.
OLD_RECORD_NAMES = {LOG_SNR_EMBED: DSPARK_LOG_SNR_FC2}


def current_name(name: str) -> str:
    """The name a record has now: `name` itself, or what an old dump's name became."""
    return OLD_RECORD_NAMES.get(name, name)


def layer_name(base: str, il: int) -> str:
    """llama.cpp's per-layer callback name: `<base>-<il>`."""
    return f"{base}-{il}"


# Views, reshapes and copies are named "<name> (view)" etc. by ggml: not separate tensors.
EXCLUDE_DERIVED = "!* (*"

# The wiring tensors a capture keeps unless told otherwise (globs on the callback name; a
# leading "!" excludes). Each captured node ends a sub-graph and costs a synchronize, so the
# target keeps only what the drafter reads from it: the inputs of its `target_layers`
# (`l_out-(L-1)`, `embd` for L = 0, added by the capture) and the verify logits.
# DFlash2's graph (src/models/dflash.cpp): the local convolutions around each layer's attention and
# FFN, and the candidate lattice the driver walks for its drafts
KEY_SELECTOR_TOP_K = "dflash.selector_top_k"
DFLASH2_LATTICE = "dflash2_lattice"
DFLASH2_RECORDS: tuple[str, ...] = (
    "attn_conv_in-*",
    "attn_conv_out-*",
    "ffn_conv_in-*",
    "ffn_conv_out-*",
    DFLASH2_LATTICE,
)
DRAFT_WIRING: tuple[str, ...] = (
    INP_TARGET_FEATURES,
    ENC_INP_EMBD,  # the older generation's encoder eval only
    INP_G_EMBEDDINGS,
    "Kcur_injected-*",
    "Vcur_injected-*",
    INP_NOISE_EMBD,
    "l_out-*",
    RESULT_NORM,
    RESULT_OUTPUT,
    *LOG_SNR_RECORDS,  # absent from a drafter without log-SNR, and from upstream's graph
    DRAFT_LOGITS,  # read back through the API, not a graph node (in-process and --exec)
    DSPARK_CONF,  # read back in-process, for a DSpark drafter with a confidence head
    *DFLASH2_RECORDS,  # a DFlash2 drafter's local convs and candidate lattice
)
TARGET_WIRING: tuple[str, ...] = (RESULT_OUTPUT,)
# when the target layers are not known in advance (capture around a program): every layer
TARGET_ALL_LAYERS: tuple[str, ...] = (TARGET_EMBD, "l_out-*", RESULT_OUTPUT)
DEFAULT_FILTERS: tuple[str, ...] = tuple(dict.fromkeys(DRAFT_WIRING + TARGET_ALL_LAYERS))


def tapped_layer_name(layer: int) -> str:
    """The callback name of the input of target layer `layer`: l_out-(layer-1), embd for 0."""
    return TARGET_EMBD if layer == 0 else layer_name(L_OUT, layer - 1)


# --- ggml types (ggml.h enum ggml_type) --------------------------------------------------------
GGML_TYPE_NAMES: dict[int, str] = {
    0: "f32",
    1: "f16",
    2: "q4_0",
    3: "q4_1",
    6: "q5_0",
    7: "q5_1",
    8: "q8_0",
    9: "q8_1",
    10: "q2_k",
    11: "q3_k",
    12: "q4_k",
    13: "q5_k",
    14: "q6_k",
    15: "q8_k",
    24: "i8",
    25: "i16",
    26: "i32",
    27: "i64",
    28: "f64",
    30: "bf16",
}

# --- reference: GGUF keys templated on the architecture (`{arch}` = general.architecture) -------
KEY_BLOCK_COUNT = "{arch}.block_count"
KEY_EMBEDDING_LENGTH = "{arch}.embedding_length"
KEY_FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
KEY_HEAD_COUNT = "{arch}.attention.head_count"
KEY_HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
KEY_KEY_LENGTH = "{arch}.attention.key_length"
KEY_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
KEY_NORM_EPS = "{arch}.attention.layer_norm_epsilon"  # LLM_NORM's; nemotron_h's RMS norms too where the above is absent
KEY_ROPE_FREQ_BASE = "{arch}.rope.freq_base"
KEY_ROPE_FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"  # the sliding-window layers' base (absent: freq_base)
KEY_SLIDING_WINDOW_ARCH = "{arch}.attention.sliding_window"
KEY_SLIDING_WINDOW_PATTERN_ARCH = "{arch}.attention.sliding_window_pattern"  # per block: attends within the window
KEY_VALUE_SCALE_ARCH = "{arch}.attention.value_scale"  # multiplies attention's output (mimo2's f_attn_value_scale)
KEY_ROPE_DIMS = "{arch}.rope.dimension_count"  # dims RoPE rotates (partial rotary: fewer than the head's)
KEY_ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"  # none / linear / yarn / longrope; absent: linear
KEY_ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
KEY_ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"  # the factor's older key
KEY_ROPE_SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"
KEY_ROPE_SCALING_ORIG_CTX = "{arch}.rope.scaling.original_context_length"
KEY_ROPE_YARN_LOG_MUL = "{arch}.rope.scaling.yarn_log_multiplier"
T_ROPE_FREQS = "rope_freqs.weight"  # llama3's per-pair frequency factors (llama and dflash graphs use it)
KEY_CONTEXT_LENGTH = "{arch}.context_length"  # the positions the model was trained on (n_ctx_train)
KEY_TOKEN_LIST = "tokenizer.ggml.tokens"
ARCH_QWEN3 = "qwen3"
ARCH_LLAMA = "llama"
TARGET_ARCHS = (ARCH_QWEN3, ARCH_LLAMA)

# GGUF per-layer tensors: `blk.<il>.<name>.weight`; the value is the HF module under `layers.<il>.`
GGUF_LAYER_PREFIX = "blk.{il}."
GGUF_TO_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LOG_SNR_N_FREQ = 128  # sinusoidal features of the GIDD log-SNR embedding (64 sin + 64 cos)

# --- reference: Hugging Face checkpoints (config.json + *.safetensors) ---------------------------
HF_CONFIG = "config.json"
HF_WEIGHTS_GLOB = "*.safetensors"
HF_TARGET_PREFIX = "model."  # target: model.layers.<il>..., model.embed_tokens, model.norm
HF_EMBED_TOKENS = "embed_tokens.weight"
HF_NORM = "norm.weight"
HF_LM_HEAD = "lm_head.weight"
HF_LAYER_PREFIX = "layers.{il}."
HF_FC = "fc.weight"  # DFlash drafter layout
HF_HIDDEN_NORM = "hidden_norm.weight"
HF_DFLASH_CONFIG = "dflash_config"
HF_TARGET_LAYER_IDS = "target_layer_ids"  # output-of-layer ids: gguf = hf + 1
HF_MASK_TOKEN_ID = "mask_token_id"
HF_BLOCK_SIZE = "block_size"
HF_LOG_SNR = "log_snr_conditioning"
HF_MIN_LOG_SNR = "min_log_snr"
HF_MAX_LOG_SNR = "max_log_snr"
# DSpark checkpoints (upstream conversion/qwen.py DSparkModel; tensor_mapping without `model.`)
HF_MARKOV_W1 = "markov_head.markov_w1.weight"  # (n_vocab, rank)
HF_MARKOV_W2 = "markov_head.markov_w2.weight"  # (n_vocab_draft, rank)
HF_MARKOV_W2_SCALE = "markov_head.markov_w2.scale"
HF_CONF_PROJ_W = "confidence_head.proj.weight"  # (1, n_embd + rank)
HF_CONF_PROJ_B = "confidence_head.proj.bias"  # (1,)
HF_D2T = "d2t"  # (n_vocab_draft,) offsets: target id = d2t[i] + i
HF_SAMPLE_FROM_ANCHOR = "sample_from_anchor"  # absent: anchor-first (DFlash-lineage exports)
HF_DRAFT_VOCAB_SIZE = "draft_vocab_size"
HF_IS_CAUSAL = "is_causal"

# --- reference: more llama.cpp callback names (src/models/dflash.cpp, llama-graph.cpp) -----------
QCUR = "Qcur"
KCUR = "Kcur"
VCUR = "Vcur"
KQV_OUT = "kqv_out"
FFN_INP = "ffn_inp"
FFN_OUT = "ffn_out"
NOISE_NORM = "noise_norm"
# reference-only hypothesis candidates: `<record>@<hypothesis>` (docs/flow.md)
CANDIDATE_SEP = "@"
HYP_SLOTS = "slots"  # inp_g_embeddings@slots=1,0: fc applied to the slots in that order
HYP_TABLE_TARGET = "table=target"  # inp_noise_embd@table=target: embedded with the target's table
HYP_NO_LOG_SNR = "log_snr=none"  # dspark_draft_embd_snr@log_snr=none: the rows without the log-SNR term
HYP_LEVELS_SWAPPED = "levels=swapped"  # dspark_log_snr_feat@levels=swapped: anchor row at min_log_snr, mask rows at max
HYP_TERM_AFTER_NORM = "term=after_norm"  # dspark_draft_embd_snr@term=after_norm: the term added to layer 0's attn norm
HYP_ANCHOR_BONUS = "anchor=bonus"  # draft_logits@anchor=bonus: the Markov chain laid out bonus-anchor (from row 1)
HYP_ANCHOR_FIRST = "anchor=first"  # draft_logits@anchor=first: the Markov chain laid out anchor-first (from row 0)
HYP_FULL_ATTENTION = "attention=full"  # l_out-<il>@attention=full: a sliding-window layer over the whole context
# ...@routing=<softmax|sigmoid>: an MoE block (an MTP head's) with its experts chosen and weighted by
# the other gating function than the one its GGUF's expert_gating_func (or the graph's default) says
HYP_ROUTING = "routing"
HYP_ROUTING_SOFTMAX = "routing=softmax"
HYP_ROUTING_SIGMOID = "routing=sigmoid"
# mtp_ffn_inp-<il>@halves=rope_first: an MLA head (DeepSeek's, GLM-5's) with each head's query and the
# compressed KV row read as [rope, nope], where the checkpoint lays them out [nope, rope]
HYP_HALVES_ROPE_FIRST = "halves=rope_first"
# l_out-<il>@recurrent=kept_rejected: a hybrid target's layer run on a recurrent state that kept the
# last verify's rejected rows (the position rolled back, not the state)
HYP_RECURRENT_KEPT = "recurrent=kept_rejected"
# l_out-<il>@router_margin: not a value of the record but evidence on it, per row (n_tokens, 2): the gap
# between the k-th and (k+1)-th router logit of layer il's MoE (a near-tie where it is small), and
# the rms of the row's router logits
HYP_ROUTER_MARGIN = "router_margin"
# EAGLE3 (torchref/eagle3/graph.py): fc_out@norm=none: fc of the raw features (a checkpoint with
# eagle3.norm_before_fc run without it); fc_out@norm=unit: fc of the features RMS-normalized with a
# unit weight (a norm added where the checkpoint has none)
HYP_NORM_NONE = "norm=none"
HYP_NORM_UNIT = "norm=unit"
HYP_FC_NORM_NONE = "fc_norm=none"  # fc_out@fc_norm=none: fc of the raw features, SpecForge's per-slot fc_norm dropped
# result_output@d2t=offsets, draft_logits@d2t=offsets: a reduced head's row i scattered to target id
# d2t[i] - i (a GGUF d2t holding the HF offsets, not absolute ids); NaN where several rows land on one
# id (which one ggml_set_rows leaves there is a race between its threads)
HYP_D2T_OFFSETS = "d2t=offsets"
# g_norm-0@g=after_norm: an EAGLE3 draft step fed the previous step's result_norm, not its eagle3_prenorm
HYP_G_AFTER_NORM = "g=after_norm"
# g_norm-0@g=batch_last: a target batch's first token paired with that batch's last g row (a later
# position's) instead of the pending row the batch before left (process()'s cross-ubatch bridge)
HYP_G_BATCH_LAST = "g=batch_last"
# inp_target_features@tap=attn_norm: each slot the output of its target layer's attention norm (the
# layer's normed input), not the residual stream entering the layer (torchref/eagle3/flow.py)
HYP_TAP_ATTN_NORM = "tap=attn_norm"
# MTP (torchref/mtp/head.py): mtp_h_input@h=prenorm, mtp_hnorm-<il>@h=prenorm: the head handed the
# target's hidden before its final norm;
# ...@h=chain_prenorm: a draft step handed the previous step's state before the head norm;
# and the reverse for a head trained on the pre-norm state (mimo2): ...@h=postnorm, the target's
# hidden after its final norm; ...@h=chain_postnorm, the previous step's state after the head norm;
# mtp_concat-<il>@slots=1,0 as EAGLE3's concat: [h, e]
HYP_H_PRENORM = "h=prenorm"
HYP_CHAIN_PRENORM = "h=chain_prenorm"
HYP_H_POSTNORM = "h=postnorm"
HYP_CHAIN_POSTNORM = "h=chain_postnorm"
# ...@h=batch_last: a target batch's first token paired with that batch's last hidden (a later
# position's) instead of the pending row the batch before left
HYP_H_BATCH_LAST = "h=batch_last"
# mtp_hnorm-<il>@norm=enorm, mtp_enorm-<il>@norm=hnorm: the head's two input norms each with the other's
# weight (the hidden normed with enorm, the embedding with hnorm)
HYP_NORM_ENORM = "norm=enorm"
HYP_NORM_HNORM = "norm=hnorm"
# ...@h=l_out-<il>: the head handed the output of target layer il, a layer before the trunk's last,
# under the hand-over's norm (the reference records every layer before the last that fits its budget)
HYP_H_LAYER = "h=l_out-"


def h_layer_hypothesis(il: int) -> str:
    """`h=l_out-<il>`: the head handed target layer il's output in place of the trunk's last."""
    return f"{HYP_H_LAYER}{il}"


# <record>@head=<j>: a chained MTP drafter's draft step computed under trained head j (diff/detectors/chain.py)
HYP_HEAD = "head"


def candidate_name(record: str, hypothesis: str) -> str:
    """A reference-only hypothesis record: what `record` would be under a named wiring fault."""
    return f"{record}{CANDIDATE_SEP}{hypothesis}"


def slots_hypothesis(perm: tuple[int, ...]) -> str:
    """`slots=1,0`: slot k of the staged row carries the layer of reference slot perm[k]."""
    return f"{HYP_SLOTS}=" + ",".join(str(p) for p in perm)


# --- record-name conventions compare relies on (docs/flow.md) ---------------------------------
UNNAMED_NODE_PREFIX = "node_"  # ggml's name for a node nobody named: `node_<n>`; never paired
# Names both producers are expected to write: a name in this set present on one side only is a
# `missing_tensor` / `unexpected_tensor` error; any other one-sided name is only reported as info.
# (inp_pos is left out: the reference does not record positions, the run's eval entries carry them.)
# The API readbacks are left out: dumps captured before featdiff read them back lack them; so is
# mtp_h_input, a graph input since issue 42 (the shim reads it before its norm), which captures
# around a program before that lack (in-process ones read it back)
READBACK_RECORDS = (DRAFT_LOGITS, DSPARK_CONF, MTP_H_INPUT)
# Readbacks that may hold only a sampler's top-k candidates (-inf elsewhere): `--exec` with
# llama.cpp's backend draft sampling, its default
TRUNCATED_READBACKS = (DRAFT_LOGITS,)
WIRING_NAMES: tuple[str, ...] = tuple(n for n in DEFAULT_FILTERS if n not in READBACK_RECORDS)
# Hugging Face config.json keys the reference reads
HF_MODEL_TYPE = "model_type"
HF_HIDDEN_SIZE = "hidden_size"
HF_NUM_LAYERS = "num_hidden_layers"
HF_NUM_HEADS = "num_attention_heads"
HF_NUM_KV_HEADS = "num_key_value_heads"
HF_HEAD_DIM = "head_dim"
HF_INTERMEDIATE_SIZE = "intermediate_size"
HF_RMS_EPS = "rms_norm_eps"
HF_ROPE_THETA = "rope_theta"
HF_VOCAB_SIZE = "vocab_size"
HF_MAX_POSITIONS = "max_position_embeddings"  # config.json: the trained context (n_ctx_train)
HF_TIE_EMBEDDINGS = "tie_word_embeddings"
GGUF_OPTIONAL_LAYER = ("attn_q_norm", "attn_k_norm")  # qwen3 and dflash have q/k norms, llama not

# config.json keys every transformers checkpoint may carry that change nothing a drafter computes,
# each with the reason; each kind's strict loader lists its own on top (modelled, modelled_eagle3)
HF_WRITER_KEYS: dict[str, str] = {
    "torch_dtype": "storage dtype; the reference computes in --dtype",
    "dtype": "storage dtype (transformers 5's spelling); the reference computes in --dtype",
    "transformers_version": "the writer's library version",
    "bos_token_id": "the tokenizer's; the target's vocabulary tokenizes",
    "eos_token_id": "the tokenizer's; the target's vocabulary tokenizes",
    "pad_token_id": "the tokenizer's; the target's vocabulary tokenizes",
    "initializer_range": "training-time initialization",
    "attention_dropout": "training-time dropout",
    "use_cache": "transformers' generation setting",
}
