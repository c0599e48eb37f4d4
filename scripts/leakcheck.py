"""What a test run left behind, looking only at what that run created.

    python scripts/leakcheck.py PREFIX_LOG

PREFIX_LOG is the file that synkhronos appended every session prefix to during the run
(``SYNK_PREFIX_LOG``; with pytest-xdist, each test process's ``PREFIX_LOG.<worker>`` too).
Reports, and exits 1 for, any /dev/shm entry of those sessions and any live process that
inherited ``SYNK_PREFIX_LOG=PREFIX_LOG`` or ``PREFIX_LOG.<worker>`` (a worker, a test's
master program).  Other programs of the same user on the machine are not looked at.  A process
that is still exiting gets a few seconds."""
import glob
import os
import sys
import time


def shm_left(prefixes):
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return []
    bases = tuple(p.lstrip("/") + "_" for p in prefixes)
    return sorted(e for e in entries if e.startswith(bases) or e.startswith(tuple("sem." + b for b in bases)))


def procs_left(marker):
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{name}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if any(v == marker or v.startswith(marker + b".") for v in env) and state not in ("Z", "X"):
            try:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            found.append(f"{name}: {cmd[:200]}")
    return found


def main():
    log = sys.argv[1]
    prefixes = set()
    for path in [log] + sorted(glob.glob(glob.escape(log) + ".*")):
        try:
            with open(path) as fh:
                prefixes.update(ln.strip() for ln in fh if ln.strip())
        except OSError:
            pass
    prefixes = sorted(prefixes)
    marker = f"SYNK_PREFIX_LOG={log}".encode()
    deadline = time.monotonic() + 5.0
    while True:
        shm, procs = shm_left(prefixes), procs_left(marker)
        if not (shm or procs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if shm:
        print("synkhronos test: shared-memory entries left by this run:", *shm, sep="\n  ", file=sys.stderr)
    if procs:
        print("synkhronos test: processes left by this run:", *procs, sep="\n  ", file=sys.stderr)
    print(f"synkhronos test: leak check of {len(prefixes)} session(s): "
          + ("LEAKS" if shm or procs else "clean"), file=sys.stderr)
    return 1 if shm or procs else 0


if __name__ == "__main__":
    sys.exit(main())
