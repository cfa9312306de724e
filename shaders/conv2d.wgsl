// conv2d: not written yet
