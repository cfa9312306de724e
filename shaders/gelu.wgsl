// gelu: not written yet
