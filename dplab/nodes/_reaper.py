"""The reaper: deletes a run's namespaces when its owner dies (``python …/_reaper.py DIR NAMES``).

A ``finally`` covers errors and Ctrl-C, but not a SIGKILLed caller or a restarted kernel. So each
:class:`dplab.nodes.Nodes` starts this small process in its own session, holding the read end of a
pipe whose only writer is the owner: when the owner exits by any means, the pipe reads EOF and
the reaper kills whatever runs in the namespaces, deletes them and the run folder DIR.
Namespaces the owner already deleted are simply absent, so the normal exit costs nothing. It
runs as a script, not with ``-m``, so that it imports only :mod:`netns` (the standard library),
not dplab and torch.
"""

from __future__ import annotations

import sys


def main() -> None:
    folder, names = sys.argv[1], sys.argv[2:]
    while sys.stdin.buffer.read(1):
        pass
    import shutil

    from netns import delete_netns, list_netns  # this folder is sys.path[0]

    present = set(list_netns())
    delete_netns([n for n in names if n in present])
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
