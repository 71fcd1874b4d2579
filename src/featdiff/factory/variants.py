"""Every fixture pair `featdiff fixture --variant NAME` writes, one list: the DFlash / DSpark pairs
of featdiff.factory.pairs (factory/fixtures.py), the DFlash2 pair (factory/dflash2.py), the target families run
through transformers with the clean drafter (factory/hf_targets.py), the EAGLE3 pairs the pinned
converter makes (factory/eagle3.py) and the Qwen3.5, Qwen3.5-MoE, GLM-4.5 and MiMo-V2 targets with an
MTP head (factory/mtp.py), chained heads (factory/mtp_chain.py, factory/mtp_step35.py), and Gemma 4's
assistant drafter (factory/gemma4_assistant.py)."""

from __future__ import annotations

from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.factory import dflash2 as fixtures_dflash2
from featdiff.factory import eagle3 as fixtures_eagle3
from featdiff.factory import fixtures, hf_targets
from featdiff.factory import gemma4_assistant as fixtures_gemma4_assistant
from featdiff.factory import hf_families as factory_hf_families
from featdiff.factory import mtp as fixtures_mtp
from featdiff.factory import mtp_chain as fixtures_mtp_chain
from featdiff.factory import mtp_deepseek4 as fixtures_mtp_deepseek4
from featdiff.factory import mtp_step35 as fixtures_mtp_step35

DFLASH2 = "dflash2"
DFLASH2_DOC = "DFlash2 drafter (local convolutions, candidate lattice) on the qwen3 target"


def _others() -> dict[str, str]:
    """The variants beside featdiff.factory.pairs': name -> one line."""
    families = {
        name: f"{f.doc} through transformers, with the clean drafter (converted)"
        for name, f in factory_hf_families.FAMILIES.items()
    }
    return {
        DFLASH2: DFLASH2_DOC,
        **families,
        **fixtures_eagle3.EAGLE3_VARIANTS,
        **fixtures_mtp.MTP_VARIANTS,
        **fixtures_mtp_chain.CHAIN_VARIANTS,
        **fixtures_mtp_step35.STEP35_VARIANTS,
        **fixtures_mtp_deepseek4.DEEPSEEK4_VARIANTS,
        **fixtures_gemma4_assistant.GEMMA4_ASSISTANT_VARIANTS,
    }


def describe() -> str:
    """One line per variant: its name and what it is."""
    return fixtures.describe_variants() + "\n" + "\n".join(f"{name:22s} {doc}" for name, doc in _others().items())


def write(outdir: Path, variant: str, seed: int = 0) -> Path:
    """Write `variant`'s pair into `outdir`; InputError naming every variant for an unknown one."""
    if variant in fixtures_eagle3.EAGLE3_VARIANTS:
        return fixtures_eagle3.write_eagle3_fixture(outdir, variant, seed)
    if variant in fixtures_mtp.MTP_VARIANTS:
        return fixtures_mtp.write_mtp_fixture(outdir, variant, seed)
    if variant in fixtures_mtp_chain.CHAIN_VARIANTS:
        return fixtures_mtp_chain.write_mtp_chain_fixture(outdir, variant, seed)
    if variant in fixtures_mtp_step35.STEP35_VARIANTS:
        return fixtures_mtp_step35.write_step35_fixture(outdir, variant, seed)
    if variant in fixtures_mtp_deepseek4.DEEPSEEK4_VARIANTS:
        return fixtures_mtp_deepseek4.write_deepseek4_fixture(outdir, variant, seed)
    if variant in fixtures_gemma4_assistant.GEMMA4_ASSISTANT_VARIANTS:
        return fixtures_gemma4_assistant.write_gemma4_assistant_fixture(outdir, variant, seed)
    if variant == DFLASH2:
        return fixtures_dflash2.write_dflash2_fixture(outdir, seed)
    if variant in factory_hf_families.FAMILIES:
        return hf_targets.write_family_fixture(outdir, variant, seed)
    if variant not in fixtures.VARIANTS:
        known = [*fixtures.VARIANTS, *_others()]
        raise InputError(f"--variant {variant!r}: no such fixture variant; choose one of {', '.join(known)}")
    return fixtures.write_fixture(outdir, variant, seed)
