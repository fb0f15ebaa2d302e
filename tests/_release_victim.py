"""A ``torchrun`` target for tests/test_distributed_release.py: ``ncdp-fast release``
(``ncdp_fast.cli.main`` on ``sys.argv[1:]``) in which rank ``$NCDP_TEST_KILL_RANK``
(RANK unset: one process, rank 0) sends itself ``$NCDP_TEST_SIGNAL`` (KILL, the
default, or TERM) while the release is being written:

* rank 0: right after it wrote the first streamed rows into ``--out``'s ``.part``
  files (it cannot clean up: the next run must);
* another rank: once rank 0's ``x.npy.part`` exists (same host), before it sends its
  rows (rank 0 must then remove its partial files on its own error path).

SIGKILL because it cannot be caught: nothing of the victim's own clean-up runs.
SIGTERM (what torchrun sends the surviving ranks) must run the command's clean-up.
"""
import os
import signal
import sys
import time
from pathlib import Path


def _die():
    os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("NCDP_TEST_SIGNAL", "KILL")))
    time.sleep(5)           # a caught SIGTERM raises in here


def main():
    victim = int(os.environ.get("NCDP_TEST_KILL_RANK", "-1"))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    if rank == victim:
        from ncdp_fast.distributed._sharded import ShardedRelease
        original = ShardedRelease._stream_rows

        def stream(self, dst, sink, chunk_rows):
            if rank == 0:
                def sink_then_die(*a):
                    sink(*a)
                    _die()
                return original(self, dst, sink_then_die, chunk_rows)
            deadline = time.monotonic() + 30
            while not (out / "x.npy.part").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            _die()
        ShardedRelease._stream_rows = stream
    from ncdp_fast.cli import main as cli
    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
