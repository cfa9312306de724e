//! Plan::for_value: dispatch to the builder of the workload's architecture and scenario.
