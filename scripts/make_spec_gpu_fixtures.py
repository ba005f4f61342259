"""Write tests/fixtures/spec_gpu: the low-entropy tiny speculative target of tests/spec_fixtures.py
(saved by transformers) and one DFlash and one DSpark draft for it, so GPU runs need no
transformers. Run from the repository root: ``python scripts/make_spec_gpu_fixtures.py``."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.spec_fixtures import draft_config, make_spec_target, write_draft  # noqa: E402

VOCAB, HIDDEN, LAYERS = 24, 32, 7


def main() -> None:
    out = Path("tests/fixtures/spec_gpu")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _, folder = make_spec_target(out, offset=2.0, mix=0.3, pull=3.5)
    folder.rename(out / "target")
    for kind, block in (("dflash", 4), ("dspark", 3)):
        cfg = draft_config(kind, hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=block)
        write_draft(out / kind, cfg, std=0.05)
    for f in sorted(out.rglob("*")):
        print(f, f.stat().st_size if f.is_file() else "")


if __name__ == "__main__":
    main()
