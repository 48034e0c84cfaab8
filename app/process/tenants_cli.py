"""`fairlane tenants add ID --weight W [--file F]`: add a tenant with a fresh API key.
`fairlane tenants admin-key [--file F]`: add the operator key (/stats, /metrics, /dashboard).

The key is printed once, on stdout by itself; the file keeps only its SHA-256 hash, so a lost key
cannot be recovered, only replaced.
"""

from __future__ import annotations

import argparse
import sys

from tenancy.tenants import TenantsFileError, append_admin_key, append_tenant

DEFAULT_TENANTS_FILE = "tenants.toml"


def add_tenants_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("tenants", help="manage the tenants file")
    actions = parser.add_subparsers(dest="tenants_action", required=True)
    add = actions.add_parser("add", help="add a tenant and print its new API key once")
    add.add_argument("tenant_id", metavar="ID", help="the tenant's id: letters, digits, '.', '_' or '-'")
    add.add_argument("--weight", type=float, default=1.0, help="its share of service relative to others (> 0)")
    add.add_argument("--file", default=DEFAULT_TENANTS_FILE,
                     help=f"the tenants file, created if missing (default ./{DEFAULT_TENANTS_FILE})")
    add.set_defaults(handler=run_tenants_add)
    admin = actions.add_parser("admin-key", help="add an [admin] operator key and print it once")
    admin.add_argument("--file", default=DEFAULT_TENANTS_FILE,
                       help=f"the tenants file (default ./{DEFAULT_TENANTS_FILE})")
    admin.set_defaults(handler=run_tenants_admin_key)


def run_tenants_add(args: argparse.Namespace) -> int:
    try:
        key = append_tenant(args.file, args.tenant_id, args.weight)
    except TenantsFileError as exc:
        print(f"fairlane: {exc}", file=sys.stderr)
        return 2
    print(f"added tenant '{args.tenant_id}' (weight {args.weight:g}) to {args.file}; its API key follows. "
          "It is shown only this once: the file keeps just its hash.", file=sys.stderr)
    print(key)
    return 0


def run_tenants_admin_key(args: argparse.Namespace) -> int:
    try:
        key = append_admin_key(args.file)
    except (TenantsFileError, OSError, ValueError) as exc:
        print(f"fairlane: {exc}", file=sys.stderr)
        return 2
    print(f"added an [admin] operator key to {args.file}; it follows, shown only this once.", file=sys.stderr)
    print(key)
    return 0
