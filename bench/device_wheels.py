"""Wheels and the vocabulary for a GPU machine without network (the `device` tool's runs).

The GPU machine has torch and triton but none of the server's or the tests' other packages,
and cannot download them. Run this with the interpreter of an installed checkout (the
`.venv` of `make test`): it downloads, for Python 3.12 on x86-64 Linux, the wheels of the
packages below at the versions installed here, into `.whl/`, copies the o200k vocabulary into
`.vocab/`, and keeps both out of git (`.git/info/exclude`).

    .venv/bin/python bench/device_wheels.py [--vocab ../shared/vocab]

Then carry `.whl` and `.vocab` in every device run and begin its command with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src \\
        TIKTOKEN_ENCODINGS_BASE=$PWD/.vocab PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

(2026-11-27: missing opentelemetry-api, which fastapi imports, or httpx2 / httpcore2 /
truststore, which openai imports, cost two device runs whose GPU tests did not collect.)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger("bench.device_wheels")

ROOT = Path(__file__).resolve().parent.parent

# Runtime dependencies of the server, and of the tests that run on the GPU machine (the SDK
# ones): everything the GPU machine's Python 3.12 lacks, dependencies of dependencies included.
PACKAGES = (
    "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pydantic", "pydantic-core",
    "annotated-types", "annotated-doc", "typing-inspection", "typing-extensions",
    "opentelemetry-api", "openai-harmony", "llguidance", "jsonschema",
    "jsonschema-specifications", "referencing", "rpds-py", "prometheus-client", "openai",
    "httpx", "httpx2", "httpcore", "httpcore2", "truststore", "anyio", "sniffio",
    "jiter", "h11", "certifi", "idna", "tqdm",
)  # fmt: skip
PLATFORMS = (  # the GPU machine loaded manylinux_2_31 wheels (llguidance)
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
)


def installed(packages: tuple[str, ...]) -> dict[str, str]:
    """name -> version installed in this interpreter, for those of ``packages`` it has."""
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            logger.warning("%s is not installed here: skipped", name)
    return versions


def download(versions: dict[str, str], target: Path) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
        "--python-version", "3.12", *platforms, "--dest", str(target),
        *(f"{name}=={version}" for name, version in sorted(versions.items())),
    ]  # fmt: skip
    subprocess.run(command, check=True)


def exclude(*paths: str) -> None:
    """Add ``paths`` (root-relative folders) to .git/info/exclude, once each."""
    exclude_file = ROOT / ".git" / "info" / "exclude"
    exclude_file.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude_file.read_text().splitlines() if exclude_file.exists() else []
    missing = [f"/{path}/" for path in paths if f"/{path}/" not in lines]
    if missing:
        exclude_file.write_text("\n".join([*lines, *missing]) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=Path, default=ROOT.parent / "shared" / "vocab",
                        help="folder holding o200k_base.tiktoken")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wheels, vocab = ROOT / ".whl", ROOT / ".vocab"
    exclude(".whl", ".vocab")
    wheels.mkdir(exist_ok=True)
    versions = installed(PACKAGES)
    download(versions, wheels)
    vocab.mkdir(exist_ok=True)
    shutil.copy2(args.vocab / "o200k_base.tiktoken", vocab / "o200k_base.tiktoken")
    size = sum(path.stat().st_size for path in wheels.glob("*.whl"))
    logger.info("%d wheels (%.1f MB) in %s, the vocabulary in %s", len(versions), size / 1e6,
                wheels, vocab)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
