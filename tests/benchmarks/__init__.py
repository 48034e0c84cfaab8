"""Tests of the in-process benchmarks and the executors without a model."""
