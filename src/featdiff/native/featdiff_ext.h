/* C entry points for the llama.cpp functions declared in src/llama-ext.h.
 *
 * That header is not installed and its functions are exported as C++ symbols, so
 * featdiff_ext.cpp re-declares them (C++ linkage, the exported mangled names) and wraps each in a
 * plain C function that cffi can bind. The prototypes mirror the pinned upstream tree.
 */
#ifndef FEATDIFF_EXT_H
#define FEATDIFF_EXT_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_context;
struct llama_model;

void            fd_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
float *         fd_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
void            fd_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float *         fd_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
float *         fd_get_embeddings_nextn(struct llama_context * ctx);  /* all rows of the last batch */
void            fd_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);  /* a chain's head k */
const int32_t * fd_model_target_layer_ids(const struct llama_model * model);
uint32_t        fd_model_target_layer_ids_n(const struct llama_model * model);

#ifdef __cplusplus
}
#endif

#endif
