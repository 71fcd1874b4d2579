"""The PyTorch reference: loads a target and a DFlash drafter (GGUF or Hugging Face), runs the
flow of docs/flow.md on the same token ids, and writes a dump with llama.cpp's record names plus
reference-only candidates. `lint` checks a drafter GGUF's DFlash metadata.
"""
