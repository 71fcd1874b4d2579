"""The prompt and rounds of the session's real captures and references (tests/conftest.py):
tests that ask for these share one capture and one reference per fixture variant."""

DEFAULT_TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
DEFAULT_ROUNDS = 3


def reference_of(target, model, out, **options):
    """`featdiff.torchref.dflash.run.reference` with what the tests leave at its defaults: no prompt
    or tokens, no rounds, float32 on the CPU, an f16 cache, the pinned build; `options` override."""
    from featdiff.torchref.dflash.run import reference

    kw = {"prompt": None, "tokens": None, "rounds": 0, "dtype": "float32", "device": "cpu", "kv_dtype": "f16",
          "llama_dir": None}  # fmt: skip
    return reference(target, model, out, **{**kw, **options})
