"""``cuctxd keygen DIR [--name NAME]``: write a CURVE key pair for the daemon or for a client.

Writes ``DIR/NAME.key`` (the public key: give it to the other side) and
``DIR/NAME.key_secret`` (mode 0600: keep it). The daemon's pair goes to
``server_key`` (the secret file) and to clients (the public file, their
``server_key``); a client's public file goes into the daemon's ``allow_dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import zmq.auth


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuctxd keygen",
                                     description="Write a CURVE key pair: NAME.key (public) and "
                                                 "NAME.key_secret (secret, mode 0600) in DIR.")
    parser.add_argument("directory", metavar="DIR", help="where to write the key files (created if missing)")
    parser.add_argument("--name", default="server", help="file name stem (default: server)")
    parser.add_argument("--force", action="store_true", help="overwrite existing key files of that name")
    return parser


def write_key_pair(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path, str]:
    """Write the pair; ``(public file, secret file, public key z85)``. FileExistsError unless ``force``."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"not a plain file name: {name!r}")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not force:
        for path in (public_file, secret_file):
            if path.exists():
                raise FileExistsError(f"{path} exists (use --force to replace it)")
    old_umask = os.umask(0o077)  # the secret is never readable by others, not even for a moment
    try:
        made_public, made_secret = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old_umask)
    os.chmod(made_secret, 0o600)
    os.chmod(made_public, 0o644)
    public, _ = zmq.auth.load_certificate(made_public)
    return Path(made_public), Path(made_secret), public.decode()


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        public_file, secret_file, public = write_key_pair(Path(args.directory), args.name, force=args.force)
    except (OSError, ValueError) as exc:
        print(f"cuctxd keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key:  {public_file}")
    print(f"secret key:  {secret_file} (mode 0600)")
    print(f"public z85:  {public}")
    return 0
