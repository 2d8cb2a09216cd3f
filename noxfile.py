"""Test, lint, type-check, benchmark and demo sessions.

    python -m nox                 # the whole test suite (every default session)
    python -m nox -s core         # one session
    python -m nox -s demo         # the main demo
    python -m nox -s bench        # benchmarks, written to BENCHMARKS.md
    python -m nox -s wheel        # build the sdist and wheel, test the installed wheel

Each framework gets its own virtual environment. Sessions use pip through the stdlib venv
backend (not uv), because pip sees the local CPU build of torch that constraints/cpu.txt pins.
A session asked to test a backend fails when that backend cannot be imported
(tests/test_backends_installed.py), so no session passes by skipping its tests.
"""

from __future__ import annotations

import re
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import nox

nox.needs_version = ">=2024.4.15"
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["core", "core_min", "torch", "keras", "flax", "lint", "typecheck", "wheel"]

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml("pyproject.toml")
TEST = nox.project.dependency_groups(PYPROJECT, "test")
METRICS_TEST = nox.project.dependency_groups(PYPROJECT, "test-metrics")
DEMO = nox.project.dependency_groups(PYPROJECT, "demo")
CONSTRAINTS = ("-c", "constraints/cpu.txt")
CORE_TESTS = (
    "tests/core",
    "tests/test_conformance.py",
    "tests/test_layer_arguments.py",
    "tests/test_readme.py",
    "tests/test_backends_installed.py",
)
# the demo's smoke run first: it is the longest single test (1-2 min), and pytest-xdist hands tests out in collection
# order, so started last it would leave the other worker idle at the end
ADAPTER_TESTS = (
    "tests/test_demo_smoke.py",
    "tests/test_conformance.py",
    "tests/test_layer_arguments.py",
    "tests/test_readme.py",
    "tests/test_backends_installed.py",
)

# benchmarks/device_check.py --smoke (the GPU check): the torch and flax sessions each require their sections to run
DEVICE_CHECK_SMOKE = "tests/test_device_check_smoke.py"


# pytest-xdist: one worker per core (at most 4, each framework's process holds its own compiled programs); most of the
# adapters' test time is single-threaded tracing and compiling, so two workers on two cores nearly halve it
PARALLEL = ("--numprocesses=auto", "--maxprocesses=4")


def run_pytest(session: nox.Session, backends: str, *paths: str) -> None:
    session.run(
        "pytest", *PARALLEL, "--durations=15", *paths, *session.posargs, env={"MASKSEMBLES_TEST_BACKENDS": backends}
    )


def install(session: nox.Session, *arguments: str) -> None:
    """pip install without compiling every module of every package to bytecode, pip's default and most of a heavy
    session's install time: compiling torch, TensorFlow, JAX and their requirements cost 35 s of CPU in the torch
    session's install (56 s -> 21 s user, same requirements, warm pip cache). Python compiles a module when the session
    first imports it instead, and keeps it: the session writes bytecode even where the caller's environment sets
    PYTHONDONTWRITEBYTECODE, so that every test process after the first reads it."""
    session.env["PYTHONDONTWRITEBYTECODE"] = None
    session.install("--no-compile", *arguments)


def release_environment(session: nox.Session) -> None:
    """Delete the session's virtual environment once the session has passed, unless nox was asked to reuse
    environments (``-r``, ``--reuse-venv``): a run without reuse builds each one afresh anyway. The default sessions'
    environments take about 12 GB together (torch, TensorFlow and JAX several times over); held to the end of the run,
    they filled a CI machine's disk before the last session. A failed session keeps its environment to look into."""
    environment = session.virtualenv
    if isinstance(environment, nox.virtualenv.VirtualEnv) and not environment.reuse_existing:
        shutil.rmtree(environment.location, ignore_errors=True)


@nox.session
def core(session: nox.Session) -> None:
    """The NumPy core and the conformance oracle (numpy the only runtime dependency)."""
    install(session, *CONSTRAINTS, "-e", ".", *TEST, *METRICS_TEST)
    run_pytest(session, "numpy", *CORE_TESTS)
    release_environment(session)


def lowest_numpy() -> str:
    """The declared numpy lower bound, raised to the first release with wheels for this Python."""
    declared = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("numpy>="))
    lowest = declared.removeprefix("numpy>=")
    first_with_wheels = {(3, 11): "1.26.0", (3, 12): "1.26.0", (3, 13): "2.1.0", (3, 14): "2.3.2"}
    candidate = first_with_wheels.get(sys.version_info[:2], lowest)
    return max(lowest, candidate, key=lambda v: tuple(int(p) for p in v.split(".")))


@nox.session
def core_min(session: nox.Session) -> None:
    """The core against the lowest numpy that pyproject.toml admits."""
    install(session, "-e", ".", *TEST, *METRICS_TEST, f"numpy=={lowest_numpy()}")
    session.run("python", "-c", "import numpy; print('numpy', numpy.__version__)")
    run_pytest(session, "numpy", *CORE_TESTS)
    release_environment(session)


@nox.session
def torch(session: nox.Session) -> None:
    """The PyTorch adapter (CPU build), with ONNX export checked in onnxruntime, Hugging Face ``transformers`` models
    built from small configs, the demo's and the GPU check's smoke tests."""
    install(
        session, *CONSTRAINTS, "-e", ".[torch]", *TEST, *nox.project.dependency_groups(PYPROJECT, "test-torch"), *DEMO
    )
    run_pytest(session, "torch,transformers", *ADAPTER_TESTS, "tests/torch", DEVICE_CHECK_SMOKE)
    release_environment(session)


def jax_test_compilation(session: nox.Session, *xla_flags: str) -> None:
    """How the JAX sessions compile: most of their time is XLA compiling many small programs, each run once or twice.

    - XLA's CPU backend without LLVM optimization (``--xla_backend_optimization_level=0``; XLA's own HLO passes,
      fusion included, run as by default): the tests check results, not speed (benchmarks/ run with the defaults).
      tests/flax/test_packing_modules.py, one process: 289 s -> 219 s user CPU.
    - JAX's persistent compilation cache, empty at the start of every run (so no run reads another's programs): the
      tests build the same small models again and again, and XLA compiles each identical program once (the cnn,
      mixer and resnet cases of tests/flax/test_packing_modules.py: 82 s -> 50 s CPU). Each pytest-xdist worker gets
      its own folder (tests/conftest.py): JAX writes an entry in place, and another process could read it
      half-written."""
    session.env["XLA_FLAGS"] = " ".join(("--xla_backend_optimization_level=0", *xla_flags))
    cache = Path(session.create_tmp()).resolve() / "jax-compilation-cache"  # absolute: some tests change directory
    shutil.rmtree(cache, ignore_errors=True)
    session.env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    session.env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the default caches only compiles over 1 s
    session.env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


KERAS_BACKEND_PACKAGES = {"tensorflow": ("tensorflow-cpu>=2.21",), "jax": ("jax>=0.10.2",), "torch": ("torch",)}


@nox.session
@nox.parametrize("backend", list(KERAS_BACKEND_PACKAGES), ids=list(KERAS_BACKEND_PACKAGES))
def keras(session: nox.Session, backend: str) -> None:
    """The Keras 3 adapter on one backend (KERAS_BACKEND is read once per process), with keras-hub models built from
    small configs: keras-hub without its requirements (pyproject.toml's test-keras-hub group says why); the session
    fails if keras_hub cannot be imported (tests/test_backends_installed.py)."""
    hub_deps = nox.project.dependency_groups(PYPROJECT, "test-keras-hub-deps")
    if backend != "tensorflow":  # a keras-hub task's fit/predict needs tf.data or grain
        hub_deps = (*hub_deps, *nox.project.dependency_groups(PYPROJECT, "test-keras-hub-grain"))
    deploy = nox.project.dependency_groups(PYPROJECT, f"test-keras-deploy-{backend}")  # export formats, runtimes
    install(session, *CONSTRAINTS, "-e", ".[keras]", *KERAS_BACKEND_PACKAGES[backend], *TEST, *hub_deps, *deploy, *DEMO)
    install(session, "--no-deps", *nox.project.dependency_groups(PYPROJECT, "test-keras-hub"))
    session.env["KERAS_BACKEND"] = backend
    if backend == "jax":
        jax_test_compilation(session)
    run_pytest(session, f"keras-{backend},keras_hub", *ADAPTER_TESTS, "tests/keras")
    release_environment(session)


@nox.session
def flax(session: nox.Session) -> None:
    """The Flax adapter (linen and NNX), with 4 virtual CPU devices for the sharding tests, and the GPU check's smoke
    test."""
    install(session, "-e", ".[flax]", *TEST, *nox.project.dependency_groups(PYPROJECT, "test-flax"), *DEMO)
    jax_test_compilation(session, "--xla_force_host_platform_device_count=4")
    run_pytest(session, "flax", *ADAPTER_TESTS, "tests/flax", DEVICE_CHECK_SMOKE)
    release_environment(session)


def version_mismatches() -> list[str]:
    """Versions written twice that disagree: pre-commit's ruff vs the lint group, CITATION.cff vs the package."""
    lint = nox.project.dependency_groups(PYPROJECT, "lint")
    ruff = next(r.removeprefix("ruff==") for r in lint if r.startswith("ruff=="))
    pre_commit = re.search(r"ruff-pre-commit\s+rev: v(\S+)", (ROOT / ".pre-commit-config.yaml").read_text())
    package = re.search(r'^__version__ = "(.+)"$', (ROOT / "masksembles_core" / "__init__.py").read_text(), re.M)
    citation = re.search(r"^version: (\S+)$", (ROOT / "CITATION.cff").read_text(), re.M)
    pairs = {
        "ruff in .pre-commit-config.yaml vs the lint group": (pre_commit and pre_commit[1], ruff),
        "CITATION.cff vs masksembles_core.__version__": (citation and citation[1], package and package[1]),
    }
    return [f"{what}: {a} != {b}" for what, (a, b) in pairs.items() if a is None or a != b]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format, and the versions that pre-commit and CITATION.cff repeat."""
    install(session, *nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    if mismatches := version_mismatches():
        session.error("; ".join(mismatches))
    release_environment(session)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy, strict on masksembles_core and the PyTorch, Keras and Flax adapters (their frameworks installed)."""
    install(
        session, *CONSTRAINTS, "-e", ".[torch,keras,flax,plots]", *nox.project.dependency_groups(PYPROJECT, "typecheck")
    )
    packages = ("masksembles_core", "masksembles_torch", "masksembles_keras", "masksembles_flax")
    session.run("mypy", *packages, "tests/core", "tests/golden")
    release_environment(session)


PACKAGES = sorted(path.parent for path in ROOT.glob("masksembles_*/__init__.py"))


def wheel_problems(wheel: Path) -> list[str]:
    """What the wheel lacks (a module or py.typed of a package, the license) or holds besides packages and metadata."""
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in package.rglob("*")
        if path.suffix == ".py" or path.name == "py.typed"
    }
    expected |= {f"{package.name}/py.typed" for package in PACKAGES}
    dist_info = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
    problems = [f"missing {name}" for name in sorted(expected - names)]
    problems += [f"no license in {info}" for info in dist_info if f"{info}/licenses/LICENSE" not in names]
    problems += [f"unexpected {name}" for name in sorted(names - expected) if name.split("/")[0] not in dist_info]
    return problems


def sdist_problems(sdist: Path) -> list[str]:
    """What the sdist lacks of the packages, the tests (golden file included), the demo and the license."""
    with tarfile.open(sdist) as archive:
        names = {name.partition("/")[2] for name in archive.getnames()}
    wanted = [ROOT / "LICENSE", ROOT / "pyproject.toml", ROOT / "noxfile.py", ROOT / "examples" / "demo.py"]
    for top in [*PACKAGES, ROOT / "tests"]:
        wanted += [path for path in top.rglob("*") if path.is_file() and "__pycache__" not in path.parts]
    return [f"missing {name}" for name in sorted({path.relative_to(ROOT).as_posix() for path in wanted} - names)]


# Runs in the session's Python: the tests must see the installed wheel, never the checkout.
TEST_INSTALLED = (
    "import sys, masksembles_core, pytest; "
    "print('testing', masksembles_core.__file__); "
    "assert masksembles_core.__file__.startswith(sys.prefix), 'masksembles_core is not the installed wheel'; "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


@nox.session
def wheel(session: nox.Session) -> None:
    """Build the sdist and the wheel from it, check their files, and run the core tests on the installed wheel.

    The tests run from a copy of tests/ (with the README and docs/, whose code blocks they run) in a temporary
    directory (the checkout is not on sys.path there), with the pytest settings of pyproject.toml.
    """
    install(session, *nox.project.dependency_groups(PYPROJECT, "build"))
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT))
    (sdist_path,) = dist.glob("*.tar.gz")
    (wheel_path,) = dist.glob("*.whl")
    for path, problems in ((sdist_path, sdist_problems(sdist_path)), (wheel_path, wheel_problems(wheel_path))):
        if problems:
            session.error(f"{path.name}: " + "; ".join(problems))
    install(session, *TEST, *METRICS_TEST, str(wheel_path))
    install(session, "--force-reinstall", "--no-deps", str(wheel_path))  # not a same-version wheel of an earlier run
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / "tests", Path(tmp) / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(ROOT / "docs", Path(tmp) / "docs", ignore=shutil.ignore_patterns("*.png", "*.csv"))
        shutil.copy(ROOT / "README.md", Path(tmp) / "README.md")  # the tests run the guides' code blocks
        with session.chdir(tmp):
            config = ("-c", str(ROOT / "pyproject.toml"), "--rootdir", tmp, "-p", "no:cacheprovider")
            session.run(
                "python", "-c", TEST_INSTALLED, *config, *CORE_TESTS, *session.posargs,
                env={"MASKSEMBLES_TEST_BACKENDS": "numpy"},
            )  # fmt: skip
    release_environment(session)


DEMO_INSTALL = {"torch": (".[torch]",), "keras": (".[keras]", "torch"), "flax": (".[flax]", "optax>=0.2")}


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The README's main demo (options after --, e.g. `nox -s demo -- --quick --framework flax`)."""
    args = list(session.posargs)
    framework = args[args.index("--framework") + 1] if "--framework" in args else "torch"
    install(session, *CONSTRAINTS, "-e", *DEMO_INSTALL[framework], *DEMO)
    if framework == "keras":
        session.env.setdefault("KERAS_BACKEND", "torch")
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks against the official masksembles 1.1.1; results go to BENCHMARKS.md."""
    install(session, *CONSTRAINTS, "-e", ".[torch,keras,flax]", "tensorflow-cpu>=2.21", "masksembles==1.1.1")
    install(session, "--no-deps", "torch-uncertainty==0.13.0")  # only its masking layers are timed
    install(session, *CONSTRAINTS, *METRICS_TEST, "netcal==1.4.0")  # the metrics' references (netcal needs torch)
    transformers = [r for r in nox.project.dependency_groups(PYPROJECT, "test-torch") if r.startswith("transformers")]
    install(session, *CONSTRAINTS, *transformers)  # bench_packing's ViT (transformers) row
    onnx = [r for r in nox.project.dependency_groups(PYPROJECT, "test-torch") if r.startswith("onnx")]
    install(session, *CONSTRAINTS, *onnx)  # bench_deploy: ONNX export, run in onnxruntime
    scripts = (
        "generation",
        "torch",
        "packing",
        "deploy",
        "keras",
        "flax",
        "flax_barrier",
        "flax_packing",
        "metrics",
        "predict",
    )
    for script in scripts:
        session.run("python", f"benchmarks/bench_{script}.py")
