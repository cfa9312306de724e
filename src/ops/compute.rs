//! Compute kernels over device tensors (matmul, softmax, attention, conv2d, ...) and `run_step` for plan steps.
