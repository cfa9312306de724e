// storage_f32: not written yet
