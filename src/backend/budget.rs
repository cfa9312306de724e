//! A Backend wrapper that emulates a smaller card: every byte requested counts against a cap.
