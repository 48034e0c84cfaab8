"""Tests of tenants, weighted fair queues and the fairness of the scheduler."""
