// relu: not written yet
