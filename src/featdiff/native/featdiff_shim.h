/* featdiff shim: the ggml eval callback that captures named tensors into an append-only spool.
 *
 * A spool is two files: <prefix>.data (raw arrays, back to back) and <prefix>.index (one JSON
 * line per record or eval, written after its data). A line is complete only when it ends in
 * '\n', so a process that dies mid-capture leaves every complete record readable.
 *
 * Every function returns 0 (or a valid pointer) on success and a negative FD_E* code (or NULL)
 * on failure; nothing here aborts.
 */
#ifndef FEATDIFF_SHIM_H
#define FEATDIFF_SHIM_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;

enum fd_error {
    FD_OK = 0,
    FD_EOPEN = -1,     /* could not open the spool files */
    FD_EWRITE = -2,    /* a write to the spool failed */
    FD_ENOMEM = -3,
    FD_EARG = -4,      /* bad argument (role out of range, too many filters) */
};

enum { FD_ROLE_TARGET = 0, FD_ROLE_DRAFT = 1, FD_N_ROLES = 2 };

typedef struct fd_capture fd_capture;

/* One per llama_context: the user_data of its eval callback. */
typedef struct fd_context_tag {
    fd_capture * cap;
    int role;
} fd_context_tag;

fd_capture * fd_capture_open(const char * prefix);
int  fd_capture_close(fd_capture * cap);
int  fd_capture_add_filter(fd_capture * cap, int role, const char * glob);
/* The next graph evaluations belong to eval `eval_index` (-1: capture nothing). */
void fd_capture_begin_eval(fd_capture * cap, int eval_index);
/* Append a raw JSON line (an eval's metadata) to the index. */
int  fd_capture_note(fd_capture * cap, const char * json_line);
/* Whether the role's filters keep records named `name` (so a caller can skip reading them). */
int  fd_capture_keeps(fd_capture * cap, int role, const char * name);
/* Record `n_rows` rows of `n_cols` floats the program read back through the API after an eval
 * (no graph node holds them: DSpark's Markov-biased logits) under `name`, if the role's filters
 * keep it; op "API" in the index. */
int  fd_capture_add_rows(fd_capture * cap, int role, const char * name, const float * data,
                         int64_t n_cols, int64_t n_rows);
/* First error seen by the callback (which cannot return one), 0 if none. */
int  fd_capture_error(const fd_capture * cap);
/* errno of the first spool write that failed (ENOSPC, EDQUOT, EFBIG: out of room), 0 if none. */
int  fd_capture_errno(const fd_capture * cap);
long fd_capture_n_records(const fd_capture * cap);

fd_context_tag * fd_tag_new(fd_capture * cap, int role);
void fd_tag_free(fd_context_tag * tag);

/* ggml_log_callback that keeps warnings and errors only (llama.cpp is chatty at load time). */
void fd_log_errors_only(int level, const char * text, void * user_data);

/* ggml_backend_sched_eval_callback; user_data is an fd_context_tag. */
bool fd_eval_callback(struct ggml_tensor * t, bool ask, void * user_data);

#ifdef __cplusplus
}
#endif

#endif
