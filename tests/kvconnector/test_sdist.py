"""kvconnector's sdist is self-contained: it carries the C++ sources and headers of `_kvcopy`, and
builds and installs offline (`--no-deps`) into a fresh venv outside the workspace, where the
extension it compiled gives the same checksum as the workspace's own build."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from kvprotocol.kvsum import kvsum64

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "kvconnector"
UV = shutil.which("uv")


@pytest.mark.skipif(UV is None, reason="needs uv on PATH (.ci/run installs it)")
def test_the_sdist_builds_offline_in_a_fresh_venv(tmp_path: Path) -> None:
    assert UV is not None
    env = {**os.environ, "UV_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run([UV, "build", "--sdist", str(PACKAGE), "-o", str(tmp_path / "dist")], check=True, env=env)
    (sdist,) = (tmp_path / "dist").glob("kvconnector-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    wanted = {f"csrc/{p.name}" for p in (PACKAGE / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
    assert wanted and wanted <= names, sorted(wanted - names)

    venv = tmp_path / "venv"
    subprocess.run([UV, "venv", "-q", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    subprocess.run([UV, "pip", "install", "-q", "--no-deps", "--python", str(python), str(sdist)], check=True, env=env)
    # load the compiled module alone: the package's own imports (numpy, torch) are not installed here
    probe = (
        "import importlib.machinery, importlib.util, pathlib, sys, sysconfig\n"
        "so = next(pathlib.Path(sysconfig.get_paths()['platlib'], 'kvconnector').glob('_kvcopy*.so'))\n"
        "spec = importlib.util.spec_from_file_location('_kvcopy', so)\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "print(mod.checksum_bytes(bytes(range(256)) * 64))\n"
    )
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert int(out.stdout) == kvsum64(bytes(range(256)) * 64)
