// attention: not written yet
