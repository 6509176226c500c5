"""Every knob of a circuits run, read once from options, ini or the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .model.named import DEFAULT_MODEL
from .rungs.repeat import RepeatSettings

DEFAULT_BUILDS = ("fp32", "bnb-int8", "bnb-nf4")
DEFAULT_REFERENCE = "fp32"


@dataclass
class CircuitsSettings:
    """What to load, which builds to gate, and how to probe them."""

    model: str = DEFAULT_MODEL
    builds: tuple[str, ...] = DEFAULT_BUILDS
    reference: str = DEFAULT_REFERENCE
    baselines: Path = Path("baselines")
    update: bool = False
    device: str = "auto"
    report: Path | None = None
    trust_remote_code: bool = False
    probe: RepeatSettings = field(default_factory=RepeatSettings)
    knockout_seed: int = 1  # held out: differs from the probe's seed
    knockout_mode: str = "zero"  # or "mean"
    knockout_screen: int | None = None  # exact knockouts only on the top k of an attribution screen
    n_rotations: int = 32  # rotation-null draws per head (kappa.N_ROTATIONS, symmetric t test)
    fdr_q: float = 0.05
    batch_size: int = 8
    tolerances: dict = field(default_factory=dict)  # gate tolerance overrides (ini circuits_tol_*)

    @property
    def knockout_probe(self) -> RepeatSettings:
        """The held-out repeat sequences knockouts are measured on."""
        return RepeatSettings(seed=self.knockout_seed, n=self.probe.n, L=self.probe.L)
