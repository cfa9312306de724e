//! Read a Hugging Face config.json or an oomprobe TOML case file into a Workload.
