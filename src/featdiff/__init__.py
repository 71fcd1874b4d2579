"""featdiff: find which tensor a llama.cpp drafter port gets wrong, and why.

Pipeline, one package per stage: capture (llama/) and the PyTorch reference (torchref/) write
dumps (dump/); diff/ compares two dumps and names the first divergence; html/ draws the triage
page; verdict/run.py runs them all for one CI verdict (`featdiff check`).

The Python API (featdiff.api), one call per stage, the same functions the command line calls,
each taking its command's options with the command's defaults (featdiff.core.options):

    featdiff.capture(target, model, output, ...) -> Path        the run dump (driver/capture.py)
    featdiff.reference(target, model, output, ...) -> Path      the reference dump (torchref/dflash/run.py)
    featdiff.compare(ref, run, name_map=None, ...) -> Comparison findings (diff/)
    featdiff.report(ref, run, output, ...) -> Path              the HTML page (html/)
    featdiff.check(target, model, ...) -> CheckResult           all of them and the accept probe (verdict/run.py)

Each stage is imported on first call, so `import featdiff` loads neither torch nor llama.cpp.
The stage packages are named apart from these functions (a subpackage imported under a
function's name would be bound over it).
"""

from featdiff.api import capture, check, compare, reference, report
from featdiff.version import VERSION as __version__

__all__ = ["__version__", "capture", "check", "compare", "reference", "report"]
