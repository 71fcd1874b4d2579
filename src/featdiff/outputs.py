"""Output paths: where a command may write, and how it writes.

Every command that writes (capture, reference, compare --json/--report, report, pack, fixture)
checks each output path against the command's inputs before it writes (capture and reference
before they run a model) with `check_output` / `check_output_dir`, and writes each file through `replaced`: under a temporary name beside it,
renamed into place when complete, so a killed or failed run never leaves a truncated file where
the user's old one was. An existing output that is not an input is replaced: that is what -o means.

A command that writes a dump from a capture holds the output's lock (`output_lock`) from before
it touches the spool until the dump is in place, so two runs never write one output at once; a
failed or interrupted run writes what it has to `failed_output`, never over the user's dump.

A write that runs out of room (a full disk, a quota, a file-size limit) is the user's problem,
not a bug: `replaced` (and the dump writer) remove the partial file and raise `no_room_error`,
one line naming the output; what was at the output before is left as it was.
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from featdiff.errors import InputError

PARTIAL_SUFFIX = ".partial"  # a file being written; renamed onto its real name once complete
LOCK_SUFFIX = ".lock"  # beside an output while a run writes it; holds the writer's pid
FAILED_TAG = ".failed"  # `<stem>.failed<suffix>`: what a failed run decoded, beside the user's dump
PID_BYTES = 32
# the errnos of a write that ran out of room: the disk (ENOSPC), the user's quota (EDQUOT), the
# file-size limit (EFBIG: `ulimit -f`; the CLI ignores SIGXFSZ so such a write fails, not kills)
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_HELD: set[Path] = set()  # the lock files this process holds (output_lock is re-entrant)


def partial_path(output: Path) -> Path:
    """Where `output` is written until it is complete: beside it, so the rename stays on one filesystem."""
    return output.with_name(output.name + PARTIAL_SUFFIX)


@contextmanager
def replaced(output: Path) -> Iterator[Path]:
    """A temporary path to write `output`'s content to: renamed onto `output` when the block ends,
    removed when it raises (the old `output`, if any, is left as it was). `output`'s lock is held
    meanwhile, so two runs never write one temporary file at once."""
    tmp = partial_path(Path(output))
    with output_lock(Path(output)):
        try:
            yield tmp
        except OSError as e:
            no_room = is_no_room(e, tmp)
            tmp.unlink(missing_ok=True)
            if no_room:
                raise no_room_error(Path(output), e) from None
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(output)


def is_no_room(e: OSError, written: Path | None = None) -> bool:
    """True when `e` says a write ran out of room: disk, quota or file-size limit (NO_ROOM_ERRNOS).
    A short write reported without an errno (numpy's `tofile`: "N requested and M written") ran
    out of room when the file it was writing, `written`, is at the file-size limit or its
    filesystem has no free block left."""
    if e.errno in NO_ROOM_ERRNOS:
        return True
    return e.errno is None and written is not None and _is_full(written)


def _is_full(path: Path) -> bool:
    try:
        size = path.stat().st_size
        free = os.statvfs(path.parent).f_bavail
    except OSError:
        return False
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return free == 0 or (limit != resource.RLIM_INFINITY and size >= limit)


def no_room_error(output: Path | str, e: OSError) -> InputError:
    """The one-line error of a write to `output` that ran out of room (`is_no_room(e)`)."""
    return InputError(
        f"{output}: could not be written ({e.strerror or e}); nothing was "
        "written there and a file already there was kept; free disk space, raise the file-size "
        "limit (`ulimit -f`) or quota, or write it elsewhere"
    )


def existing_file(arg: str) -> Path | None:
    """`arg` as the path of an existing regular file, else None. A program's argument need not be
    a path at all (a prompt of a few hundred characters, text with a NUL): one the system cannot
    look up as a path (too long, not encodable, not searchable) names no file: `os.path.isfile`
    answers False for it, where `Path.is_file` raises (ENAMETOOLONG)."""
    return Path(arg) if os.path.isfile(arg) else None


def check_output(output: Path, inputs: Iterable[Path | None], what: str) -> Path:
    """`output` as a file a command may write: not one of its `inputs` (nor inside an input
    directory), not an existing directory, in a directory that exists. `what` is the option
    that names it (`-o`, `--json`), quoted in the message."""
    output = Path(output)
    _check_not_input(output, inputs, what)
    if output.is_dir():
        raise InputError(f"{output}: {what} names an existing directory, expected a file path; choose another {what}")
    _check_parent(output, what)
    return output


def check_output_dir(output: Path, inputs: Iterable[Path | None], what: str) -> Path:
    """`output` as a directory a command may write files into: not one of its `inputs` (nor inside
    an input directory), not an existing file. Missing directories on the way are the writer's to
    create (`mkdir -p`: the user named a directory to make), unless one of them is a file."""
    output = Path(output)
    _check_not_input(output, inputs, what)
    if output.exists() and not output.is_dir():
        raise InputError(f"{output}: {what} names an existing file, expected a directory; choose another {what}")
    blocking = next((p for p in output.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise InputError(
            f"{output}: {what} needs {blocking} to be a directory, but it is a file; choose another {what}"
        )
    return output


def _check_not_input(output: Path, inputs: Iterable[Path | None], what: str) -> None:
    for given in (Path(p) for p in inputs if p is not None):
        if given.is_dir() and _is_within(output, given):
            raise InputError(
                f"{output}: {what} must not be inside an input directory of this command, but it "
                f"is inside {given}; choose another {what} outside it"
            )
        if given.exists() and _is_same_file(output, given):
            raise InputError(
                f"{output}: {what} must not be an input of this command, but it is the input "
                f"{given}; choose another {what}"
            )


def _is_same_file(output: Path, given: Path) -> bool:
    """True when `output` is `given` under any spelling: a relative path, a symlink, a hard link."""
    return output.exists() and os.path.samefile(output, given)


def _is_within(output: Path, directory: Path) -> bool:
    return output.resolve().is_relative_to(directory.resolve())


def _check_parent(output: Path, what: str) -> None:
    parent = output.parent
    if not parent.is_dir():
        found = "is a file" if parent.exists() else "does not exist"
        raise InputError(
            f"{output}: {what} needs the directory {parent}, which {found}; "
            f"create the directory or choose another {what}"
        )


def lock_path(output: Path) -> Path:
    """The lock file of `output`: beside it, `<output>.lock`."""
    return output.with_name(output.name + LOCK_SUFFIX)


@contextmanager
def output_lock(output: Path, what: str = "-o") -> Iterator[Path]:
    """Hold `output`'s lock (an exclusive flock on `<output>.lock`) for the block; another run
    holding it is an InputError naming its pid. The lock file is removed on release while still
    locked, so a run that opened it meanwhile sees it gone and locks a new one (`_acquire`)."""
    path = lock_path(Path(output))
    key = path.resolve()
    if key in _HELD:  # this process holds it already (a capture writing its dump): nothing to take
        yield path
        return
    fd = _acquire(path, Path(output), what)
    _HELD.add(key)
    try:
        yield path
    finally:
        _HELD.discard(key)
        path.unlink(missing_ok=True)
        os.close(fd)


def _acquire(path: Path, output: Path, what: str) -> int:
    """An open, flock-ed descriptor of the lock file now at `path`, with this pid written in it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise InputError(
                f"{path}: cannot create the lock file beside {what} {output} ({e.strerror}); "
                f"check that the directory is writable or choose another {what}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, PID_BYTES, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InputError(
                f"{output}: another featdiff run is writing {output} (pid {holder}); "
                f"wait for it or choose another {what}"
            ) from None
        if _is_linked(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # its holder removed this file as it let go: lock the one at `path` now


def _is_linked(fd: int, path: Path) -> bool:
    """True when the open file `fd` is still the file named `path` (not unlinked or replaced)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def failed_output(output: Path) -> Path:
    """Where a failed or interrupted run writes what it has: `output` when nothing is there, else
    the first free `<stem>.failed<suffix>`, `<stem>.failed-2<suffix>`, ... beside it, so the
    user's dump is never replaced by a partial one."""
    output = Path(output)
    if not output.exists():
        return output
    return free_path(output.with_name(f"{output.stem}{FAILED_TAG}{output.suffix}"))


def free_path(path: Path) -> Path:
    """`path` if nothing is there, else the first free `<stem>-2<suffix>`, `<stem>-3<suffix>`, ..."""
    n = 1
    found = Path(path)
    while found.exists():
        n += 1
        found = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return found
