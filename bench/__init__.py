"""Benchmarks and the process launcher they share with the live tests; outside the apps."""
