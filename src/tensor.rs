//! Device tensors: a tensor of any size as row-aligned chunks within the device's buffer and binding limits.
