"""The demo: Adam vs Adam+Magma on a byte-level LLaMA-style model.

Run ``python3 -m magma_optax.demo`` (``--help`` for flags; needs flax, tqdm and
matplotlib: ``pip install "magma-optax[demo]"``). :mod:`magma_optax.demo.corpus` is its
byte corpus, :mod:`magma_optax.demo.llama` its model, :mod:`magma_optax.demo.run` the
training run.
"""
