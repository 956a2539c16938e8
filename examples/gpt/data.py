"""Byte-level text corpus: by default the running Python's standard library sources.

The files are split deterministically into train and validation by a hash of their relative path (so the
split does not depend on file-system order or on the machine). ``--data PATH`` takes any text file or
folder instead (a folder contributes every file it holds that decodes as UTF-8 text).
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SEPARATOR = b"\n\n"


@dataclass
class Corpus:
    """Train and validation byte streams (uint8 1-D tensors) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    n_files: int


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"--data {root}: no such file or directory")
    return sorted(p for p in root.rglob("*") if p.is_file())


def _is_val(rel: str, val_fraction: float) -> bool:
    bucket = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:4], "big") / 2**32
    return bucket < val_fraction


def load_corpus(data: str | None = None, *, val_fraction: float = 0.1, max_bytes: int = 64 << 20) -> Corpus:
    """Read the corpus into memory.

    Args:
        data: a text file or folder; None means the standard library's ``*.py`` files
            (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded).
        val_fraction: share of files (by path hash) held out for validation.
        max_bytes: stop reading after this many bytes in total (files in sorted order).

    Raises:
        FileNotFoundError / ValueError: the path is missing or holds no usable text.
    """
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts and "dist-packages" not in p.parts]
        source = f"Python {sysconfig.get_python_version()} standard library ({root})"
    else:
        root = Path(data)
        files = _files(root)
        source = str(root)
    if len(files) == 1:  # one file: split its bytes instead of its files
        raw = files[0].read_bytes()[:max_bytes]
        cut = int(len(raw) * (1 - val_fraction))
        train_b, val_b, n = raw[:cut], raw[cut:], 1
    else:
        train_parts: list[bytes] = []
        val_parts: list[bytes] = []
        total = n = 0
        for path in files:
            try:
                raw = path.read_bytes()
                raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            rel = path.relative_to(root).as_posix() if path != root else path.name
            (val_parts if _is_val(rel, val_fraction) else train_parts).append(raw)
            total += len(raw)
            n += 1
            if total >= max_bytes:
                break
        train_b, val_b = SEPARATOR.join(train_parts), SEPARATOR.join(val_parts)
    if len(train_b) < 10_000 or len(val_b) < 1_000:
        raise ValueError(
            f"{source}: too little text ({len(train_b)} train / {len(val_b)} validation bytes; at least 10000 / "
            f"1000 are needed, and a folder's validation part is about {val_fraction:.0%} of its files): "
            "give a larger file or folder"
        )
    to_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(train=to_tensor(train_b), val=to_tensor(val_b), source=source, n_files=n)


def unigram_baseline(train: torch.Tensor, val: torch.Tensor) -> float:
    """Cross-entropy (nats per byte) of the validation bytes under the train set's byte frequencies
    (add-one smoothed): the loss of the best model that ignores context."""
    counts = torch.bincount(train.long(), minlength=256).double() + 1.0
    logp = torch.log(counts / counts.sum())
    val_counts = torch.bincount(val.long(), minlength=256).double()
    return float(-(val_counts * logp).sum() / val_counts.sum())


def get_batch(stream: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x, y int64 (batch_size, block_size), y shifted by one byte."""
    starts = torch.randint(0, stream.numel() - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = stream[(starts[:, None] + offsets[None, :])].long()
    return windows[:, :-1], windows[:, 1:]


def bits(nats: float) -> float:
    return nats / math.log(2)
