"""The cffi binding (API mode) to the llama.cpp build under test, plus featdiff's C shim.

It compiles against that build's own headers, so struct layouts come from the compiler, never
from a guess. The compiled module is cached per build under ~/.cache/featdiff (or
$FEATDIFF_CACHE), keyed by the headers, the library and the shim sources it was built from.

Accepted layouts for a build (`--llama-dir DIR` or $FEATDIFF_LLAMA_DIR):
* an install prefix: DIR/include/llama.h and DIR/lib/libllama.so (.dylib on macOS; also lib64/);
* a llama.cpp checkout: DIR/include/llama.h, DIR/ggml/include/ggml.h and the libraries of a
  CMake build under DIR/build (build/bin or build/src, build/ggml/src);
* a CMake build directory configured out of tree (`cmake -S SRC -B DIR`): the libraries in it,
  the headers of the source its CMakeCache.txt names.
Without either: the project's own build of the pinned llama.cpp (`make setup`: the checkout
build/llama.cpp/src, the tree the tools are built from, featdiff.llama.tools), else an installed
llama-cpp-python==0.3.36's include/ and lib/.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.resources
import importlib.util
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from featdiff.core.cache_dir import cache_root
from featdiff.core.errors import InputError
from featdiff.llama.cffi_modules import compile_into, import_compiled

log = logging.getLogger(__name__)

# the C sources ship inside the package (package data), so an installed wheel compiles them too
NATIVE_DIR = Path(str(importlib.resources.files("featdiff") / "native"))
SHIM_SOURCES = ("featdiff_shim.c", "featdiff_ext.cpp")
SHIM_HEADERS = ("featdiff_shim.h", "featdiff_ext.h")
LIBS = ("llama", "ggml", "ggml-base")
# The project's build of the pinned llama.cpp: one tree and one CMake build serve the binding,
# the preload and the tools (featdiff.llama.tools builds it; $FEATDIFF_TOOLS_DIR moves it).
ENV_TOOLS_DIR = "FEATDIFF_TOOLS_DIR"
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TOOLS_DIR = REPO_ROOT / "build" / "llama.cpp"
PROJECT_TREE = "src"  # the patched tree in the tools dir, with its CMake build in build/
# the shared library's file name on this platform (macOS builds make .dylib, Linux .so)
LIBLLAMA = "libllama.dylib" if sys.platform == "darwin" else "libllama.so"
ENV_LLAMA_DIR = "FEATDIFF_LLAMA_DIR"
CMAKE_CACHE = "CMakeCache.txt"  # in every CMake build directory
# the CMakeCache.txt entries that name the source a build directory was configured from
# (`cmake -S SRC`): llama.cpp's own project (set by its project() call, also when it is a
# subproject), then the top-level source directory
CMAKE_SOURCE_ENTRIES = ("llama.cpp_SOURCE_DIR", "CMAKE_HOME_DIRECTORY")
CMAKE_LIB_DEPTH = 3  # a build's libllama sits 1-3 levels below it: bin/, src/, ggml/src/
PINNED_WHEEL = "llama-cpp-python==0.3.36"  # the installed build featdiff binds without a project build

CDEF = """
typedef int32_t llama_token;
typedef int32_t llama_pos;
typedef int32_t llama_seq_id;
struct llama_model;
struct llama_context;
struct llama_vocab;
typedef struct llama_memory_i * llama_memory_t;
struct ggml_tensor;
enum ggml_log_level { GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_ERROR, ... };
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);

struct llama_model_params { int32_t n_gpu_layers; bool vocab_only; ...; };
enum ggml_type { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
                GGML_TYPE_Q8_0, GGML_TYPE_BF16, GGML_TYPE_IQ4_NL, ... };
enum llama_flash_attn_type { LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED,
                             LLAMA_FLASH_ATTN_TYPE_ENABLED, ... };
struct llama_context_params {
    uint32_t n_ctx; uint32_t n_batch; uint32_t n_ubatch; uint32_t n_seq_max;
    int32_t n_threads; int32_t n_threads_batch;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k; enum ggml_type type_v;
    ggml_backend_sched_eval_callback cb_eval; void * cb_eval_user_data;
    struct llama_context * ctx_other;
    ...;
};

void llama_backend_init(void);
size_t ggml_backend_reg_count(void);
typedef struct ggml_backend_device * ggml_backend_dev_t;
enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, ... };
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
void ggml_backend_load_all_from_path(const char * dir_path);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
struct llama_model_params llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
struct llama_model * llama_model_load_from_file(const char * path, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
llama_token llama_vocab_mask(const struct llama_vocab * vocab);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
llama_memory_t llama_get_memory(const struct llama_context * ctx);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
void llama_set_causal_attn(struct llama_context * ctx, bool causal_attn);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

/* featdiff_ext.h */
void fd_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
float * fd_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
void fd_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float * fd_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
float * fd_get_embeddings_nextn(struct llama_context * ctx);
void fd_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);
const int32_t * fd_model_target_layer_ids(const struct llama_model * model);
uint32_t fd_model_target_layer_ids_n(const struct llama_model * model);

/* featdiff_shim.h */
static const int FD_ROLE_TARGET;  /* the header's values, read when the binding compiles */
static const int FD_ROLE_DRAFT;
typedef struct fd_capture fd_capture;
typedef struct fd_context_tag { fd_capture * cap; int role; } fd_context_tag;
fd_capture * fd_capture_open(const char * prefix);
int fd_capture_close(fd_capture * cap);
int fd_capture_add_filter(fd_capture * cap, int role, const char * glob);
void fd_capture_begin_eval(fd_capture * cap, int eval_index);
int fd_capture_note(fd_capture * cap, const char * json_line);
int fd_capture_add_rows(fd_capture * cap, int role, const char * name, const float * data, int64_t n_cols, int64_t n_rows);
int fd_capture_error(const fd_capture * cap);
int fd_capture_errno(const fd_capture * cap);
long fd_capture_n_records(const fd_capture * cap);
fd_context_tag * fd_tag_new(fd_capture * cap, int role);
void fd_tag_free(fd_context_tag * tag);
bool fd_eval_callback(struct ggml_tensor * t, bool ask, void * user_data);
void fd_log_errors_only(int level, const char * text, void * user_data);
"""

# The two generations of llama.h's batch API; the build's header decides which one is compiled in.
# "ext": llama_batch_ext_* + llama_process (the pinned build and upstream since late 2026);
# "legacy": the plain llama_batch struct + llama_decode / llama_encode (older builds and forks).
BATCH_EXT, BATCH_LEGACY = "ext", "legacy"
EXT_MARKER = "llama_batch_ext_init"  # declared by llama.h only in the ext generation
CDEF_BATCH = {
    BATCH_EXT: """
struct llama_batch_ext;
enum llama_process_type { LLAMA_PROCESS_TYPE_ENCODE, LLAMA_PROCESS_TYPE_DECODE, ... };
struct llama_embd { const float * data; size_t n_rows; size_t n_embd; };
struct llama_batch_ext * llama_batch_ext_init(struct llama_context * ctx);
void llama_batch_ext_free(struct llama_batch_ext * batch);
void llama_batch_ext_clear(struct llama_batch_ext * batch);
int32_t llama_batch_ext_add_token(struct llama_batch_ext * batch, llama_seq_id seq_id, llama_token id);
int32_t llama_batch_ext_add_embd(struct llama_batch_ext * batch, llama_seq_id seq_id, struct llama_embd embd);
bool llama_batch_ext_set_pos(struct llama_batch_ext * batch, int32_t idx, const llama_pos * pos);
bool llama_batch_ext_set_output_logits(struct llama_batch_ext * batch, int32_t idx, bool value);
bool llama_batch_ext_set_embd_token(struct llama_batch_ext * batch, int32_t idx, struct llama_embd embd);
int32_t llama_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * batch);
""",
    BATCH_LEGACY: """
typedef struct llama_batch {
    int32_t n_tokens; llama_token * token; float * embd; llama_pos * pos;
    int32_t * n_seq_id; llama_seq_id ** seq_id; int8_t * logits;
} llama_batch;
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
int32_t llama_encode(struct llama_context * ctx, struct llama_batch batch);
""",
}


@dataclass(frozen=True)
class LlamaBuild:
    """Where a llama.cpp build keeps its headers and libraries."""

    root: Path
    include_dirs: tuple[Path, ...]
    lib_dirs: tuple[Path, ...]
    kind: str  # "project" (featdiff's build of the pinned tree), "pinned" (llama-cpp-python), "prefix", "checkout"

    @property
    def backend_dirs(self) -> tuple[Path, ...]:
        """Where a GGML_BACKEND_DL build keeps its backend libraries: beside libllama, and in an
        install prefix's bin/ (where `cmake --install` puts libggml-cpu.so and the like)."""
        return (*self.lib_dirs, *((self.root / "bin",) if self.kind == "prefix" else ()))

    @property
    def batch_api(self) -> str:
        """Which batch API generation this build's llama.h declares (BATCH_EXT or BATCH_LEGACY)."""
        header = next(d / "llama.h" for d in self.include_dirs if (d / "llama.h").is_file())
        return BATCH_EXT if EXT_MARKER in header.read_text(errors="replace") else BATCH_LEGACY

    @property
    def has_rs_seq(self) -> bool:
        """This build's llama_context_params has `n_rs_seq` (recurrent-state rollback)."""
        header = next(d / "llama.h" for d in self.include_dirs if (d / "llama.h").is_file())
        return f"uint32_t {RS_SEQ_FIELD};" in header.read_text(errors="replace")

    @property
    def has_mtp(self) -> bool:
        """This build's llama.h has MTP contexts (llama_context_type, load_mtp)."""
        header = next(d / "llama.h" for d in self.include_dirs if (d / "llama.h").is_file())
        return MTP_MARKER in header.read_text(errors="replace")

    @property
    def libllama(self) -> Path:
        return next(d / LIBLLAMA for d in self.lib_dirs if (d / LIBLLAMA).exists())


def tools_dir() -> Path:
    """Where the project builds the pinned llama.cpp (its tree, build, tools)."""
    return Path(os.environ.get(ENV_TOOLS_DIR) or DEFAULT_TOOLS_DIR)


def project_tree() -> Path:
    """The project's patched checkout of the pinned llama.cpp, built in place (`make setup`)."""
    return tools_dir() / PROJECT_TREE


def find_build(llama_dir: Path | None = None) -> LlamaBuild:
    """The build to bind: `llama_dir`, else $FEATDIFF_LLAMA_DIR, else the project's build of the
    pinned llama.cpp, else an installed llama-cpp-python."""
    chosen = llama_dir or (Path(os.environ[ENV_LLAMA_DIR]) if os.environ.get(ENV_LLAMA_DIR) else None)
    if chosen is None:
        tree = project_tree()
        if (tree / "include" / "llama.h").is_file() and (tree / "build" / "bin" / LIBLLAMA).exists():
            return _checked(_checkout(tree.resolve(), "project"))
        return _pinned_build()
    root = Path(chosen).expanduser().resolve()
    source = source_of(root)
    if source is not None and not (root / "include" / "llama.h").is_file():
        return _checked(_build_tree(root, source))
    if not (root / "include" / "llama.h").is_file():
        raise InputError(
            f"{root}: no include/llama.h (nor a {CMAKE_CACHE} naming a llama.cpp source); --llama-dir must be "
            "a llama.cpp checkout, its CMake build directory, or an install prefix"
        )
    if (root / "ggml" / "include" / "ggml.h").is_file():
        return _checked(_checkout(root, "checkout"))
    return _checked(LlamaBuild(root, (root / "include",), (root / "lib", root / "lib64"), "prefix"))


def _checkout(root: Path, kind: str) -> LlamaBuild:
    libs = tuple(root / "build" / d for d in ("bin", "src", "ggml/src"))
    return LlamaBuild(root, (root / "include", root / "ggml" / "include"), libs, kind)


def _build_tree(build_dir: Path, source: Path) -> LlamaBuild:
    """A CMake build directory of the checkout `source`, wherever it was configured (`-B`)."""
    libs = tuple(build_dir / d for d in ("bin", "src", "ggml/src"))
    return LlamaBuild(source, (source / "include", source / "ggml" / "include"), libs, "checkout")


def source_of(build_dir: Path) -> Path | None:
    """The llama.cpp source a CMake build directory was configured from, as its CMakeCache.txt
    names it (CMAKE_SOURCE_ENTRIES); None when `build_dir` holds no cache, or the cache names no
    tree with include/llama.h."""
    cache = build_dir / CMAKE_CACHE
    if not cache.is_file():
        return None
    entries = dict(_cache_entry(line) for line in cache.read_text(errors="replace").splitlines())
    named = (Path(entries[k]) for k in CMAKE_SOURCE_ENTRIES if entries.get(k))
    return next((p.resolve() for p in named if (p / "include" / "llama.h").is_file()), None)


def _cache_entry(line: str) -> tuple[str, str]:
    """(KEY, VALUE) of a CMakeCache.txt line `KEY:TYPE=VALUE`; comments give an unused pair."""
    key, _, rest = line.partition(":")
    return key.strip(), rest.partition("=")[2].strip()


def build_dir_of(libllama: Path) -> Path | None:
    """The CMake build directory a libllama was built in (its bin/, src/ or ggml/src/): the nearest
    directory above it whose CMakeCache.txt names a llama.cpp source; `find_build` accepts it."""
    return next((d for d in list(libllama.parents)[:CMAKE_LIB_DEPTH] if source_of(d) is not None), None)


def _pinned_build() -> LlamaBuild:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(no_build_message(REPO_ROOT))
    site = Path(next(iter(spec.submodule_search_locations))).parent
    return _checked(LlamaBuild(site, (site / "include",), (site / "lib",), "pinned"))


def no_build_message(repo: Path) -> str:
    """What to do when there is no build at all: in featdiff's checkout (`repo` holds its
    Makefile), build the pinned tree; in a pip-installed featdiff, install the pinned wheel."""
    if (repo / "Makefile").is_file() and (repo / "pyproject.toml").is_file():
        return (
            f"no llama.cpp build: neither the project's ({project_tree()}/build) nor {PINNED_WHEEL}; "
            "run `make setup`, or pass --llama-dir"
        )
    return (
        f"no llama.cpp build: {PINNED_WHEEL} is not installed beside featdiff; run "
        f"`pip install {PINNED_WHEEL}`, or pass --llama-dir DIR of your build (a checkout, its CMake "
        "build directory, or an install prefix; BUILD_SHARED_LIBS=ON)"
    )


def _checked(build: LlamaBuild) -> LlamaBuild:
    existing = tuple(d for d in build.lib_dirs if d.is_dir())
    if not any((d / LIBLLAMA).exists() for d in existing):
        where = ", ".join(str(d) for d in build.lib_dirs)
        raise InputError(
            f"{build.root}: no {LIBLLAMA} in {where} (looked for {build.lib_dirs[0] / LIBLLAMA}); "
            "build llama.cpp with -DBUILD_SHARED_LIBS=ON, or pass its install prefix or CMake build directory"
        )
    for h in ("llama.h", "ggml.h", "ggml-backend.h"):
        if not any((d / h).is_file() for d in build.include_dirs):
            raise InputError(f"{build.root}: header {h} not found in {', '.join(map(str, build.include_dirs))}")
    return LlamaBuild(build.root, build.include_dirs, existing, build.kind)


# llama_context_params.n_rs_seq: recurrent-state snapshots per sequence, the rollback a
# speculative loop on a hybrid target needs (llama.h; common.cpp sets it to the draft length).
# Declared only where the build's header has it: a cffi field the struct lacks fails to compile.
RS_SEQ_FIELD = "n_rs_seq"
CONTEXT_PARAMS_HEAD = "uint32_t n_ctx; uint32_t n_batch; uint32_t n_ubatch; uint32_t n_seq_max;"


# MTP heads (llama.h: llama_model_params.load_mtp, llama_context_params.ctx_type of enum
# llama_context_type, llama_model_n_layer_nextn): a build without them runs no MTP drafter, and
# cffi fails to compile a field a struct lacks, so they are declared only where the header has them
MTP_MARKER = "LLAMA_CONTEXT_TYPE_MTP"
MODEL_PARAMS_HEAD = "struct llama_model_params { int32_t n_gpu_layers; bool vocab_only;"
CDEF_MTP = """
enum llama_context_type { LLAMA_CONTEXT_TYPE_DEFAULT, LLAMA_CONTEXT_TYPE_MTP, ... };
int32_t llama_model_n_layer_nextn(const struct llama_model * model);
"""
CONTEXT_PARAMS_DECL = "struct llama_context_params {"


def cdef(build: LlamaBuild) -> str:
    """The declarations the binding compiles for `build`: the common ones, its batch API's and,
    where its header has them, n_rs_seq and the MTP context type."""
    common = CDEF
    if build.has_rs_seq:
        common = common.replace(CONTEXT_PARAMS_HEAD, f"{CONTEXT_PARAMS_HEAD} uint32_t {RS_SEQ_FIELD};")
    if build.has_mtp:
        common = common.replace(MODEL_PARAMS_HEAD, f"{MODEL_PARAMS_HEAD} bool load_mtp;")
        common = common.replace(CONTEXT_PARAMS_HEAD, f"{CONTEXT_PARAMS_HEAD} enum llama_context_type ctx_type;")
        common = common.replace(CONTEXT_PARAMS_DECL, CDEF_MTP + CONTEXT_PARAMS_DECL, 1)
    return common + CDEF_BATCH[build.batch_api]


def build_key(build: LlamaBuild) -> str:
    """A hash of everything the compiled module depends on."""
    h = hashlib.sha256()
    files = [d / n for d in build.include_dirs for n in ("llama.h", "ggml.h", "ggml-backend.h") if (d / n).is_file()]
    files += [NATIVE_DIR / n for n in SHIM_SOURCES + SHIM_HEADERS]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    lib = build.libllama.resolve()
    h.update(f"{lib}:{lib.stat().st_size}:{lib.stat().st_mtime_ns}".encode())
    h.update(f"{sys.version_info[:2]}:{cdef(build)}".encode())
    return h.hexdigest()[:16]


def _cache_dir() -> Path:
    return cache_root() / "binding"


def load(llama_dir: Path | None = None) -> tuple[ModuleType, LlamaBuild]:
    """The compiled binding module (its `ffi`, `lib`) for this build, compiling it once."""
    build = find_build(llama_dir)
    key = build_key(build)
    outdir = _cache_dir() / key
    modname = f"_featdiff_llama_{key}"
    found = list(outdir.glob(f"{modname}*{sysconfig.get_config_var('EXT_SUFFIX')}"))
    if not found:
        found = [_compile(build, outdir, modname)]
    why = f"{build.libllama}: the binding does not load; this build lacks a symbol featdiff needs (see native/featdiff_ext.cpp)"
    return import_compiled(modname, found[0], why), build


def _compile(build: LlamaBuild, outdir: Path, modname: str) -> Path:
    import cffi

    log.info("compiling the llama.cpp binding against %s (once per build)", build.root)
    ffi = cffi.FFI()
    ffi.cdef(cdef(build))
    lib_dirs = [str(d) for d in build.lib_dirs]
    ffi.set_source(
        modname,
        '#include "llama.h"\n#include "featdiff_shim.h"\n#include "featdiff_ext.h"\n',
        sources=[str(NATIVE_DIR / s) for s in SHIM_SOURCES],
        include_dirs=[str(d) for d in build.include_dirs] + [str(NATIVE_DIR)],
        library_dirs=lib_dirs,
        runtime_library_dirs=lib_dirs,
        libraries=list(LIBS) + ["stdc++"],
        extra_compile_args=["-O2"],
    )
    return compile_into(ffi, outdir)
