"""The attention seams: where vLLM 0.33.0's DeepSeek V4 / V4.1 models pick their
attention class.

One seam per model, both the same shape (the ONLY places the plugin changes vLLM's
code paths):

    vllm/models/deepseek_v4/nvidia/model.py  :: _select_dsv4_attn_cls(vllm_config)
    vllm/models/deepseek_v41/nvidia/model.py :: _select_dsv4_attn_cls(vllm_config)

Each model's ``DeepseekV4DecoderLayer.__init__`` (used for the main layers, the
MTP layers and the DSpark draft layers alike) looks its module's function up by
global name at call time and instantiates the class it returns.
:func:`install_attention_seams` rebinds each to a selector (:func:`select_attn_cls`,
:func:`select_attn_cls_v41`) that, when ``attention_config.backend`` is the ``DSV4``
backend, returns dsv4's subclass of vLLM's FlashMLA attention class for that model
(:mod:`dsv4_plugin.attention_v4`, :mod:`dsv4_plugin.attention_v41`), and otherwise
calls vLLM's original function unchanged.

The subclasses re-state vLLM's ``_forward_decode`` / ``_forward_prefill`` with
dsv4's kernels, so the install step hashes the vLLM source they mirror. A model
whose hashes differ gets a *refusing* selector instead: it still defers to vLLM for
every other backend, and raises :class:`SeamChangedError` only in a process that
selected DSV4 for that model (vLLM's own selectors silently fall back to FlashMLA
for a backend they do not know, so leaving the seam alone would be wrong).

Selecting DSV4 also checks, once, at model construction (before any weight is
loaded) that dsv4's CUDA extension is built and the GPU is sm_90, and fails with
one line if not (:func:`device_problem`).

This module imports no vLLM model code at import time.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._backend import BACKEND_NAME

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

logger = logging.getLogger("dsv4_plugin")

SEAM_FUNCTION = "_select_dsv4_attn_cls"


@dataclass
class Seam:
    """One model's attention-class selection point and the vLLM source it relies on."""

    model: str  # what users call it, for messages
    module: str  # vLLM module holding SEAM_FUNCTION and DeepseekV4DecoderLayer
    attn_cls_path: str  # "module:Class" of dsv4's attention class for this model
    # sha256 of textwrap.dedent(inspect.getsource(obj)) in vllm 0.33.0, by
    # qualified name: the seam function, its call site and the FlashMLA methods
    # the dsv4 subclass mirrors or inherits.
    expected_sha256: dict[str, str]
    selector_name: str  # the dsv4_plugin.attention function installed at the seam
    problems: list[str] = field(default_factory=list)  # filled by install

    @property
    def layer_init(self) -> str:
        return f"{self.module}.DeepseekV4DecoderLayer.__init__"

    def attn_cls(self):
        mod, name = self.attn_cls_path.split(":")
        return getattr(importlib.import_module(mod), name)


_V4 = "vllm.models.deepseek_v4.nvidia"
_V41 = "vllm.models.deepseek_v41.nvidia"

SEAMS: dict[str, Seam] = {
    "deepseek_v4": Seam(
        model="DeepSeek V4 (DeepseekV4ForCausalLM)",
        module=f"{_V4}.model",
        attn_cls_path="dsv4_plugin.attention_v4:DSV4FlashMLAAttention",
        expected_sha256={
            f"{_V4}.model._select_dsv4_attn_cls": "de6e01e08bfa00193f8a2a66f2fbe3cfed8637d731cfb57f7835af3401002a28",
            f"{_V4}.model.DeepseekV4DecoderLayer.__init__": "30c9570e0a7aa8f39c69df2e789518ca93bbbc5345194dff6db453415833de95",
            f"{_V4}.flashmla.DeepseekV4FlashMLAAttention.forward_mqa": "327124c4100185b59c0e32d655882cc95d6c4afad370130a67216aa694210eff",
            f"{_V4}.flashmla.DeepseekV4FlashMLAAttention._forward_decode": "2537a6feb8b4863e52f3bb12f91a6d4e74bb6b0d28caa3a36d711c2bc0d37946",
            f"{_V4}.flashmla.DeepseekV4FlashMLAAttention._forward_prefill": "2e6f7c725e2ca7135241aa6757473c795dcb3a0f7980afa10a4ba9e0c2ae1cd1",
        },
        selector_name="select_attn_cls",
    ),
    "deepseek_v41": Seam(
        model="DeepSeek V4.1 (DeepseekV41ForCausalLM)",
        module=f"{_V41}.model",
        attn_cls_path="dsv4_plugin.attention_v41:DSV41FlashMLAAttention",
        expected_sha256={
            f"{_V41}.model._select_dsv4_attn_cls": "d52b7401990721cf7667c0cf729a2f03016b7826fb3148b86837bfb64c4e0f2e",
            f"{_V41}.model.DeepseekV4DecoderLayer.__init__": "827ec1a9e5922e4556dfff7e73027f5ec5fef3a1d2a787388ed3bd562283b9c3",
            f"{_V41}.flashmla.DeepseekV4FlashMLAAttention.forward_mqa": "71f119230a437228c8bc093ec369753403cb94803ad01752f9bf846682d2b56b",
            f"{_V41}.flashmla.DeepseekV4FlashMLAAttention._forward_decode": "24bd03f2decd5cc70b33ba2cb146fd87fec22f7fe06b15177dc68ceba1928ead",
            f"{_V41}.flashmla.DeepseekV4FlashMLAAttention._forward_prefill": "9bace27d453e4f71667234d2de98f389fe0c56b627083cb871740c25a1600f88",
        },
        selector_name="select_attn_cls_v41",
    ),
}


class SeamChangedError(RuntimeError):
    """vLLM's code at a plugin seam differs from vllm 0.33.0."""


class DSV4UnavailableError(RuntimeError):
    """DSV4 was selected where dsv4's kernels cannot run."""


def source_sha256(obj) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode()).hexdigest()


def _resolve(qualname: str):
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualname)


def seam_problems(seam: Seam) -> list[str]:
    """What differs between the installed vLLM and vllm 0.33.0 at ``seam`` ([] if nothing)."""
    problems = []
    for qualname, expected in seam.expected_sha256.items():
        try:
            obj = _resolve(qualname)
            obj = getattr(obj, "__dsv4_original__", obj)  # the unwrapped function
            got = source_sha256(obj)
        except Exception as e:  # missing module/attribute, no source file, ...
            problems.append(f"{qualname}: {type(e).__name__}: {e}")
            continue
        if got != expected:
            problems.append(f"{qualname}: source changed")
    try:
        layer_init = _resolve(seam.layer_init)
        if SEAM_FUNCTION not in layer_init.__code__.co_names:
            problems.append(
                f"{seam.layer_init} no longer calls {SEAM_FUNCTION} by global name"
            )
    except Exception as e:
        problems.append(f"{seam.layer_init}: {type(e).__name__}: {e}")
    return problems


def _seam_error(seam: Seam, problems: list[str]) -> SeamChangedError:
    return SeamChangedError(
        f"dsv4 plugin: vLLM's {seam.model} attention-class selection is not the code "
        "the plugin was written against (vllm==0.33.0), so --attention-backend dsv4 "
        "cannot run this model:\n  - "
        + "\n  - ".join(problems)
        + "\nInstall vllm==0.33.0, or choose another --attention-backend."
    )


def check_seam(model: str = "deepseek_v4") -> None:
    """Raise SeamChangedError unless vLLM's code at ``model``'s seam is what we expect."""
    seam = SEAMS[model]
    problems = seam_problems(seam)
    if problems:
        raise _seam_error(seam, problems)


# ---------------------------------------------------------------------------
# Runtime checks made when DSV4 is selected.
# ---------------------------------------------------------------------------


def device_problem() -> str | None:
    """None if dsv4's kernels can run here, else one line saying why not."""
    import dsv4

    if not dsv4.HAS_CUDA_EXTENSION:
        from dsv4._ops import BUILD_HINT

        return BUILD_HINT
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return f"dsv4's kernels need an NVIDIA GPU; this platform is {current_platform.device_name!r}"
    cap = current_platform.get_device_capability()
    if cap is None or (cap.major, cap.minor) != (9, 0):
        got = "none" if cap is None else f"sm_{cap.major}{cap.minor}"
        return f"dsv4's kernels are built for sm_90 (Hopper: H100, H200); this GPU is {got}"
    return None


_device_checked = False


def require_device() -> None:
    """Raise DSV4UnavailableError (one line) unless dsv4's kernels can run here."""
    global _device_checked
    if _device_checked:
        return
    problem = device_problem()
    if problem:
        raise DSV4UnavailableError(f"--attention-backend dsv4: {problem}")
    _device_checked = True


def dsv4_backend_member():
    """The AttentionBackendEnum member named DSV4 (None if not registered)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.__members__.get(BACKEND_NAME)


def is_dsv4_selected(vllm_config: "VllmConfig") -> bool:
    member = dsv4_backend_member()
    return member is not None and vllm_config.attention_config.backend is member


def _select(seam: Seam, selector, vllm_config: "VllmConfig"):
    if not is_dsv4_selected(vllm_config):
        return selector.__dsv4_original__(vllm_config)
    if seam.problems:
        raise _seam_error(seam, seam.problems)
    require_device()
    return seam.attn_cls()


def select_attn_cls(vllm_config: "VllmConfig"):
    """Replacement for vLLM's DeepSeek V4 ``_select_dsv4_attn_cls``: DSV4 -> dsv4's class."""
    return _select(SEAMS["deepseek_v4"], select_attn_cls, vllm_config)


def select_attn_cls_v41(vllm_config: "VllmConfig"):
    """Replacement for vLLM's DeepSeek V4.1 ``_select_dsv4_attn_cls``: DSV4 -> dsv4's class.

    Prefill context parallelism goes to vLLM's function, which accepts only its
    FlashMLA backends there (and says so): dsv4 does not claim PCP.
    """
    if vllm_config.parallel_config.prefill_context_parallel_size > 1:
        return select_attn_cls_v41.__dsv4_original__(vllm_config)
    return _select(SEAMS["deepseek_v41"], select_attn_cls_v41, vllm_config)


def install_attention_seams() -> None:
    """Rebind each model's ``_select_dsv4_attn_cls`` (idempotent).

    A model whose vLLM source differs still gets the selector, in its refusing
    form (see the module docstring); one warning is logged for it here.
    """
    for seam in SEAMS.values():
        selector = globals()[seam.selector_name]
        try:
            model = importlib.import_module(seam.module)
        except Exception as e:  # this vLLM build cannot import the model at all
            seam.problems = [f"{seam.module}: {type(e).__name__}: {e}"]
            logger.warning("dsv4 plugin: %s is not importable; dsv4 does not serve it (%s)",
                           seam.model, seam.problems[0])
            continue
        current = getattr(model, SEAM_FUNCTION, None)
        if current is selector:
            continue
        seam.problems = seam_problems(seam)
        if seam.problems:
            logger.warning(
                "dsv4 plugin: vLLM's %s attention selection differs from vllm 0.33.0; "
                "--attention-backend dsv4 will refuse this model (%s)",
                seam.model, "; ".join(seam.problems),
            )
        if current is None:
            continue  # nothing to wrap (seam.problems names the missing function)
        selector.__dsv4_original__ = current  # type: ignore[attr-defined]
        setattr(model, SEAM_FUNCTION, selector)


def seam_installed(model: str = "deepseek_v4") -> bool:
    import sys

    seam = SEAMS[model]
    mod = sys.modules.get(seam.module)
    return mod is not None and getattr(mod, SEAM_FUNCTION, None) is globals()[seam.selector_name]


def __getattr__(name):
    # The attention classes live in attention_v4 / attention_v41 (they import vLLM's
    # model code); keep their earlier import path working without importing it here.
    if name in ("DSV4FlashMLAAttention", "DSV4AttentionBackend"):
        from . import attention_v4

        return getattr(attention_v4, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_NAME",
    "DSV4UnavailableError",
    "SEAMS",
    "SeamChangedError",
    "check_seam",
    "device_problem",
    "install_attention_seams",
    "is_dsv4_selected",
    "select_attn_cls",
    "select_attn_cls_v41",
]
