"""Import hygiene, capabilities report and the command line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ncdp_fast as nf

ROOT = Path(__file__).resolve().parent.parent


def _run(code, env_extra=None):
    import os
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


def test_import_needs_no_torch_cupy_or_gpu():
    # Block torch and cupy imports entirely: ncdp_fast and its CPU ops must still work.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'cupy'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np, ncdp_fast as nf\n"
        "r = nf.clip_and_noise(np.ones((2, 3)), max_norm=1.0, noise_multiplier=1.0, seed=1)\n"
        "info = nf.info(print_it=False)\n"
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules\n"
        "print('ok', r.grad.shape)\n")
    proc = _run(code, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert "ok (3,)" in proc.stdout


def test_info_reports_capabilities(capsys):
    report = nf.info()
    out = capsys.readouterr().out
    for key in ("version", "cuda_compiled", "cuda_archs", "cuda_devices", "numba_version",
                "numba_threads"):
        assert key in report and key in out
    assert report["version"] == nf.__version__
    assert report["native_module"], "ncdp_fast._C should be built by `make`"
    if report["cuda_compiled"]:
        assert report["cuda_archs"], "a CUDA build names its architectures"
    assert report["numba_threads"] >= 1


def test_cli_info():
    proc = _run("from ncdp_fast.cli import main; main(['info'])")
    assert proc.returncode == 0, proc.stderr
    assert "cuda_compiled" in proc.stdout


def test_cli_demo_small():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from ncdp_fast.demo import run_demo
    report = run_demo(epochs=3, seed=0, verbose=False)
    assert 0.0 <= report["accuracy_private"] <= 1.0
    assert report["accuracy_nonprivate"] > 0.8
    assert report["steps"] >= 1
    json.dumps(report)


def test_public_api():
    for name in ("gaussian", "clip_and_noise", "clip_and_noise_linear", "clip_and_noise_layers",
                 "info"):
        assert callable(getattr(nf, name))


def test_native_module_builds_without_cuda(tmp_path):
    """NCDP_DISABLE_CUDA=1 (or a machine without nvcc) must still build _C."""
    import os
    import shutil
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")
    ninja = shutil.which("ninja", path=str(Path(sys.executable).parent)) or shutil.which("ninja")
    if cmake is None:
        pytest.skip("cmake not available")
    import pybind11
    env = dict(os.environ, NCDP_DISABLE_CUDA="1")
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path), *gen,
                    f"-DPython_EXECUTABLE={sys.executable}",
                    f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True, env=env, timeout=600)
    subprocess.run([cmake, "--build", str(tmp_path), "-j2"], check=True, capture_output=True,
                   env=env, timeout=600)
    built = list(tmp_path.glob("_C*.so"))
    assert built, "no _C module produced"
    code = ("import sys; sys.path.insert(0, %r); import _C; "
            "print(_C.cuda_compiled(), repr(_C.cuda_archs()), hasattr(_C, 'launch_row_sq_norms'))"
            % str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "''", "False"]
