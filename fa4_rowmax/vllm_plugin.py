"""vLLM general plugin for the `FA4_ROWMAX` attention backend: registration and the backend's softmax setting.

Declared in pyproject.toml under the `vllm.general_plugins` entry-point group, which vLLM loads in the engine, in
every worker and when it builds its command line (`vllm.plugins.load_general_plugins`).

Note [FA4_ROWMAX: opt-in by selection]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Installing this package changes nothing any vLLM process computes. `register()` binds vLLM's `CUSTOM` attention
backend slot (`vllm.v1.attention.backends.registry.register_backend(AttentionBackendEnum.CUSTOM, path)`) to
`fa4_rowmax.vllm_backend.FA4RowmaxBackend`: a name binding only, the backend module is imported only when the user
selects it with `--attention-backend CUSTOM` (or `attention_config={"backend": "CUSTOM"}`), and selecting it is
the opt-in. The `CUSTOM` slot, not a named member such as the AMD backend's `AITER_FUSED`: vLLM 0.26.0's
`register_backend` takes enum members only, 0.33.0's takes both, so the slot is the one way in that both serve.
One package holds the slot: when another holds it already, `register()` leaves it there and warns.
The numerics of the prefill attention it serves come from the backend's own variables, read and checked in every
process, selected or not, so a typo fails loudly instead of leaving a run on numerics other than the user believes:
- `FA4_ROWMAX_VLLM_SOFTMAX_MODE`: `rowmax_h15` (default), `rowmax_pot`, or `exact` (FA4's exact twin);
- `FA4_ROWMAX_VLLM_RESCALE_THRESHOLD`: a float >= 0 in log2 units (default: the architecture's);
- `FA4_ROWMAX_VLLM_BETA`: a number in [0, 1] (default: FA4's tuning).
Empty means unset. They are the `softmax_mode`, `rescale_threshold` and `beta` of the patched
`flash_attn.cute.flash_attn_varlen_func`, validated by `fa4_rowmax.interface.softmax_stage`; an error names the
variable. They are not the process-wide `FA4_ROWMAX_SOFTMAX_MODE` family the patched FA4 reads for engines that
cannot pass arguments: this backend passes its setting explicitly on every call it makes.
"""

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Optional

from fa4_rowmax.interface import softmax_stage

logger = logging.getLogger(__name__)

BACKEND_NAME = "FA4_ROWMAX"
BACKEND_CLASS = "fa4_rowmax.vllm_backend.FA4RowmaxBackend"
# The registry slot this backend takes (Note [FA4_ROWMAX: opt-in by selection]) and what --attention-backend names.
VLLM_SLOT = "CUSTOM"
VLLM_REGISTRY_MODULE = "vllm.v1.attention.backends.registry"
MODE_ENV = "FA4_ROWMAX_VLLM_SOFTMAX_MODE"
THRESHOLD_ENV = "FA4_ROWMAX_VLLM_RESCALE_THRESHOLD"
BETA_ENV = "FA4_ROWMAX_VLLM_BETA"
DEFAULT_MODE = "rowmax_h15"


@dataclass(frozen=True)
class SoftmaxSetting:
    """The softmax arguments this backend passes to FA4 for prefill, as `flash_attn_varlen_func` names them."""

    softmax_mode: str = DEFAULT_MODE
    rescale_threshold: Optional[float] = None
    beta: Optional[float] = None

    def fa4_arguments(self) -> dict:
        return dict(softmax_mode=self.softmax_mode, rescale_threshold=self.rescale_threshold, beta=self.beta)


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    return value or None


def _env_float(name: str) -> Optional[float]:
    value = _env(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a number; unset it or give a float") from None


def softmax_setting() -> SoftmaxSetting:
    """The backend's setting from its environment variables (Note [FA4_ROWMAX: opt-in by selection]), validated
    by `softmax_stage`; a bad value raises ValueError/TypeError naming the variable."""
    setting = SoftmaxSetting(_env(MODE_ENV) or DEFAULT_MODE, _env_float(THRESHOLD_ENV), _env_float(BETA_ENV))
    variables = {"softmax_mode": MODE_ENV, "rescale_threshold": THRESHOLD_ENV, "beta": BETA_ENV}
    try:
        softmax_stage(**setting.fa4_arguments())
    except (TypeError, ValueError) as error:
        named = [variable for argument, variable in variables.items() if str(error).startswith(argument)]
        where = named[0] if named else ", ".join(variables.values())
        raise type(error)(f"environment variable {where}: {error}") from None
    return setting


def register() -> None:
    """The entry point: check the setting (every process) and bind the `CUSTOM` slot."""
    setting = softmax_setting()
    if register_vllm_backend():
        logger.info(
            "fa4_rowmax: vLLM attention backend %s registered in the %s slot (%s); inactive unless selected with "
            "--attention-backend %s; its prefill setting: %s",
            BACKEND_NAME,
            VLLM_SLOT,
            BACKEND_CLASS,
            VLLM_SLOT,
            setting,
        )


def register_vllm_backend() -> bool:
    """Bind vLLM's `CUSTOM` attention backend slot to `BACKEND_CLASS` (idempotent). Returns whether the slot is
    bound to this package's backend; False, and a warning, when this vLLM has no such registry or another package
    holds the slot (installing this one must not break that one's backend; `--attention-backend CUSTOM` then
    selects the other package's, and this warning says so)."""
    try:
        registry = importlib.import_module(VLLM_REGISTRY_MODULE)
    except ImportError as error:
        logger.warning(
            "fa4_rowmax: vLLM's attention backend registry (%s) is not importable (%s): backend %s not registered",
            VLLM_REGISTRY_MODULE,
            error,
            BACKEND_NAME,
        )
        return False
    slot = registry.AttentionBackendEnum[VLLM_SLOT]
    if slot.is_overridden():
        path = slot.get_path()
        if path != BACKEND_CLASS:
            logger.warning(
                "fa4_rowmax: vLLM attention backend slot %s is already registered to %s: %s not registered, "
                "--attention-backend %s selects that backend",
                VLLM_SLOT,
                path,
                BACKEND_NAME,
                VLLM_SLOT,
            )
            return False
        return True
    registry.register_backend(slot, BACKEND_CLASS)
    return True
