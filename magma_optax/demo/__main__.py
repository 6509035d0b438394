"""``python3 -m magma_optax.demo``: see :mod:`magma_optax.demo.run`."""

from magma_optax.demo.run import main

if __name__ == "__main__":
  main()
