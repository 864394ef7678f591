"""The policy model: its configuration, the megatron-core build, weight conversion and warm start."""
