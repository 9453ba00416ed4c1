"""Build kvport's sdist and wheels, and check the wheel as a new user installs it.

``python tests/packaging/wheelcheck.py dist PYTHON...`` (``make dist``): the sdist, then one wheel
per interpreter built *from the sdist* (a file missing from the sdist fails here), each with the
native kernels where gcc and xxhash.h exist; then the core install's size: the first interpreter's
wheel in a fresh venv, ``site-packages`` measured.

``python tests/packaging/wheelcheck.py check PYTHON...`` (``make wheelcheck``), per interpreter: a
fresh venv under build/wheelcheck/, ``pip install dist/kvport-*.whl`` (core only), then

* no torch, numba or transformers came with it, and ``kvport`` imports from the venv, not from src/;
* ``kvport serve`` starts (answers with its port) and drains on SIGTERM; ``kvport doctor`` runs;
* pytest, from the venv, runs tests/core_tests.txt against the installed package.

The interpreters are checked side by side (``--jobs``, 2 by default); each one's pytest output is
printed whole when it ends, and kept in build/wheelcheck/<tag>-pytest.log.

PYTHON is a version ("3.12": ``python3.12`` on PATH, else pyenv's newest 3.12.x) or a path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
WORK = ROOT / "build" / "wheelcheck"
HEAVY = ("torch", "numba", "llvmlite", "transformers", "vllm")
MiB = 1 << 20


_PRINT = threading.Lock()  # one interpreter's lines at a time


def say(msg: str) -> None:
    with _PRINT:
        print(f"wheelcheck: {msg}", flush=True)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """``cmd``, its output captured; on failure, that output and exit."""
    p = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if p.returncode != 0:
        sys.exit(f"wheelcheck: {' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return p


def find_python(want: str) -> str:
    """An interpreter for ``want`` (a version such as "3.12", or a path), checked by running it."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    cands = [want] if "/" in want else [
        shutil.which(f"python{want}") or "",
        *sorted((str(p) for p in pyenv.glob(f"{want}.*/bin/python{want}")), key=_version_key, reverse=True)]
    for c in filter(None, cands):
        p = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True)
        if p.returncode == 0 and ("/" in want or p.stdout.strip() == want):
            return c
    sys.exit(f"wheelcheck: no Python {want} here (python{want} on PATH, or pyenv's {pyenv}/{want}.*)")


def _version_key(path: str) -> tuple[int, ...]:
    ver = Path(path).parents[1].name
    return tuple(int(x) if x.isdigit() else 0 for x in ver.split("."))


def tag_of(python: str) -> str:
    return run([python, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"]).stdout.strip()


def wheel_for(python: str) -> Path:
    tag = tag_of(python)
    found = sorted(DIST.glob(f"kvport-*-{tag}-{tag}-*.whl"))
    if not found:
        sys.exit(f"wheelcheck: no {tag} wheel in {DIST}: run `make dist` first")
    return found[-1]


def build(pythons: list[str]) -> None:
    DIST.mkdir(exist_ok=True)
    for old in DIST.glob("kvport-*"):
        old.unlink()
    t0 = time.monotonic()
    run([sys.executable, "-m", "build", "--sdist", "--outdir", str(DIST), str(ROOT)])
    sdist = next(DIST.glob("kvport-*.tar.gz"))
    say(f"{sdist.name}: {sdist.stat().st_size / 1024:.0f} KiB ({time.monotonic() - t0:.1f} s)")
    for py in pythons:
        t0 = time.monotonic()
        run([py, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(DIST), str(sdist)])
        whl = wheel_for(py)
        names = zipfile.ZipFile(whl).namelist()
        native = [n for n in names if n.startswith("kvport/_memops") and n.endswith(".so")]
        say(f"{whl.name}: {whl.stat().st_size / 1024:.0f} KiB, native kernels "
            f"{'built' if native else 'not built (fallbacks)'} ({time.monotonic() - t0:.1f} s)")
        if len(native) > 1 or any(f"-{tag_of(py)[2:]}-" not in n for n in native):
            sys.exit(f"wheelcheck: {whl.name} carries native modules of another Python: {native}")


def fresh_venv(python: str, name: str) -> tuple[Path, Path]:
    """A new venv under build/wheelcheck/NAME: (its python, its site-packages)."""
    venv = WORK / name
    shutil.rmtree(venv, ignore_errors=True)
    run([python, "-m", "venv", str(venv)])
    vpy = venv / "bin" / "python"
    site = run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    return vpy, Path(site)


def install_core(python: str, name: str) -> tuple[Path, Path, float]:
    """The core wheel in a fresh venv: (python, site-packages, its size in MiB)."""
    vpy, site = fresh_venv(python, name)
    run([str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel_for(python))])
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file() and not f.is_symlink()) / MiB
    return vpy, site, size


def biggest(site: Path, n: int = 5) -> str:
    sizes: dict[str, int] = {}
    for f in site.rglob("*"):
        if f.is_file() and not f.is_symlink():
            top = f.relative_to(site).parts[0]
            sizes[top] = sizes.get(top, 0) + f.stat().st_size
    return ", ".join(f"{k} {v / MiB:.1f}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:n])


def size_report(python: str) -> None:
    t0 = time.monotonic()
    _, site, size = install_core(python, f"size-{tag_of(python)}")
    say(f"core install ({tag_of(python)}, pip install kvport, no extra): site-packages {size:.1f} MiB "
        f"(largest, MiB: {biggest(site)}) ({time.monotonic() - t0:.1f} s)")


def check_serve(vpy: Path) -> None:
    """``kvport serve`` on a free port answers with its port, and exits 0 on SIGTERM."""
    cmd = [str(vpy.parent / "kvport"), "serve", "--listen", "127.0.0.1:0", "--capacity", "1GiB", "--inflight", "64MiB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=WORK)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            sys.exit(f"wheelcheck: kvport serve did not start: {proc.communicate(timeout=10)[1]}")
        port = json.loads(line)["port"]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(30)
    if rc != 0:
        sys.exit(f"wheelcheck: kvport serve exited {rc} on SIGTERM")
    say(f"  kvport serve started on port {port} and drained on SIGTERM")


def check(python: str) -> dict[str, object]:
    tag = tag_of(python)
    t0 = time.monotonic()
    vpy, site, size = install_core(python, tag)
    probe = ("import importlib.util as u, json, kvport; "
             f"print(json.dumps([kvport.__file__, [m for m in {HEAVY!r} if u.find_spec(m)]]))")
    where, heavy = json.loads(run([str(vpy), "-c", probe], cwd=WORK).stdout)
    if heavy or not Path(where).is_relative_to(site):
        sys.exit(f"wheelcheck: {tag}: kvport from {where}, heavy packages installed: {heavy}")
    say(f"{tag}: core installed, {size:.1f} MiB, no {'/'.join(HEAVY)}; kvport from {Path(where).parent}")
    check_serve(vpy)
    doc = json.loads(run([str(vpy.parent / "kvport"), "doctor", "--json"], cwd=WORK).stdout)
    say("  kvport doctor: " + ", ".join(f"{c['name']} {c['status']}" for c in doc["checks"]
                                         if c["name"] in ("core", "native", "extra hf", "extra codecs")))
    run([str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{wheel_for(python)}[test]"])
    paths = [ln.strip() for ln in (ROOT / "tests" / "core_tests.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    report = WORK / f"{tag}-junit.xml"
    log = WORK / f"{tag}-pytest.log"
    t1 = time.monotonic()
    env = dict(os.environ, KVPORT_WHEELCHECK_SITE=str(site))
    with log.open("w") as out:  # the interpreters run side by side: each one's output whole, after it
        tests = subprocess.run([str(vpy), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                                f"--junitxml={report}", *paths], cwd=ROOT, env=env, check=False, stdout=out,
                               stderr=subprocess.STDOUT)
    with _PRINT:
        print(f"wheelcheck: {tag}: pytest's output ({log.relative_to(ROOT)})", flush=True)
        print(log.read_text(), end="", flush=True)
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    result = {"python": tag, "native": next(c["status"] for c in doc["checks"] if c["name"] == "native"),
              "site_packages_mib": round(size, 1), "tests_s": round(time.monotonic() - t1, 1),
              "total_s": round(time.monotonic() - t0, 1), **counts,
              "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}
    say(f"{tag}: {json.dumps(result)}")
    if tests.returncode != 0:
        sys.exit(f"wheelcheck: {tag}: core tests failed (exit {tests.returncode})")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["dist", "check"])
    ap.add_argument("pythons", nargs="+", help="versions (3.12) or interpreter paths")
    ap.add_argument("--jobs", type=int, default=2, help="check: interpreters checked at once (default 2)")
    args = ap.parse_args()
    pythons = [find_python(p) for p in args.pythons]
    WORK.mkdir(parents=True, exist_ok=True)
    if args.action == "dist":
        build(pythons)
        size_report(pythons[0])
        return
    # Side by side: the core tests wait on sockets, timeouts and child processes more than they compute
    # (about 0.6 of a core each), so two interpreters on two cores take the time of one.
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(check, pythons))
    for r in results:
        say(f"{r['python']}: {r['passed']} passed, {r['skipped']} skipped of {r['tests']} core tests in "
            f"{r['tests_s']} s; site-packages {r['site_packages_mib']} MiB; native {r['native']}; "
            f"{r['total_s']} s in all")


if __name__ == "__main__":
    main()
