"""featdiff: find which tensor a llama.cpp drafter port gets wrong, and why.

Pipeline: capture (llama/) and reference/ write dumps (dump.py); compare/ reads two dumps and
names the first divergence; report/ draws it.
"""

__version__ = "0.1.0"
