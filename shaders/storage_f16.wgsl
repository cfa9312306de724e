// storage_f16: not written yet
