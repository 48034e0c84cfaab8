"""fairlane test suite."""
