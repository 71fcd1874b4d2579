"""EAGLE3's reference: its graph, flow, Hugging Face checkpoints and `reference` command."""
