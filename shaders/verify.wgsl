// verify: not written yet
