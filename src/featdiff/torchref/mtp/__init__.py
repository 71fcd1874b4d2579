"""MTP heads' reference: the head, its decoder layer, flow, Hugging Face heads and `reference`."""
