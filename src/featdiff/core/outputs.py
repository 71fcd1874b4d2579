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
not a bug: every writer (`replaced`, the lock, the dump writer, a capture's spool, the crash
report) tells it from other failures with `is_no_room`, removes what it wrote and raises
`no_room_error`, one line naming the output; what was at the output before is left as it was.
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from featdiff.core.errors import InputError, NoRoomError

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


def append_text(path: Path, text: str) -> None:
    """Append `text` to `path`, a file others write too (GitHub's $GITHUB_STEP_SUMMARY): never
    replaced, and a write that fails takes back what it appended, so the file is as it was."""
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    start = os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError as e:
        os.ftruncate(fd, start)
        raise_if_no_room(e, path)
        raise
    finally:
        os.close(fd)


def is_no_room(e: OSError, written: Path | None = None) -> bool:
    """True when `e` says a write ran out of room: disk, quota or file-size limit (NO_ROOM_ERRNOS).
    A short write reported without an errno (numpy's `tofile`: "N requested and M written") ran
    out of room when the file it was writing, `written`, is at the file-size limit or its
    filesystem has no free block left."""
    if e.errno in NO_ROOM_ERRNOS:
        return True
    return e.errno is None and written is not None and _is_full(written)


def room_shortfall(directory: Path, need: int) -> OSError | None:
    """The error a write of a `need`-byte file into `directory` would meet, None when it fits:
    EFBIG past the file-size limit (`ulimit -f`), ENOSPC past the filesystem's free space. For a
    writer that cannot tell its own failures apart (a compiler it runs), asked before it runs."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < need:
        why = f"{os.strerror(errno.EFBIG)}: the file-size limit is {limit} bytes, below the {need} this needs"
        return OSError(errno.EFBIG, why)
    existing = next((p for p in (directory, *directory.parents) if p.is_dir()), Path("/"))
    stat = os.statvfs(existing)
    if stat.f_bavail * stat.f_frsize < need:
        why = f"{os.strerror(errno.ENOSPC)}: {stat.f_bavail * stat.f_frsize} bytes free, this needs {need}"
        return OSError(errno.ENOSPC, why)
    return None


def _is_full(path: Path) -> bool:
    try:
        size = path.stat().st_size
        free = os.statvfs(path.parent).f_bavail
    except OSError:
        return False
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return free == 0 or (limit != resource.RLIM_INFINITY and size >= limit)


def no_room_error(output: Path | str, e: OSError, via: Path | str | None = None) -> NoRoomError:
    """The one-line error of a write to `output` that ran out of room (`is_no_room(e)`); `via`
    names the file whose write failed when it is not `output` itself (a capture's spool)."""
    where = f" writing {via}" if via is not None else ""
    return NoRoomError(
        f"{output}: could not be written ({e.strerror or e}{where}); nothing was "
        "written there and a file already there was kept; free disk space, raise the file-size "
        "limit (`ulimit -f`) or quota, or write it elsewhere"
    )


def raise_if_no_room(e: OSError, output: Path | str, via: Path | str | None = None) -> None:
    """Raise `no_room_error` for `e` when it says a write ran out of room; else return, for the
    caller to re-raise `e` (a bug, or a disk that is failing rather than full)."""
    if is_no_room(e):
        raise no_room_error(output, e, via) from None


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
            raise_if_no_room(e, path)
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
            _write_pid(fd, path)
            return fd
        os.close(fd)  # its holder removed this file as it let go: lock the one at `path` now


def _write_pid(fd: int, path: Path) -> None:
    """Write this pid into the lock file `fd` (named `path`), for a second run's message; a lock
    that cannot be written is released and removed."""
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as e:
        path.unlink(missing_ok=True)  # while still locked, as output_lock releases it
        os.close(fd)
        raise_if_no_room(e, path)
        raise


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
