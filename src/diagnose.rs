//! The seed's quick diagnosis: which cause dominates, and what each remedy buys.
