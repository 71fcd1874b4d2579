/* featdiff preload: capture around an unmodified llama.cpp program (`featdiff capture --exec`).
 *
 * Loaded into the program with LD_PRELOAD (Linux) or DYLD_INSERT_LIBRARIES (macOS) and linked
 * with featdiff_shim.c but against no llama/ggml library, so every llama.cpp and ggml symbol it
 * uses resolves to the program's own libraries. It interposes a few llama.h functions, calls
 * the program's ones (found with dlsym(RTLD_NEXT) on Linux, through __DATA,__interpose on
 * macOS), and writes what it sees as JSON lines into the shim's spool index:
 *
 *   llama_model_load_from_file   "exec_model"    model pointer and path
 *   llama_init_from_model        "exec_context"  role from the architecture; the shim's eval
 *                                                callback chained in front of the program's own
 *   llama_batch_ext_*            a shadow of each batch (tokens, positions, seq ids, outputs)
 *   llama_process, llama_decode, "exec_eval" before the decode, "exec_done" with its rc after
 *   llama_encode
 *   llama_memory_clear           "exec_clear"    (warm-up and probe decodes end in one)
 *   llama_memory_seq_rm          "exec_seq_rm"   which positions the program removes from a cache
 *   llama_memory_seq_cp / _keep  "exec_memory"   every other change to what a sequence holds: copies,
 *   / _add / _div                                 keeps, position shifts (context shift, cache reuse)
 *   llama_state_seq_get_data*    "exec_memory"   a sequence's state saved (op "state_save") or
 *   llama_state_seq_set_data*                     restored ("state_restore"), named by a hash of its
 *                                                 bytes: the server's RAM prompt cache, checkpoints
 *   llama_state_seq_save_file /  "exec_memory"   the same through a file (`/slots` save and restore),
 *   llama_state_seq_load_file                     named by its path
 *   llama_free                   "exec_free"
 *
 * Both generations of llama.h's batch API are served: FDP_BATCH_EXT (set by featdiff from the
 * build's header) compiles the llama_batch_ext / llama_process hooks in; without it only the plain
 * llama_batch ones (llama_decode, llama_encode), which both generations have, are. FDP_MTP (set
 * where the header has LLAMA_CONTEXT_TYPE_MTP) makes an MTP context a drafter's, whatever its model.
 * Phases are decided in Python from these facts (featdiff/llama/exec.py), not here.
 * Environment: FEATDIFF_SPOOL (spool prefix), FEATDIFF_FILTERS (lines "<role>\t<glob>", role 0
 * target, 1 draft), FEATDIFF_ARCH_KEY and FEATDIFF_DRAFT_ARCH (comma-separated: a model whose
 * architecture metadata is one of these is a drafter), FEATDIFF_PARENT_PID (featdiff's pid: on Linux every
 * process the library loads into dies with its parent, so the program never outlives featdiff).
 * Nothing here aborts: on a failure the preload says so once on stderr, stops capturing, and the
 * program runs on untouched.
 */
#define _GNU_SOURCE
#include "featdiff_shim.h"

#include "llama.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef __linux__
#include <signal.h>
#include <sys/prctl.h>
#endif

#define FDP_META_MAX 128

/* ---------------------------------------------------------------- dying with featdiff */

#ifdef __linux__
/* Runs when the library loads, in every process started with the preload (a wrapper script's
 * shell, the program it starts, ...): each gets SIGKILL when its own parent dies, so a chain of
 * them dies with featdiff, even when featdiff itself is killed with SIGKILL. A process whose
 * parent is already gone (reparented to init, pid 1) when it gets here missed that signal: it
 * exits now. Only pid 1 counts as gone: a wrapper's child has the wrapper as its parent, and a
 * featdiff that is pid 1 itself (a container's init) is alive. */
__attribute__((constructor)) static void fdp_die_with_parent(void) {
    const char * featdiff = getenv("FEATDIFF_PARENT_PID");
    if (!featdiff || !*featdiff) return;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return;
    const pid_t parent = getppid();
    if (parent == 1 && atol(featdiff) != 1) raise(SIGKILL);
}
#endif

/* ---------------------------------------------------------------- the program's functions */

typedef struct llama_model *   (*fdp_load_fn)(const char *, struct llama_model_params);
typedef struct llama_context * (*fdp_init_fn)(struct llama_model *, struct llama_context_params);
typedef void    (*fdp_free_fn)(struct llama_context *);
typedef int32_t (*fdp_decode_fn)(struct llama_context *, struct llama_batch);
typedef void    (*fdp_clear_fn)(llama_memory_t, bool);
typedef bool    (*fdp_seq_rm_fn)(llama_memory_t, llama_seq_id, llama_pos, llama_pos);
typedef void    (*fdp_seq_cp_fn)(llama_memory_t, llama_seq_id, llama_seq_id, llama_pos, llama_pos);
typedef void    (*fdp_seq_keep_fn)(llama_memory_t, llama_seq_id);
typedef void    (*fdp_seq_shift_fn)(llama_memory_t, llama_seq_id, llama_pos, llama_pos, llama_pos);
typedef void    (*fdp_seq_div_fn)(llama_memory_t, llama_seq_id, llama_pos, llama_pos, int);
typedef size_t  (*fdp_state_get_fn)(struct llama_context *, uint8_t *, size_t, llama_seq_id);
typedef size_t  (*fdp_state_set_fn)(struct llama_context *, const uint8_t *, size_t, llama_seq_id);
typedef size_t  (*fdp_state_save_fn)(struct llama_context *, const char *, llama_seq_id, const llama_token *, size_t);
typedef size_t  (*fdp_state_load_fn)(struct llama_context *, const char *, llama_seq_id, llama_token *, size_t, size_t *);
#ifdef LLAMA_STATE_SEQ_FLAGS_NONE
typedef size_t  (*fdp_state_get_ext_fn)(struct llama_context *, uint8_t *, size_t, llama_seq_id, llama_state_seq_flags);
typedef size_t  (*fdp_state_set_ext_fn)(struct llama_context *, const uint8_t *, size_t, llama_seq_id, llama_state_seq_flags);
#endif
#if FDP_BATCH_EXT
typedef int32_t (*fdp_process_fn)(struct llama_context *, enum llama_process_type, struct llama_batch_ext *);
typedef struct llama_batch_ext * (*fdp_batch_init_fn)(struct llama_context *);
typedef void    (*fdp_batch_fn)(struct llama_batch_ext *);
typedef int32_t (*fdp_batch_add_fn)(struct llama_batch_ext *, llama_seq_id);
typedef int32_t (*fdp_batch_add_token_fn)(struct llama_batch_ext *, llama_seq_id, llama_token);
typedef int32_t (*fdp_batch_add_embd_fn)(struct llama_batch_ext *, llama_seq_id, struct llama_embd);
typedef bool    (*fdp_batch_add_seq_fn)(struct llama_batch_ext *, int32_t, llama_seq_id);
typedef bool    (*fdp_batch_flag_fn)(struct llama_batch_ext *, int32_t, bool);
typedef bool    (*fdp_batch_pos_fn)(struct llama_batch_ext *, int32_t, const llama_pos *);
#endif

struct fdp_real {
    fdp_load_fn load;
    fdp_init_fn init;
    fdp_free_fn free_ctx;
    fdp_decode_fn decode;
    fdp_decode_fn encode;
    fdp_clear_fn clear_mem;
    fdp_seq_rm_fn seq_rm;
    fdp_seq_cp_fn seq_cp;
    fdp_seq_keep_fn seq_keep;
    fdp_seq_shift_fn seq_add;
    fdp_seq_div_fn seq_div;
    fdp_state_get_fn state_get;
    fdp_state_set_fn state_set;
    fdp_state_save_fn state_save;
    fdp_state_load_fn state_load;
#ifdef LLAMA_STATE_SEQ_FLAGS_NONE
    fdp_state_get_ext_fn state_get_ext;
    fdp_state_set_ext_fn state_set_ext;
#endif
#if FDP_BATCH_EXT
    fdp_process_fn process;
    fdp_batch_init_fn batch_init;
    fdp_batch_fn batch_free;
    fdp_batch_fn batch_clear;
    fdp_batch_add_fn batch_add;
    fdp_batch_add_token_fn batch_add_token;
    fdp_batch_add_embd_fn batch_add_embd;
    fdp_batch_add_seq_fn batch_add_seq;
    fdp_batch_flag_fn batch_output_logits;
    fdp_batch_flag_fn batch_output_embd;
    fdp_batch_pos_fn batch_set_pos;
#endif
};

/* ---------------------------------------------------------------- state */

/* One entry of a batch as the program built it. */
struct fdp_entry {
    llama_token token;   /* -1 (LLAMA_TOKEN_NULL): an embedding row */
    llama_pos pos;       /* -1: not set (llama.cpp then places it) */
    llama_seq_id seq;    /* the first sequence id */
    int output;
};

struct fdp_batch {
    const void * batch;  /* the program's llama_batch_ext */
    struct fdp_entry * e;
    int n, cap;
    struct fdp_batch * next;
};

/* One per llama_context: the user_data of the chained eval callback. */
struct fdp_ctx {
    struct llama_context * ctx;
    llama_memory_t mem;
    fd_context_tag * tag;
    ggml_backend_sched_eval_callback user_cb;  /* the program's own callback, chained */
    void * user_data;
    bool user_asked;
    bool kv_unified;  /* one KV stream for every sequence: llama.cpp splits its batches simply */
    int index;
    int role;
    struct fdp_ctx * next;
};

/* A preload has no caller to hand state to: it lives here, set up once by fdp_init. */
struct fdp_state {
    struct fdp_real real;
    pthread_mutex_t spool_lock;  /* index lines, eval numbering, the capture itself (recursive) */
    pthread_mutex_t batch_lock;  /* the batch shadows */
    fd_capture * cap;            /* NULL: not capturing */
    char draft_arch[FDP_META_MAX];
    char arch_key[FDP_META_MAX];
    int n_evals;
    int n_ctx;
    struct fdp_ctx * contexts;
    struct fdp_batch * batches;
};

static struct fdp_state G = { .batch_lock = PTHREAD_MUTEX_INITIALIZER };
static pthread_once_t G_once = PTHREAD_ONCE_INIT;

/* ---------------------------------------------------------------- JSON lines */

struct fdp_buf { char * s; size_t n, cap; int oom; };

static void buf_printf(struct fdp_buf * b, const char * fmt, ...) {
    for (int attempt = 0; attempt < 2 && !b->oom; ++attempt) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) { b->oom = 1; return; }
        if (b->s && b->n + (size_t) k < b->cap) { b->n += (size_t) k; return; }
        size_t cap = (b->cap + (size_t) k + 1) * 2;
        char * s = (char *) realloc(b->s, cap);
        if (!s) { b->oom = 1; return; }
        b->s = s;
        b->cap = cap;
    }
}

static void buf_str(struct fdp_buf * b, const char * s) {
    buf_printf(b, "\"");
    for (; s && *s; ++s) {
        unsigned char c = (unsigned char) *s;
        if (c == '"' || c == '\\') buf_printf(b, "\\%c", c);
        else if (c < 0x20) buf_printf(b, "\\u%04x", c);
        else buf_printf(b, "%c", c);
    }
    buf_printf(b, "\"");
}

static void say(const char * what) {
    fprintf(stderr, "featdiff preload: %s; capture stopped, the program runs on\n", what);
}

/* Write one line to the index and free the buffer. Caller holds spool_lock. */
static void note_locked(struct fdp_buf * b) {
    if (G.cap && !b->oom && b->s && fd_capture_note(G.cap, b->s) != FD_OK) {
        say("writing the spool index failed");
        G.cap = NULL;
    }
    free(b->s);
}

static void note(struct fdp_buf * b) {
    pthread_mutex_lock(&G.spool_lock);
    note_locked(b);
    pthread_mutex_unlock(&G.spool_lock);
}

/* ---------------------------------------------------------------- set-up */

/* The program's `name`; a missing one is said on stderr unless it is `optional`. */
static void * lookup(const char * name, int optional) {
    void * fn = dlsym(RTLD_NEXT, name);
    if (!fn && !optional) fprintf(stderr, "featdiff preload: the program's llama.cpp has no %s\n", name);
    return fn;
}

#if defined(__APPLE__)
/* dyld interposes through this section; inside this image the names still mean the originals. */
#define FDP_HOOK(name, hook) \
    __attribute__((used)) static const struct { const void * repl; const void * orig; } \
    fdp_interpose_##name __attribute__((section("__DATA,__interpose"))) = { (const void *) &hook, (const void *) &name };
#define FDP_RESOLVE(field, name) G.real.field = &name
#define FDP_RESOLVE_EXT(field, name) FDP_RESOLVE(field, name)
#else
#define FDP_HOOK(name, hook) __typeof__(name) name __attribute__((alias(#hook), visibility("default")));
#define FDP_RESOLVE(field, name) G.real.field = (__typeof__(G.real.field)) lookup(#name, 0)
/* the ext batch API: absent from a program of the older generation, which never calls it */
#define FDP_RESOLVE_EXT(field, name) G.real.field = (__typeof__(G.real.field)) lookup(#name, 1)
#endif

static void resolve(void) {
    FDP_RESOLVE(load, llama_model_load_from_file);
    FDP_RESOLVE(init, llama_init_from_model);
    FDP_RESOLVE(free_ctx, llama_free);
    FDP_RESOLVE(decode, llama_decode);
    FDP_RESOLVE(encode, llama_encode);
    FDP_RESOLVE(clear_mem, llama_memory_clear);
    FDP_RESOLVE(seq_rm, llama_memory_seq_rm);
    FDP_RESOLVE(seq_cp, llama_memory_seq_cp);
    FDP_RESOLVE(seq_keep, llama_memory_seq_keep);
    FDP_RESOLVE(seq_add, llama_memory_seq_add);
    FDP_RESOLVE(seq_div, llama_memory_seq_div);
    FDP_RESOLVE(state_get, llama_state_seq_get_data);
    FDP_RESOLVE(state_set, llama_state_seq_set_data);
    FDP_RESOLVE(state_save, llama_state_seq_save_file);
    FDP_RESOLVE(state_load, llama_state_seq_load_file);
#ifdef LLAMA_STATE_SEQ_FLAGS_NONE
    FDP_RESOLVE(state_get_ext, llama_state_seq_get_data_ext);
    FDP_RESOLVE(state_set_ext, llama_state_seq_set_data_ext);
#endif
#if FDP_BATCH_EXT
    FDP_RESOLVE_EXT(process, llama_process);
    FDP_RESOLVE_EXT(batch_init, llama_batch_ext_init);
    FDP_RESOLVE_EXT(batch_free, llama_batch_ext_free);
    FDP_RESOLVE_EXT(batch_clear, llama_batch_ext_clear);
    FDP_RESOLVE_EXT(batch_add, llama_batch_ext_add);
    FDP_RESOLVE_EXT(batch_add_token, llama_batch_ext_add_token);
    FDP_RESOLVE_EXT(batch_add_embd, llama_batch_ext_add_embd);
    FDP_RESOLVE_EXT(batch_add_seq, llama_batch_ext_add_seq);
    FDP_RESOLVE_EXT(batch_output_logits, llama_batch_ext_set_output_logits);
    FDP_RESOLVE_EXT(batch_output_embd, llama_batch_ext_set_output_embd);
    FDP_RESOLVE_EXT(batch_set_pos, llama_batch_ext_set_pos);
#else
    /* compiled against headers of the older generation: a program of the newer one decodes
     * through llama_process, which this build of the preload cannot see */
    if (dlsym(RTLD_NEXT, "llama_process")) {
        fprintf(stderr, "featdiff preload: the program's llama.cpp has llama_process, but the preload was compiled "
                        "against headers without it; pass --llama-dir of the program's own build\n");
    }
#endif
}

/* The spool belongs to the first process that claims it; a child the program starts (it
 * inherits the environment) runs uncaptured. */
static int claim(const char * prefix) {
    char path[4096];
    snprintf(path, sizeof(path), "%s.owner", prefix);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return 0;
    char pid[32];
    int n = snprintf(pid, sizeof(pid), "%ld\n", (long) getpid());
    ssize_t w = write(fd, pid, (size_t) n);
    close(fd);
    return w == n;
}

static int add_filters(fd_capture * cap, const char * spec) {
    char * copy = strdup(spec ? spec : "");
    char * save = NULL;
    int rc = copy ? FD_OK : FD_ENOMEM;
    for (char * line = copy ? strtok_r(copy, "\n", &save) : NULL; line && rc == FD_OK; line = strtok_r(NULL, "\n", &save)) {
        char * tab = strchr(line, '\t');
        rc = tab ? fd_capture_add_filter(cap, atoi(line), tab + 1) : FD_EARG;
    }
    free(copy);
    return rc;
}

static void copy_env(char * dst, const char * name) {
    const char * v = getenv(name);
    snprintf(dst, FDP_META_MAX, "%s", v ? v : "");
}

static void forked_child(void) { G.cap = NULL; }  /* a fork() shares the spool fds: stop */

static void note_start(void) {
    Dl_info info = { 0 };
    /* llama_decode: in both batch API generations */
    const char * lib = G.real.decode && dladdr((void *) G.real.decode, &info) && info.dli_fname ? info.dli_fname : "";
    struct fdp_buf b = { 0 };
    buf_printf(&b, "{\"kind\":\"exec_start\",\"pid\":%ld,\"library\":", (long) getpid());
    buf_str(&b, lib);
    buf_printf(&b, "}");
    note(&b);
}

static void init_once(void) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&G.spool_lock, &attr);
    resolve();
    copy_env(G.draft_arch, "FEATDIFF_DRAFT_ARCH");
    copy_env(G.arch_key, "FEATDIFF_ARCH_KEY");
    const char * prefix = getenv("FEATDIFF_SPOOL");
    if (!prefix || !*prefix || !claim(prefix)) return;
    fd_capture * cap = fd_capture_open(prefix);
    if (!cap) { say("cannot create the spool files"); return; }
    if (add_filters(cap, getenv("FEATDIFF_FILTERS")) != FD_OK) {
        say("bad FEATDIFF_FILTERS (at most 64 globs per role, lines \"<role>\\t<glob>\")");
        fd_capture_close(cap);
        return;
    }
    pthread_atfork(NULL, NULL, forked_child);
    G.cap = cap;
    note_start();
}

static void init(void) { pthread_once(&G_once, init_once); }

/* ---------------------------------------------------------------- contexts */

/* Whether `arch` is one of the comma-separated drafter architectures of FEATDIFF_DRAFT_ARCH. */
static int is_draft_arch(const char * arch) {
    const size_t n = strlen(arch);
    for (const char * p = G.draft_arch; n && *p;) {
        const char * end = strchr(p, ',');
        const size_t len = end ? (size_t) (end - p) : strlen(p);
        if (len == n && strncmp(p, arch, n) == 0) return 1;
        p += len + (end ? 1 : 0);
    }
    return 0;
}

/* A context's role: a drafter's architecture (FEATDIFF_DRAFT_ARCH), or an MTP context
 * (LLAMA_CONTEXT_TYPE_MTP: the head runs on the target's own model, or on a separate head GGUF
 * of the target's architecture) is the draft; anything else the target. */
static int role_of(const struct llama_model * model, const struct llama_context_params * params) {
#if FDP_MTP
    if (params->ctx_type == LLAMA_CONTEXT_TYPE_MTP) return FD_ROLE_DRAFT;
#else
    (void) params;
#endif
    char arch[FDP_META_MAX] = "";
    if (!G.arch_key[0] || llama_model_meta_val_str(model, G.arch_key, arch, sizeof(arch)) < 0) return FD_ROLE_TARGET;
    return is_draft_arch(arch) ? FD_ROLE_DRAFT : FD_ROLE_TARGET;
}

static struct fdp_ctx * find_ctx(const struct llama_context * ctx) {
    struct fdp_ctx * c = G.contexts;
    while (c && c->ctx != ctx) c = c->next;
    return c;
}

/* The shim's callback first, then the program's; each sees only the nodes it asked for. */
static bool chained_callback(struct ggml_tensor * t, bool ask, void * user_data) {
    struct fdp_ctx * c = (struct fdp_ctx *) user_data;
    if (ask) {
        bool ours = fd_eval_callback(t, true, c->tag);
        c->user_asked = c->user_cb ? c->user_cb(t, true, c->user_data) : false;
        return ours || c->user_asked;
    }
    fd_eval_callback(t, false, c->tag);  /* records what the filters selected; always true */
    if (!c->user_asked) return true;
    c->user_asked = false;
    return c->user_cb(t, false, c->user_data);
}

/* llama_n_rs_seq(ctx): the recurrent-state snapshots a context keeps per sequence for rollback,
 * which decide how a recurrent memory splits its batches; absent from older builds, looked up
 * at run time (-1: not known). */
static long long n_rs_seq_of(const struct llama_context * ctx) {
    typedef uint32_t (*fdp_rs_fn)(const struct llama_context *);
    static fdp_rs_fn fn;
    static int looked_up;
    if (!looked_up) {
        fn = (fdp_rs_fn) dlsym(RTLD_DEFAULT, "llama_n_rs_seq");
        looked_up = 1;
    }
    return fn ? (long long) fn(ctx) : -1;
}

static void note_context(const struct fdp_ctx * c, const struct llama_model * model, const char * arch) {
    struct fdp_buf b = { 0 };
    buf_printf(&b, "{\"kind\":\"exec_context\",\"ctx\":%d,\"ok\":%s,\"role\":%d,\"model\":%llu,\"arch\":",
               c->index, c->ctx ? "true" : "false", c->role, (unsigned long long) (uintptr_t) model);
    buf_str(&b, arch);
    if (c->ctx) {
        buf_printf(&b, ",\"n_ctx\":%u,\"n_batch\":%u,\"n_ubatch\":%u,\"n_seq_max\":%u,\"kv_unified\":%s,\"chained\":%s",
                   llama_n_ctx(c->ctx), llama_n_batch(c->ctx), llama_n_ubatch(c->ctx), llama_n_seq_max(c->ctx),
                   c->kv_unified ? "true" : "false", c->user_cb ? "true" : "false");
        const long long rs = n_rs_seq_of(c->ctx);
        if (rs >= 0) buf_printf(&b, ",\"n_rs_seq\":%lld", rs);
    }
    buf_printf(&b, "}");
    note_locked(&b);
}

/* A tag for a context about to be created, with `params` rewired to the chained callback;
 * NULL (and `params` untouched) when out of memory. */
static struct fdp_ctx * new_ctx(const struct llama_model * model, struct llama_context_params * params) {
    struct fdp_ctx * c = (struct fdp_ctx *) calloc(1, sizeof(*c));
    if (!c) return NULL;
    c->role = role_of(model, params);
    c->tag = fd_tag_new(G.cap, c->role);
    if (!c->tag) { free(c); return NULL; }
    c->user_cb = params->cb_eval;
    c->user_data = params->cb_eval_user_data;
    c->kv_unified = params->kv_unified;
    params->cb_eval = chained_callback;
    params->cb_eval_user_data = c;
    return c;
}

/* Note the context (a failed one too: memory-fitting probes create throwaway ones) and keep it. */
static void register_ctx(struct fdp_ctx * c, struct llama_context * ctx, const struct llama_model * model) {
    char arch[FDP_META_MAX] = "";
    if (G.arch_key[0]) llama_model_meta_val_str(model, G.arch_key, arch, sizeof(arch));
    pthread_mutex_lock(&G.spool_lock);
    c->ctx = ctx;
    c->index = G.n_ctx++;
    note_context(c, model, arch);
    if (ctx) {
        c->mem = llama_get_memory(ctx);
        c->next = G.contexts;
        G.contexts = c;
    }
    pthread_mutex_unlock(&G.spool_lock);
    if (!ctx) {
        fd_tag_free(c->tag);
        free(c);
    }
}

static struct llama_context * hook_init(struct llama_model * model, struct llama_context_params params) {
    init();
    if (!G.real.init) return NULL;
    struct fdp_ctx * c = G.cap ? new_ctx(model, &params) : NULL;
    struct llama_context * ctx = G.real.init(model, params);
    if (c) register_ctx(c, ctx, model);
    return ctx;
}
FDP_HOOK(llama_init_from_model, hook_init)

static void forget_ctx(struct fdp_ctx * c) {
    struct fdp_ctx ** p = &G.contexts;
    while (*p && *p != c) p = &(*p)->next;
    if (*p) *p = c->next;
}

static void hook_free(struct llama_context * ctx) {
    init();
    pthread_mutex_lock(&G.spool_lock);
    struct fdp_ctx * c = find_ctx(ctx);
    if (c) {
        struct fdp_buf b = { 0 };
        buf_printf(&b, "{\"kind\":\"exec_free\",\"ctx\":%d}", c->index);
        note_locked(&b);
        forget_ctx(c);
    }
    pthread_mutex_unlock(&G.spool_lock);
    if (G.real.free_ctx) G.real.free_ctx(ctx);
    if (c) {  /* after the context: it may still call back while it is torn down */
        fd_tag_free(c->tag);
        free(c);
    }
}
FDP_HOOK(llama_free, hook_free)

static struct llama_model * hook_load(const char * path, struct llama_model_params params) {
    init();
    if (!G.real.load) return NULL;
    struct llama_model * model = G.real.load(path, params);
    if (model && G.cap) {
        struct fdp_buf b = { 0 };
        buf_printf(&b, "{\"kind\":\"exec_model\",\"model\":%llu,\"path\":", (unsigned long long) (uintptr_t) model);
        buf_str(&b, path);
        buf_printf(&b, "}");
        note(&b);
    }
    return model;
}
FDP_HOOK(llama_model_load_from_file, hook_load)

static void hook_clear(llama_memory_t mem, bool data) {
    init();
    pthread_mutex_lock(&G.spool_lock);
    struct fdp_ctx * c = G.contexts;
    while (c && c->mem != mem) c = c->next;
    if (c && G.cap) {
        struct fdp_buf b = { 0 };
        buf_printf(&b, "{\"kind\":\"exec_clear\",\"ctx\":%d,\"after_eval\":%d}", c->index, G.n_evals - 1);
        note_locked(&b);
    }
    pthread_mutex_unlock(&G.spool_lock);
    if (G.real.clear_mem) G.real.clear_mem(mem, data);
}
FDP_HOOK(llama_memory_clear, hook_clear)

/* A removal from a context's cache: compare follows which rows each cache holds (a driver that
 * leaves rejected rows in the draft cache is seen here). Noted after it ran, with its result. */
static bool hook_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    init();
    bool ok = G.real.seq_rm ? G.real.seq_rm(mem, seq_id, p0, p1) : false;
    pthread_mutex_lock(&G.spool_lock);
    struct fdp_ctx * c = G.contexts;
    while (c && c->mem != mem) c = c->next;
    if (c && G.cap) {
        struct fdp_buf b = { 0 };
        buf_printf(&b, "{\"kind\":\"exec_seq_rm\",\"ctx\":%d,\"after_eval\":%d,\"seq_id\":%d,\"p0\":%d,\"p1\":%d,\"ok\":%s}",
                   c->index, G.n_evals - 1, (int) seq_id, (int) p0, (int) p1, ok ? "true" : "false");
        note_locked(&b);
    }
    pthread_mutex_unlock(&G.spool_lock);
    return ok;
}
FDP_HOOK(llama_memory_seq_rm, hook_seq_rm)

/* Every other change a program makes to what a sequence holds, as one "exec_memory" line after
 * it ran: featdiff follows which tokens each sequence's cache holds at each position through
 * them (a restored prompt cache, a shifted context), and names the ones it cannot follow. */
struct fdp_mem_op {
    const char * op;
    int seq_id, seq_dst, p0, p1, delta, flags, ok;
    const char * state;  /* a saved state's name: a hash of its bytes, or a file's path */
    int state_is_file;
};

static void note_memory(int ctx_index, const struct fdp_mem_op * m) {
    struct fdp_buf b = { 0 };
    buf_printf(&b, "{\"kind\":\"exec_memory\",\"ctx\":%d,\"after_eval\":%d,\"op\":\"%s\",\"seq_id\":%d,"
                   "\"seq_dst\":%d,\"p0\":%d,\"p1\":%d,\"delta\":%d,\"flags\":%d,\"ok\":%s",
               ctx_index, G.n_evals - 1, m->op, m->seq_id, m->seq_dst, m->p0, m->p1, m->delta, m->flags,
               m->ok ? "true" : "false");
    if (m->state) {
        buf_printf(&b, m->state_is_file ? ",\"file\":" : ",\"state\":");
        buf_str(&b, m->state);
    }
    buf_printf(&b, "}");
    note_locked(&b);
}

static void note_mem_op(llama_memory_t mem, const struct fdp_mem_op * m) {
    pthread_mutex_lock(&G.spool_lock);
    struct fdp_ctx * c = G.contexts;
    while (c && c->mem != mem) c = c->next;
    if (c && G.cap) note_memory(c->index, m);
    pthread_mutex_unlock(&G.spool_lock);
}

static void note_ctx_op(const struct llama_context * ctx, const struct fdp_mem_op * m) {
    pthread_mutex_lock(&G.spool_lock);
    struct fdp_ctx * c = find_ctx(ctx);
    if (c && G.cap) note_memory(c->index, m);
    pthread_mutex_unlock(&G.spool_lock);
}

static void hook_seq_cp(llama_memory_t mem, llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1) {
    init();
    if (G.real.seq_cp) G.real.seq_cp(mem, src, dst, p0, p1);
    struct fdp_mem_op m = { .op = "seq_cp", .seq_id = src, .seq_dst = dst, .p0 = p0, .p1 = p1, .ok = 1 };
    note_mem_op(mem, &m);
}
FDP_HOOK(llama_memory_seq_cp, hook_seq_cp)

static void hook_seq_keep(llama_memory_t mem, llama_seq_id seq_id) {
    init();
    if (G.real.seq_keep) G.real.seq_keep(mem, seq_id);
    struct fdp_mem_op m = { .op = "seq_keep", .seq_id = seq_id, .seq_dst = -1, .p0 = -1, .p1 = -1, .ok = 1 };
    note_mem_op(mem, &m);
}
FDP_HOOK(llama_memory_seq_keep, hook_seq_keep)

static void hook_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta) {
    init();
    if (G.real.seq_add) G.real.seq_add(mem, seq_id, p0, p1, delta);
    struct fdp_mem_op m = { .op = "seq_add", .seq_id = seq_id, .seq_dst = -1, .p0 = p0, .p1 = p1, .delta = delta, .ok = 1 };
    note_mem_op(mem, &m);
}
FDP_HOOK(llama_memory_seq_add, hook_seq_add)

static void hook_seq_div(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    init();
    if (G.real.seq_div) G.real.seq_div(mem, seq_id, p0, p1, d);
    struct fdp_mem_op m = { .op = "seq_div", .seq_id = seq_id, .seq_dst = -1, .p0 = p0, .p1 = p1, .delta = d, .ok = 1 };
    note_mem_op(mem, &m);
}
FDP_HOOK(llama_memory_seq_div, hook_seq_div)

/* A saved state is named by the FNV-1a hash of its bytes (and their count): a restore of the
 * same bytes names the same state, so featdiff knows which saved history a restore brings back,
 * whatever the program believes it restored. */
static void state_name(const uint8_t * data, size_t n, char * out, size_t cap) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; data && i < n; ++i) h = (h ^ data[i]) * 1099511628211ULL;
    snprintf(out, cap, "%016llx-%zu", (unsigned long long) h, n);
}

static void note_state(const struct llama_context * ctx, const char * op, llama_seq_id seq, const uint8_t * data,
                       size_t size, size_t n, int flags) {
    char name[64];
    state_name(data, size, name, sizeof(name));
    struct fdp_mem_op m = { .op = op, .seq_id = seq, .seq_dst = -1, .p0 = -1, .p1 = -1, .flags = flags,
                            .ok = n > 0 && n == size, .state = name };
    note_ctx_op(ctx, &m);
}

static size_t hook_state_get(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq) {
    init();
    size_t n = G.real.state_get ? G.real.state_get(ctx, dst, size, seq) : 0;
    note_state(ctx, "state_save", seq, dst, n, n, 0);
    return n;
}
FDP_HOOK(llama_state_seq_get_data, hook_state_get)

static size_t hook_state_set(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id seq) {
    init();
    size_t n = G.real.state_set ? G.real.state_set(ctx, src, size, seq) : 0;
    note_state(ctx, "state_restore", seq, src, size, n, 0);
    return n;
}
FDP_HOOK(llama_state_seq_set_data, hook_state_set)

#ifdef LLAMA_STATE_SEQ_FLAGS_NONE
static size_t hook_state_get_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq,
                                 llama_state_seq_flags flags) {
    init();
    size_t n = G.real.state_get_ext ? G.real.state_get_ext(ctx, dst, size, seq, flags) : 0;
    note_state(ctx, "state_save", seq, dst, n, n, (int) flags);
    return n;
}
FDP_HOOK(llama_state_seq_get_data_ext, hook_state_get_ext)

static size_t hook_state_set_ext(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id seq,
                                 llama_state_seq_flags flags) {
    init();
    size_t n = G.real.state_set_ext ? G.real.state_set_ext(ctx, src, size, seq, flags) : 0;
    note_state(ctx, "state_restore", seq, src, size, n, (int) flags);
    return n;
}
FDP_HOOK(llama_state_seq_set_data_ext, hook_state_set_ext)
#endif

static size_t hook_state_save(struct llama_context * ctx, const char * path, llama_seq_id seq,
                              const llama_token * tokens, size_t n_tokens) {
    init();
    size_t n = G.real.state_save ? G.real.state_save(ctx, path, seq, tokens, n_tokens) : 0;
    struct fdp_mem_op m = { .op = "state_save", .seq_id = seq, .seq_dst = -1, .p0 = -1, .p1 = -1, .ok = n > 0,
                            .state = path ? path : "", .state_is_file = 1 };
    note_ctx_op(ctx, &m);
    return n;
}
FDP_HOOK(llama_state_seq_save_file, hook_state_save)

static size_t hook_state_load(struct llama_context * ctx, const char * path, llama_seq_id seq, llama_token * tokens,
                              size_t cap, size_t * n_tokens) {
    init();
    size_t n = G.real.state_load ? G.real.state_load(ctx, path, seq, tokens, cap, n_tokens) : 0;
    if (tokens) {  /* NULL tokens: only the count is read, nothing is loaded */
        struct fdp_mem_op m = { .op = "state_restore", .seq_id = seq, .seq_dst = -1, .p0 = -1, .p1 = -1, .ok = n > 0,
                                .state = path ? path : "", .state_is_file = 1 };
        note_ctx_op(ctx, &m);
    }
    return n;
}
FDP_HOOK(llama_state_seq_load_file, hook_state_load)

/* ---------------------------------------------------------------- batch shadows */
#if FDP_BATCH_EXT

static struct fdp_batch * find_batch(const struct llama_batch_ext * batch) {
    struct fdp_batch * s = G.batches;
    while (s && s->batch != batch) s = s->next;
    return s;
}

/* The shadow entry at `idx`, created (and the shadow grown) as needed; NULL when out of memory. */
static struct fdp_entry * entry_at(const struct llama_batch_ext * batch, int32_t idx) {
    struct fdp_batch * s = find_batch(batch);
    if (!s && (s = (struct fdp_batch *) calloc(1, sizeof(*s))) != NULL) {
        s->batch = batch;
        s->next = G.batches;
        G.batches = s;
    }
    if (!s || idx < 0) return NULL;
    if (idx >= s->cap) {
        int cap = (idx + 1) * 2;
        struct fdp_entry * e = (struct fdp_entry *) realloc(s->e, (size_t) cap * sizeof(*e));
        if (!e) return NULL;
        s->e = e;
        s->cap = cap;
    }
    for (; s->n <= idx; ++s->n) s->e[s->n] = (struct fdp_entry) { -1, -1, 0, 0 };
    return &s->e[idx];
}

static void shadow_add(const struct llama_batch_ext * batch, int32_t idx, llama_seq_id seq, llama_token token) {
    if (!G.cap || idx < 0) return;
    pthread_mutex_lock(&G.batch_lock);
    struct fdp_entry * e = entry_at(batch, idx);
    if (e) *e = (struct fdp_entry) { token, -1, seq, 0 };
    pthread_mutex_unlock(&G.batch_lock);
}

static void shadow_set(const struct llama_batch_ext * batch, int32_t idx, const llama_pos * pos, int output) {
    if (!G.cap || idx < 0) return;
    pthread_mutex_lock(&G.batch_lock);
    struct fdp_entry * e = entry_at(batch, idx);
    if (e && pos) e->pos = pos[0];
    if (e && output >= 0) e->output = output;
    pthread_mutex_unlock(&G.batch_lock);
}

static void shadow_clear(const struct llama_batch_ext * batch, int drop) {
    pthread_mutex_lock(&G.batch_lock);
    struct fdp_batch ** p = &G.batches;
    while (*p && (*p)->batch != batch) p = &(*p)->next;
    struct fdp_batch * s = *p;
    if (s && drop) {
        *p = s->next;
        free(s->e);
        free(s);
    } else if (s) {
        s->n = 0;
    }
    pthread_mutex_unlock(&G.batch_lock);
}

static struct llama_batch_ext * hook_batch_init(struct llama_context * ctx) {
    init();
    return G.real.batch_init ? G.real.batch_init(ctx) : NULL;
}
FDP_HOOK(llama_batch_ext_init, hook_batch_init)

static void hook_batch_free(struct llama_batch_ext * batch) {
    init();
    shadow_clear(batch, 1);
    if (G.real.batch_free) G.real.batch_free(batch);
}
FDP_HOOK(llama_batch_ext_free, hook_batch_free)

static void hook_batch_clear(struct llama_batch_ext * batch) {
    init();
    shadow_clear(batch, 0);
    if (G.real.batch_clear) G.real.batch_clear(batch);
}
FDP_HOOK(llama_batch_ext_clear, hook_batch_clear)

static int32_t hook_batch_add(struct llama_batch_ext * batch, llama_seq_id seq_id) {
    init();
    int32_t idx = G.real.batch_add ? G.real.batch_add(batch, seq_id) : -1;
    shadow_add(batch, idx, seq_id, -1);
    return idx;
}
FDP_HOOK(llama_batch_ext_add, hook_batch_add)

static int32_t hook_batch_add_token(struct llama_batch_ext * batch, llama_seq_id seq_id, llama_token id) {
    init();
    int32_t idx = G.real.batch_add_token ? G.real.batch_add_token(batch, seq_id, id) : -1;
    shadow_add(batch, idx, seq_id, id);
    return idx;
}
FDP_HOOK(llama_batch_ext_add_token, hook_batch_add_token)

static int32_t hook_batch_add_embd(struct llama_batch_ext * batch, llama_seq_id seq_id, struct llama_embd embd) {
    init();
    int32_t idx = G.real.batch_add_embd ? G.real.batch_add_embd(batch, seq_id, embd) : -1;
    shadow_add(batch, idx, seq_id, -1);
    return idx;
}
FDP_HOOK(llama_batch_ext_add_embd, hook_batch_add_embd)

static bool hook_batch_add_seq(struct llama_batch_ext * batch, int32_t idx, llama_seq_id seq_id) {
    init();  /* an extra sequence: the shadow keeps the first one */
    return G.real.batch_add_seq ? G.real.batch_add_seq(batch, idx, seq_id) : false;
}
FDP_HOOK(llama_batch_ext_add_seq, hook_batch_add_seq)

static bool hook_batch_set_pos(struct llama_batch_ext * batch, int32_t idx, const llama_pos * pos) {
    init();
    bool ok = G.real.batch_set_pos ? G.real.batch_set_pos(batch, idx, pos) : false;
    if (ok) shadow_set(batch, idx, pos, -1);
    return ok;
}
FDP_HOOK(llama_batch_ext_set_pos, hook_batch_set_pos)

static bool hook_batch_output_logits(struct llama_batch_ext * batch, int32_t idx, bool value) {
    init();
    bool ok = G.real.batch_output_logits ? G.real.batch_output_logits(batch, idx, value) : false;
    if (ok) shadow_set(batch, idx, NULL, value);
    return ok;
}
FDP_HOOK(llama_batch_ext_set_output_logits, hook_batch_output_logits)

static bool hook_batch_output_embd(struct llama_batch_ext * batch, int32_t idx, bool value) {
    init();
    bool ok = G.real.batch_output_embd ? G.real.batch_output_embd(batch, idx, value) : false;
    if (ok) shadow_set(batch, idx, NULL, value);
    return ok;
}
FDP_HOOK(llama_batch_ext_set_output_embd, hook_batch_output_embd)
#endif /* FDP_BATCH_EXT */

/* ---------------------------------------------------------------- evals */

static void entry_array(struct fdp_buf * b, const char * key, const struct fdp_entry * e, int n, int field) {
    buf_printf(b, ",\"%s\":[", key);
    for (int i = 0; i < n; ++i) {
        int v = field == 0 ? e[i].token : field == 1 ? e[i].pos : field == 2 ? e[i].seq : e[i].output;
        buf_printf(b, i ? ",%d" : "%d", v);
    }
    buf_printf(b, "]");
}

/* Number the eval, note what the program asked to decode, and point the shim at it.
 * Takes spool_lock; eval_end releases it. */
static int eval_begin(const struct fdp_ctx * c, const char * call, const struct fdp_entry * e, int n) {
    pthread_mutex_lock(&G.spool_lock);
    int eval = G.n_evals++;
    struct fdp_buf b = { 0 };
    buf_printf(&b, "{\"kind\":\"exec_eval\",\"eval\":%d,\"ctx\":%d,\"call\":\"%s\",\"n_tokens\":%d", eval, c->index, call, n);
    entry_array(&b, "token_ids", e, n, 0);
    entry_array(&b, "positions", e, n, 1);
    entry_array(&b, "seq_ids", e, n, 2);
    entry_array(&b, "outputs", e, n, 3);
    buf_printf(&b, "}");
    note_locked(&b);
    if (G.cap) fd_capture_begin_eval(G.cap, eval);
    return eval;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

static void eval_end(int eval, int32_t rc, double t0) {
    if (G.cap) fd_capture_begin_eval(G.cap, -1);
    struct fdp_buf b = { 0 };
    buf_printf(&b, "{\"kind\":\"exec_done\",\"eval\":%d,\"rc\":%d,\"ms\":%.3f}", eval, rc, now_ms() - t0);
    note_locked(&b);
    pthread_mutex_unlock(&G.spool_lock);
}

#if FDP_BATCH_EXT
/* A copy of the batch's shadow (NULL and n = 0 when it has none). */
static struct fdp_entry * shadow_copy(const struct llama_batch_ext * batch, int * n) {
    pthread_mutex_lock(&G.batch_lock);
    struct fdp_batch * s = find_batch(batch);
    *n = s ? s->n : 0;
    struct fdp_entry * e = *n ? (struct fdp_entry *) malloc((size_t) *n * sizeof(*e)) : NULL;
    if (e) memcpy(e, s->e, (size_t) *n * sizeof(*e));
    else *n = 0;
    pthread_mutex_unlock(&G.batch_lock);
    return e;
}
#endif

/* Backend sampling (llama.cpp's default for the draft) leaves only its top-k candidates'
 * logits; these functions, absent from older builds, are looked up at run time. */
typedef uint32_t      (*fdp_count_fn)(struct llama_context *, int32_t);
typedef float *       (*fdp_floats_fn)(struct llama_context *, int32_t);
typedef llama_token * (*fdp_tokens_fn)(struct llama_context *, int32_t);

/* Row `i` of the logits the program's sampler reads: the full row, or with backend sampling
 * the candidates' logits in place and -inf elsewhere (what that sampler's distribution holds). */
static int logits_row(struct llama_context * ctx, int32_t i, int32_t n_vocab, float * dst) {
    static fdp_count_fn n_cand;
    static fdp_floats_fn cand_logits;
    static fdp_tokens_fn cand_ids;
    static int looked_up;
    if (!looked_up) {
        n_cand = (fdp_count_fn) dlsym(RTLD_DEFAULT, "llama_get_sampled_logits_count_ith");
        cand_logits = (fdp_floats_fn) dlsym(RTLD_DEFAULT, "llama_get_sampled_logits_ith");
        cand_ids = (fdp_tokens_fn) dlsym(RTLD_DEFAULT, "llama_get_sampled_candidates_ith");
        looked_up = 1;
    }
    const uint32_t k = n_cand && cand_logits && cand_ids ? n_cand(ctx, i) : 0;
    if (k > 0) {
        const float * v = cand_logits(ctx, i);
        const llama_token * id = cand_ids(ctx, i);
        if (!v || !id) return 0;
        for (int32_t t = 0; t < n_vocab; ++t) dst[t] = -INFINITY;
        for (uint32_t j = 0; j < k; ++j) {
            if (id[j] >= 0 && id[j] < n_vocab) dst[id[j]] = v[j];
        }
        return 1;
    }
    const float * row = llama_get_logits_ith(ctx, i);
    if (!row) return 0;
    memcpy(dst, row, (size_t) n_vocab * sizeof(float));
    return 1;
}

/* The logits of a draft token batch's output rows, as the program's sampler reads them:
 * DSpark's Markov-biased logits exist nowhere else. Recorded as `draft_logits`,
 * (n_outputs, n_vocab), if the filters keep that name. */
static void read_back_logits(struct llama_context * ctx, const struct fdp_entry * e, int n) {
    if (!e || n <= 0 || e[0].token < 0 || !fd_capture_keeps(G.cap, FD_ROLE_DRAFT, "draft_logits")) return;
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    int n_out = 0;
    for (int i = 0; i < n; ++i) n_out += e[i].output != 0;
    float * rows = n_out && n_vocab > 0 ? (float *) malloc((size_t) n_out * (size_t) n_vocab * sizeof(float)) : NULL;
    if (!rows) return;
    int j = 0;
    for (int i = 0; i < n && j >= 0; ++i) {
        if (!e[i].output) continue;
        if (logits_row(ctx, i, n_vocab, rows + (size_t) j * (size_t) n_vocab)) j++;
        else j = -1;
    }
    if (j == n_out) fd_capture_add_rows(G.cap, FD_ROLE_DRAFT, "draft_logits", rows, n_vocab, n_out);
    free(rows);
}

#if FDP_BATCH_EXT
static int32_t hook_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * batch) {
    init();
    if (!G.real.process) return -1;
    pthread_mutex_lock(&G.spool_lock);
    struct fdp_ctx * c = G.cap ? find_ctx(ctx) : NULL;
    if (!c) {
        pthread_mutex_unlock(&G.spool_lock);
        return G.real.process(ctx, type, batch);
    }
    int n = 0;
    struct fdp_entry * e = shadow_copy(batch, &n);
    int eval = eval_begin(c, type == LLAMA_PROCESS_TYPE_ENCODE ? "encode" : "decode", e, n);
    double t0 = now_ms();
    int32_t rc = G.real.process(ctx, type, batch);
    if (rc == 0 && c->role == FD_ROLE_DRAFT && type == LLAMA_PROCESS_TYPE_DECODE) read_back_logits(ctx, e, n);
    free(e);
    eval_end(eval, rc, t0);
    pthread_mutex_unlock(&G.spool_lock);
    return rc;
}
FDP_HOOK(llama_process, hook_process)
#endif

/* The legacy batch is a plain struct: read it directly. */
static struct fdp_entry * entries_of(const struct llama_batch * batch) {
    int n = batch->n_tokens > 0 ? batch->n_tokens : 0;
    struct fdp_entry * e = n ? (struct fdp_entry *) calloc((size_t) n, sizeof(*e)) : NULL;
    for (int i = 0; e && i < n; ++i) {
        e[i].token = batch->token ? batch->token[i] : -1;
        e[i].pos = batch->pos ? batch->pos[i] : -1;
        e[i].seq = batch->seq_id && batch->n_seq_id && batch->n_seq_id[i] > 0 ? batch->seq_id[i][0] : 0;
        e[i].output = batch->logits ? batch->logits[i] != 0 : i == n - 1;
    }
    return e;
}

/* One plain-batch call (llama_decode or llama_encode), numbered and noted like hook_process. */
static int32_t plain_call(fdp_decode_fn real, const char * call, struct llama_context * ctx, struct llama_batch batch) {
    if (!real) return -1;
    pthread_mutex_lock(&G.spool_lock);
    struct fdp_ctx * c = G.cap ? find_ctx(ctx) : NULL;
    if (!c) {
        pthread_mutex_unlock(&G.spool_lock);
        return real(ctx, batch);
    }
    struct fdp_entry * e = entries_of(&batch);
    int eval = eval_begin(c, call, e, e ? batch.n_tokens : 0);
    double t0 = now_ms();
    int32_t rc = real(ctx, batch);
    if (rc == 0 && c->role == FD_ROLE_DRAFT && real == G.real.decode) read_back_logits(ctx, e, e ? batch.n_tokens : 0);
    free(e);
    eval_end(eval, rc, t0);
    pthread_mutex_unlock(&G.spool_lock);
    return rc;
}

static int32_t hook_decode(struct llama_context * ctx, struct llama_batch batch) {
    init();
    return plain_call(G.real.decode, "decode", ctx, batch);
}
FDP_HOOK(llama_decode, hook_decode)

/* The older generation's DFlash encoder step (features -> the rows its decode injects). */
static int32_t hook_encode(struct llama_context * ctx, struct llama_batch batch) {
    init();
    return plain_call(G.real.encode, "encode", ctx, batch);
}
FDP_HOOK(llama_encode, hook_encode)
