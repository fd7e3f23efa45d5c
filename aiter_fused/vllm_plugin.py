"""vLLM general plugin: opt-in only; by default it leaves AITER untouched.

Declared in pyproject.toml under the `vllm.general_plugins` entry-point group, which vLLM loads in the
engine, in every worker and when it builds its command line (`vllm.plugins.load_general_plugins`).

Note [Opt-in, never silent]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The fused kernel changes numerics (MX operands, Schraudolph exp2), so installing this package must not
change what any vLLM process computes. `register()` does two things and logs both:
- It always registers the attention backend name `AITER_FUSED` with vLLM's backend registry
  (`vllm.v1.attention.backends.registry.register_backend`, the API of vLLM 0.33.0). That is a name
  binding only: vLLM imports `aiter_fused.vllm_backend` and runs it only when the user selects it
  (`--attention-backend AITER_FUSED`), and selecting it is the opt-in (the backend then installs the
  AITER override in that worker, see `aiter_fused.vllm_backend`).
- It installs the AITER override (`aiter_fused.override.install`, which reaches every caller of
  `aiter.flash_attn_varlen_func`, vLLM's stock ROCM_AITER_FA backend included) only when
  `AITER_FUSED_ENABLE=1` and the numerics are named: `AITER_FUSED_FORMAT` (mxfp8, mxfp6, mxfp4) or
  `AITER_FUSED_EXACT=1`. `AITER_FUSED_DISABLE=1` still wins.
Every switch is read, and a bad value rejected (naming the variable and the accepted values), in every
process, whether or not it opts in: a typo such as `AITER_FUSED_ENABLE=true` fails loudly instead of
leaving the user on stock numerics believing otherwise.
"""

import importlib
import importlib.util
import logging
import os

from aiter_fused import override

logger = logging.getLogger(__name__)

ENABLE_ENV = "AITER_FUSED_ENABLE"
BACKEND_NAME = "AITER_FUSED"
BACKEND_CLASS = "aiter_fused.vllm_backend.AiterFusedBackend"
# The registry module and function this plugin uses, as in vLLM 0.33.0 (tests/test_aiter_vllm_backend.py runs
# against that release).
VLLM_REGISTRY_MODULE = "vllm.v1.attention.backends.registry"


def register() -> None:
    enabled = override.env_flag(ENABLE_ENV)
    # Every switch is checked in every process, opted in or not (Note [Opt-in, never silent]).
    override.env_flag(override.DISABLE_ENV)
    override.current_format()  # AITER_FUSED_FORMAT and AITER_FUSED_EXACT
    register_vllm_backend()
    if not enabled:
        logger.info(
            "aiter_fused: %s is not set to 1, AITER is left untouched (opt in with %s=1 and %s=<mxfp8|mxfp6|mxfp4>, "
            "or select the attention backend %s)",
            ENABLE_ENV,
            ENABLE_ENV,
            override.FORMAT_ENV,
            BACKEND_NAME,
        )
        return
    if not os.environ.get(override.FORMAT_ENV, "").strip() and not override.env_flag(override.EXACT_ENV):
        raise ValueError(
            f"environment variable {ENABLE_ENV}=1 needs the numerics named: set {override.FORMAT_ENV} to one of "
            f"('mxfp8', 'mxfp6', 'mxfp4'), or {override.EXACT_ENV}=1"
        )
    if importlib.util.find_spec("aiter") is None:
        raise RuntimeError(f"environment variable {ENABLE_ENV}=1, but the amd-aiter package is not installed")
    if override.install():
        logger.info(
            "aiter_fused: %s=1: AITER override installed in this process (%s)", ENABLE_ENV, override.current_format()
        )


def register_vllm_backend() -> bool:
    """Register `BACKEND_NAME` -> `BACKEND_CLASS` with vLLM's attention backend registry (idempotent).
    Returns whether the name is registered to this package's backend; False (and a warning) when this
    vLLM has no such registry."""
    try:
        registry = importlib.import_module(VLLM_REGISTRY_MODULE)
    except ImportError as error:
        logger.warning(
            "aiter_fused: vLLM's attention backend registry (%s) is not importable (%s): backend %s not registered",
            VLLM_REGISTRY_MODULE,
            error,
            BACKEND_NAME,
        )
        return False
    members = registry.AttentionBackendEnum.__members__
    if BACKEND_NAME in members:
        path = members[BACKEND_NAME].get_path()
        if path != BACKEND_CLASS:
            raise RuntimeError(
                f"vLLM attention backend {BACKEND_NAME} is already registered to {path}, not {BACKEND_CLASS}"
            )
        return True
    registry.register_backend(BACKEND_NAME, BACKEND_CLASS)
    logger.info(
        "aiter_fused: vLLM attention backend %s registered (%s); inactive unless selected", BACKEND_NAME, BACKEND_CLASS
    )
    return True
