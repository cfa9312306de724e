// fill: not written yet
