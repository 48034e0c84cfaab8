"""Tests of the scheduler, block accounting and engine loop."""
