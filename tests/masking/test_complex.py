"""Complex parameters: the block-mask transforms treat a complex leaf as the real
vector (Re, Im) of twice the length -- cosines from the real inner product, norms
from magnitudes -- and never drop the imaginary part."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


def _complex(key, shape):
  kr, ki = jax.random.split(key)
  return jax.random.normal(kr, shape) + 1j * jax.random.normal(ki, shape)


def _as_real(z):
  return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_alignment_mask_on_complex_equals_its_real_view(granularity):
  # Row blocks of a (4, 6) complex leaf are (6, 2) slabs of the real view.
  real_gran = granularity if granularity == "tensor" else (1, 6, 2)
  keys = jax.random.split(jax.random.key(0), 4)
  grads = [_complex(k, (4, 6)) for k in keys]
  tx_c = magma.alignment_mask(keep_prob=1.0, granularity=granularity, key=1)
  tx_r = magma.alignment_mask(keep_prob=1.0, granularity=real_gran, key=1)
  sc = tx_c.init({"w": grads[0]})
  sr = tx_r.init({"w": _as_real(grads[0])})
  for g in grads:
    uc, sc = tx_c.update({"w": g}, sc)
    ur, sr = tx_r.update({"w": _as_real(g)}, sr)
    np.testing.assert_allclose(_as_real(uc["w"]), ur["w"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    np.ravel(sc.scores["w"]), np.ravel(sr.scores["w"]), rtol=1e-6
  )
  assert not np.allclose(np.ravel(sc.scores["w"]), 0.5)  # the scores moved


def test_damping_on_complex_uses_magnitudes():
  z = _complex(jax.random.key(2), (3, 5))
  out, _ = magma.damping(0.5, granularity="row").update({"w": z}, optax.EmptyState())
  ref, _ = magma.damping(0.5, granularity=(1, 5, 2)).update(
    {"w": _as_real(z)}, optax.EmptyState()
  )
  np.testing.assert_allclose(_as_real(out["w"]), ref["w"], rtol=1e-6)


def test_magma_adam_on_complex_masks_with_the_real_cosine():
  # magma(adam) on a complex leaf: the update is s * z * Adam's complex update, with
  # the score from the real cosine of Adam's complex first moment and the gradient.
  p = {"w": jnp.zeros((2, 3), jnp.complex64)}
  g = {"w": _complex(jax.random.key(3), (2, 3))}
  tx = magma.magma(optax.adam(1e-2), keep_prob=1.0, key=0)
  state = tx.init(p)
  u, state = tx.update(g, state, p)
  base_u, _ = optax.adam(1e-2).update(g, optax.adam(1e-2).init(p), p)
  s = state.mask_state.scores["w"]
  mu = state.inner_state[0].mu["w"]
  a, b = np.ravel(_as_real(mu)), np.ravel(_as_real(g["w"]))
  cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
  np.testing.assert_allclose(s, 0.9 * 0.5 + 0.1 / (1 + np.exp(-cos / 2.0)), rtol=1e-6)
  np.testing.assert_allclose(u["w"], s * base_u["w"], rtol=1e-6)
  assert jnp.iscomplexobj(u["w"]) and np.any(np.imag(u["w"]) != 0)


def test_adam_magma_refuses_complex():
  with pytest.raises(ValueError, match="complex"):
    magma.adam_magma(1e-2).init({"w": jnp.zeros(3, jnp.complex64)})
