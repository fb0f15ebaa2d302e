"""``ncdp-fast release``: the NeuroMixGDP release of .npy files, in one process or
under ``torchrun --nproc-per-node N`` (gloo), with the same result either way.

Each process memory-maps the features file and reads only its contiguous shard of
rows (``shard_bounds``); the labels (n integers) are read by every process.  Before
any work every rank opens its inputs and rank 0 checks and locks ``--out``; one
exchange stops every rank if any of them failed.  The release is written by rank 0
into the directory ``--out`` as ``x.npy`` (T, d) and ``y.npy`` (T, K) in row order,
``report.json`` (metadata and privacy report; never the seed) and ``manifest.json``
(each file's size and SHA-256, and an HMAC with ``--hmac-key-file``), all as
``*.part`` files renamed when complete; a failure on any rank (SIGTERM included)
removes them.  ``ncdp_fast.release.load(DIR)`` reads and verifies the directory.
Progress goes to stderr (rank 0).  Under torchrun the process group is initialised
from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with
``--timeout`` seconds for every collective, so a lost rank is an error, not a hang.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["add_release_parser", "run_release"]

EXAMPLES = """\
examples:
  one process:
    ncdp-fast release --features X.npy --labels y.npy --num-classes 10 \\
        --epsilon 1 --delta 1e-5 --out rel
  4 processes on this machine (gloo; the same release, up to float rounding of x):
    torchrun --standalone --nproc-per-node 4 -m ncdp_fast.cli release \\
        --features X.npy --labels y.npy --num-classes 10 --epsilon 1 --delta 1e-5 --out rel
  2 machines: torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m ncdp_fast.cli release ...  (each machine needs the
        features and labels files; --out is written on the machine of rank 0)
  read it:
    python -c "import ncdp_fast.release as r; rel = r.load('rel'); print(rel.x.shape, rel.epsilon)"

exit status: 0 released; 2 refused or failed (one line per rank on stderr saying why);
143 stopped by SIGTERM (what torchrun sends the other ranks when one fails).
"""


def add_release_parser(sub) -> None:
    """Register the ``release`` subcommand on an argparse subparsers object."""
    p = sub.add_parser("release", help="NeuroMixGDP private release of a features .npy "
                       "into a directory (one process, or under torchrun --nproc-per-node N; "
                       "same result)",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", required=True,
                   help="(n, d) float32/float64 .npy file (private; not .npz)")
    p.add_argument("--labels", required=True,
                   help="(n,) integer .npy file of class ids in [0, K) (private)")
    p.add_argument("--num-classes", type=int, required=True, help="K, public")
    p.add_argument("--epsilon", type=float, required=True,
                   help="target epsilon of the whole release (the noise is calibrated to it)")
    p.add_argument("--delta", type=float, required=True,
                   help="target delta, in (0, 1); typically below 1/n")
    p.add_argument("--mixup-degree", default="auto",
                   help="m (a number >= 1) or 'auto' (Section 3.2's optimal degree)")
    p.add_argument("--num-samples", type=int, default=None, help="T released rows (default n)")
    p.add_argument("--hierarchical-classes", type=float, default=None,
                   help="c: hierarchical sampling with class rate c/K (default: Poisson)")
    p.add_argument("--lam", type=float, default=1.0, help="sigma_y / sigma_x")
    p.add_argument("--clip-x", type=float, default=1.0,
                   help="C_x: each feature row is scaled to L2 norm <= C_x before mixing "
                   "(test features must be clipped the same way)")
    p.add_argument("--clip-y", type=float, default=1.0,
                   help="C_y: the one-hot labels' clip bound")
    p.add_argument("--accountant", choices=["pld", "clt"], default="pld",
                   help="how the noise is calibrated: pld (so that the rigorous PLD bound meets "
                   "--epsilon) or clt (the paper's central-limit approximation, which can "
                   "underestimate epsilon)")
    p.add_argument("--pld-interval", type=float, default=None,
                   help="PLD accountant's grid step in nats (default 1e-4; coarser is faster "
                   "and more pessimistic)")
    p.add_argument("--seed", type=int, default=None,
                   help="noise key: SECRET (with it and the output anyone can solve for the "
                   "private rows) and SINGLE-USE: each run takes a fresh range of its stream, "
                   "recorded in the key ledger ($NCDP_FAST_LEDGER_DIR, else "
                   "$XDG_CACHE_HOME/ncdp_fast/key-ledger or ~/.cache/ncdp_fast/key-ledger; "
                   "a salted scrypt tag of the key and the used ranges, never the key). "
                   "Default: from the OS on rank 0, used once and not recorded")
    p.add_argument("--offset", type=int, default=None,
                   help="first draw of --seed's stream (default: the next range no earlier run "
                   "recorded); a range an earlier run used is refused")
    p.add_argument("--out", required=True,
                   help="output directory (created if absent; written by rank 0): x.npy, "
                   "y.npy, report.json, manifest.json")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a release already in --out (without it, one there is refused "
                   "on every rank before any work)")
    p.add_argument("--hmac-key-file", default=None, metavar="FILE",
                   help="a file whose bytes (at least 16) are the publisher's secret: the "
                   "manifest then carries an HMAC-SHA256 that ncdp_fast.release.load(DIR, "
                   "key=...) verifies. Read by rank 0 only; keep it apart from the release")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds (> 0) a collective may wait before failing (distributed runs)")
    p.add_argument("--chunk-mb", type=float, default=32.0,
                   help="bound (> 0) on one round's partial-sum buffer and on one chunk "
                   "streamed to rank 0 (MiB)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(fn=run_release)


def _mixup(text):
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"ncdp-fast release: --mixup-degree: expected a number >= 1 or "
                         f"'auto', got {text!r}") from None


def _init_group(timeout: float):
    """The default gloo group when launched by torchrun (env vars), else None."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    import datetime
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if local > 1 and "NUMBA_NUM_THREADS" not in os.environ:
        import numba       # share the cores among the processes of this node
        numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS,
                                         (os.cpu_count() or 1) // local)))
    return dist.group.WORLD


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled, self.t0, self.last = enabled, time.monotonic(), 0.0

    def __call__(self, done, total):
        now = time.monotonic()
        if self.enabled and (now - self.last >= 1.0 or done == total):
            self.last = now
            pct = 100.0 * done / total if total else 100.0
            _say(f"ncdp-fast release: rank 0 rows {done}/{total} ({pct:.0f}%), "
                 f"{now - self.t0:.1f} s")


def _ledger_offset(args, kw, d, n, group, rank):
    """The first draw of ``--seed``'s stream this run may use: rank 0 reserves it in
    the key ledger (``ncdp_fast._key_ledger``) and sends it to the other ranks, or
    sends its refusal so that every rank stops.  None without ``--seed``."""
    if args.seed is None:
        if args.offset is not None:
            raise ValueError(f"--offset: expected it only with --seed (a key from the OS is "
                             f"used once, from draw 0), got --offset {args.offset}")
        return None
    payload = None
    if rank == 0:
        from .._key_ledger import claim_range
        from ..release.mechanism import NeuroMixGDP
        from ._release import noise_draws
        try:
            draws = noise_draws(NeuroMixGDP(**kw, seed=args.seed, offset=0), n, d, args.num_classes)
            payload = ("ok", claim_range(args.seed, draws, args.offset))
        except (ValueError, TypeError, OSError) as e:
            payload = ("error", str(e))
        if payload[0] == "ok" and not args.quiet:
            _say(f"ncdp-fast release: --seed's draws [{payload[1]}, {payload[1] + draws}) "
                 "reserved in the key ledger")
    if group is not None:
        import torch.distributed as dist
        box = [payload]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        payload = box[0]
    if payload[0] == "error":
        raise ValueError(payload[1] if rank == 0 else f"rank 0: {payload[1]}")
    return payload[1]


class _Terminated(BaseException):
    """SIGTERM (what torchrun sends the other ranks when one fails) as an exception,
    so that the error paths run instead of the process vanishing."""


def _on_sigterm(signum, frame):
    import signal

    from ..release._directory import abort_all
    signal.signal(signum, signal.SIG_IGN)     # one is enough; let the clean-up finish
    abort_all()         # first, in case the exception lands inside another clean-up
    raise _Terminated()


def _sigterm_handler():
    """Install :func:`_on_sigterm`; returns the previous handler (None: not installed,
    as off the main thread, where Python allows no signal handler)."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def _check_args(args):
    """What needs no file and no peer: refused on every rank before the group starts."""
    from .._validate import check_positive
    t = check_positive(args.timeout, "--timeout")
    if t > 1e9:
        raise ValueError(f"--timeout: expected seconds in (0, 1e9], got {args.timeout!r}")
    check_positive(args.chunk_mb, "--chunk-mb")
    if args.pld_interval is not None:
        check_positive(args.pld_interval, "--pld-interval")


def _open_npy(path, option, mode):
    """The array of a .npy file (a memory map), or a ValueError naming ``option``."""
    import numpy as np
    try:
        a = np.load(path, mmap_mode=mode, allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"{option}: {path}: no such file") from None
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{option}: {path}: not a readable .npy file ({e})") from None
    if not isinstance(a, np.ndarray):           # an .npz archive
        names = ", ".join(a.files)
        a.close()
        raise ValueError(f"{option}: expected a .npy file holding one array, got an .npz "
                         f"archive ({names}) in {path}; write that array alone with "
                         "numpy.save")
    return a


def _read_key(path):
    if path is None:
        return None
    from ..release.released import _check_key
    try:
        with open(path, "rb") as f:
            key = f.read()
    except OSError as e:
        raise ValueError(f"--hmac-key-file: cannot read {path} ({e.strerror})") from None
    if len(key) < 16:
        raise ValueError(f"--hmac-key-file: expected a secret of at least 16 bytes, got "
                         f"{len(key)} bytes in {path}")
    return _check_key(key)


def _preflight(args, group, rank):
    """Every rank opens its inputs and rank 0 checks and locks ``--out`` and reads the
    key; one exchange then stops every rank, before any work, if one of them failed
    (each says which rank and why).  Returns (features, labels, writer, key)."""
    from ..release._directory import DirectoryWriter
    from ._group import check_same_config
    err, feats, labels, writer, key = None, None, None, None, None
    try:
        # A private copy-on-write map: pages are read from the file on first use and
        # never written, and numba sees a writable array (the kernels' compiled
        # signature, instead of a second one for read-only arrays).
        feats = _open_npy(args.features, "--features", "c")
        labels = _open_npy(args.labels, "--labels", "r")
        if feats.ndim != 2:
            raise ValueError(f"--features: expected an (n, d) array, got shape {feats.shape}")
        if rank == 0:
            key = _read_key(args.hmac_key_file)
            writer = DirectoryWriter(args.out, overwrite=args.overwrite, name="--out",
                                     overwrite_hint="--overwrite").open()
            for line in writer.notes:       # not progress: said even with --quiet
                _say(f"ncdp-fast release: {line}")
    except (ValueError, TypeError, OSError) as e:
        err = e
    try:
        check_same_config({}, group, "ncdp-fast release", error=err)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return feats, labels, writer, key


def _say(line: str) -> None:
    """One line on stderr in one write: under torchrun the ranks share one pipe,
    and print's separate write of the newline let another rank's line land in
    the middle; a single write of at most PIPE_BUF bytes is never interleaved."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _rank_world_env():
    """(rank, world) as torchrun set them, for messages before the group exists."""
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def run_release(args) -> int:
    import numpy as np

    from ..release.mechanism import NeuroMixGDP
    from ._group import rank_world, shard_bounds
    from ._release import release_sharded
    rank, world = _rank_world_env()
    try:
        _check_args(args)
    except (ValueError, TypeError) as e:
        _say(f"ncdp-fast release: rank {rank} of {world}: error: {e}")
        return 2
    group = _init_group(args.timeout)
    rank, world = rank_world(group)
    previous = _sigterm_handler()
    writer = None
    try:
        feats, labels, writer, key = _preflight(args, group, rank)
        lo, hi = shard_bounds(feats.shape[0], rank, world)
        kw = dict(epsilon=args.epsilon, delta=args.delta, mixup_degree=_mixup(args.mixup_degree),
                  num_samples=args.num_samples, lam=args.lam, clip_x=args.clip_x,
                  clip_y=args.clip_y, hierarchical_classes=args.hierarchical_classes,
                  accountant=args.accountant)
        offset = _ledger_offset(args, kw, feats.shape[1], labels.shape[0] if labels.ndim else 0,
                                group, rank)
        mech = NeuroMixGDP(**kw, seed=args.seed, offset=offset)
        if args.pld_interval is not None:
            mech.value_discretization_interval = float(args.pld_interval)
        if rank == 0 and not args.quiet:
            _say(f"ncdp-fast release: {feats.shape[0]} rows x {feats.shape[1]} on {world} "
                 f"process(es); this rank holds rows [{lo}, {hi})")
        res = release_sharded(mech, feats[lo:hi], np.asarray(labels),
                              num_classes=args.num_classes, group=group,
                              chunk_bytes=int(args.chunk_mb * 2**20),
                              progress=_Progress(rank == 0 and not args.quiet))
        if rank == 0 and not args.quiet:
            st = res.stats
            _say(f"ncdp-fast release: config exchange {st['check_s']:.1f} s, accounting (rank 0) "
                 f"{st['accounting_s']:.1f} s, {st['rounds']} round(s) {st['rounds_s']:.1f} s "
                 f"(of which in reduce-scatter {st['reduce_scatter_s']:.1f} s); writing "
                 f"{args.out}")
        out = res.write(args.out, writer, key=key, chunk_bytes=int(args.chunk_mb * 2**20))
    except (ValueError, TypeError, OSError, RuntimeError) as e:   # gloo errors are RuntimeError
        _say(f"ncdp-fast release: rank {rank} of {world}: error: "
             f"{str(e).removeprefix('ncdp-fast release: ')}")
        return 2
    except _Terminated:
        _say(f"ncdp-fast release: rank {rank} of {world}: stopped by SIGTERM (torchrun "
             "stops the other ranks when one fails)" + ("; partial output removed"
                                                         if rank == 0 else ""))
        return 128 + 15
    finally:
        if writer is not None:
            writer.abort()          # nothing left to do after a commit; else the .part files
        if previous is not None:
            import signal
            signal.signal(signal.SIGTERM, previous)
        if group is not None:
            import torch.distributed as dist
            dist.destroy_process_group()
    if rank == 0:
        r = res.report
        print(f"released T = {res.num_samples} rows (m = {res.mixup_degree:g}, sigma = "
              f"{r.noise_multiplier:.6g}; epsilon = {r.epsilon_pld:.4g} (PLD), delta = "
              f"{r.delta:g}) to {out}/ (x.npy, y.npy, report.json, manifest.json; read it "
              f"with ncdp_fast.release.load)")
    return 0
