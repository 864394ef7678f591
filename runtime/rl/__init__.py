"""The RL loop's pieces: GRPO's maths, the data-parallel trainer that applies it, the weight push
to the rollout engines, the job's configuration (`job`) and the iteration that drives them all
(`loop`)."""
