"""The package, its entry points, the install rules, and the README's promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import specgguf
from specgguf import errors
from specgguf.llama.buildconfig import build_key, cmake_args, cpu_cmake_args, with_rpc

from .helpers import ROOT, run_cli

AMX_XEON = frozenset(
    [
        "sse4_2",
        "avx",
        "avx2",
        "bmi2",
        "fma",
        "f16c",
        "avx512f",
        "avx512vbmi",
        "avx512_vnni",
        "avx512_bf16",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
    ]
)


def test_version_prints_package_and_llama_cpp_build() -> None:
    res = run_cli("--version")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    assert lines[0] == f"specgguf {specgguf.__version__}"
    assert re.match(r"llama-cpp-python \d+\.\d+\.\d+, ggml \S+", lines[1]), lines
    assert "backends: CPU" in lines[1]
    assert res.stderr == b""


def test_python_dash_m_and_console_script_agree() -> None:
    script = Path(sys.executable).parent / "specgguf"
    assert script.is_file(), "the specgguf console script is not installed next to python"
    res = subprocess.run([str(script), "--version"], capture_output=True, check=False)
    assert res.returncode == 0
    assert res.stdout == run_cli("--version").stdout


def test_doctor_smoke_test_generates_tokens() -> None:
    res = run_cli("doctor", "--json")
    assert res.returncode == 0, res.stderr.decode()
    rep = json.loads(res.stdout)
    assert rep["smoke_test"]["ok"] is True
    assert rep["smoke_test"]["tokens"] == 8
    assert "CPU" in rep["backends"]
    assert rep["llama_cpp_python"].startswith("0.3.")
    # the lookup drafters' indexes: compiled at install (setup.py) where a C compiler was
    # found (CI requires it), else in pure Python, as SPECGGUF_PURE_PYTHON asks too
    pure = os.environ.get("SPECGGUF_PURE_PYTHON", "") not in ("", "0")
    assert rep["lookup_indexes"] in ("compiled", "pure Python")
    if pure:
        assert rep["lookup_indexes"] == "pure Python"
    elif os.environ.get("SPECGGUF_REQUIRE_COMPILED"):
        assert rep["lookup_indexes"] == "compiled"


def test_unknown_command_is_a_usage_error_on_stderr() -> None:
    res = run_cli("no-such-command")
    assert res.returncode == errors.EXIT_USAGE
    assert res.stdout == b""
    assert b"No such command" in res.stderr


def test_cmake_args_leave_amx_out_on_amx_cpus_only() -> None:
    args = cpu_cmake_args(AMX_XEON, "x86_64")
    assert "-DGGML_NATIVE=OFF" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_BF16=ON" in args
    assert "-DGGML_AVX_VNNI=OFF" in args  # not in the flag set above
    # No AMX, or not x86: the native build stays.
    assert cpu_cmake_args(AMX_XEON - {"amx_int8"}, "x86_64") == []
    assert cpu_cmake_args(frozenset({"asimd", "sve"}), "aarch64") == []


def test_cmake_args_per_backend_and_build_key() -> None:
    assert cmake_args("cuda", frozenset(), "x86_64")[0] == "-DGGML_CUDA=on"
    assert cmake_args("rocm", frozenset(), "x86_64")[0] == "-DGGML_HIP=on"
    assert cmake_args("metal", frozenset(), "arm64")[0] == "-DGGML_METAL=on"
    cuda_amx = cmake_args("cuda", AMX_XEON, "x86_64")
    assert "-DGGML_CUDA=on" in cuda_amx and "-DGGML_AMX_INT8=OFF" in cuda_amx
    with pytest.raises(ValueError, match="unknown backend"):
        cmake_args("opencl", frozenset())
    assert build_key("0.3.36", "-DA=1") != build_key("0.3.36", "-DA=2")
    assert build_key("0.3.36", "-DA=1") == build_key("0.3.36", "-DA=1")


def test_every_build_has_the_rpc_backend() -> None:
    for backend in ("cpu", "cuda", "metal", "rocm", "vulkan"):
        for flags in (frozenset(), AMX_XEON):
            assert cmake_args(backend, flags, "x86_64").count("-DGGML_RPC=ON") == 1
    # A user's CMAKE_ARGS gets it too, unless it says otherwise.
    assert with_rpc("-DGGML_CUDA=on") == "-DGGML_CUDA=on -DGGML_RPC=ON"
    assert with_rpc("") == "-DGGML_RPC=ON"
    assert with_rpc("-DGGML_RPC=OFF -DGGML_CUDA=on") == "-DGGML_RPC=OFF -DGGML_CUDA=on"


def test_install_script_builds_a_version_inside_the_declared_range() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dep = next(d for d in meta["project"]["dependencies"] if d.startswith("llama-cpp-python"))
    lo, hi = re.findall(r">=([\d.]+),<([\d.]+)", dep)[0]
    pinned = re.search(
        r'LLAMA_CPP_PYTHON_VERSION = "([\d.]+)"', (ROOT / "scripts/install").read_text()
    )
    assert pinned is not None

    def v(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split("."))

    assert v(lo) <= v(pinned[1]) < v(hi)


def test_readme_exit_code_table_matches_errors_module() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- exit-codes -->")[1].split("<!-- /exit-codes -->")[0]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", block, re.M)}
    # 0 (success) is not an error; every code the module defines is documented.
    defined = {0} | {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert documented == defined
    # Every error class maps to a documented code.
    classes = [c for c in vars(errors).values() if isinstance(c, type)]
    for cls in classes:
        if issubclass(cls, errors.SpecggufError):
            assert cls.exit_code in documented, cls


def test_readme_states_exactly_two_fenced_fresh_machine_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    for tag in ("main-command", "test-command"):
        block = readme.split(f"<!-- {tag} -->")[1].split(f"<!-- /{tag} -->")[0]
        lines = [ln for ln in block.strip().splitlines() if not ln.startswith("```")]
        assert len(lines) == 1, (tag, lines)
        assert lines[0].startswith("scripts/install")
