//! Model states: params, gradients and optimizer state per precision, optimizer and ZeRO stage.
