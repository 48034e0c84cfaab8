"""Tests of the settings loader."""
