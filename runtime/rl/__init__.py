"""The RL loop's pieces: GRPO's maths and the data-parallel trainer that applies it."""
