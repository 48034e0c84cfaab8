"""fairlane on several replicas: engine replicas as a Ray Serve deployment behind one OpenAI ingress.

The top serving layer: it may import app, scheduling, tenancy and config, and nothing but the
benchmarks imports it. Single-process `fairlane serve` never reaches this package, so it never
imports Ray (an import-linter contract and a test keep it so).
"""
