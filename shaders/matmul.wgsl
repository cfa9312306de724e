// matmul: not written yet
