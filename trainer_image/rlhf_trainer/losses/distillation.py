"""Knowledge distillation on a dataset (kd): the teacher's next-token distributions as soft targets.

Per response token, the forward KL from the teacher's distribution to the student's, KL(p_T || p_S)
(Hinton et al. 2015, arXiv:1503.02531; on language models' token distributions, Kim & Rush 2016,
arXiv:1606.07947). The teacher sends its k likeliest tokens of each position, renormalised over them:
k entries a token instead of the vocabulary bound what crosses between the groups. The student's
log-probs stay normalised over the whole vocabulary, so the loss is zero only when the student puts
the teacher's (renormalised) probabilities on those k tokens and nothing elsewhere.
"""

from __future__ import annotations

from torch import Tensor


def top_k_forward_kl(student_logits: Tensor, teacher_logps: Tensor, teacher_ids: Tensor) -> Tensor:
    """KL(p_T || p_S) per position [B, T]: student_logits [B, T, V]; the teacher's top-k log-probs and
    token ids [B, T, k]."""
    teacher = teacher_logps.float().log_softmax(-1)  # renormalised over its k tokens
    student = student_logits.float().log_softmax(-1).gather(-1, teacher_ids)
    return (teacher.exp() * (teacher - student)).sum(-1)
