"""The user's-problem exception: a bad file, a flag, a build without a symbol; and the
interruption by a signal.

`cli.main` is the only place that turns them into a one-line message and an exit code (2; 130, 143).
"""

import signal
from pathlib import Path


class InputError(Exception):
    """Unusable input. The message names the file, what was expected, what was found, the fix."""


class NoRoomError(InputError):
    """A write ran out of room (a full disk, a quota, `ulimit -f`): the user's to free, exit 2
    like any InputError. Its writer removed what it had written (featdiff.core.outputs.no_room_error)."""


class ProgramFailed(InputError):
    """The program featdiff ran around failed after it had decoded: `dump` holds what it decoded
    before that, the evidence `check` judges (the failure may be the wiring fault's doing)."""

    def __init__(self, message: str, dump: Path) -> None:
        super().__init__(message)
        self.dump = Path(dump)


class Interrupted(KeyboardInterrupt):
    """featdiff was stopped by SIGINT or SIGTERM (`signum`). `outcome` says what the stopped
    command left behind, e.g. where it packed what was decoded ("": nothing to say).

    A KeyboardInterrupt, so code that cleans up on Ctrl-C cleans up on SIGTERM too; `cli.main`
    raises it from its signal handlers and is the one place that turns it into a line and exit
    code 128 + signum (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT, outcome: str = ""):
        super().__init__(signum, outcome)
        self.signum = int(signum)
        self.outcome = outcome

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal."""
        return 128 + self.signum

    def __str__(self) -> str:
        said = f"interrupted by {signal.Signals(self.signum).name}"
        return f"{said}; {self.outcome}" if self.outcome else said

    @staticmethod
    def of(stop: BaseException, outcome: str = "") -> "Interrupted":
        """`stop` (an Interrupted, or Python's own Ctrl-C KeyboardInterrupt) with `outcome`."""
        return Interrupted(getattr(stop, "signum", signal.SIGINT), outcome)
