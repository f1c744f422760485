"""Test, lint and type-check sessions for the ups monorepo.

``nox`` runs them all: one session per distribution (it installs that distribution and what it
declares, then runs its own tests), the cross-package tests and type-check, lint, the plugins
and the docs, and a summary of every test run. torch is pinned to the release CI uses; users' ranges stay open.

A session that passes deletes its virtualenv (each holds its own torch, about 1.2 GB, and
sessions are not reused by default); set ``UPS_KEEP_VENVS=1`` to keep them, e.g. for ``nox -r``.
"""

from __future__ import annotations

import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
REPORTS = ROOT / ".nox-reports"
TORCH = "torch==2.13.0"
TORCH_INDEX = os.environ.get("UPS_TORCH_INDEX", "https://download.pytorch.org/whl/cu128")
"""Where ``nox -s gpu`` and ``nox -s bench_gpu`` get :data:`TORCH` built for CUDA: PyTorch's
own index of CUDA 12.8 wheels, unless ``UPS_TORCH_INDEX`` names another (``.../whl/cu126``
for an older driver, ``https://pypi.org/simple`` for PyPI's wheel, which is CUDA 12 too)."""
PACKAGES = {
    "core": "ups-dist-core",
    "samplers": "ups-samplers",
    "ckpt": "ups-ckpt",
    "comm_hooks": "ups-comm-hooks",
    "cloud": "ups-cloud",
    "fsdp": "ups-fsdp",
}
PLUGINS = ("ups-blocks", "ups-tensorboard", "ups-optuna", "ups-mlflow", "ups-wandb")
"""The plugins of plugins/, written as a third party would write them."""
TOOLS = {"ruff": "ruff==0.17.6", "mypy": "mypy==2.4.1"}
DOCS = ("mkdocs", "mkdocs-material")
DOCS_TESTS = (
    "tests/test_docs_code.py",
    "tests/test_docs_hooks.py",
    "tests/test_docs_config.py",
    "tests/test_docs_claims.py",
)
WITH_PLUGINS = ("tests/test_e2e_cli_imports.py",)
"""Cross-package tests that need every plugin of plugins/ installed too: run in ``test-plugins``."""
CONSTRAINTS = ROOT / "constraints-ci.txt"
"""Exact versions of the S3 test stack, which pip's resolver otherwise backtracks through."""

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = [
    *(f"test-{p}" for p in PACKAGES),
    "integration",
    "lint",
    "test-plugins",
    "summary",
]

GUARD = """
import importlib, pathlib, sys
root = pathlib.Path(sys.argv[1]).resolve()
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    where = pathlib.Path(module.__file__).resolve()
    assert root in where.parents, f"{name} is imported from {where}, not from the tree {root}"
"""


def requirements(distribution: str) -> list[str]:
    """What a distribution declares (dependencies and its test extra), less the ups ones."""
    project = tomllib.loads((ROOT / "packages" / distribution / "pyproject.toml").read_text())[
        "project"
    ]
    declared = project["dependencies"] + project.get("optional-dependencies", {}).get("test", [])
    return [r for r in declared if not r.startswith("ups-")]


def install(session: nox.Session, *short_names: str) -> None:
    """Install distributions from the tree (editable) and what they declare, then check that
    their modules are imported from the tree, never from a stale installed copy."""
    dists = [PACKAGES[n] for n in short_names]
    needs = sorted({r for d in dists for r in requirements(d)})
    session.install("-c", str(CONSTRAINTS), TORCH, *(r for r in needs if not r.startswith("torch")))
    # --no-deps: each plugin package's ups-dist-core requirement names the tree's copy, which
    # is already here, editable.
    session.install("--no-deps", *(arg for d in dists for arg in ("-e", f"packages/{d}")))
    modules = [f"ups.{n}" for n in short_names]
    session.run("python", "-c", GUARD, str(ROOT), *modules)


def discard(session: nox.Session) -> None:
    """Delete a session's virtualenv once it has passed, unless ``UPS_KEEP_VENVS`` is set."""
    if not os.environ.get("UPS_KEEP_VENVS"):
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def pytest(session: nox.Session, name: str, *paths: str) -> None:
    REPORTS.mkdir(exist_ok=True)
    session.run(
        "python",
        "-m",
        "pytest",
        "-c",
        "pyproject.toml",
        f"--junitxml={REPORTS / name}.xml",
        *paths,
        *session.posargs,
    )


def _package_session(short: str) -> None:
    @nox.session(name=f"test-{short}")
    def tests(session: nox.Session) -> None:
        """Install this distribution with what it declares (and ups-dist-core); run its tests."""
        install(session, *dict.fromkeys(["core", short]))
        pytest(session, f"test-{short}", f"packages/{PACKAGES[short]}/tests")
        discard(session)


for _short in PACKAGES:
    _package_session(_short)


@nox.session
def integration(session: nox.Session) -> None:
    """Every distribution together: end-to-end runs of the CLI, the example, third-party
    plugins (the docs' tests, which need the plugins of plugins/ too, run in ``test-plugins``);
    then mypy --strict over every distribution's sources, in the same environment. h5py is
    what the neural-operator example (examples/pde_operator) reads its data with."""
    install(session, *PACKAGES)
    session.install("-c", str(CONSTRAINTS), "h5py")
    # tests/gpu is the GPU suite (nox -s gpu); tests/test_gpu_suite.py checks here that it
    # collects and skips every test for "no CUDA device".
    ignored = (*DOCS_TESTS, *WITH_PLUGINS, "tests/gpu")
    pytest(session, "integration", "tests", *(f"--ignore={t}" for t in ignored))
    session.install(TOOLS["mypy"], "types-PyYAML", "types-tqdm")
    session.run("mypy", *(f"packages/{d}/src" for d in PACKAGES.values()))
    discard(session)


CUDA_INFO = """
import torch
devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}: {devices or 'no CUDA device'}")
"""


def install_for_cuda(session: nox.Session, *short_names: str) -> None:
    """Install :data:`TORCH` built for CUDA (from :data:`TORCH_INDEX`), then the distributions
    as :func:`install` does (the CUDA build satisfies their torch requirement), and h5py for
    the operator example; print what torch sees."""
    session.install("--index-url", TORCH_INDEX, TORCH)
    install(session, *short_names)
    session.install("-c", str(CONSTRAINTS), "h5py")
    session.run("python", "-c", CUDA_INFO)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """The GPU suite, tests/gpu, on this machine's CUDA device(s): both examples in bf16 and
    fp16, resumed bitwise; a real out-of-memory error skipped; NCCL and every comm hook;
    pinned memory with workers; ``ups tune``, MFU and the profiler; ``torch.compile``
    (docs/gpu.md). Not a default session: ``nox -s gpu``. Without a CUDA device every test is
    skipped for "no CUDA device", and the skips are listed."""
    install_for_cuda(session, *PACKAGES)
    pytest(session, "gpu", "-m", "gpu", "tests/gpu", "-rs")
    discard(session)


@nox.session(name="test-plugins")
def test_plugins(session: nox.Session) -> None:
    """The plugins, installed from their folders with pip as a user installs them (not
    editable), with every distribution of packages/ (the docs select their plugins): the
    plugins' tests, their types, the docs' tests, the commands that do not train importing no
    torch, and the site built with ``mkdocs --strict``."""
    session.install(
        "-c",
        str(CONSTRAINTS),
        TORCH,
        "pytest>=8",
        "hypothesis>=6.100",
        TOOLS["mypy"],
        "types-PyYAML",
        *DOCS,
    )
    session.install(
        "-c",
        str(CONSTRAINTS),
        *(f"./packages/{d}" for d in PACKAGES.values()),
        *(f"./plugins/{p}" for p in PLUGINS),
    )
    session.run("ups", "plugins")
    tests = (*(f"plugins/{p}/tests" for p in PLUGINS), *DOCS_TESTS, *WITH_PLUGINS)
    pytest(session, "test-plugins", *tests)
    session.run("mypy", *(f"plugins/{p}/src" for p in PLUGINS))
    session.run(
        "mkdocs", "build", "--strict", "--site-dir", str(Path(session.create_tmp()) / "site")
    )
    discard(session)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install(TOOLS["ruff"])
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    discard(session)


@nox.session(python=False)
def summary(session: nox.Session) -> None:
    """Add up the test sessions' JUnit reports into one closing line."""
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    reports = sorted(REPORTS.glob("*.xml"))
    for report in reports:
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    print(f"{len(reports)} reports")
    print(f"total: {passed} passed, {failed} failed, {totals['skipped']} skipped")
    if failed or not reports:
        session.error("some tests failed" if failed else "no test reports found")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Benchmark the engine against a hand-written DDP loop (2 local CPU ranks, gloo);
    see docs/benchmarks.md. Not a default session: ``nox -s bench``."""
    install(session, "core")
    session.run("python", "benchmarks/bench_engine.py", *session.posargs)


@nox.session(name="bench_ema", default=False)
def bench_ema(session: nox.Session) -> None:
    """Benchmark the EMA of the weights (``training.ema``, every step) in one process against
    the same steps without it, and ``EMA.update`` against a Python loop of ``lerp_``; see
    docs/benchmarks.md. Not a default session: ``nox -s bench_ema``."""
    install(session, "core")
    session.install("-c", str(CONSTRAINTS), "h5py")  # the operator example's FNO imports it
    session.run("python", "benchmarks/bench_ema.py", *session.posargs)


@nox.session(name="bench_guard", default=False)
def bench_guard(session: nox.Session) -> None:
    """Benchmark the training guard (``training.guard``) in one process against the same run
    without it, and its added work alone; see docs/benchmarks.md. Not a default session:
    ``nox -s bench_guard``."""
    install(session, "core")
    session.install("-c", str(CONSTRAINTS), "h5py")  # the operator example's FNO imports it
    session.run("python", "benchmarks/bench_guard.py", *session.posargs)


@nox.session(name="bench_samplers", default=False)
def bench_samplers(session: nox.Session) -> None:
    """Benchmark the samplers of ups-samplers against torch's ``DistributedSampler`` (one
    epoch of one rank, 10^8 samples, 8 ranks); see benchmarks/README.md. Not a default session:
    ``nox -s bench_samplers``; small runs: ``nox -s bench_samplers -- --size 1000000``."""
    install(session, "core", "samplers")
    session.run("python", "benchmarks/bench_samplers.py", *session.posargs)


@nox.session(name="bench_ckpt", default=False)
def bench_ckpt(session: nox.Session) -> None:
    """Benchmark ups-ckpt's saves against a bare ``torch.save`` of the same state (a model of
    10^8 parameters and Adam's state, 1.2 GB): synchronous ``local`` and ``sharded`` saves, the
    stall of a background save; see benchmarks/README.md. Not a default session:
    ``nox -s bench_ckpt``; small runs: ``nox -s bench_ckpt -- --params 1000000 --repeats 1``."""
    install(session, "core", "ckpt")
    session.run("python", "benchmarks/bench_ckpt.py", *session.posargs)


@nox.session(name="bench_memory", default=False)
def bench_memory(session: nox.Session) -> None:
    """Benchmark what each rank holds under ups-fsdp's ``zero`` and ``fsdp`` against ``ddp``
    (a model of 50 M parameters, AdamW, 2 and 4 local CPU ranks, gloo): bytes of parameters,
    gradients and optimizer state, peak resident memory, step time; see benchmarks/README.md.
    Not a default session: ``nox -s bench_memory``; small runs:
    ``nox -s bench_memory -- --params 2000000 --steps 2``."""
    install(session, "core", "fsdp")
    session.run("python", "benchmarks/bench_memory.py", *session.posargs)


@nox.session(name="bench_comm", default=False)
def bench_comm(session: nox.Session) -> None:
    """Benchmark ups-comm-hooks' hooks against plain float32 all-reduce (a model of 12.6 M
    parameters, 2 gloo ranks in 2 network namespaces over a veth pair shaped by tc to 200 Mbit/s
    and 1 Gbit/s): step time and bytes per step; see benchmarks/README.md. Needs root, ``ip`` and
    ``tc``. Not a default session: ``nox -s bench_comm``; small runs:
    ``nox -s bench_comm -- --rates 1gbit --rounds 1 --steps 2``."""
    install(session, "core", "comm_hooks")
    session.run("python", "benchmarks/bench_comm.py", *session.posargs)


@nox.session(name="bench_gpu", default=False)
def bench_gpu(session: nox.Session) -> None:
    """Benchmark the engine on a CUDA device: against a hand-written loop on a compute-bound
    model (the ratio of their step rates, one run), and the training stall of ups-ckpt's
    background save of a state in GPU memory against its synchronous save; see
    docs/gpu.md. Exits with a message on a machine without CUDA. Not a default session:
    ``nox -s bench_gpu``."""
    install_for_cuda(session, "core", "ckpt")
    session.run("python", "benchmarks/bench_gpu.py", *session.posargs)


@nox.session(name="bench_pipeline", default=False)
def bench_pipeline(session: nox.Session) -> None:
    """Benchmark the engine's training-step contract and data pipeline: a custom
    ``ups.core.Step`` on dict batches against the built-in step (the bundled example, 2 local
    CPU ranks), a loader-bound HDF5 dataset read by 2 worker processes against none (1 rank),
    and the engine's own time per step in one process against a hand-written loop; see
    benchmarks/README.md. Not a default session: ``nox -s bench_pipeline``; small
    runs: ``nox -s bench_pipeline -- --repeats 1 --steps 200 --loader-repeats 1
    --overhead-repeats 1``."""
    install(session, "core")
    session.install("-c", str(CONSTRAINTS), "h5py")
    session.run("python", "benchmarks/bench_pipeline.py", *session.posargs)


@nox.session(name="bench_cli", default=False)
def bench_cli(session: nox.Session) -> None:
    """Benchmark how fast ``ups`` answers when it does not train (``--help``, ``status``,
    ``plugins``) beside ``python -c pass`` and ``import torch``, with every distribution of
    packages/ and the plugins ups-tensorboard and ups-optuna installed; see benchmarks/README.md.
    Not a default session: ``nox -s bench_cli``; ``-- --repeats 9`` for more runs."""
    install(session, *PACKAGES)
    session.install("-c", str(CONSTRAINTS), "./plugins/ups-tensorboard", "./plugins/ups-optuna")
    session.run("python", "benchmarks/bench_cli.py", *session.posargs)


@nox.session(name="bench_launch", default=False)
def bench_launch(session: nox.Session) -> None:
    """Benchmark how long ``ups.core.train(config, nproc=2)`` takes to start its ranks, forked
    from ups's forkserver against spawned, on a tiny project; see benchmarks/README.md. Not a
    default session: ``nox -s bench_launch``; ``-- --repeats 9 --nproc 4`` for more."""
    install(session, "core")
    session.run("python", "benchmarks/bench_launch.py", *session.posargs)
