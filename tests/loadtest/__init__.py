"""Tests of the HTTP load client and `fairlane bench serve`."""
