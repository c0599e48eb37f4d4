"""What /proc/PID/stat says of a process (one reader for the launcher, the fork server and
the planes): its state, its parent, the rest of its fields."""


def stat_fields(pid="self"):
    """The fields of /proc/PID/stat after the command name (index 0: the state, 1: the
    parent's pid, …; ``proc(5)``'s field k is index k - 3), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid):
    """The one-letter state of ``pid`` (R, S, D, T, t, Z …), None if gone."""
    fields = stat_fields(pid)
    return None if not fields else fields[0].decode()


def parent_of(pid):
    """The pid of ``pid``'s parent, None if gone."""
    fields = stat_fields(pid)
    return None if not fields or len(fields) < 2 else int(fields[1])
