"""Vocabulary without a model: names, phases, errors, options, outputs, the block rule, a plain GGUF reader."""
