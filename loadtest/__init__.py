"""Load a fairlane server over HTTP the way its users would: `python -m loadtest` scenarios and
`fairlane bench serve`. HTTP only: of the server it imports just the API-key hash, for the tenants
file it writes (an import-linter contract).
"""
