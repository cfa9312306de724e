// checksum: not written yet
