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
