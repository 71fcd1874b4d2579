// See featdiff_ext.h. The declarations below must match upstream src/llama-ext.h; a build whose
// library lacks one of these symbols fails to load the binding, and the Python loader names it.
#include "featdiff_ext.h"

#include "llama.h"

LLAMA_API void            llama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float *         llama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
LLAMA_API void            llama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
LLAMA_API float *         llama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
LLAMA_API float *         llama_get_embeddings_nextn(struct llama_context * ctx);
LLAMA_API void            llama_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);
LLAMA_API const int32_t * llama_model_target_layer_ids(const struct llama_model * model);
LLAMA_API uint32_t        llama_model_target_layer_ids_n(const struct llama_model * model);

extern "C" {

void fd_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value) {
    llama_set_embeddings_layer_inp(ctx, lid, value);
}

float * fd_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid) {
    return llama_get_embeddings_layer_inp(ctx, lid);
}

void fd_set_embeddings_nextn(llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

float * fd_get_embeddings_nextn_ith(llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

float * fd_get_embeddings_nextn(llama_context * ctx) {
    return llama_get_embeddings_nextn(ctx);
}

void fd_set_nextn_layer_offset(llama_context * ctx, int32_t offset) {
    llama_set_nextn_layer_offset(ctx, offset);
}

const int32_t * fd_model_target_layer_ids(const llama_model * model) {
    return llama_model_target_layer_ids(model);
}

uint32_t fd_model_target_layer_ids_n(const llama_model * model) {
    return llama_model_target_layer_ids_n(model);
}

}
