"""``ncdp-fast audit``: the table, --json and --out (small sizes, fixed seeds)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from ncdp_fast.cli import main  # noqa: E402


def test_audit_command_json_and_report(tmp_path, capsys):
    argv = ["audit", "--only", "dpsgd", "--canaries", "40", "--seeds", "1", "--seed", "5",
            "--epsilon", "2"]
    assert main(argv + ["--json", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["config"] for r in rows] == [
        "dpsgd dirac, q=1, each step", "dpsgd dirac, q=1/4, each step",
        "dpsgd dirac, q=1/4, final model", "dpsgd input-space, q=1, each step"]
    for r in rows:
        assert r["canaries"] == 40 and r["seeds"] == 1 and len(r["lower_bound_runs"]) == 1
        assert r["epsilon_claimed"] <= 2.0
        assert all(0 <= b < r["epsilon_claimed"] for b in r["lower_bound_runs"])
    (js,) = tmp_path.glob("audit-cpu-*.json")
    meta = json.loads(js.read_text())["meta"]
    assert {"device", "commit", "date"} <= set(meta)
    md = js.with_suffix(".md").read_text()
    assert "eps lower bound mu-GDP" in md and "dpsgd dirac, q=1, each step" in md


def test_audit_command_refuses_unknown_audit(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--only", "nothing"])
    assert "--only" in capsys.readouterr().err


@pytest.mark.parametrize("argv, shown", [
    (["demo", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
    (["demo", "--seed", "-1"], "argument --seed: expected an integer in [0, 2**64), got -1"),
    (["demo", "--epochs", "-1"], "argument --epochs: expected an integer >= 1, got -1"),
    (["demo", "--delta", "1"], "argument --delta: expected a number in (0, 1), got 1.0"),
    (["audit", "--seeds", "0"], "argument --seeds: expected an integer >= 1, got 0"),
    (["audit", "--confidence", "1.5"], "argument --confidence: expected a number in (0, 1)"),
    (["bench", "--rounds", "0"], "argument --rounds: expected an integer >= 1, got 0"),
])
def test_bad_command_line_numbers_are_usage_errors_naming_the_option(argv, shown, capsys):
    """The sixth audit: demo --batch-size 0 was a ZeroDivisionError traceback,
    --seed -1 NumPy's, audit --seeds 0 a reduction over an empty array; each is
    argparse's usage error now (exit 2), before anything runs."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and shown in capsys.readouterr().err


def test_audit_out_that_is_a_file_is_refused_before_the_runs(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["audit", "--seeds", "1", "--out", str(tmp_path / "f")]) == 2
    assert "--out: expected a directory" in capsys.readouterr().err
