// storage_bf16: not written yet
