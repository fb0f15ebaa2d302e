"""The ``ncdp-fast`` command: ``info``, ``demo``, ``bench``, ``gpu-check``, ``data``,
``reproduce``, ``release`` (one process or under ``torchrun -m ncdp_fast.cli release``),
``audit`` (one-run empirical epsilon lower bounds)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ._validate import (check_delta, check_nonneg, check_pos_int, check_positive, check_uint64,
                        cli_type)


def _cmd_info(args) -> int:
    from . import info
    info()
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo
    run_demo(epochs=args.epochs, noise_multiplier=args.noise_multiplier,
             max_grad_norm=args.max_grad_norm, batch_size=args.batch_size, delta=args.delta,
             seed=args.seed)
    return 0


# bench/test_bench_<name>.py, pytest-benchmark tests (bench/README.md).
BENCHES = ["clip", "linear", "mix", "ntk", "privacy", "train", "release", "finetune",
           "distributed_ntk", "distributed_dpsgd", "distributed_release", "tied", "hf", "noise",
           "conv", "norm", "bag"]
# Accounting only, gloo ranks on the CPU, or CPU targets: no GPU part.
CPU_ONLY_BENCHES = {"privacy", "distributed_ntk", "distributed_dpsgd", "distributed_release"}
GPU_BENCHES = [b for b in BENCHES if b not in CPU_ONLY_BENCHES]


def _bench_name(text: str) -> str:
    """A benchmark's name; its file names are accepted too (bench_mix.py, test_bench_mix.py)."""
    name = text.removesuffix(".py").removeprefix("test_").removeprefix("bench_")
    if name not in BENCHES:
        raise argparse.ArgumentTypeError(f"unknown benchmark {text!r} (one of "
                                         f"{', '.join(BENCHES)})")
    return name


def _cmd_bench(args) -> int:
    """Run the pytest-benchmark suite of bench/ (it lives in the source tree, next
    to the package, because it compares against peers a user installs separately)
    once per device, then write its tables (bench/report.py) into ``--out``."""
    import tempfile
    root = Path(__file__).resolve().parent.parent / "bench"
    if not (root / "conftest.py").is_file():
        print(f"ncdp-fast bench: no bench/ suite next to the package ({root}); run from a "
              "source checkout", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    from _common import cuda_missing
    from report import write_tables
    why = cuda_missing() if args.device != "cpu" else None
    if args.device == "cuda" and why:
        print(f"ncdp-fast bench: --device cuda: {why}", file=sys.stderr)
        return 2
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu"] + ([] if why else ["cuda"])}
    status = 0
    for dev in devices[args.device]:
        names = [n for n in (args.only or BENCHES) if dev == "cpu" or n not in CPU_ONLY_BENCHES]
        for n in set(args.only or ()) - set(names):
            print(f"ncdp-fast bench: {n} has no GPU part; skipped with --device {dev}",
                  file=sys.stderr)
        if not names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run_json = Path(tmp) / "run.json"
            cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                   *(str(root / f"test_bench_{n}.py") for n in names),
                   f"--bench-device={dev}", f"--bench-size={'quick' if args.quick else 'full'}",
                   f"--benchmark-json={run_json}"]
            if args.rounds:
                cmd.append(f"--bench-rounds={args.rounds}")
            print("$", " ".join(cmd), flush=True)
            rc = subprocess.call(cmd, cwd=root.parent)
            if rc:
                status = max(status, rc if rc > 0 else 1)      # < 0: killed by a signal
            if run_json.exists():
                write_tables(json.loads(run_json.read_text()), args.out)
            else:
                status = status or 1
    return status


def _cmd_gpu_check(args) -> int:
    from ._gpu_check import run
    return run(args.args)


def _cmd_data(args) -> int:
    from .datasets import fetch_main
    return int(fetch_main(args.args) or 0)


def _cmd_reproduce(args) -> int:
    from .reproduce import run
    return run(args.name, args.args)


def _add_release(sub) -> None:
    """``ncdp-fast release``: the NeuroMixGDP release of .npy files, in one process or
    under torchrun (its options and run: ncdp_fast/distributed/_cli.py)."""
    from .distributed._cli import add_release_parser
    add_release_parser(sub)


def _add_audit(sub) -> None:
    """``ncdp-fast audit``: one-run epsilon lower bounds (ncdp_fast/audit/_cli.py)."""
    from .audit._cli import add_audit_parser
    add_audit_parser(sub)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ncdp-fast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what this installation can do").set_defaults(fn=_cmd_info)
    demo = sub.add_parser("demo", help="private linear probe on scikit-learn's digits")
    demo.add_argument("--epochs", type=cli_type(int, check_pos_int), default=20)
    demo.add_argument("--noise-multiplier", type=cli_type(float, check_nonneg), default=3.0)
    demo.add_argument("--max-grad-norm", type=cli_type(float, check_positive), default=1.0)
    demo.add_argument("--batch-size", type=cli_type(int, check_pos_int), default=256,
                      help="expected (Poisson) batch size")
    demo.add_argument("--delta", type=cli_type(float, check_delta), default=1e-5)
    demo.add_argument("--seed", type=cli_type(int, check_uint64), default=None,
                      help="seed for data split, sampling and noise (default: from the OS); "
                      "the demo's data is public, so no key ledger is kept (unlike release)")
    demo.set_defaults(fn=_cmd_demo)
    bench = sub.add_parser("bench", help="run the benchmarks of bench/ against their peers "
                           "(pytest-benchmark) and write their tables (what `make bench` runs)")
    bench.add_argument("--out", default="bench/results")
    bench.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    bench.add_argument("--only", nargs="*", type=_bench_name, metavar="NAME",
                       help=f"some of {', '.join(BENCHES)} (bench/test_bench_<NAME>.py)")
    bench.add_argument("--device", default="all", choices=["cpu", "cuda", "all"],
                       help="cuda: the GPU benchmarks only, failing without a GPU "
                       "(reports *-gpu-<date>.{json,md})")
    bench.add_argument("--rounds", type=cli_type(int, check_pos_int), default=None,
                       help="interleaved rounds of the compared methods (default: 3)")
    bench.set_defaults(fn=_cmd_bench)
    # Its options (--full, --budget, --no-build, ...; --help) go to _gpu_check.run.
    sub.add_parser("gpu-check", add_help=False,
                   help="on a machine with an NVIDIA GPU: rebuild the extension for it, run the "
                   "GPU tests and the GPU benchmarks (what `make gpu-check` runs)"
                   ).set_defaults(fn=_cmd_gpu_check, args=[])
    data = sub.add_parser("data", help="fetch MNIST, Fashion-MNIST, the pretrained extractors and "
                          "the State of the Union text, and cache the images' features (what "
                          "`make data` runs)")
    data.set_defaults(fn=_cmd_data, args=[])             # its options go to the fetcher
    data.add_argument("--fetcher-help", action="store_true",
                      help="the fetcher's own options (--only, --extractors, --resolution, --force)")
    from .reproduce import REPRODUCTIONS
    rep = sub.add_parser("reproduce", help="reproduce a paper's experiments into bench/results/",
                         epilog="; ".join(f"{k}: {v[2]}" for k, v in REPRODUCTIONS.items()))
    rep.add_argument("name", choices=sorted(REPRODUCTIONS))
    rep.add_argument("args", nargs=argparse.REMAINDER, help="options of the reproduction (--help)")
    rep.set_defaults(fn=_cmd_reproduce)
    _add_release(sub)
    _add_audit(sub)
    args, extra = parser.parse_known_args(argv)
    if args.command == "data":
        # The fetcher parses its own options (argparse's REMAINDER cannot start
        # with an option, so they are passed on here instead).
        args.args = ["--help"] if args.fetcher_help else extra
    elif args.command == "gpu-check":
        args.args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.fn(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
