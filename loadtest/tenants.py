"""`python -m loadtest.tenants CLIENT_FILE SERVER_FILE`: write the server's tenants file (ids, weights,
key hashes) for the load tool's tenants file (ids, weights, plain keys)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadtest.workload import LoadTenantsError, load_admin_key, load_tenants, server_tenants_toml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.tenants", description=__doc__)
    parser.add_argument("client_file", help="the load tool's tenants file: [[tenants]] id, api_key, weight")
    parser.add_argument("server_file", help="where to write the server's tenants file (overwritten)")
    args = parser.parse_args(argv)
    try:
        tenants = load_tenants(args.client_file)
        admin_key = load_admin_key(args.client_file)
    except LoadTenantsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.server_file).write_text(server_tenants_toml(tenants, admin_key), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
