"""This repository's gate suite: the packaged one (pytest_circuits/probes), run by ``pytest probes``."""

from pytest_circuits.probes import *  # noqa: F401,F403
