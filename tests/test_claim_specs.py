"""The claim specs of examples/compare/ (docs/claims.md) load, and every cell's config resolves (the runs themselves
are not tests). Specs that read generated data (compare_data/, built by the scripts beside them) are only parsed."""

from __future__ import annotations

from pathlib import Path

import pytest

from postrl.compare import load_spec, plan

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "examples" / "compare").glob("*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_claim_spec_loads_and_its_cells_resolve(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # model and data paths are relative to the repository root
    monkeypatch.syspath_prepend(str(path.parent))  # user stages by import path (claim_rewards, toy_prm)
    spec = load_spec(path)
    assert spec.seeds and len(spec.seeds) >= 3  # every claim is measured over 3+ seeds
    if "compare_data/" in path.read_text():  # needs make_proxy_rm.py / make_split_rms.py / ... first
        return
    cells = plan(spec)
    assert len(cells) == len(spec.seeds) * len(spec.all_variants)


def test_there_are_claim_specs():
    assert len(SPECS) >= 15
