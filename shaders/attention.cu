// attention: the softmax step of naive attention, probs = softmax(scale * scores) with the
// causal mask (the CUDA twin of attention.wgsl). Composed as prelude + codec + this file +
// softmax.cu: the kernel is softmax.cu with MASKED = true and the entry point `attention`
// (params: softmax's; q_period = seq, q_row0 = the query index of the dispatch's first row;
// q_period = 0 for no mask).
// Naive attention on the host: scores = (1/sqrt(d)) * Q·Kᵀ (matmul with a transposed B),
// probs = this kernel over the stored scores, out = probs·V (matmul).
#define MASKED true
#define SOFTMAX_ENTRY attention
