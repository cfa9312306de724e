//! Sizes and counts on the command line: 40GiB, 512MiB, 7B, 7e9; and human formatting.
