"""The shipped systemd unit (daemon/systemd/cuctxd.service) read the way systemd reads what the tests need of it,
and a stand-in ``systemctl`` for machines without a service manager.

:func:`service_command` turns the unit's ``ExecStart=`` into an argv (``%t`` the runtime directory, ``%E`` the
configuration directory, as systemd's specifiers say) and :func:`prepare_runtime_directory` makes its
``RuntimeDirectory=`` with ``RuntimeDirectoryMode=`` and says where (``$RUNTIME_DIRECTORY``), as systemd does
before it starts the service. Run as a program, this module is ``systemctl --user`` enough for the README's
service block: ``daemon-reload``, ``enable --now cuctxd`` (starts the unit's ``ExecStart`` from
``~/.config/systemd/user/cuctxd.service``, in the background, and waits for its socket), ``status cuctxd``
(exit 0 while it runs) and ``stop cuctxd``; the daemon's pid goes to ``$CUCTXD_TEST_SYSTEMCTL_STATE/pid``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

UNIT = Path(__file__).resolve().parent.parent / "daemon" / "systemd" / "cuctxd.service"


def unit_settings(path: Path = UNIT) -> dict[str, str]:
    """``Key=value`` lines of the unit (the last one wins, as systemd's do for these keys)."""
    settings = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def service_command(runtime: Path, config: Path, path: Path = UNIT) -> list[str]:
    """The unit's ``ExecStart=`` as an argv, with ``%t`` = ``runtime`` and ``%E`` = ``config``."""
    line = unit_settings(path)["ExecStart"].replace("%t", str(runtime)).replace("%E", str(config))
    return shlex.split(line)


def prepare_runtime_directory(runtime: Path, path: Path = UNIT) -> dict[str, str]:
    """Make the unit's ``RuntimeDirectory=`` under ``runtime`` with its mode, as systemd does at start; the
    environment systemd then gives the service (``RUNTIME_DIRECTORY``)."""
    settings = unit_settings(path)
    directory = runtime / settings["RuntimeDirectory"]
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(int(settings["RuntimeDirectoryMode"], 8))
    return {"RUNTIME_DIRECTORY": str(directory)}


def _systemctl(argv: list[str]) -> int:
    state = Path(os.environ["CUCTXD_TEST_SYSTEMCTL_STATE"])
    words = [word for word in argv if word != "--user"]
    unit = Path.home() / ".config" / "systemd" / "user" / "cuctxd.service"
    pid_file = state / "pid"
    if words == ["daemon-reload"]:
        return 0
    if words == ["enable", "--now", "cuctxd"]:
        runtime = Path(os.environ["XDG_RUNTIME_DIR"])
        env = dict(os.environ, **prepare_runtime_directory(runtime, unit))
        argv = service_command(runtime, Path.home() / ".config", unit)
        log = (state / "daemon.log").open("w")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        pid_file.write_text(str(process.pid))
        socket = Path(argv[argv.index("--endpoint") + 1][len("ipc://"):])
        deadline = time.monotonic() + 30
        while not socket.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0 if socket.exists() else 1
    if words == ["status", "cuctxd"]:
        if not pid_file.exists():
            return 3
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 3
        print(f"cuctxd.service - cuctxd CUDA context daemon\n   Active: active (running), Main PID: {pid}")
        return 0
    if words == ["stop", "cuctxd"] and pid_file.exists():
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        return 0
    print(f"systemctl (test stand-in): not understood: {argv}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(_systemctl(sys.argv[1:]))
