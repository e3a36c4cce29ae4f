"""Fixtures of the Python package's tests (pytest; run from the repository root: `pytest`).

Models come from ../shared/data (stories260K) and models/ (SmolLM2's GGUF, fetched by
scripts/fetch-model.sh); the CLI is build/release/cumulus (or $CUMULUS_CLI). A missing
fixture skips its tests, or fails them under CUMULUS_REQUIRE_FIXTURES=1 (CI), as the C++
tests do (tests/fixtures.h).
"""

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
STORIES = SHARED / "data" / "models" / "stories260K"
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def need(path: pathlib.Path, what: str) -> pathlib.Path:
    """Skips the test (fails it under CUMULUS_REQUIRE_FIXTURES=1) when `path` is missing."""
    if not path.exists():
        message = f"{what}: {path} is missing"
        if os.environ.get("CUMULUS_REQUIRE_FIXTURES") == "1":
            pytest.fail(message + " (fixture required: CUMULUS_REQUIRE_FIXTURES=1)")
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def stories_model():
    import cumulus

    return cumulus.Model(str(need(STORIES / "stories260K.bin", "stories260K")), threads=2)


@pytest.fixture(scope="session")
def smollm2_model():
    import cumulus

    return cumulus.Model(str(need(SMOLLM2, "SmolLM2 GGUF (scripts/fetch-model.sh)")), threads=2)


@pytest.fixture(scope="session")
def stories_golden_sample() -> str:
    """llama2.c's greedy sample of stories260K from BOS (stories260K.md, written by its authors)."""
    md = need(STORIES / "stories260K.md", "stories260K's golden sample").read_text()
    start = md.index("-t 0.0\n") + len("-t 0.0\n")
    return md[start : md.index("\n```", start)]


@pytest.fixture(scope="session")
def cli() -> pathlib.Path:
    return need(pathlib.Path(os.environ.get("CUMULUS_CLI", ROOT / "build" / "release" / "cumulus")),
                "the cumulus CLI (cmake --build --preset release)")
