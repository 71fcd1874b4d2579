"""The options of featdiff's stage commands, each defined once: the command line's flags and help
(cli.py builds its typer options from these) and the default the Python API's keyword takes
(api.py), so the two cannot drift; tests/test_api.py walks the CLI's commands to prove it.

Plain data, importing nothing: `import featdiff` reads it without loading typer, torch or
llama.cpp. A definition's `name` is the keyword of the API function and the parameter of the
CLI's command; `min`, `max`, `exists` and `dir_okay` are the checks the command line makes.
(llama.cpp's own run options, `-ctk` and the like, are featdiff.llama.options.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPUTE_DTYPE_DEFAULT = "float32"  # the reference computes in float32 unless asked (torchref/numerics.py)
DEVICE_DEFAULT = "cpu"  # torch's device for the reference
KV_DTYPE_DEFAULT = "f16"  # llama.cpp's KV cache type unless told otherwise (dump.KV_TYPE_DEFAULT)
ROUNDS_DEFAULT = 2  # speculative rounds of a capture or a reference
REQUIRED: Any = ...  # the default of an option the command cannot run without (typer's spelling)


@dataclass(frozen=True)
class Option:
    """One option of a stage command: API keyword and CLI parameter `name`, its `flags`, `default`
    and `help`, and the checks the command line makes of a value."""

    name: str
    flags: tuple[str, ...]
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    exists: bool = False  # a path that must exist
    dir_okay: bool = True  # a path that may be a directory


# ---------------------------------------------------------------- the models and the flow

TARGET_GGUF = Option("target", ("--target",), None, "Target model GGUF.", exists=True, dir_okay=False)
MODEL_GGUF = Option("model", ("--model",), None, "Drafter model GGUF.", exists=True, dir_okay=False)
RUN_TARGET = Option("target", ("--target",), REQUIRED, "Target model GGUF (the run).", exists=True, dir_okay=False)
RUN_MODEL = Option("model", ("--model",), REQUIRED, "Drafter GGUF (the run).", exists=True, dir_okay=False)
REF_TARGET = Option(
    "ref_target", ("--ref-target",), None, "Reference target: GGUF or HF directory. Default: --target.", exists=True
)
REF_MODEL = Option(
    "ref_model",
    ("--ref-model",),
    None,
    "Reference drafter, e.g. the trained HF checkpoint. Default: --model.",
    exists=True,
)
PROMPT = Option("prompt", ("--prompt",), None, "Prompt text, tokenized with llama.cpp's own vocabulary.")
TOKENS = Option("tokens", ("--tokens",), None, "Comma-separated token ids, e.g. 1,2,3.")
ROUNDS = Option(
    "rounds",
    ("--rounds",),
    ROUNDS_DEFAULT,
    (
        "Speculative rounds (draft, verify, inject) after the prefill; at most what fits the target's trained"
        " context: prompt + (rounds + 1) x block rows <= {arch}.context_length (HF: max_position_embeddings; "
        "32768 when the target states none)."
    ),
    min=0,
)
DRAFT_MAX = Option(
    "draft_max",
    ("--draft-max",),
    None,
    (
        "Drafts per block, as llama.cpp's --spec-draft-n-max: the block is the anchor plus N masks, N clamped"
        " to dflash.block_size - 1. Default: 3, llama.cpp's default. In-process only: with --exec the "
        "program's command line decides."
    ),
)
P_MIN = Option(
    "p_min",
    ("--p-min",),
    None,
    (
        "llama.cpp's --spec-draft-p-min: a DSpark drafter with a confidence head stops drafting below it. "
        "Default 0 (reference: the --run dump's)."
    ),
    min=0.0,
    max=1.0,
)
LLAMA_DIR = Option(
    "llama_dir",
    ("--llama-dir",),
    None,
    (
        "A llama.cpp build to use: a checkout with its CMake build dir, or an install prefix. Default: "
        "$FEATDIFF_LLAMA_DIR, else featdiff's build of the pinned llama.cpp (make setup), else "
        "llama-cpp-python."
    ),
)
NAME_MAP = Option(
    "name_map",
    ("--map",),
    None,
    "Name map (TOML) for forks that name tensors their own way.",
    exists=True,
    dir_okay=False,
)

# ---------------------------------------------------------------- capture

DUMP_OUTPUT = Option("output", ("-o", "--output"), REQUIRED, "Dump to write (.npz).")
FILTERS = Option(
    "filters", ("--filter",), None, "Glob on callback names to capture (repeatable). Default: the wiring tensors."
)
EXEC = Option("exec_", ("--exec",), False, "Capture around an unmodified llama.cpp program given after `--`.")
REQUESTS = Option(
    "requests",
    ("--requests",),
    None,
    (
        "With --exec of llama-server and no --prompt/--tokens: stop after N of your own requests have "
        "completed (default: at Ctrl-C)."
    ),
    min=1,
)

# ---------------------------------------------------------------- reference

REF_TARGET_ANY = Option("target", ("--target",), REQUIRED, "Target model: GGUF or HF directory.", exists=True)
REF_MODEL_ANY = Option("model", ("--model",), REQUIRED, "Drafter: GGUF or HF directory (DFlash layout).", exists=True)
DTYPE = Option("dtype", ("--dtype",), COMPUTE_DTYPE_DEFAULT, "Compute dtype.")
DEVICE = Option("device", ("--device",), DEVICE_DEFAULT, "Torch device.")
KV_DTYPE = Option("kv_dtype", ("--kv-dtype",), KV_DTYPE_DEFAULT, "Emulate the run's KV cache type: f16 or f32.")
REF_LLAMA_DIR = Option(
    "llama_dir",
    ("--llama-dir",),
    None,
    (
        "The llama.cpp build the run used: its vocabulary tokenizes --prompt and its own ggml dequantizes "
        "every quantized GGUF weight (bit for bit what the run read). Default: gguf-py dequantizes, and a "
        "type it cannot read (Q1_0) goes to the default build's ($FEATDIFF_LLAMA_DIR, else featdiff's build "
        "of the pinned llama.cpp)."
    ),
)
BLOCK = Option(
    "block",
    ("--block",),
    None,
    (
        "Rows per draft block: the anchor and the masks; a run's --spec-draft-n-max + 1 (anchor-first DSpark:"
        " n-max), up to dflash.block_size. Default: llama.cpp's default --spec-draft-n-max 3, clamped."
    ),
)
BLOCKS_OF_RUN = Option(
    "run",
    ("--run",),
    None,
    (
        "A run dump (.npz): draft blocks as long as its draft evals, and its --p-min. Instead of --block. "
        "A run of several requests (llama-server): each flow replayed from its own prompt, the reference "
        "drafting on its own (no --prompt/--tokens needed)."
    ),
)
FOLLOW = Option(
    "follow",
    ("--follow",),
    None,
    (
        "A run dump (.npz) to replay: its prompt, rounds, drafts and accepted prefixes instead of the "
        "reference's own, so every eval of the run pairs (a quantized target, a server's own loop); a run "
        "of several requests, flow by flow. Replaces --prompt/--tokens/--rounds/--block/--run."
    ),
    exists=True,
    dir_okay=False,
)

LAYER_IDS_MEAN = Option(
    "layer_ids_mean",
    ("--layer-ids-mean",),
    None,
    (
        "input or output: what an EAGLE3 Hugging Face checkpoint's eagle_aux_hidden_state_layer_ids name, where "
        "the checkpoint cannot tell (llama.cpp and vLLM tap layer inputs, SpecForge layer outputs: id + 1). "
        "Default: told by the checkpoint's trainer."
    ),
)

# ---------------------------------------------------------------- compare and report

JSON_OUT = Option("json_out", ("--json",), None, "Write findings JSON to FILE, or - for stdout only.")
ALSO_REPORT = Option("report", ("--report",), None, "Also write the HTML triage report.")
VERBOSE = Option("verbose", ("--verbose", "-v"), False, "Print the per-record table too.")
LOG_VERBOSE = Option(
    "verbose",
    ("--verbose", "-v"),
    False,
    "Also print each round's detail on stderr (where the reference's own choice parts from the run's).",
)
HTML_OUTPUT = Option("output", ("-o", "--output"), REQUIRED, "HTML file to write.")
PNG_DIR = Option("png_dir", ("--png-dir",), None, "Also write each figure as a PNG here.")

# ---------------------------------------------------------------- check

CHECK_PROMPTS = Option(
    "prompts",
    ("--prompts",),
    None,
    (
        "One prompt per line (`tokens: 1,2,3` for ids); the capture takes the first, the accept probe all. "
        "Default: two built-in prompts."
    ),
    exists=True,
    dir_okay=False,
)
CHECK_ROUNDS = Option(
    "rounds",
    ("--rounds",),
    None,
    "In-process: speculative rounds of the capture and of the probe, per prompt. Default: 4.",
    min=1,
)
MIN_ACCEPT = Option(
    "min_accept",
    ("--min-accept",),
    None,
    "Fail when the run's accept rate (accepted / drafted tokens) is below this fraction.",
    min=0.0,
    max=1.0,
)
KEEP = Option(
    "keep", ("--keep",), None, "Keep the run and reference dumps in this directory (default: a temporary one)."
)
CHECK_JSON_OUT = Option("json_out", ("--json",), None, "Write the check's JSON to FILE, or - for stdout only.")
SUMMARY_MD = Option(
    "summary_md",
    ("--summary-md",),
    None,
    "Write a Markdown verdict (also appended to $GITHUB_STEP_SUMMARY when set).",
)
CHECK_EXEC = Option(
    "exec_", ("--exec",), False, "Run around the llama-server or llama-speculative-simple command given after `--`."
)
JUDGED_RUN = Option(
    "run",
    ("--run",),
    None,
    (
        "Judge this capture instead of making one (e.g. of your own llama-server traffic); the probe is its "
        "own flows' rounds."
    ),
    exists=True,
    dir_okay=False,
)
