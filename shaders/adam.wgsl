// adam: not written yet
