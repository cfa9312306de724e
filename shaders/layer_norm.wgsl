// layer_norm: not written yet
