"""vLLM general plugin: installs the AITER override in every vLLM process.

Declared in pyproject.toml under the `vllm.general_plugins` entry-point group, which vLLM loads in the
engine and in every worker. It installs only where AITER can run, a ROCm build of torch, unless
`AITER_FUSED_FORCE_PLUGIN=1`; `AITER_FUSED_DISABLE=1` still wins (see `aiter_fused.override`).
"""

import importlib.util
import logging

import torch

from aiter_fused import override

logger = logging.getLogger(__name__)

FORCE_ENV = "AITER_FUSED_FORCE_PLUGIN"


def register() -> None:
    forced = override.env_flag(FORCE_ENV)
    if torch.version.hip is None and not forced:
        logger.info("aiter_fused: torch is not a ROCm build; AITER override not installed (%s=1 forces it)", FORCE_ENV)
        return
    if importlib.util.find_spec("aiter") is None:
        logger.warning("aiter_fused: the amd-aiter package is not installed; AITER override not installed")
        return
    override.install()  # logs what it did
