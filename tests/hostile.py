"""Hostile files for the security tests: pickles that run code when loaded without restriction."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path


class _Payload:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (self.code,)


def hostile_pickle(marker: Path) -> bytes:
    """A pickle that writes ``marker`` when loaded by ``pickle.load``/``torch.load(weights_only=False)``."""
    return pickle.dumps(_Payload(f"open({str(marker)!r}, 'w').write('pwned')"))


def hostile_torch_save(marker: Path) -> bytes:
    """A ``torch.save`` archive (what DCP stores per entry) whose ``data.pkl`` is hostile."""
    import torch

    buf = io.BytesIO()
    torch.save(0.5, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(
                name, hostile_pickle(marker) if name.endswith("data.pkl") else src.read(name)
            )
    return out.getvalue()
