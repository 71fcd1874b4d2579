/* featdiff shim: see featdiff_shim.h. The per-tensor work (filter, copy, convert, spool) all
 * happens here, so Python is never called back per node.
 *
 * The scheduler calls the callback twice per node: ask=true before computing (return true to be
 * called again), then ask=false once the node's data is ready. Each node we ask for ends a
 * sub-graph and forces a backend synchronize, so the ask phase decides from the filters alone; it
 * records only a graph input read before its consumer runs (a norm's source, read_point below).
 */
#define _GNU_SOURCE
#include "featdiff_shim.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FD_MAX_FILTERS 64
#define FD_MAX_OCC 4096        /* distinct (role, name) pairs counted per eval */
#define FD_MAX_LEAFS 16        /* graph inputs captured per eval and context */
#define FD_LINE_MAX 4096
#define FD_SEEN_SLOTS 8192     /* filter decisions remembered per (role, name): a power of 2 */
#define FD_GRAPH_SLOTS 32768   /* node addresses remembered per graph: a power of 2 */
#define FD_GRAPH_FULL (FD_GRAPH_SLOTS / 4 * 3)

struct fd_occ { int role; int count; char name[GGML_MAX_NAME]; };

/* The ask phase runs for every node of every graph; the same names recur eval after eval, so
 * each (role, name) is matched against the globs once and the answer remembered. */
struct fd_seen { signed char state; /* 0 empty, 1 no, 2 yes */ char role; char name[GGML_MAX_NAME]; };

struct fd_capture {
    int fd_data;
    int fd_index;
    long long data_off;
    int eval;
    int error;
    int write_errno;   /* errno of the first failed spool write: a full disk is not a bug */
    long n_records;
    char * filters[FD_N_ROLES][FD_MAX_FILTERS];
    int n_filters[FD_N_ROLES];
    struct fd_occ occ[FD_MAX_OCC];
    int n_occ;
    struct fd_seen seen[FD_SEEN_SLOTS];
};

/* Per-context state between the ask=true and ask=false calls of one node. */
struct fd_pending {
    int want_node;
    int occurrence;
    int n_leafs;
    struct ggml_tensor * leafs[GGML_MAX_SRC];
    char leaf_names[GGML_MAX_SRC][GGML_MAX_NAME];   /* each input's own name (not its copy's) */
};

/* A batch larger than n_ubatch is computed as several graphs (ubatches), one after the other,
 * and the scheduler asks about every node of a graph exactly once. The next graph starts where a
 * node address comes round again (llama.cpp reuses the graph, or rebuilds it in the same buffer),
 * or where the graph's first node does (a rebuild in llama.cpp's other graph buffer has new
 * addresses, but the same first node: the token or feature input). */
struct fd_graph {
    int eval;                     /* the eval `ubatch` counts the graphs of */
    int ubatch;                   /* 0 for the eval's first graph, 1 for the second, ... */
    enum ggml_op first_op;        /* the graph's first node */
    char first_name[GGML_MAX_NAME];
    int n_nodes;
    const struct ggml_tensor * nodes[FD_GRAPH_SLOTS];   /* open addressing; NULL = empty */
};

struct fd_tag_state {
    fd_context_tag tag;           /* first: fd_context_tag* and fd_tag_state* are the same address */
    struct fd_pending pending;
    int leaf_eval;
    int n_leafs_done;
    char leafs_done[FD_MAX_LEAFS][GGML_MAX_NAME];   /* inputs recorded in this graph, by name */
    struct fd_graph graph;
};

/* ---------------------------------------------------------------- spool */

static int write_all(int fd, const void * buf, size_t n) {
    const char * p = (const char *) buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return FD_EWRITE;
        }
        p += w;
        n -= (size_t) w;
    }
    return FD_OK;
}

/* `rc`, keeping the errno of the first write that failed (ENOSPC, EFBIG: the caller's to name). */
static int kept_errno(fd_capture * cap, int rc) {
    if (rc == FD_EWRITE && !cap->write_errno) cap->write_errno = errno;
    return rc;
}

fd_capture * fd_capture_open(const char * prefix) {
    char path[4096];
    fd_capture * cap = (fd_capture *) calloc(1, sizeof(*cap));
    if (!cap) return NULL;
    snprintf(path, sizeof(path), "%s.data", prefix);
    cap->fd_data = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    snprintf(path, sizeof(path), "%s.index", prefix);
    cap->fd_index = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (cap->fd_data < 0 || cap->fd_index < 0) {
        fd_capture_close(cap);
        return NULL;
    }
    cap->eval = -1;
    return cap;
}

int fd_capture_close(fd_capture * cap) {
    if (!cap) return FD_EARG;
    int rc = cap->error;
    if (cap->fd_data >= 0 && close(cap->fd_data) != 0) rc = FD_EWRITE;
    if (cap->fd_index >= 0 && close(cap->fd_index) != 0) rc = FD_EWRITE;
    for (int r = 0; r < FD_N_ROLES; ++r)
        for (int i = 0; i < cap->n_filters[r]; ++i) free(cap->filters[r][i]);
    free(cap);
    return rc;
}

int fd_capture_add_filter(fd_capture * cap, int role, const char * glob) {
    if (!cap || role < 0 || role >= FD_N_ROLES || cap->n_filters[role] >= FD_MAX_FILTERS) return FD_EARG;
    char * copy = strdup(glob);
    if (!copy) return FD_ENOMEM;
    cap->filters[role][cap->n_filters[role]++] = copy;
    memset(cap->seen, 0, sizeof(cap->seen));   /* decisions made under the old filters */
    return FD_OK;
}

void fd_capture_begin_eval(fd_capture * cap, int eval_index) {
    cap->eval = eval_index;
    cap->n_occ = 0;
}

int fd_capture_note(fd_capture * cap, const char * json_line) {
    int rc = write_all(cap->fd_index, json_line, strlen(json_line));
    if (rc == FD_OK) rc = write_all(cap->fd_index, "\n", 1);
    return kept_errno(cap, rc);
}

int fd_capture_error(const fd_capture * cap) { return cap->error; }
int fd_capture_errno(const fd_capture * cap) { return cap->write_errno; }
long fd_capture_n_records(const fd_capture * cap) { return cap->n_records; }

fd_context_tag * fd_tag_new(fd_capture * cap, int role) {
    if (role < 0 || role >= FD_N_ROLES) return NULL;
    struct fd_tag_state * s = (struct fd_tag_state *) calloc(1, sizeof(*s));
    if (!s) return NULL;
    s->tag.cap = cap;
    s->tag.role = role;
    s->leaf_eval = -1;
    s->graph.eval = -1;
    return &s->tag;
}

void fd_tag_free(fd_context_tag * tag) { free(tag); }

/* ---------------------------------------------------------------- selection */

/* A name is selected when some glob matches it and no "!glob" does. */
static int matches_globs(const fd_capture * cap, int role, const char * name) {
    int hit = 0;
    for (int i = 0; i < cap->n_filters[role]; ++i) {
        const char * g = cap->filters[role][i];
        if (g[0] == '!') {
            if (fnmatch(g + 1, name, 0) == 0) return 0;
        } else if (!hit && fnmatch(g, name, 0) == 0) {
            hit = 1;
        }
    }
    return hit;
}

static unsigned hash_name(int role, const char * name) {
    unsigned h = 2166136261u ^ (unsigned) role;   /* FNV-1a */
    for (; *name; ++name) h = (h ^ (unsigned char) *name) * 16777619u;
    return h;
}

static int matches(fd_capture * cap, int role, const char * name) {
    unsigned i = hash_name(role, name) & (FD_SEEN_SLOTS - 1);
    for (int probe = 0; probe < 8; ++probe, i = (i + 1) & (FD_SEEN_SLOTS - 1)) {
        struct fd_seen * e = &cap->seen[i];
        if (e->state == 0) {
            int hit = matches_globs(cap, role, name);
            if (strlen(name) < sizeof(e->name)) {
                e->state = (signed char) (hit ? 2 : 1);
                e->role = (char) role;
                memcpy(e->name, name, strlen(name) + 1);
            }
            return hit;
        }
        if (e->role == role && strcmp(e->name, name) == 0) return e->state == 2;
    }
    return matches_globs(cap, role, name);   /* a crowded neighbourhood: just match */
}

/* 0 for the first node of this name in this eval, 1 for the second, ... */
static int next_occurrence(fd_capture * cap, int role, const char * name) {
    for (int i = 0; i < cap->n_occ; ++i) {
        if (cap->occ[i].role == role && strcmp(cap->occ[i].name, name) == 0) return cap->occ[i].count++;
    }
    if (cap->n_occ == FD_MAX_OCC) return -1;
    struct fd_occ * o = &cap->occ[cap->n_occ++];
    o->role = role;
    o->count = 1;
    snprintf(o->name, sizeof(o->name), "%s", name);
    return 0;
}

/* A new graph of the same eval counts its names afresh: occurrence is per graph. */
static void forget_occurrences(fd_capture * cap, int role) {
    int kept = 0;
    for (int i = 0; i < cap->n_occ; ++i)
        if (cap->occ[i].role != role) cap->occ[kept++] = cap->occ[i];
    cap->n_occ = kept;
}

/* Insert `t` into the graph's node set; 1 if it was there already. */
static int graph_insert(struct fd_graph * g, const struct ggml_tensor * t) {
    unsigned i = (unsigned) (((uintptr_t) t >> 4) * 2654435761u) & (FD_GRAPH_SLOTS - 1);
    for (;; i = (i + 1) & (FD_GRAPH_SLOTS - 1)) {
        if (g->nodes[i] == t) return 1;
        if (g->nodes[i] == NULL) break;
    }
    if (g->n_nodes < FD_GRAPH_FULL) {   /* a graph of more nodes: the rest are not remembered */
        g->nodes[i] = t;
        g->n_nodes++;
    }
    return 0;
}

static void graph_clear(struct fd_graph * g) {
    if (g->n_nodes) memset(g->nodes, 0, sizeof(g->nodes));
    g->n_nodes = 0;
}

/* Whether `t` is the graph's first node again: same op and name, a name the graph gave it. */
static int is_first_node(const struct fd_graph * g, const struct ggml_tensor * t) {
    return g->first_name[0] && t->op == g->first_op && strcmp(t->name, g->first_name) == 0;
}

static void start_graph(struct fd_graph * g, const struct ggml_tensor * t) {
    graph_clear(g);
    g->first_op = t->op;
    /* ggml's default names (node_<n>) say nothing about where a graph starts */
    snprintf(g->first_name, sizeof(g->first_name), "%s", strncmp(t->name, "node_", 5) == 0 ? "" : t->name);
}

/* Called for every node in the ask phase: follows which graph of the eval is computing. */
static void follow_graph(struct fd_tag_state * s, const struct ggml_tensor * t) {
    fd_capture * cap = s->tag.cap;
    struct fd_graph * g = &s->graph;
    if (g->eval != cap->eval) {
        start_graph(g, t);
        g->eval = cap->eval;
        g->ubatch = 0;
    } else if (graph_insert(g, t) || is_first_node(g, t)) {   /* the next ubatch's graph */
        start_graph(g, t);
        g->ubatch++;
        forget_occurrences(cap, s->tag.role);
        s->n_leafs_done = 0;
    }
    graph_insert(g, t);
}

/* A graph input (leaf) is read where a consumer of it is evaluated, from the tensor that consumer
 * reads: the input, or on another backend the scheduler's copy of it (below). The consumers taken
 * are the same on the CPU and on a device, so a capture of every node records the same inputs
 * wherever the graph ran:
 *  - after the consumer ran (FD_READ_AFTER): a matrix multiplication, ROPE's positions, GET_ROWS'
 *    row ids, and a view of the input (issue 42 item 4), unless the consumer may have written the
 *    input's bytes. That is an in-place op (its result a view of the input: ggml_*_inplace,
 *    ggml_cpy's and ggml_set_rows' destination) or a consumer ggml-alloc handed the input's own
 *    memory (an op it may compute in place, the input's last reader); a view, a reshape, a permute
 *    or a transpose computes nothing.
 *  - before the consumer runs (FD_READ_BEFORE): a norm's source (RMS_NORM, NORM; issue 42, an input
 *    only a norm reads, as an MTP head's mtp_h_input). ggml-alloc computes RMS_NORM in place, in
 *    the memory of its source when the norm is its last reader, so after the norm the input may be
 *    gone. Before it, the input is whole: the scheduler asks about a node once the nodes before it
 *    that it asked for have run (and their backend synchronized), the graph inputs were set before
 *    the graph ran and their copies made, synchronously, before the split's first node is asked
 *    about (ggml_backend_sched_compute_splits), and no earlier node was given the input's memory
 *    (ggml-alloc gives it only to its last reader, and the norm reads it later). A norm that is
 *    not computed (a branch ggml_build_forward_select left out) reads nothing. */
enum { FD_READ_NEVER, FD_READ_AFTER, FD_READ_BEFORE };

static int is_view_op(enum ggml_op op) {
    return op == GGML_OP_VIEW || op == GGML_OP_RESHAPE || op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE;
}

static int may_overwrite(const struct ggml_tensor * node, const struct ggml_tensor * src) {
    if (is_view_op(node->op)) return 0;
    if (node->view_src && (node->view_src == src || node->view_src == src->view_src)) return 1;
    if (node->buffer != src->buffer || !node->data || !src->data) return 0;
    const char * a = (const char *) node->data;
    const char * b = (const char *) src->data;
    return a < b + ggml_nbytes(src) && b < a + ggml_nbytes(node);
}

/* When src[i] of `node` may be read (FD_READ_*). A scheduler copy (below) is taken as a MUL_MAT's
 * second operand, ROPE's positions, GET_ROWS' row ids, a view's source or a norm's source only:
 * never a model weight. llama.cpp multiplies weight x activation, so a weight the scheduler copies
 * to a device (op offload) is a MUL_MAT's first operand; a norm's source is the activation it
 * normalizes (build_norm multiplies by the norm's weight after it, in a MUL). */
static int read_point(const struct ggml_tensor * node, int i, int is_copy) {
    switch (node->op) {
        case GGML_OP_RMS_NORM:
        case GGML_OP_NORM:
            return i == 0 && (node->flags & GGML_TENSOR_FLAG_COMPUTE) ? FD_READ_BEFORE : FD_READ_NEVER;
        default: break;
    }
    if (may_overwrite(node, node->src[i])) return FD_READ_NEVER;
    switch (node->op) {
        case GGML_OP_MUL_MAT:  return !is_copy || i == 1 ? FD_READ_AFTER : FD_READ_NEVER;
        case GGML_OP_ROPE:
        case GGML_OP_GET_ROWS: return i == 1 ? FD_READ_AFTER : FD_READ_NEVER;
        default:               return is_view_op(node->op) && i == 0 ? FD_READ_AFTER : FD_READ_NEVER;
    }
}

/* When a consumer runs on another backend than its source (a device with -ngl, the CPU for a
 * graph input), ggml's scheduler hands it a copy named "<backend>#<source name>#<copy>"
 * (ggml-backend.cpp, ggml_backend_sched_split_graph), without the input flag when there is one
 * copy. Writes the source's own name into `out`; 0 when `name` is no such copy's. */
static int copied_from(const char * name, char out[GGML_MAX_NAME]) {
    const char * first = strchr(name, '#');
    const char * last = strrchr(name, '#');
    if (!first || first == name || last == first || !last[1]) return 0;
    for (const char * d = last + 1; *d; ++d)
        if (*d < '0' || *d > '9') return 0;
    snprintf(out, GGML_MAX_NAME, "%.*s", (int) (last - first - 1), first + 1);
    return 1;
}

static int leaf_done(const struct fd_tag_state * s, const char * name) {
    for (int i = 0; i < s->n_leafs_done; ++i)
        if (strcmp(s->leafs_done[i], name) == 0) return 1;
    return 0;
}

/* Whether this graph computed a selected node `name` already: `occ` counts the selected names
 * of the graph, nodes and recorded inputs alike. */
static int was_computed(const struct fd_tag_state * s, const char * name) {
    const fd_capture * cap = s->tag.cap;
    if (leaf_done(s, name)) return 0;
    for (int i = 0; i < cap->n_occ; ++i)
        if (cap->occ[i].role == s->tag.role && strcmp(cap->occ[i].name, name) == 0) return 1;
    return 0;
}

static void record_tensor(fd_capture * cap, int ubatch, int role, const struct ggml_tensor * t, const char * name,
                          int occurrence, int is_leaf);

/* Where src[i] of `node` may be read (FD_READ_*) when it is a graph input (ggml_set_input, not a
 * model weight nor a computed node); `name` gets the input's own name. The input itself carries
 * the flag; a scheduler copy of it is one unless the graph computed a node of that name (then it
 * is a copy of that node's output, recorded as the node). */
static int input_source(const struct fd_tag_state * s, const struct ggml_tensor * node, int i,
                        char name[GGML_MAX_NAME]) {
    const struct ggml_tensor * src = node->src[i];
    if (!src || src->op != GGML_OP_NONE || !src->buffer) return FD_READ_NEVER;
    if (copied_from(src->name, name)) return was_computed(s, name) ? FD_READ_NEVER : read_point(node, i, 1);
    snprintf(name, GGML_MAX_NAME, "%s", src->name);
    return src->flags & GGML_TENSOR_FLAG_INPUT ? read_point(node, i, 0) : FD_READ_NEVER;
}

/* The inputs of `node` to record (each once per graph, under its own name, from whichever
 * tensor holds its data: the input, or the scheduler's copy on the consumer's backend): those
 * read before `node` runs are recorded now, in the ask phase; the others are left pending for
 * the phase after it. */
static void select_leafs(struct fd_tag_state * s, const struct ggml_tensor * node) {
    fd_capture * cap = s->tag.cap;
    if (s->leaf_eval != cap->eval) {
        s->leaf_eval = cap->eval;
        s->n_leafs_done = 0;
    }
    s->pending.n_leafs = 0;
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        char * name = s->pending.leaf_names[s->pending.n_leafs];
        const int when = input_source(s, node, i, name);
        if (when == FD_READ_NEVER || leaf_done(s, name) || !matches(cap, s->tag.role, name)) continue;
        if (s->n_leafs_done == FD_MAX_LEAFS) break;
        memcpy(s->leafs_done[s->n_leafs_done++], name, strlen(name) + 1);   /* < GGML_MAX_NAME */
        if (when == FD_READ_BEFORE) {
            record_tensor(cap, s->graph.ubatch, s->tag.role, node->src[i], name,
                          next_occurrence(cap, s->tag.role, name), 1);
        } else {
            s->pending.leafs[s->pending.n_leafs++] = node->src[i];
        }
    }
}

/* ---------------------------------------------------------------- copy and convert */

static int is_int_type(enum ggml_type t) { return t == GGML_TYPE_I32 || t == GGML_TYPE_I64; }

static void convert_row(enum ggml_type type, const char * src, size_t nb0, int64_t ne0, char * dst) {
    if (is_int_type(type) || type == GGML_TYPE_F32) {
        size_t es = ggml_type_size(type);
        if (nb0 == es) { memcpy(dst, src, (size_t) ne0 * es); return; }
        for (int64_t k = 0; k < ne0; ++k) memcpy(dst + k * es, src + k * nb0, es);
        return;
    }
    const struct ggml_type_traits * tr = ggml_get_type_traits(type);
    float * out = (float *) dst;
    if (nb0 == ggml_type_size(type) || ggml_is_quantized(type)) { tr->to_float(src, out, ne0); return; }
    for (int64_t k = 0; k < ne0; ++k) tr->to_float(src + k * nb0, out + k, 1);
}

/* Host copy of `t` in ggml order, contiguous: float32, or int32/int64 kept. */
static char * host_array(const struct ggml_tensor * t, size_t * out_nbytes, const char ** dtype) {
    const size_t raw_n = ggml_nbytes(t);
    const size_t es = is_int_type(t->type) ? ggml_type_size(t->type) : sizeof(float);
    const size_t row_bytes = (size_t) t->ne[0] * es;
    char * raw = (char *) malloc(raw_n ? raw_n : 1);
    if (!raw) return NULL;
    ggml_backend_tensor_get(t, raw, 0, raw_n);   /* device memory (CUDA/Metal) arrives here too */
    *dtype = t->type == GGML_TYPE_I32 ? "int32" : t->type == GGML_TYPE_I64 ? "int64" : "float32";
    if ((t->type == GGML_TYPE_F32 || is_int_type(t->type)) && ggml_is_contiguous(t)) {
        *out_nbytes = raw_n;   /* already in the stored layout: no second copy */
        return raw;
    }
    char * out = (char *) malloc(row_bytes * (size_t) ggml_nrows(t) + 1);
    if (!out) { free(raw); return NULL; }
    char * dst = out;
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
    for (int64_t i1 = 0; i1 < t->ne[1]; ++i1, dst += row_bytes) {
        convert_row(t->type, raw + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3], t->nb[0], t->ne[0], dst);
    }
    free(raw);
    *out_nbytes = row_bytes * (size_t) ggml_nrows(t);
    return out;
}

/* The bytes of `t` where they lie, when they are already in the stored layout and in host memory
 * (the CPU backend's buffers, a device's host buffer): written from there, with no copy and no
 * allocation (a capture of every node writes each node's output once, and a fresh allocation of
 * that size costs its page faults). NULL: read it with host_array. */
static const void * stored_in_place(const struct ggml_tensor * t, size_t * nbytes, const char ** dtype) {
    if (t->type != GGML_TYPE_F32 && !is_int_type(t->type)) return NULL;
    if (!t->data || !t->buffer || !ggml_backend_buffer_is_host(t->buffer) || !ggml_is_contiguous(t)) return NULL;
    *nbytes = ggml_nbytes(t);
    *dtype = t->type == GGML_TYPE_I32 ? "int32" : t->type == GGML_TYPE_I64 ? "int64" : "float32";
    return t->data;
}

/* ---------------------------------------------------------------- index lines */

/* The ggml device whose memory held `t` when it was read: "CPU" for host memory (where the CPU
 * backend computes, also in a device's pinned host buffer), else the device's name ("Vulkan0",
 * "CUDA0"): the backend that computed a node, or that a graph input was copied to. NULL for
 * rows read back through the API (no buffer). */
static const char * memory_device(const struct ggml_tensor * t) {
    ggml_backend_buffer_t buf = t->view_src ? t->view_src->buffer : t->buffer;
    if (!buf) return NULL;
    if (ggml_backend_buffer_is_host(buf)) return "CPU";
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    return dev ? ggml_backend_dev_name(dev) : ggml_backend_buffer_name(buf);
}

static int json_str(char * buf, size_t cap, const char * s) {
    size_t n = 0;
    if (n < cap) buf[n++] = '"';
    for (; *s && n + 7 < cap; ++s) {
        unsigned char c = (unsigned char) *s;
        if (c == '"' || c == '\\') { buf[n++] = '\\'; buf[n++] = (char) c; }
        else if (c < 0x20) n += (size_t) snprintf(buf + n, cap - n, "\\u%04x", c);
        else buf[n++] = (char) c;
    }
    if (n < cap) buf[n++] = '"';
    return (int) n;
}

static int index_line(char * buf, size_t cap, const struct ggml_tensor * t, const char * op, int eval, int ubatch,
                      int role, int occurrence, const char * dtype, long long off, size_t nbytes, int is_leaf) {
    int n = snprintf(buf, cap, "{\"kind\":\"record\",\"eval\":%d,\"ubatch\":%d,\"role\":%d,\"occurrence\":%d,\"name\":",
                     eval, ubatch, role, occurrence);
    n += json_str(buf + n, cap - n, t->name);
    n += snprintf(buf + n, cap - n, ",\"op\":\"%s\",\"ggml_type\":\"%s\",\"n_dims\":%d,\"ne\":[%lld,%lld,%lld,%lld],\"nb\":[%zu,%zu,%zu,%zu],\"srcs\":[",
                  op, ggml_type_name(t->type), ggml_n_dims(t),
                  (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3],
                  t->nb[0], t->nb[1], t->nb[2], t->nb[3]);
    for (int i = 0, first = 1; i < GGML_MAX_SRC && (size_t) n < cap - 80; ++i) {
        if (!t->src[i]) continue;
        char own[GGML_MAX_NAME];   /* a scheduler copy of a source is listed as the source */
        if (!first) buf[n++] = ',';
        n += json_str(buf + n, cap - n, copied_from(t->src[i]->name, own) ? own : t->src[i]->name);
        first = 0;
    }
    n += snprintf(buf + n, cap - n, "],\"dtype\":\"%s\",\"offset\":%lld,\"nbytes\":%zu,\"is_leaf\":%s",
                  dtype, off, nbytes, is_leaf ? "true" : "false");
    const char * device = memory_device(t);
    if (device) {
        n += snprintf(buf + n, cap - n, ",\"backend\":");
        n += json_str(buf + n, cap - n, device);
    }
    n += snprintf(buf + n, cap - n, "}\n");
    return n;
}

/* Append one record: its data, then its index line (an index line means complete data).
 * `t` describes the data (name, type, ne, nb, srcs); `op` is what the index calls its op. */
static int append_record(fd_capture * cap, const void * data, size_t nbytes, const struct ggml_tensor * t,
                         const char * op, int ubatch, int role, int occurrence, const char * dtype, int is_leaf) {
    char line[FD_LINE_MAX];
    int rc = write_all(cap->fd_data, data, nbytes);
    if (rc == FD_OK) {
        int n = index_line(line, sizeof(line), t, op, cap->eval, ubatch, role, occurrence, dtype, cap->data_off, nbytes,
                           is_leaf);
        rc = write_all(cap->fd_index, line, (size_t) n);
    }
    if (rc != FD_OK) { cap->error = kept_errno(cap, rc); return rc; }
    cap->data_off += (long long) nbytes;
    cap->n_records++;
    return FD_OK;
}

/* Record `t`'s data under `name` (a graph input read through the scheduler's copy keeps the
 * input's own name: the index line describes a copy of the tensor struct renamed). */
static void record_tensor(fd_capture * cap, int ubatch, int role, const struct ggml_tensor * t, const char * name,
                          int occurrence, int is_leaf) {
    size_t nbytes = 0;
    const char * dtype = NULL;
    const void * lying = stored_in_place(t, &nbytes, &dtype);
    char * data = lying ? NULL : host_array(t, &nbytes, &dtype);
    if (!lying && !data) { cap->error = FD_ENOMEM; return; }
    struct ggml_tensor described = *t;
    snprintf(described.name, sizeof(described.name), "%s", name);
    append_record(cap, lying ? lying : data, nbytes, &described, ggml_op_desc(t), ubatch, role, occurrence, dtype,
                  is_leaf);
    free(data);
}

int fd_capture_keeps(fd_capture * cap, int role, const char * name) {
    return cap && role >= 0 && role < FD_N_ROLES && matches(cap, role, name);
}

int fd_capture_add_rows(fd_capture * cap, int role, const char * name, const float * data,
                        int64_t n_cols, int64_t n_rows) {
    if (!cap || !data || role < 0 || role >= FD_N_ROLES || n_cols <= 0 || n_rows <= 0) return FD_EARG;
    if (cap->eval < 0 || cap->error || !matches(cap, role, name)) return cap->error;
    const int occurrence = next_occurrence(cap, role, name);
    if (occurrence < 0) return FD_OK;
    struct ggml_tensor rows;   /* describes the rows for the index line: contiguous f32, no sources */
    memset(&rows, 0, sizeof(rows));
    rows.type = GGML_TYPE_F32;
    rows.ne[0] = n_cols; rows.ne[1] = n_rows; rows.ne[2] = rows.ne[3] = 1;
    rows.nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; ++i) rows.nb[i] = rows.nb[i - 1] * (size_t) rows.ne[i - 1];
    snprintf(rows.name, sizeof(rows.name), "%s", name);
    return append_record(cap, data, (size_t) n_cols * (size_t) n_rows * sizeof(float), &rows, "API", 0, role,
                         occurrence, "float32", 0);
}

/* ---------------------------------------------------------------- logging */

void fd_log_errors_only(int level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* ---------------------------------------------------------------- the callback */

bool fd_eval_callback(struct ggml_tensor * t, bool ask, void * user_data) {
    struct fd_tag_state * s = (struct fd_tag_state *) user_data;
    fd_capture * cap = s->tag.cap;
    if (ask) {
        s->pending.want_node = 0;
        s->pending.n_leafs = 0;
        if (cap->eval < 0 || cap->error) return false;
        follow_graph(s, t);
        select_leafs(s, t);
        /* only nodes flagged for computation hold data */
        if ((t->flags & GGML_TENSOR_FLAG_COMPUTE) && matches(cap, s->tag.role, t->name)) {
            s->pending.want_node = 1;
            s->pending.occurrence = next_occurrence(cap, s->tag.role, t->name);
        }
        return s->pending.want_node || s->pending.n_leafs > 0;
    }
    for (int i = 0; i < s->pending.n_leafs; ++i) {
        const char * name = s->pending.leaf_names[i];
        record_tensor(cap, s->graph.ubatch, s->tag.role, s->pending.leafs[i], name,
                      next_occurrence(cap, s->tag.role, name), 1);
    }
    if (s->pending.want_node && s->pending.occurrence >= 0) {
        record_tensor(cap, s->graph.ubatch, s->tag.role, t, t->name, s->pending.occurrence, 0);
    }
    s->pending.want_node = 0;
    s->pending.n_leafs = 0;
    return true;   /* false here would abort the graph computation */
}
