"""Whether a run can make the files and folders it names, asked before any worker starts (the
command line's outputs, `plait data prepare`'s folder)."""

from __future__ import annotations

from pathlib import Path


def creatable(target: Path, ancestor: Path, folder: bool) -> str | None:
    """Create `target` (a file, or `folder`) and the folders between it and its existing
    `ancestor`, as a run will, then remove them; the system's reason where it cannot (root
    passes every access test, and /sys, /proc or a read-only mount still refuse)."""
    made = [p for p in [target, *target.parents] if p != ancestor and ancestor in p.parents]
    done = []
    try:
        for p in reversed(made):
            try:
                if p == target and not folder:
                    p.open("x").close()
                else:
                    p.mkdir()
            except FileExistsError:  # made meanwhile by another process (the job's other node
                continue  # checking the same path): creatable, and not ours to remove
            done.append(p)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        for p in reversed(done):
            p.unlink() if p == target and not folder else p.rmdir()
    return None
