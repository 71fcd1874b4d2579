"""Session-wide fixtures shared by the whole suite: tiny models per variant, real captures of
them through the pinned llama.cpp build, and their reference dumps (each made once per session)."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from featdiff.diff.result import Comparison
from featdiff.factory.fixtures import write_fixture

from findings_schema import validate_findings, written
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

_UNCHECKED_TO_JSON = Comparison.to_json
TOOLS_FIXTURE = "tools"  # the fixture below: featdiff's build of the llama.cpp programs
THROUGH_SERVER = "through_server"  # a probe parameter: True runs it through the built llama-server
# fixtures whose models the pinned tree's converter makes (featdiff.factory.converter; cached per machine),
# run through the transformers reference: tests/reference/test_hf_target.py, tests/test_converter.py
CONVERTED_FIXTURES = ("qwen3moe", "qwen3moe_tied", "converted", "converted_feature")
# fixture -> the build of featdiff.llama.extra_builds.TEST_BUILDS it needs (the device fixture's Vulkan
# param only: CUDA's runs in `make test-cuda`), in the order they are built in the background and
# their tests run, last: Vulkan first, its tests being the longest (llvmpipe's shader compiles)
BUILD_OF_FIXTURE = {"vulkan": "vulkan", "device": "vulkan", "legacy": "release", "dl_prefix": "backend-dl"}
BUILD_ORDER = ("vulkan", "release", "backend-dl")
BACKGROUND_BUILDS_ENV = "FEATDIFF_BACKGROUND_BUILDS"  # 0: no background builds (each fixture builds its own)
XDIST_WORKER_ENV = "PYTEST_XDIST_WORKER"  # pytest-xdist's worker id (gw0, gw1, ...), unset in a session of one process
BACKGROUND_LOG = "test-builds.log"  # in the tools dir, beside each build's own featdiff-build.log
# the DFlash pairs a session fixture writes without the converter take a second, except the trained
# ones (one training, a minute or two on one core): how a test module names one
TRAINED_DFLASH = re.compile(r'"trained(-(?!eagle3|mtp)[a-z0-9-]+)?"')
FAMILY_WRITER = "write_family_fixture("  # featdiff.factory.hf_targets': module fixtures call it
WARM_UP_NICE = "10"  # below the tests, above the builds (nice 19), which have their tests' slack
WARM_UP_LOG = "test-warm-up.log"  # in the tools dir
# writes each variant named after the directory into it: the training and conversion caches fill
WARM_UP = "import sys; from pathlib import Path; from featdiff.factory import variants\n" + (
    "for v in sys.argv[2:]: variants.write(Path(sys.argv[1]) / v, v)"
)


def pytest_collection_modifyitems(config, items):
    """Mark what needs `make tools` (`tools`): every test using the `tools` fixture, directly or
    through another fixture, and every probe run `through_server`; and what converts (`slow`):
    every test on a pair of the pinned converter's (CONVERTED_FIXTURES). `make test-fast` leaves
    both out, `make test` runs them. (`browser`, `cuda` and the other `slow` tests are marked where
    they are written.)"""
    for item in items:
        callspec = getattr(item, "callspec", None)
        through_server = callspec is not None and callspec.params.get(THROUGH_SERVER) is True
        fixtures = getattr(item, "fixturenames", ())
        if TOOLS_FIXTURE in fixtures or through_server:
            item.add_marker(pytest.mark.tools)
        if any(f in fixtures for f in CONVERTED_FIXTURES):
            item.add_marker(pytest.mark.slow)


def _build_needed(item: pytest.Item) -> str | None:
    """The test build (BUILD_ORDER) `item` needs through its fixtures, if any."""
    callspec = getattr(item, "callspec", None)
    for fixture in getattr(item, "fixturenames", ()):
        build = BUILD_OF_FIXTURE.get(fixture)
        if build and not (fixture == "device" and callspec is not None and callspec.params.get("device") != "vulkan"):
            return build
    return None


def pytest_configure(config: pytest.Config) -> None:
    """The featdiff processes the tests start (reference, check and probe in a process of their
    own, the demo, README's blocks) run torch on one thread too, as this process does
    (torch_on_one_thread): at torch's default of 2, its second OpenMP thread spins for a core it
    mostly waits for, and takes it from the builds behind the tests. `featdiff reference` of the
    clean pair, 6 rounds: 31.1 s wall and 9.6 CPU seconds at the default, 11.7 s and 3.5 at one
    thread (3 runs each, alternated, 2 busy cores). llama.cpp's programs are not affected: ggml
    names its OpenMP thread count (-t) at every parallel region.

    llama.cpp itself computes on one thread too: the programs the tests start without -t (and the
    tests' own command lines say -t 1) through LLAMA_ARG_THREADS, which they read, and featdiff's
    in-process captures, which follow it (featdiff.llama.options.run_threads). ggml's threads wait
    for each other at every node by spinning, so on 2 cores shared with the warm-up (nice 10) a
    2-thread tiny model stalls whenever one of its threads is preempted: `test_check_faults.py -k
    "anchor-mask or keep-rejected"` (4 checks around both programs) took 69.6 s beside one nice-10
    busy loop at -t 2 and 33.7 s at -t 1, 8 s alone either way. A value already set is kept."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from featdiff.llama.options import THREADS_ENV

    os.environ.setdefault(THREADS_ENV, "1")


@pytest.hookimpl(tryfirst=True)  # before the terminal's --collect-only listing
def pytest_collection_finish(session: pytest.Session) -> None:
    """Run the modules whose tests need a build of their own (the older release, Vulkan, the
    backend-loaded library: minutes each on 2 cores) last, whole (`make test`'s two workers take a
    module at a time, in this order: pytest-xdist's --dist loadscope --no-loadscope-reorder), and
    start those builds now, in one niced background process: the suite keeps the cores busy with
    tests that need no build, so the builds take what the tests leave and are done, or nearly,
    when their tests come. Each build holds its build lock (featdiff.llama.tools): the fixture
    that needs it waits for it, or finds it built; one that failed left no stamp, so the fixture
    builds again and fails naming the build's log."""
    _start_warm_up(session)
    needed = {item: _build_needed(item) for item in session.items}
    builds = _builds_by_module(needed)
    if not builds:
        return
    last = {m: BUILD_ORDER.index(b) for m, b in builds.items()}
    session.items.sort(key=lambda item: last.get(_module(item), -1))  # stable: in order otherwise
    if session.config.option.collectonly or not _starts_background():
        return
    from featdiff.llama.binding import tools_dir

    log = tools_dir() / BACKGROUND_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    wanted = [b for b in BUILD_ORDER if b in needed.values()]
    cmd = ["nice", "-n", "19", sys.executable, "-m", "featdiff.llama.extra_builds", *wanted]
    with open(log, "a") as out:  # appended: sessions run side by side on a shared machine
        session.config.stash[_BACKGROUND] = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _builds_by_module(needed: dict[pytest.Item, str | None]) -> dict[str, str]:
    """Each module with a test that needs a build (`needed`: _build_needed of each test): the
    first of BUILD_ORDER its tests need."""
    builds: dict[str, str] = {}
    for item, build in needed.items():
        if build is not None:
            known = builds.get(_module(item), build)
            builds[_module(item)] = min(build, known, key=BUILD_ORDER.index)
    return builds


def _starts_background() -> bool:
    """Whether this process starts the background builds and warm-up: the session's own, or the
    first of pytest-xdist's workers (gw0; every worker collects the same tests), unless
    BACKGROUND_BUILDS_ENV says none."""
    return os.environ.get(BACKGROUND_BUILDS_ENV) != "0" and os.environ.get(XDIST_WORKER_ENV, "gw0") == "gw0"


_BACKGROUND = pytest.StashKey[subprocess.Popen]()
_WARM_UP = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def _warm_up_variants(items: list[pytest.Item]) -> list[str]:
    """The fixture variants worth making ahead of the tests in `items`, in the order they first
    use them: each EAGLE3 and MTP variant (the pinned converter's: 15 CPU seconds a conversion,
    a training for the trained ones) that a test using its pairs fixture (directly or through
    another fixture) names in its own source or as a parameter, and the trained DFlash pair when
    one names it; and each transformers family (the converter's too) a module that writes one
    with FAMILY_WRITER names. A variant a test reaches otherwise is made by its fixture, as before."""
    from featdiff.factory.eagle3 import EAGLE3_VARIANTS
    from featdiff.factory.hf_families import FAMILIES
    from featdiff.factory.mtp import MTP_VARIANTS

    named_by = {
        "fixture_models": (("trained", TRAINED_DFLASH),),
        "eagle3_pairs": tuple((v, re.compile(re.escape(f'"{v}"'))) for v in EAGLE3_VARIANTS),
        "mtp_pairs": tuple((v, re.compile(re.escape(f'"{v}"'))) for v in MTP_VARIANTS),
    }
    families = tuple((v, re.compile(re.escape(f'"{v}"'))) for v in FAMILIES)
    chosen: list[str] = []
    sources: dict[Path, str] = {}
    for item in items:
        fixtures = set(named_by) & set(getattr(item, "fixturenames", ()))
        words = _test_words(item) if fixtures else ""
        for fixture in fixtures:
            chosen += [v for v, named in named_by[fixture] if v not in chosen and named.search(words)]
        path = Path(str(item.fspath))
        source = sources.setdefault(path, path.read_text())
        if FAMILY_WRITER in source:  # a module fixture writes the family its module names
            chosen += [v for v, named in families if v not in chosen and named.search(source)]
    return chosen


def _test_words(item: pytest.Item) -> str:
    """The test function's source (from its `def`: a parametrize decorator names every case's
    variant) and its own parameters' string values, each quoted."""
    callspec = getattr(item, "callspec", None)
    params = [f'"{v}"' for v in callspec.params.values() if isinstance(v, str)] if callspec else []
    function = getattr(item, "function", None)
    source = inspect.getsource(function) if function is not None else ""
    return " ".join([source[source.find(f"def {getattr(function, '__name__', '')}(") :], *params])


def _start_warm_up(session: pytest.Session) -> None:
    """Make the converted and trained variants this session's tests use (_warm_up_variants) in
    one background process (nice WARM_UP_NICE), from collection on, into the per-machine caches:
    the suite keeps about one core busy, and most of those tests come minutes later. The caches'
    locks (featdiff.core.cache_dir.making) make a fixture that asks meanwhile wait for the
    background's conversion or training, never make it twice; one that failed there leaves no
    entry, so the fixture makes it and fails in the test."""
    if session.config.option.collectonly or not _starts_background():
        return
    variants = _warm_up_variants(session.items)
    if not variants:
        return
    from featdiff.llama.binding import tools_dir

    outdir = Path(tempfile.mkdtemp(prefix="featdiff-warm-up-"))
    log = tools_dir() / WARM_UP_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["nice", "-n", WARM_UP_NICE, sys.executable, "-c", WARM_UP, str(outdir), *variants]
    with open(log, "a") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    session.config.stash[_WARM_UP] = (proc, outdir)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """From the first test that needs a build on, the session waits for the builds left: they run
    at normal priority from then on (ninja's next jobs too), where this user may raise a priority
    (root, CAP_SYS_NICE); otherwise they stay at nice 19, which costs nothing where no other job
    wants the cores (CI)."""
    proc = item.config.stash.get(_BACKGROUND, None)
    if proc is not None and proc.poll() is None and _build_needed(item) is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PGRP, proc.pid, 0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the background builds and warm-up a session leaves unfinished (one stopped by -x or
    ^C): a build killed part-way has no stamp, so the next run builds on from it rather than
    trusting it; a training or conversion killed part-way stored no cache entry. A pytest-xdist
    worker that ran out of tests while the other still runs waits for them instead, unless
    interrupted: what they make is for the other worker's tests."""
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
    waits = XDIST_WORKER_ENV in os.environ and not interrupted
    for proc in (session.config.stash.get(_BACKGROUND, None), session.config.stash.get(_WARM_UP, (None,))[0]):
        if proc is not None and proc.poll() is None:
            if not waits:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    warm_up = session.config.stash.get(_WARM_UP, None)
    if warm_up is not None:  # a training stopped part-way stored nothing (training.cache.store)
        shutil.rmtree(warm_up[1], ignore_errors=True)


@pytest.fixture(scope="session")
def legacy():
    """The older llama.cpp (llama-cpp-python 0.3.35's, the batch API before llama_batch_ext),
    built once per machine (featdiff.llama.extra_builds.ensure_release; tests/llama/test_legacy_api.py)."""
    from featdiff.llama.extra_builds import ensure_release

    return ensure_release()


@pytest.fixture(scope="session", autouse=True)
def torch_on_one_thread():
    """The suite's own references on one torch thread. The tiny models' matrices (n_embd 64) are
    far below what intra-op threads pay for, and on two shared cores torch's second OpenMP thread
    mostly waits for a core: one in-process `check` of the tiny pair took 97 s at torch's default
    (2 threads) and 35 s at 1, back to back on the busy 2-core machine. Training pins its own count."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tools():
    """featdiff's build of the pinned llama.cpp programs (llama-server, llama-speculative-simple,
    llama-quantize, ...) and their source tree, built once per machine (`make tools`)."""
    from featdiff.llama.tools import ensure_tools

    return ensure_tools()


def _checked_to_json(self: Comparison) -> dict:
    """Comparison.to_json, each result validated against docs/findings.schema.json as written."""
    out = _UNCHECKED_TO_JSON(self)
    validate_findings(written(out))
    return out


@pytest.fixture(autouse=True)
def findings_json_follows_the_schema(monkeypatch):
    """Every findings JSON a test makes (the CLI's --json, write_json, check's JSON, a to_json
    call) is validated against the schema (tests/findings_schema.py)."""
    monkeypatch.setattr(Comparison, "to_json", _checked_to_json)


@pytest.fixture(scope="session")
def eagle3_pairs(tmp_path_factory):
    """EAGLE3 variant -> its pair made by the pinned converter (featdiff.factory.eagle3), once."""
    from featdiff.factory.eagle3 import write_eagle3_fixture

    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = write_eagle3_fixture(tmp_path_factory.mktemp(variant), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def mtp_pairs(tmp_path_factory):
    """MTP variant -> its Qwen3.5 target and head made by the pinned converter (featdiff.factory.mtp), once."""
    from featdiff.factory.mtp import write_mtp_fixture

    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = write_mtp_fixture(tmp_path_factory.mktemp(variant), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory):
    """variant name -> directory with target.gguf, draft.gguf, target-hf/, draft-hf/."""
    made: dict[str, Path] = {}

    def get(variant: str = "clean") -> Path:
        if variant not in made:
            made[variant] = write_fixture(tmp_path_factory.mktemp(f"fx-{variant}"), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def captured(tmp_path_factory, fixture_models):
    """(variant, filters) -> a real capture dump of that fixture pair (made once)."""
    from featdiff.driver.capture import capture

    made: dict[tuple, Path] = {}

    def get(
        variant: str = "clean",
        filters: tuple[str, ...] | None = None,
        tokens: str = DEFAULT_TOKENS,
        rounds: int = DEFAULT_ROUNDS,
    ) -> Path:
        key = (variant, filters, tokens, rounds)
        if key not in made:
            d = fixture_models(variant)
            out = tmp_path_factory.mktemp(f"run-{variant}") / "run.npz"
            made[key] = capture(
                d / "target.gguf",
                d / "draft.gguf",
                out,
                tokens=tokens,
                rounds=rounds,
                filters=list(filters) if filters else None,
            )
        return made[key]

    return get


@pytest.fixture(scope="session")
def referenced(tmp_path_factory, fixture_models):
    """(variant, model=, target=, tokens=, rounds=, kv_dtype=) -> the reference dump of that
    fixture pair's files (default: the trained checkpoint draft-hf), made once per arguments."""
    from featdiff.torchref.dflash.run import reference

    made: dict[tuple, Path] = {}

    def get(
        variant: str = "clean",
        model: str = "draft-hf",
        target: str = "target.gguf",
        tokens: str = DEFAULT_TOKENS,
        rounds: int = DEFAULT_ROUNDS,
        kv_dtype: str = "f16",
    ) -> Path:
        key = (variant, model, target, tokens, rounds, kv_dtype)
        if key not in made:
            d = fixture_models(variant)
            out = tmp_path_factory.mktemp(f"ref-{variant}") / "ref.npz"
            made[key] = reference(
                d / target,
                d / model,
                out,
                prompt=None,
                tokens=tokens,
                rounds=rounds,
                dtype="float32",
                device="cpu",
                kv_dtype=kv_dtype,
                llama_dir=None,
            )
        return made[key]

    return get
