"""The training-free per-token teacher-selection diagnostic ("Unmasking OPD", paper B).

``diagnose(student, teachers, task, budget=...)`` estimates, at nodes along the student's own
rollouts, the success probability of each candidate next token by targeted rollouts, and scores
how well each teacher's distillation gradient points along the ideal gradient. See
``docs/diagnostic.md``.
"""

from .diagnose import TeacherLike, check_options, diagnose, min_budget, resolve_teachers
from .nodes import Node, candidate_set, node_depths, plan_nodes
from .report import METRICS, DiagnosticReport, bootstrap_mean
from .rollouts import SuccessEstimates, estimate_success, prefix_text
from .scores import (
    alignment,
    cosine,
    distillation_gradient,
    has_signal,
    ideal_gradient,
    proxy_scores,
    renormalise,
    teacher_advantage,
)
from .teachers import SELF_CONTEXTS, ContextTeacher, TeacherSpec, context_text, parse_teacher_spec

__all__ = [
    "diagnose", "resolve_teachers", "check_options", "min_budget", "TeacherLike",
    "DiagnosticReport", "METRICS", "bootstrap_mean",
    "Node", "node_depths", "candidate_set", "plan_nodes",
    "SuccessEstimates", "estimate_success", "prefix_text",
    "renormalise", "ideal_gradient", "distillation_gradient", "cosine", "alignment",
    "teacher_advantage", "has_signal", "proxy_scores",
    "SELF_CONTEXTS", "ContextTeacher", "TeacherSpec", "parse_teacher_spec", "context_text",
]
