"""A small LLaMA-style byte language model in Flax NNX: the demo's model.

RMSNorm, rotary position embeddings, SwiGLU MLPs and a tied byte embedding, in the
presets ``"tiny"``, ``"small"`` and ``"medium"`` (:class:`LlamaConfig`); parameter
paths that :func:`magma_optax.transformer_labels` reads (attention, MLP). With the
training step, evaluation and learning-rate schedule of the demo and of
``benchmarks/lm.py``. Needs flax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape of a :class:`Llama` model.

  Attributes:
    vocab_size: vocabulary size (256 for bytes).
    dim: model width.
    n_layers: number of decoder blocks.
    n_heads: attention heads; must divide ``dim`` into an even head size.
    mlp_dim: hidden width of the SwiGLU MLP (LLaMA uses about 8/3 of ``dim``).
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: use the embedding matrix as the output head (no ``lm_head``).
    init_std: standard deviation of the normal initialisation of every matrix; the
      output projections (``o_proj``, ``down_proj``) are further divided by
      sqrt(2 n_layers), as in GPT-2.
    dtype: computation dtype of the attention and MLP matmuls, e.g.
      ``jnp.bfloat16`` (``None``: the parameters' dtype). Parameters, gradients,
      the residual stream, the norms and the output head stay in float32: the
      logits feed the loss.
  """

  vocab_size: int = 256
  dim: int = 128
  n_layers: int = 4
  n_heads: int = 4
  mlp_dim: int = 352
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  dtype: Any = None

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "mlp_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}.")
    if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
      raise ValueError(
        f"n_heads must divide dim into an even head size; got dim={self.dim},"
        f" n_heads={self.n_heads}."
      )
    for name in ("rope_theta", "norm_eps", "init_std"):
      value = getattr(self, name)
      if not value > 0:
        raise ValueError(f"{name} must be > 0; got {value!r}.")
    if self.dtype is not None and not _is_float_dtype(self.dtype):
      raise ValueError(
        f"dtype must be None or a floating dtype such as jnp.bfloat16; got"
        f" {self.dtype!r}."
      )

  @classmethod
  def tiny(cls, **overrides: Any) -> LlamaConfig:
    """~0.1M parameters: tests, notebooks in small mode, quick checks."""
    return cls(**{"dim": 64, "n_layers": 2, "n_heads": 4, "mlp_dim": 176, **overrides})

  @classmethod
  def small(cls, **overrides: Any) -> LlamaConfig:
    """~0.8M parameters: the demo and the CPU benchmark."""
    return cls(**{"dim": 128, "n_layers": 4, "n_heads": 4, "mlp_dim": 352, **overrides})

  @classmethod
  def medium(cls, **overrides: Any) -> LlamaConfig:
    """~11M parameters: accelerator runs."""
    return cls(
      **{"dim": 384, "n_layers": 6, "n_heads": 6, "mlp_dim": 1024, **overrides}
    )

  @classmethod
  def paper60m(cls, **overrides: Any) -> LlamaConfig:
    """The body of the paper's smallest model: width 512, 8 layers, 8 heads, MLP 1376.

    The 60M LLaMA of the Magma paper's C4 runs (the GaLore configuration). Its name
    counts a 32k-token embedding and output head; with this module's byte
    vocabulary those shrink to 256 rows, leaving about 25.6M parameters, 25.3M of
    them in the decoder blocks.
    """
    return cls(
      **{"dim": 512, "n_layers": 8, "n_heads": 8, "mlp_dim": 1376, **overrides}
    )

  @classmethod
  def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
    """The preset ``name``: one of :data:`PRESETS`."""
    if name not in PRESETS:
      raise ValueError(f"preset must be one of {PRESETS}; got {name!r}.")
    return getattr(cls, name)(**overrides)


PRESETS = ("tiny", "small", "medium", "paper60m")


def _is_float_dtype(dtype: Any) -> bool:
  try:
    return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    return False


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x[batch, seq, heads, head_dim]`` (rotate-half).

  Pairs feature i with i + head_dim/2 and rotates each pair at position t by the
  angle t * theta^(-2i/head_dim) (Su et al., arXiv 2104.09864).
  """
  seq, half = x.shape[1], x.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Softmax attention of ``[batch, seq, heads, head_dim]`` inputs, causally masked.

  Plain einsums: on CPU this is about twice as fast as
  ``jax.nn.dot_product_attention`` at these sizes; scores are computed in f32.
  """
  t, scale = q.shape[1], q.shape[-1] ** -0.5
  scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
  causal = jnp.tril(jnp.ones((t, t), dtype=bool))
  scores = jnp.where(causal, scores * scale, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bnts,bsnh->btnh", weights, v)


def _linear(
  d_in: int, d_out: int, std: float, rngs: nnx.Rngs, dtype: Any = None
) -> nnx.Linear:
  init = nnx.initializers.normal(std)
  return nnx.Linear(
    d_in, d_out, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs
  )


class Attention(nnx.Module):
  """Causal multi-head self-attention with RoPE on queries and keys."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    dim, std = config.dim, config.init_std
    out_std = std / math.sqrt(2 * config.n_layers)
    self.n_heads = config.n_heads
    self.rope_theta = config.rope_theta
    dtype = config.dtype
    self.q_proj = _linear(dim, dim, std, rngs, dtype)
    self.k_proj = _linear(dim, dim, std, rngs, dtype)
    self.v_proj = _linear(dim, dim, std, rngs, dtype)
    self.o_proj = _linear(dim, dim, out_std, rngs, dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    heads = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)
    q = rope(heads(self.q_proj(x)), self.rope_theta)
    k = rope(heads(self.k_proj(x)), self.rope_theta)
    v = heads(self.v_proj(x))
    return self.o_proj(causal_attention(q, k, v).reshape(b, t, d))


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (Shazeer, arXiv 2002.05202)."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    dim, hidden, std = config.dim, config.mlp_dim, config.init_std
    out_std, dtype = std / math.sqrt(2 * config.n_layers), config.dtype
    self.gate_proj = _linear(dim, hidden, std, rngs, dtype)
    self.up_proj = _linear(dim, hidden, std, rngs, dtype)
    self.down_proj = _linear(hidden, dim, out_std, rngs, dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, rngs=rngs)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """LLaMA-style decoder-only language model: tokens ``int[batch, seq]`` -> logits.

  Args:
    config: the model's shape.
    rngs: NNX random streams for initialisation.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from magma_optax.demo import llama
    >>> model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(
      config.vocab_size,
      config.dim,
      embedding_init=nnx.initializers.normal(config.init_std),
      rngs=rngs,
    )
    self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
    self.final_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, rngs=rngs)
    if not config.tie_embeddings:
      self.lm_head = _linear(config.dim, config.vocab_size, config.init_std, rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    x = self.final_norm(x)
    if self.config.tie_embeddings:
      return self.embed.attend(x)
    return self.lm_head(x)


def init_params(config: LlamaConfig, seed: int = 0) -> tuple[nnx.GraphDef, Params]:
  """A fresh model as a static graph definition and a nested dict of parameters.

  Args:
    config: the model's shape.
    seed: initialisation seed.

  Returns:
    ``(graphdef, params)``: ``params`` is a plain nested dict of arrays (layer
    indices are int keys) for optax; ``apply(graphdef, params, tokens)`` runs it.
  """
  graphdef, state = nnx.split(Llama(config, rngs=nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def count_params(params: Params) -> int:
  """Number of scalars in ``params``."""
  return sum(x.size for x in jax.tree.leaves(params))


def apply(graphdef: nnx.GraphDef, params: Params, tokens: jax.Array) -> jax.Array:
  """Logits ``f32[batch, seq, vocab]`` of ``tokens`` under ``params``."""
  return nnx.merge(graphdef, params)(tokens)


def loss_fn(graphdef: nnx.GraphDef, params: Params, batch: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of ``batch: int[batch, seq + 1]``."""
  logits = apply(graphdef, params, batch[:, :-1])
  losses = optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch[:, 1:]
  )
  return losses.mean()


def lr_schedule(peak_lr: float, total_steps: int) -> optax.Schedule:
  """The paper's schedule: linear warm-up over 10 % of steps, cosine to 10 % of peak.

  Args:
    peak_lr: peak learning rate (> 0).
    total_steps: training steps (>= 1).

  Returns:
    An ``optax.Schedule`` for ``optax.adam(learning_rate=...)`` and friends.
  """
  if not peak_lr > 0:
    raise ValueError(f"peak_lr must be > 0; got {peak_lr!r}.")
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1; got {total_steps!r}.")
  warmup = max(1, total_steps // 10)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=peak_lr,
    warmup_steps=warmup,
    decay_steps=max(total_steps, warmup + 1),
    end_value=0.1 * peak_lr,
  )


def make_train_step(
  graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, donate: bool = True
) -> Callable[[Params, Any, jax.Array], tuple[Params, Any, jax.Array]]:
  """A jitted training step for any optax transform.

  Args:
    graphdef: from :func:`init_params`.
    tx: the optimizer; it receives ``params`` as its third argument (AdamW's weight
      decay, sparse-training wrappers).
    donate: donate ``params`` and ``opt_state`` buffers to the step (saves memory;
      do not reuse the inputs after the call).

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss)`` with ``loss``
    the batch's mean cross-entropy before the update.
  """

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def make_eval_fn(
  graphdef: nnx.GraphDef,
) -> Callable[[Params, jax.Array], jax.Array]:
  """A jitted ``evaluate(params, batches) -> mean loss`` over ``int[n, batch, seq+1]``.

  Use with :func:`magma_optax.corpus.validation_batches`; perplexity is
  ``exp(loss)``.
  """

  def evaluate(params, batches):
    return jax.lax.map(lambda b: loss_fn(graphdef, params, b), batches).mean()

  return jax.jit(evaluate)
