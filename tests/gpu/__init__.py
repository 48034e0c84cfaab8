"""Tests of the model runner, attention, sampler and models against Hugging Face."""
