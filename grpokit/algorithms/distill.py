"""On-policy distillation inside GRPO (ms-swift's OPD-RL): a teacher's log-probabilities in the advantage.

The student samples; a frozen teacher scores the sampled tokens; each completion token's advantage becomes

    A_{i,t} = A_i + c · (log π_teacher(y_t) − log π_old(y_t))        (c = --teacher_kl_coef, default 1)

after the group normalisation that made A_i. ``log π_old`` is the student's log-prob at rollout time, from the
same no-grad forward that gives the old log-probs, so the term is a constant to the loss: the clipped policy
gradient turns it into the per-token reward −(log π_old − log π_teacher), the single-sample (k1) estimate of the
reverse KL(π_student ‖ π_teacher) (on-policy distillation: Agarwal et al., arXiv 2306.13649; Thinking Machines'
"On-Policy Distillation", 2025). With no reward functions A_i = 0 and the term is the whole signal.

Why the sampled token, not a top-k or full-distribution KL: the term multiplies ∇ log π(y_t) of the action that
was drawn, so its expectation is the reverse-KL gradient. A term that sums over the teacher's top-k (or over
the vocabulary) without looking at y_t puts the same number on every sampled action of a position; its policy
gradient is then zero in expectation and only the variance remains (tests/unit/test_distill.py shows both).

Logged: ``teacher_kl``, the non-negative k3 estimate exp(d) − d − 1 with d = log π_teacher − log π_old, averaged
over the completion tokens (ms-swift's gauge; it falls as the student nears the teacher); the advantage uses the
signed k1 log-ratio d. Outside the completion mask the term is 0 (A_i stays there, never trained).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class DistillOut:
    advantages: Tensor  # [N, C] per-token advantages: A_i + c · (teacher − student) on completion tokens
    metrics: dict[str, float] = field(default_factory=dict)  # teacher_kl (k3 mean over completion tokens)


def teacher_log_ratio(teacher_logps: Tensor, student_logps: Tensor, mask: Tensor) -> Tensor:
    """[N, C] signed log-ratio log π_teacher − log π_student (k1), 0 outside ``mask`` (padding may hold -inf)."""
    keep = mask > 0
    return torch.where(keep, teacher_logps.detach() - student_logps.detach(), 0.0)


def teacher_kl_per_token(teacher_logps: Tensor, student_logps: Tensor, mask: Tensor) -> Tensor:
    """[N, C] k3 estimate exp(d) − d − 1 of the reverse KL with d = teacher − student, 0 outside ``mask``."""
    d = teacher_log_ratio(teacher_logps, student_logps, mask)
    return torch.expm1(d) - d  # exp(d) − 1 − d, exact near d = 0; 0 where d = 0 (masked tokens)


def distill_advantages(
    advantages_N: Tensor, teacher_logps: Tensor, student_logps: Tensor, mask: Tensor, coef: float
) -> DistillOut:
    """Per-token advantages [N, C] from per-sequence ``advantages_N`` [N] (or per-token [N, C]) and the teacher
    and rollout-time student log-probs [N, C] of the sampled tokens; ``mask`` [N, C] marks completion tokens."""
    if teacher_logps.shape != mask.shape or student_logps.shape != mask.shape:
        raise ValueError(
            f"distill_advantages: teacher {tuple(teacher_logps.shape)}, student "
            f"{tuple(student_logps.shape)} and mask {tuple(mask.shape)} must have one shape [N, C]"
        )
    base = advantages_N.detach().to(teacher_logps.dtype)
    base = base.unsqueeze(1).expand_as(mask) if base.dim() == 1 else base
    out = base + coef * teacher_log_ratio(teacher_logps, student_logps, mask)
    return DistillOut(out, {"teacher_kl": masked_mean(teacher_kl_per_token(teacher_logps, student_logps, mask), mask)})


def masked_mean(x_NC: Tensor, mask: Tensor) -> float:
    """Mean of ``x_NC`` over the tokens ``mask`` keeps (0.0 when it keeps none)."""
    keep = mask > 0
    return float(torch.where(keep, x_NC, 0.0).sum() / keep.sum().clamp(min=1))
