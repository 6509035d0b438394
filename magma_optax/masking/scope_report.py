"""What a mask will act on, before training: a table per leaf, and a warning when the
paper's attention + MLP scope finds no attention or no MLP in a model.

:func:`scope_report` plans the leaves exactly as the transforms do
(``_scoping.plan_leaves``: the same ``where``, ``labels``, ``keep_prob``,
``granularity`` and ``stack_axes``), on the host, outside any jitted step.
:func:`magma_optax._core.labels.warn_if_scope_misses` is what ``plan_leaves`` calls when
the scope is decided by :func:`magma_optax.attention_mlp_weights` or by the default
labels with per-label keep probabilities.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magma_optax._core import blocks as _blocks
from magma_optax._core import labels as _labels
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax.masking import engine as _engine


class ScopeRow(NamedTuple):
  """One leaf of a :class:`ScopeReport`.

  Attributes:
    path: ``jax.tree_util.keystr`` of the leaf's key path (without an NNX
      Variable's trailing ``.value``).
    shape: the leaf's shape.
    dtype: the leaf's dtype name.
    label: the leaf's label (``labels=``; default :func:`transformer_labels`).
    masked: whether the mask acts on this leaf.
    keep_prob: its keep probability (a float, ``"schedule"``, or ``None`` when not
      masked).
    num_blocks: its number of mask blocks under the granularity (0 when not
      masked).
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  label: str
  masked: bool
  keep_prob: float | str | None
  num_blocks: int


class ScopeReport(tuple):
  """The rows of :func:`scope_report` (a tuple of :class:`ScopeRow`); ``str`` and
  ``repr`` are the table (``print(report)``, or a notebook cell ending in it),
  ``.masked`` the masked rows."""

  def __repr__(self) -> str:
    return str(self)

  @property
  def masked(self) -> tuple[ScopeRow, ...]:
    return tuple(r for r in self if r.masked)

  def __str__(self) -> str:
    head = ("path", "shape", "dtype", "label", "masked", "keep_prob", "blocks")
    rows = [
      (
        r.path, "x".join(map(str, r.shape)) or "()", r.dtype, r.label,
        "yes" if r.masked else "no",
        "-" if r.keep_prob is None else (
          r.keep_prob if isinstance(r.keep_prob, str) else f"{r.keep_prob:g}"
        ),
        str(r.num_blocks) if r.masked else "-",
      )
      for r in self
    ]  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(
      c.ljust(w) for c, w in zip(cells, widths, strict=True)
    ).rstrip()
    n, total = len(self.masked), len(self)
    size = sum(_size(r.shape) for r in self.masked)
    footer = f"{n} of {total} leaves masked ({size:,} entries)"
    return "\n".join([line(head), line(["-" * w for w in widths])] + [
      line(r) for r in rows
    ] + [footer])  # fmt: skip


def _size(shape: tuple[int, ...]) -> int:
  out = 1
  for d in shape:
    out *= d
  return out


def _keep_prob(value: Any) -> float | str:
  if _schedules.is_schedule(value):
    return "schedule"
  return float(value)


def scope_report(
  params: Any,
  *,
  where: _scoping.Where = None,
  labels: _scoping.Labels = None,
  keep_prob: Any = 0.5,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int | None = None,
  print_table: bool = False,
) -> ScopeReport:
  """Which leaves a mask acts on, with what label, keep probability and blocks.

  Plans ``params`` exactly as :func:`magma`, :func:`skip_update`,
  :func:`bernoulli_mask`, :func:`alignment_mask` and :func:`adam_magma` do for the
  same arguments, on the host (call it before training, not inside the step).
  Print the report for the table (path, shape, label, masked, keep probability,
  block count); a notebook shows it as the value of a cell.

  Args:
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``; an
      ``nnx.State`` works too).
    where: the transform's ``where=`` (e.g. :func:`attention_mlp_weights`).
    labels: the transform's ``labels=`` (default :func:`transformer_labels`).
    keep_prob: the transform's ``keep_prob=`` (a float, schedule or mapping).
    granularity: the transform's block granularity.
    stack_axes: the transform's ``stack_axes``.
    print_table: also print the table here (default False: ``print(report)``
      prints it, once).

  Returns:
    A :class:`ScopeReport`: a tuple of :class:`ScopeRow`, one per leaf in
    flattening order; ``str(report)`` is the table.

  Example:
    >>> import jax.numpy as jnp
    >>> import magma_optax as magma
    >>> params = {"attn": {"q_proj": {"kernel": jnp.ones((8, 8)),
    ...                               "bias": jnp.ones(8)}},
    ...           "mlp": {"up": {"kernel": jnp.ones((8, 16))}}}
    >>> report = magma.scope_report(params, where=magma.attention_mlp_weights)
    >>> print(report)
    path                          shape  dtype    label      masked  keep_prob  blocks
    ----------------------------  -----  -------  ---------  ------  ---------  ------
    ['attn']['q_proj']['bias']    8      float32  other      no      -          -
    ['attn']['q_proj']['kernel']  8x8    float32  attention  yes     0.5        1
    ['mlp']['up']['kernel']       8x16   float32  mlp        yes     0.5        1
    2 of 3 leaves masked (192 entries)
    >>> [r.path for r in report.masked]
    ["['attn']['q_proj']['kernel']", "['mlp']['up']['kernel']"]
  """
  config = _engine.MaskConfig.create(
    keep_prob=keep_prob,
    granularity=granularity,
    stack_axes=stack_axes,
    where=where,
    labels=labels,
  )
  plans, _ = config.plan(params)
  paths_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  rows = []
  for plan, (path, leaf) in zip(plans, paths_leaves, strict=True):
    masked = plan.layout is not None
    rows.append(
      ScopeRow(
        path=jax.tree_util.keystr(_labels.strip_variable(path)),
        shape=tuple(jnp.shape(leaf)),
        dtype=str(getattr(leaf, "dtype", type(leaf).__name__)),
        label=plan.label,
        masked=masked,
        keep_prob=_keep_prob(plan.keep_prob) if masked else None,
        num_blocks=plan.layout.num_blocks if masked else 0,
      )
    )
  report = ScopeReport(rows)
  if print_table:
    print(report)
  return report
