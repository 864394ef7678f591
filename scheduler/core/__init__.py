"""dynarl's scheduler core: pure Python, no Django.

The Celery tick, the node agents' simulator backend, the cluster simulator and the benchmark
all run this same code. Nothing under this package may import Django.
"""
