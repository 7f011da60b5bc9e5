"""Distillation from a teacher's next-token distributions, sent as its top-k (kd, and distill with jsdBeta).

The teacher sends its k likeliest tokens of each position, renormalised over them: k entries a token
instead of the vocabulary bound what crosses between the groups. The student's log-probs stay
normalised over the whole vocabulary, so a divergence is zero only when the student puts the teacher's
(renormalised) probabilities on those k tokens and nothing elsewhere.

- beta 0: the forward KL from the teacher to the student, KL(p_T || p_S) (Hinton et al. 2015,
  arXiv:1503.02531; on language models' token distributions, Kim & Rush 2016, arXiv:1606.07947);
- 0 < beta < 1: GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, arXiv:2306.13649),
  beta KL(p_T || M) + (1 - beta) KL(p_S || M) with the mixture M = beta p_T + (1 - beta) p_S: near the
  forward KL's mode-covering for small beta, the reverse KL's mode-seeking near 1, and finite wherever
  the student puts mass (the reverse KL itself is infinite outside the teacher's k tokens; distill
  estimates it from the sampled token instead, algorithms.advantages.reverse_kl).

Outside the k tokens the teacher's probability is 0, so there M = (1 - beta) p_S and each token adds
p_S log(1 / (1 - beta)) to KL(p_S || M): the divergence over the whole vocabulary is exact from the k
tokens and the student's mass left outside them.
"""

from __future__ import annotations

import math

from torch import Tensor


def top_k_divergence(student_logits: Tensor, teacher_logps: Tensor, teacher_ids: Tensor,
                     beta: float = 0.0) -> Tensor:
    """The divergence of the student from the teacher's top-k per position [B, T] (see the module's
    docstring for beta): student_logits [B, T, V]; the teacher's top-k log-probs and token ids [B, T, k]."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    teacher = teacher_logps.float().log_softmax(-1)  # renormalised over its k tokens
    student = student_logits.float().log_softmax(-1).gather(-1, teacher_ids)
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    mixture = (teacher + math.log(beta)).logaddexp(student + math.log(1.0 - beta))
    teacher_term = (teacher.exp() * (teacher - mixture)).sum(-1)
    outside = (1.0 - student.exp().sum(-1)).clamp_min(0.0)  # the student's mass off the teacher's k tokens
    student_term = (student.exp() * (student - mixture)).sum(-1) - outside * math.log(1.0 - beta)
    return beta * teacher_term + (1.0 - beta) * student_term
