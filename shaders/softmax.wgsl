// softmax: not written yet
