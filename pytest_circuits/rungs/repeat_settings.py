"""The repeat probe's settings, light (no torch) so `settings.py` can hold them: seed, ``n``, ``L``, and
the own-text probe's file (`ProbeText`, ``--circuits-probe-text``) when its passages replace the random ids."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CircuitsError
from ..fsio import read_utf8

MAX_TEXT_BYTES = 64 * 1024 * 1024  # a probe text larger than this is refused, not read into memory


class ProbeTextError(CircuitsError):
    """An own-text probe file that cannot be read, or a text too short for the probe."""


@dataclass(frozen=True)
class ProbeText:
    """The own-text probe's file: its path, the sha256 of its bytes (the identity a record keeps) and its
    text; ``trust_remote_code``: whether the model folder's own tokenizer code may run to tokenize it."""

    path: Path
    sha256: str
    text: str = field(compare=False, repr=False)
    trust_remote_code: bool = field(default=False, compare=False)

    def as_dict(self) -> dict:
        """The file's part of the record's ``probe.text`` (the ids' part: `rungs.text_probe.text_identity`)."""
        return {"file": self.path.name, "sha256": self.sha256}


def read_probe_text(
    path: str | Path, said: str = "--circuits-probe-text", trust_remote_code: bool = False
) -> ProbeText:
    """The text at ``path`` (UTF-8, not blank), or one line naming the flag ``said``, the file and the fix."""
    path = Path(path)
    data, text = read_utf8(path, said, "a UTF-8 text file", ProbeTextError, MAX_TEXT_BYTES, "give a smaller text file")
    if not text.strip():
        raise ProbeTextError(f"{said} {path} is empty; give a text with at least n x L tokens")
    return ProbeText(path, hashlib.sha256(data).hexdigest(), text, trust_remote_code)


@dataclass(frozen=True)
class RepeatSettings:
    """Probe settings that fix its tokens: seed, sequences ``n``, segment length ``L``, and the own-text
    probe's file (None: the random-repeat probe's uniform ids)."""

    seed: int = 0
    n: int = 8
    L: int = 64
    text: ProbeText | None = None

    def as_dict(self) -> dict:
        """``{seed, n, L}``, and ``text`` (the file's name and sha256) for the own-text probe."""
        head = {"seed": self.seed, "n": self.n, "L": self.L}
        return head if self.text is None else {**head, "text": self.text.as_dict()}
