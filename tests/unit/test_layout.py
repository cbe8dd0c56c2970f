"""The house rules of the source tree, checked: a package per process with imports that
point one way, llama_cpp only in the engine, no module or function past its size.

Imports are read from the source with ``ast`` (every ``import`` and ``from ... import``,
at any depth, relative ones resolved), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "aotx"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module ``name`` imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_imports_point_one_way() -> None:
    """The gateway never imports device or engine code; the device never imports the
    gateway, nor an engine kind's package; the broker neither; the engine none of the
    three; only the engine imports llama_cpp and llguidance."""
    forbidden = {
        "aotx.gateway": ("aotx.device", "aotx.engine", "aotx.broker", "llama_cpp"),
        "aotx.broker": ("aotx.device", "aotx.engine", "aotx.gateway", "llama_cpp"),
        # the device knows the engines' contract (engine.interface, engine.load), not a kind
        "aotx.device": ("aotx.gateway", "aotx.broker", "llama_cpp", "aotx.engine.llama",
                        "aotx.engine.vllm"),
        "aotx.engine": ("aotx.gateway", "aotx.broker", "aotx.device"),
    }
    shared = ("aotx.wire", "aotx.ids", "aotx.mailbox", "aotx.client", "aotx.paths",
              "aotx.config", "aotx.cpuslice")
    seen = modules()
    bad = []
    for name, path in seen.items():
        found = imports(name, path)
        for package, banned in forbidden.items():
            if within(name, package):
                bad += [(name, m) for m in found if any(within(m, b) for b in banned)]
        if within(name, "aotx") and not within(name, "aotx.engine"):
            bad += [(name, m) for m in found if within(m, "llama_cpp") or within(m, "llguidance")]
        if any(within(name, s) for s in shared):  # what all processes share imports none of them
            bad += [(name, m) for m in found
                    if any(within(m, p) for p in forbidden if p != "aotx.engine")
                    or (within(m, "aotx.engine") and name != "aotx.engine")]
    assert not bad, bad
    assert any(within(m, "llama_cpp") for m in imports("aotx.engine.llama.engine",
                                                       seen["aotx.engine.llama.engine"]))


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: pathlib.Path) -> None:
    """The boundary test would catch a violation: an import inside a function, written
    relative to the package, is found and resolved."""
    src = tmp_path / "routes.py"
    src.write_text("def f():\n    from ..device import runtime\n    import llama_cpp\n")
    found = imports("aotx.gateway.routes", src)
    assert "aotx.device.runtime" in found and "llama_cpp" in found


def test_no_module_or_function_is_too_long() -> None:
    long_modules, long_functions = [], []
    for name, path in modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            long_modules.append((name, lines))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    long_functions.append((f"{name}.{node.name}", span))
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def test_the_process_packages_exist() -> None:
    for package in ("gateway", "broker", "device", "engine"):
        assert os.path.isfile(ROOT / package / "__init__.py"), package
    assert (ROOT / "wire" / "__init__.py").is_file() and not (ROOT / "wire.py").exists()


def test_a_vllm_only_device_never_imports_llama_cpp() -> None:
    """The device's modules and vLLM's engine package load without llama.cpp: a device
    that serves vLLM models alone (engine/load.py imports a kind when it loads one)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import aotx.device.runtime, aotx.engine.load, aotx.engine.vllm.load\n"
            "assert 'aotx.engine.vllm.load' in sys.modules\n"
            "print(sorted(m for m in sys.modules if m.startswith(('llama_cpp', 'aotx.engine.llama'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_benchmarks_start_what_they_measure_through_common() -> None:
    """bench/ is a package its scripts import (``python -m bench.NAME``): none edits
    sys.path, and only bench/common.py starts aotx or builds a LlamaEngine."""
    bench = ROOT.parent / "bench"
    assert (bench / "__init__.py").is_file()
    bad = []
    for path in sorted(bench.glob("*.py")):
        text = path.read_text()
        if "sys.path" in text:
            bad.append((path.name, "sys.path"))
        if path.name != "common.py" and ('"-m", "aotx"' in text or "LlamaEngine(" in text):
            bad.append((path.name, "its own launcher or engine"))
    assert not bad, bad
