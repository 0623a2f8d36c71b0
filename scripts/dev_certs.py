"""Write a development CA, the certificates and the NATS keys compose.yaml mounts.

    scripts/dev-certs                 # into deploy/tls (compose.yaml's folder)
    scripts/dev-certs --out DIR       # elsewhere
    scripts/dev-certs --force         # replace an existing set (restart the stack after)

What is written is listed by :func:`conveyor_testkit.certs.write_dev_certs`. These are
development certificates only: see docs/operations.md ("TLS") for production.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conveyor_testkit.certs import write_dev_certs

ROOT = Path(__file__).resolve().parent.parent
#: Where compose.yaml expects the files (its volumes mount this folder).
DEFAULT_OUT = ROOT / "deploy" / "tls"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    out: Path = args.out
    if (out / "ca.pem").exists() and not args.force:
        print(
            f"{out} already holds a CA: keep it, or pass --force for a new one (every "
            "service must then restart with the new files)",
            file=sys.stderr,
        )
        return 1
    written = write_dev_certs(out)
    print(f"wrote {len(written)} files to {out}:")
    for path in written:
        print(f"  {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
