//! Boundary search over an oracle: gallop from the prediction, bisect, confirm the pair.
