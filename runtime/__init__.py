"""dynarl's own small RL runtime: the task, the policy model and the pieces a real job runs.

Pure Python plus torch and megatron-core; it imports no Django and no other dynarl package, so
the same code runs inside Ray actors on any node.
"""
